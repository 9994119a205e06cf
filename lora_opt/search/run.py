"""``lora-opt search``'s work: one study per deployment and router (a ``SearchSetup`` each), its trials driven
by a backend (``BACKENDS``), its front replayed on the held-out traffic; the fronts merged, the files written
(``front.json``, each front point's placement, each study's plots), one MLflow run.

``search`` is the whole command as one call (it returns what the command prints: ``report``, or the
result as JSON, and its exit status)."""
from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from lora_opt.errors import EXIT_NOT_ACCEPTABLE, InputError
from lora_opt.io import atomic_write_json
from lora_opt.placement.confidence import resolve_bound
from lora_opt.placement.evaluate import Criterion
from lora_opt.placement.instances import FleetOptions
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.workload_file import Workload, load_workload
from lora_opt.search.deployments import DEFAULT_DEPLOYMENT
from lora_opt.search.plots import write_study_plots
from lora_opt.search.study import (DEFAULT_BATCH, DEFAULT_OBJECTIVE, SearchOptions, SearchResult, SearchSetup,
                                   check_storage, front_table, load_study, merge_fronts, replay_front, run_search,
                                   traffic_halves)
from lora_opt.search.tune import run_tune_search
from lora_opt.tracking import log_command_run
from twin.errors import ScenarioError


def _ask_tell(setup, ctx, traffic, options: SearchOptions, *, where: Path, timeout_s: float | None) -> SearchResult:
    return run_search(setup, ctx, traffic, options, timeout_s=timeout_s)


def _tune(setup, ctx, traffic, options: SearchOptions, *, where: Path, timeout_s: float | None) -> SearchResult:
    return run_tune_search(setup, ctx, traffic, options, tune_dir=where / "tune")


@dataclass(frozen=True)
class Backend:
    """A way a study's trials are driven (all write the same Optuna storage)."""

    run: Callable[..., SearchResult]
    """``run(setup, ctx, traffic, options, *, where, timeout_s) -> SearchResult``: ``where`` is the study's
    output folder, ``timeout_s`` the per-trial limit (where the backend has one)."""
    reproducible: bool
    """A seeded study gives the same trials and front for any number of workers, and the trials a killed
    run had in flight are evaluated again (else: they are recorded as failed)."""
    needs: tuple[str, str] | None = None
    """(the optional module it imports, what installs it): checked before any work."""


#: how a study's trials are driven, by name (``--backend``): Optuna ask/tell over Ray tasks (``study.run_search``),
#: or a Ray Tune experiment (``tune.run_tune_search``, resumable through ``<out>/tune``, no per-trial limit)
BACKENDS: dict[str, Backend] = {
    "ask-tell": Backend(_ask_tell, reproducible=True),
    "tune": Backend(_tune, reproducible=False, needs=("ray.tune", "Ray Tune (pip install 'lora-opt[tune]')")),
}
DEFAULT_BACKEND = "ask-tell"


@dataclass(frozen=True)
class SearchRequest:
    """What ``search`` runs besides the workload, the pool and the ``SearchOptions``: one study per
    deployment and router, their fronts merged."""

    objective: str = DEFAULT_OBJECTIVE
    """Latency objective minimised beside the GPU count (a key of ``study.OBJECTIVES``)."""
    criterion: Criterion | None = None
    """Feasibility: rho, or SLO targets with an attainment (None: the workload's rho)."""
    confidence: float | None = None
    """Decide at this confidence, in (0, 1): a trial is feasible only when the twin also serves it at the
    load the profile's error model derives for it (None: the point estimate, the load as it is)."""
    error_model: str | None = None
    """Error model YAML behind ``confidence`` (None: the profile's bundled one); only with ``confidence``."""
    deployments: tuple[str, ...] = (DEFAULT_DEPLOYMENT,)
    """What a trial is (``deployments.DEPLOYMENTS``), one study each."""
    routers: tuple[str, ...] = ("static",)
    """Router policies (``twin.routers.ROUTERS``) trials are replayed behind, one study each."""
    adapters: str = "static"
    """``static`` (a GPU serves the adapters placed on it) or ``on-demand`` (``FleetOptions.adapters``)."""
    scrape_interval_s: float | None = None
    """Seconds between the router's reads of the GPUs' metrics (None: ``FleetOptions``'s default)."""
    history: str | None = None
    """Request log: rates and search traffic from its first half, the front replayed on its second half
    (None: the workload's evaluation traffic, drawn with two seeds)."""
    batch: int = DEFAULT_BATCH
    """Ask/tell: trials asked at once, then evaluated in parallel (the results depend on it, not on workers)."""
    backend: str = DEFAULT_BACKEND
    """A key of ``BACKENDS``."""
    timeout_s: float | None = 600.0
    """Ask/tell: a trial running longer is recorded as failed."""
    surrogate: str | None = None
    """Surrogate directory for the greedy seeds (None: the bundled one for the profile)."""
    out: str | None = None
    """Output directory (None: ``outputs/search-<workload>``)."""
    progress: bool = True
    """The set-up's progress line (stderr); the studies' bars are ``SearchOptions.progress``."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise InputError(f"--backend: {self.backend!r} not allowed; allowed values: {', '.join(BACKENDS)}")


@dataclass
class SearchRun:
    """What ``search`` did: ``result`` is ``front.json``'s content."""

    result: dict
    studies: list[tuple[SearchSetup, SearchResult, list[dict]]]
    """Each study's setup, result and replayed front, in the order they ran."""
    out: Path
    code: int
    """The exit status: 0, or ``EXIT_NOT_ACCEPTABLE`` when no trial was feasible."""


def check_backend(name: str) -> Backend:
    """The backend named ``name``, its optional dependency installed (InputError otherwise)."""
    backend = BACKENDS[name]
    if backend.needs is not None:
        module, what = backend.needs
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise InputError(f"--backend {name}: needs {what}: {exc}") from None
    return backend


def resolve_storage(storage: str | None) -> str | None:
    """``storage``, else ``$OPTUNA_STORAGE`` (None: neither), checked as a URL Optuna can open; the error
    names where the URL came from."""
    if storage:
        check_storage(storage)
        return storage
    storage = os.environ.get("OPTUNA_STORAGE")
    if storage:
        try:
            check_storage(storage)
        except ScenarioError as exc:
            raise InputError(str(exc).replace("--storage", "OPTUNA_STORAGE (the default --storage)", 1)) from None
    return storage


def _prepare(workload, gpus: int, request: SearchRequest):
    """(workload, output folder, search traffic, held-out traffic, context, confidence setting, setups)."""
    with tqdm(total=None, desc="search: loading the workload, surrogate and traffic", bar_format="{desc} [{elapsed}]",
              disable=not request.progress) as prep:
        wl = workload if isinstance(workload, Workload) else load_workload(workload)
        out = Path(request.out or f"outputs/search-{wl.name}")
        out.mkdir(parents=True, exist_ok=True)
        # with a log, its first half sets the rates and is searched on; its second half is held out
        wl, search_traffic, heldout, ctx_kw = traffic_halves(wl, request.history)
        ctx = PlacementContext.for_workload(wl, request.surrogate, **ctx_kw)
        conf = None
        if request.confidence is not None:
            conf = resolve_bound(ctx.profile, request.confidence, request.error_model)
        elif request.error_model:
            raise InputError("--error-model: only with --confidence (search decides on the point estimate without one)")
        scrape = {} if request.scrape_interval_s is None else {"scrape_interval_s": request.scrape_interval_s}
        setups = [SearchSetup.build(wl, gpus, ctx, request.criterion, request.objective, batch=request.batch,
                                    fleet=FleetOptions(router, request.adapters, **scrape), deployment=deployment,
                                    confidence=conf)
                  for deployment in dict.fromkeys(request.deployments) for router in dict.fromkeys(request.routers)]
        prep.set_description_str("search: setup ready")
    return wl, out, search_traffic, heldout, ctx, conf, setups


def search(workload: Workload | str | Path, gpus: int, request: SearchRequest = SearchRequest(),
           options: SearchOptions = SearchOptions(), *, tracking_uri: str | None = None,
           track: bool = False) -> SearchRun:
    """Run (or resume) the studies of ``request`` for ``workload`` (a Workload, a file or a bundled name)
    on a pool of ``gpus``; write ``front.json``, each front point's ``placement-<g>gpus-trial<n>.json`` and
    each study's plots under ``request.out`` (one folder per study when there are several); with ``track``,
    log one MLflow run (a library caller logs nothing unless it asks, as calibrate / evaluate do).  ``options.storage`` None: ``$OPTUNA_STORAGE``, else ``sqlite:///<out>/study.db``; ``options.study_name``
    names the first study, the others get their default names."""
    backend = check_backend(request.backend)
    storage = resolve_storage(options.storage)
    wl, out, search_traffic, heldout, ctx, conf, setups = _prepare(workload, gpus, request)
    options = dataclasses.replace(options, storage=storage or f"sqlite:///{out / 'study.db'}")
    several = len(setups) > 1
    studies, rows, plots = [], [], []
    for setup in setups:
        # several studies (deployment x router): the study name names the first; the others get their default names
        where = out / f"{setup.deployment}-{setup.fleet.router}" if several else out
        where.mkdir(parents=True, exist_ok=True)
        res = backend.run(setup, ctx, search_traffic, options if not studies else
                          dataclasses.replace(options, study_name=None), where=where, timeout_s=request.timeout_s)
        front = replay_front(res.front, setup, heldout, workers=options.workers, ray_address=options.ray_address)
        for r in front:
            r.pop("placement").save(where / f"placement-{r['gpus']}gpus-trial{r['trial']}.json")
            r["study"] = res.study_name
        plots += write_study_plots(load_study(res.storage, res.study_name), where, gpus, request.objective)
        studies.append((setup, res, front))
        rows += front
    if several:
        rows = merge_fronts(rows, request.objective)
    result = _result(studies, rows, plots, request, options, backend, conf)
    atomic_write_json(out / "front.json", result, indent=1, default=str)
    setup, res = studies[0][0], studies[0][1]
    log_command_run("search", res.study_name, params={"workload": wl.name, "gpus": gpus, "trials": options.trials,
                    "objective": request.objective, "criterion": setup.criterion.label, "storage": res.storage,
                    "study": res.study_name, "backend": request.backend, "deployments": ",".join(request.deployments),
                    "routers": ",".join(request.routers), "adapters": request.adapters,
                    "confidence": setup.confidence, "verify_load": setup.verify_load},
                    metrics={"trials": result["trials"], "complete": result["complete"], "failed": result["failed"],
                             "front_points": len(rows)},
                    artifacts=[out], profile=wl.profile, seeds={"sampler": options.seed, "evaluation": wl.evaluation.seed},
                    wall_s=result["wall_s"], tracking_uri=tracking_uri, track=track)
    return SearchRun(result, studies, out, 0 if rows else EXIT_NOT_ACCEPTABLE)   # ran, no feasible point: 3


def _result(studies, rows: list[dict], plots: list[Path], request: SearchRequest, options: SearchOptions,
            backend: Backend, conf) -> dict:
    """``front.json``'s content."""
    setup, res = studies[0][0], studies[0][1]
    return {"study": res.study_name, "storage": res.storage, "backend": request.backend, "seed": options.seed,
            "reproducible": backend.reproducible,
            "criterion": setup.criterion.label, "objective": request.objective,
            "confidence": conf.to_dict() if conf is not None else None,
            "trials": sum(r.trials for _, r, _ in studies), "complete": sum(r.complete for _, r, _ in studies),
            "failed": sum(r.failed for _, r, _ in studies), "wall_s": sum(r.wall_s for _, r, _ in studies),
            "front": rows, "plots": [str(p) for p in plots], "adapters": request.adapters,
            "studies": [{"study": r.study_name, "deployment": s.deployment, "router": s.fleet.router,
                         "adapters": s.fleet.adapters, "trials": r.trials, "complete": r.complete,
                         "failed": r.failed, "front_points": len(f)} for s, r, f in studies]}


def _stale_note(n: int, backend: Backend) -> str:
    if not n:
        return ""
    return f", {n} in flight at the last kill " + ("evaluated again" if backend.reproducible else "recorded as failed")


def report(run: SearchRun) -> str:
    """What ``lora-opt search`` prints: each study's line, the front (search traffic, then the held-out
    replay) and where the files are."""
    name, objective = run.result["backend"], run.result["objective"]
    backend, rows, several = BACKENDS[name], run.result["front"], len(run.studies) > 1
    lines = []
    for s, r, _ in run.studies:
        lines.append(f"study {r.study_name} in {r.storage} ({name}): {r.trials} trials ({r.complete} complete, "
                     f"{r.failed} failed{_stale_note(r.resumed_stale, backend)}); "
                     f"{r.wall_s:.0f} s; criterion {s.criterion.label}"
                     + (f"; {s.label}" if s.label != "placement / static / static" else "")
                     + ("" if s.confidence is None else f"; at confidence {s.confidence:g}: feasible also at "
                        f"{s.verify_load:.3f}x the load"))
    if not backend.reproducible:
        lines.append(f"  ({name}: the trials depend on the order they finished in -- not reproducible across runs "
                     "or --workers; the default backend is)")
    lines.append("Pareto front (GPUs vs " + objective + " in ms; search traffic, then the held-out replay"
                 + ("; across the studies" if several else "") + "):")
    lines.append(front_table(rows, objective) if rows else "  no feasible trial: no placement met the criterion "
                 f"(exit status {EXIT_NOT_ACCEPTABLE}); try more --trials or --gpus, or a looser criterion")
    lines.append(f"  -> {run.out}/front.json, placement-*.json, pareto_front.png, hypervolume_history.png;  "
                 + ("(one folder per study) " if several else "") + f"optuna-dashboard {run.studies[0][1].storage}")
    return "\n".join(lines)
