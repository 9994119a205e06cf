"""Multi-objective search over placements: Optuna (ask/tell) in the driver, trials on Ray.

Objectives: GPUs used and a latency (p99 TTFT by default), both measured by replaying traffic on
the twin.  Constraints (Optuna's ``constraints_func``, not penalties): no GPU starves (the
feasibility ``Criterion``: the workload's rho, or SLO attainment), none fails to start, every
adapter is placed.

Parametrisation (why): adapters are taken in the greedy's priority order (rank descending, rates
zig-zagged) and a placement is ``gpus`` = k contiguous parts of it, part g getting a share
``share_g`` of the adapters and an integer A_max ``amax_g`` (clipped to the part's size and to what
fits in memory; the spaces of every deployment: ``lora_opt.search.space``).  Contiguous parts of a rank-descending order keep every GPU's max rank -- the
dominant memory cost -- as low as the split allows, zig-zagged rates keep loads even, and the space
is 2k + 1 numbers instead of one GPU per adapter; every greedy and greedy-plus placement is such a
split, so the greedy seeds are exact points of the space.  Adapters too hot for one GPU (which
greedy-plus replicates) are outside it.  rho is not a free variable inside a study: it *defines*
feasibility, and a study free to lower it would call anything feasible; ``lora-opt pareto`` sweeps
it (and SLO targets) instead, one study per criterion, and the greedy seeds for several rho give
the search its starting points.

Trials run on *search traffic* (the observed history of a trace split, or the workload's traffic
with another seed); the front is then replayed on the held-out evaluation traffic and both numbers
are reported, so the search cannot overfit the traffic it is judged on.

Ask/tell over Ray tasks is the default backend, and the reproducible one: ``run_search`` asks fixed
batches, evaluates them in parallel and tells them in trial order, so a seeded study gives the same
trials whatever the number of workers.  ``lora_opt.search.tune`` runs the same study as a Ray Tune
experiment (``--backend tune``); ``lora-opt bench search`` compares the two.  Either way the study
lives in one Optuna storage (SQLite by default) that resumes after a kill and optuna-dashboard opens.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from lora_opt.errors import InputError
from lora_opt.parallel import TaskPool
from lora_opt.placement.evaluate import (GRACE_S, Criterion, evaluate_on_fleet, evaluate_placement, served_ok,
                                        with_evaluation, workload_requests)
from lora_opt.placement.instances import FleetOptions
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.placement.policies.packing import max_loras_that_start, priority_order
from lora_opt.placement.workload_file import Workload, load_request_log, split_request_log
from lora_opt.search.deployments import DEFAULT_DEPLOYMENT, check_deployment, study_suffix
from lora_opt.search.space import AMAX_MAX, decode, encode, part_sizes, seed_params, suggest  # noqa: F401 (API)
from twin.errors import ScenarioError
from twin.workload import Requests

#: the latency objectives a study minimises beside the GPU count: name -> (evaluation key, statistic)
OBJECTIVES = {"p99_ttft": ("ttft_ms", "p99"), "mean_ttft": ("ttft_ms", "mean"),
              "p99_itl": ("itl_ms", "p99"), "mean_itl": ("itl_ms", "mean")}
DEFAULT_OBJECTIVE = "p99_ttft"
#: Optuna constraint names (a trial is feasible when every value is <= 0)
CONSTRAINTS = ("starving_gpus", "gpus_failing_startup", "unplaced_adapters")
#: objective value of a trial with no completed request (finite: Optuna sorts it last)
NO_LATENCY = 1e9
#: trials asked per batch before any of them is told.  A property of the study -- never of the
#: number of workers -- so that a seeded study proposes the same trials on 1 worker, 2 or a cluster
#: (``run_search``); up to this many trials run at once.
DEFAULT_BATCH = 8


@dataclass
class Traffic:
    """Requests to replay and the window they fill."""

    requests: Requests | None
    """None = generate from the workload's evaluation section (with ``seed``)."""
    duration_s: float
    seed: int = 0


def traffic_halves(wl: Workload, log_path: str | None):
    """(workload, traffic to search / place on, held-out traffic, PlacementContext keywords).
    Without a log: the workload's evaluation traffic, drawn with two seeds.  With a request log
    (as for ``place --history``): rates from its first half, which is also the traffic placements
    are searched and verified on; its second half is held out."""
    T = wl.evaluation.duration_s
    if not log_path:
        _check_judged_window(T, "evaluation.duration_s")
        return wl, Traffic(None, T, seed=wl.evaluation.seed + 1), Traffic(None, T, seed=wl.evaluation.seed), {}
    wl, log, span = load_request_log(wl, log_path)
    wl, first, second, half = split_request_log(wl, log, span)
    _check_judged_window(min(half, span - half), f"request log {log_path} (each half of its {span:g} s span)")
    return wl, Traffic(first, half), Traffic(second, span - half), {"history": first, "history_s": half}


def _check_judged_window(window_s: float, what: str, grace_s: float = GRACE_S) -> None:
    """Before any trial runs: a window no longer than the starvation grace leaves no request due, so
    every trial would fail its verdict (``Criterion.check`` refuses it) and the study would end with
    'no feasible point' instead of saying why."""
    if not window_s > grace_s:
        raise ScenarioError(f"{what}: {window_s:g} s; search and pareto judge starvation with a {grace_s:g} s "
                            f"grace, which must be below the replayed window: give more than {grace_s:g} s")


def replay(p: Placement, wl: Workload, traffic: Traffic, *, criterion: Criterion, grace_s: float = GRACE_S,
           workers: int | None = 1, ray_address: str | None = None, fleet: FleetOptions | None = None,
           load: float = 1.0) -> dict:
    """``evaluate_placement`` on ``traffic`` -- its requests, or the workload's evaluation traffic
    drawn with the traffic's seed; with a ``fleet`` other than static routing of static adapters,
    ``evaluate_on_fleet`` (the GPUs as one fleet twin, in this process).  ``load``: the traffic at this x
    the load, its time compressed by it, bursts included, as greedy-plus verifies -- generated traffic
    drawn over ``load`` x the window and compressed into it (the same window judged), logged requests
    compressed (their window shortens)."""
    if traffic.requests is None:
        wl = dataclasses.replace(wl, evaluation=dataclasses.replace(wl.evaluation, seed=traffic.seed))
    if load != 1.0:
        if traffic.requests is None:
            req = workload_requests(with_evaluation(wl, duration_s=traffic.duration_s * load),
                                    min(g.max_model_len for g in p.gpus))
            window = traffic.duration_s
        else:
            req, window = traffic.requests, traffic.duration_s / load
        traffic = Traffic(Requests(arrival=np.ascontiguousarray(req.arrival / load), adapter=req.adapter,
                                   in_len=req.in_len, out_len=req.out_len), window, traffic.seed)
    if fleet is not None and (fleet.router, fleet.adapters) != ("static", "static"):
        return evaluate_on_fleet(p, wl, fleet, requests=traffic.requests, duration_s=traffic.duration_s,
                                 grace_s=grace_s, criterion=criterion)
    return evaluate_placement(p, wl, requests=traffic.requests, duration_s=traffic.duration_s, workers=workers,
                              ray_address=ray_address, progress=False, grace_s=grace_s, criterion=criterion)


@dataclass
class SearchSetup:
    """Everything a trial needs besides its parameters."""

    workload: Workload
    pool: int
    order: np.ndarray
    mem_caps: dict[int, int]
    criterion: Criterion
    objective: str = DEFAULT_OBJECTIVE
    grace_s: float = GRACE_S
    batch: int = DEFAULT_BATCH
    """trials the ask/tell study asks at once (``run_search``): the results depend on it, not on
    the number of workers"""
    fleet: FleetOptions = FleetOptions()
    """How trials are replayed: static routing of static adapters (default: today's per-GPU
    replay), or a router policy and/or on-demand adapters on the fleet twin."""
    deployment: str = DEFAULT_DEPLOYMENT
    """``lora_opt.search.deployments.DEPLOYMENTS``: what a trial's parameters stand for."""
    confidence: float | None = None
    """Decisions at this confidence (``lora_opt.placement.confidence``); None: the point estimate."""
    verify_load: float = 1.0
    """1 / the error model's capacity-ratio bound at ``confidence`` (1 without one): a trial is feasible only
    when it does not starve at this x the load either (its latency objective: at the load itself)."""

    @classmethod
    def build(cls, wl: Workload, pool: int, ctx: PlacementContext, criterion: Criterion | None = None,
              objective: str = DEFAULT_OBJECTIVE, batch: int = DEFAULT_BATCH, fleet: FleetOptions | None = None,
              deployment: str = DEFAULT_DEPLOYMENT, confidence=None) -> SearchSetup:
        """``confidence``: a ``lora_opt.placement.confidence.ConfidenceSetting`` (None: the point estimate)."""
        check_deployment(deployment)
        if deployment == "hybrid" and len(wl.adapters) < 2:
            raise ScenarioError("deployment hybrid: needs at least 2 adapters (the hot ones on every GPU, a tail placed)")
        if objective not in OBJECTIVES:
            raise ScenarioError(f"objective: {objective!r} not allowed; allowed values: {', '.join(OBJECTIVES)}")
        if not isinstance(pool, int) or pool < 1:
            raise ScenarioError(f"gpus: must be an integer >= 1, got {pool!r}")
        ranks = np.array([a.rank for a in wl.adapters])
        rates = np.array([a.rate for a in wl.adapters], float)
        prof = ctx.profile
        e = wl.resolved_engine(prof)
        caps = {int(r): max_loras_that_start(prof, int(r), e, AMAX_MAX) for r in set(ranks.tolist())}
        if not isinstance(batch, int) or batch < 1:
            raise ScenarioError(f"batch: must be an integer >= 1, got {batch!r}")
        bound = confidence.bound if confidence is not None else None
        return cls(wl, pool, priority_order(ranks, rates), caps, criterion or Criterion(rho=wl.rho), objective,
                   batch=batch, fleet=fleet or FleetOptions(), deployment=deployment,
                   confidence=None if bound is None else bound.confidence,
                   verify_load=1.0 if bound is None else bound.verification_load)

    @property
    def label(self) -> str:
        """deployment / router / adapters, as a front row names them"""
        return f"{self.deployment} / {self.fleet.router} / {self.fleet.adapters}"


def objective_value(ev: dict, objective: str) -> float:
    key, stat = OBJECTIVES[objective]
    v = ev[key][stat]
    return float(v) if v is not None and math.isfinite(v) else NO_LATENCY


def run_trial(params: dict, setup: SearchSetup, traffic: Traffic) -> dict:
    """Ray task / serial unit: decode, replay, objectives and constraints."""
    t0 = time.perf_counter()
    p = decode(params, setup)
    ev = replay(p, setup.workload, traffic, criterion=setup.criterion, grace_s=setup.grace_s, fleet=setup.fleet)
    starving = ev["gpus_starving"]
    if setup.verify_load != 1.0 and not starving and not ev["gpus_failing_startup"]:
        # at a confidence: no GPU may starve at the verification load either (one that starves at the load
        # itself needs no second replay)
        starving = replay(p, setup.workload, traffic, criterion=setup.criterion, grace_s=setup.grace_s,
                          fleet=setup.fleet, load=setup.verify_load)["gpus_starving"]
    return {"values": [float(len(p.gpus)), objective_value(ev, setup.objective)],
            "constraints": [float(starving), float(ev["gpus_failing_startup"]),
                            float(min(ev["unrouted_requests"], 1))],
            "metrics": {"ttft_p99_ms": ev["ttft_ms"]["p99"], "ttft_mean_ms": ev["ttft_ms"]["mean"],
                        "itl_p99_ms": ev["itl_ms"]["p99"], "itl_mean_ms": ev["itl_ms"]["mean"],
                        "throughput_tok_s": ev["throughput_tok_s"], "gpus_starving": ev["gpus_starving"],
                        "gpus_starving_at_confidence": starving,
                        "gpus_failing_startup": ev["gpus_failing_startup"],
                        **{k: ev[k] for k in ("adapter_loads_cpu", "adapter_loads_disk") if k in ev}},
            "wall_s": time.perf_counter() - t0}


@dataclass(frozen=True)
class SearchOptions:
    """How a study runs, whichever backend drives its trials (``run_search``, ``tune.run_tune_search``)."""

    trials: int = 64
    """Trials the study is run (or resumed) until, counting those it already has, >= 1."""
    storage: str | None = None
    """Optuna storage URL the study lives in (resumes from it; None: ``sqlite:///lora-opt-search.db``)."""
    study_name: str | None = None
    """The study's name (None: ``<workload>-<gpus>gpus-<objective>`` and the setup's suffixes, ``open_study``)."""
    seed: int = 0
    """Sampler seed, >= 0 (ask/tell: the same trials and front for any ``workers``)."""
    workers: int | None = None
    """Parallel trials (1 = serial, no Ray; None = serial when the trials are too few to pay Ray's start-up,
    else Ray on all cores), >= 1."""
    ray_address: str | None = None
    """An existing Ray cluster (None = ``RAY_ADDRESS`` or a local instance)."""
    seeds: bool = True
    """Start from the greedy placements (``seed_placements``), enqueued as the first trials."""
    progress: bool = True
    """A progress bar over the trials (stderr)."""

    def __post_init__(self):
        for name, lo in (("trials", 1), ("seed", 0), ("workers", 1)):
            value = getattr(self, name)
            if value is None and name == "workers":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InputError(f"--{name}: expected an integer, got {value!r}")
            if value < lo:
                raise InputError(f"--{name}: must be >= {lo}, got {value}")


@dataclass
class SearchResult:
    study_name: str
    storage: str
    trials: int
    complete: int
    failed: int
    front: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    resumed_stale: int = 0
    """trials a killed run had in flight, evaluated again"""


def seed_placements(setup: SearchSetup, ctx: PlacementContext, rhos=(0.7, 0.8, 0.9, 0.95)) -> list[tuple[str, Placement]]:
    """Greedy placements to start from: greedy-plus under the papers' criterion at several rho, the
    default greedy-plus, and the paper's greedy."""
    wl = setup.workload
    out = []
    for r in rhos:
        pol = get_policy("greedy-plus", margin=0.0, ttft_p99_s=None, criterion=Criterion(rho=r))
        out.append((f"greedy-plus rho {r:g}", pol.place(wl, setup.pool, ctx)))
    out.append(("greedy-plus", get_policy("greedy-plus", criterion=setup.criterion).place(wl, setup.pool, ctx)))
    out.append(("greedy", get_policy("greedy").place(wl, setup.pool, ctx)))
    return out


def check_storage(storage: str) -> None:
    """A storage URL Optuna can open (a SQLAlchemy URL whose database driver is installed);
    ScenarioError naming ``--storage`` otherwise."""
    from sqlalchemy.engine import make_url  # comes with optuna
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(storage).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError) as exc:
        raise ScenarioError(f"--storage: {storage!r:.100} is not a database URL Optuna can open "
                            f"(e.g. sqlite:///study.db, postgresql://...): {str(exc)[:120]}") from None


def open_storage(storage: str, attempts: int = 5):
    """Optuna storage for `storage`. SQLite: readers of a running study (optuna-dashboard, a
    second `search`, a poller) hold locks, so wait up to 60 s for them rather than fail on
    sqlite3's 5 s default; and two processes opening the same *new* file both try to create its
    schema (one fails with a UNIQUE/"already exists" error), so retry: the loser then finds the
    schema made."""
    import optuna  # heavy optional dependency: only when a study runs
    from sqlalchemy.exc import IntegrityError, OperationalError  # comes with optuna

    check_storage(storage)
    if not storage.startswith("sqlite:"):
        return storage
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(storage, engine_kwargs={"connect_args": {"timeout": 60}})
        except (IntegrityError, OperationalError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


#: hypervolume reference latency (ms) of the study's plots and of ``lora-opt pareto``
REF_LATENCY_MS = 60_000.0


@contextlib.contextmanager
def optuna_quiet():
    """Optuna's INFO lines off for the duration (its verbosity restored afterwards: a library must not
    change a process-wide setting for good); "experimental" warnings (multivariate TPE, metric names)
    silenced."""
    import optuna  # heavy optional dependency: only when a study runs

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(before)


def batch_sampler(seed: int, told: int):
    """The sampler of the batch that starts when the study holds ``told`` trials: TPE seeded from
    (``seed``, ``told``), so the proposals depend on the seed and the study's trials only -- not on
    how many workers ran the previous batches, in which order they finished, or whether the run was
    resumed at a batch boundary."""
    import optuna  # heavy optional dependency: only when a study runs

    derived = int(np.random.SeedSequence([int(seed), int(told)]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=derived, multivariate=True, group=True, n_startup_trials=10)


def open_study(setup: SearchSetup, storage: str, study_name: str | None, seed: int):
    """(study, name): created or loaded, metric names set."""
    import optuna  # heavy optional dependency: only when a study runs

    name = study_name or (f"{setup.workload.name or 'workload'}-{setup.pool}gpus-{setup.objective}"
                          + study_suffix(setup.deployment, setup.fleet.router, setup.fleet.adapters)
                          + ("" if setup.confidence is None else f"-C{setup.confidence:g}"))
    study = optuna.create_study(study_name=name, storage=open_storage(storage), sampler=batch_sampler(seed, 0),
                                directions=["minimize", "minimize"], load_if_exists=True)
    stored = study.user_attrs.get("verify_load", 1.0 if study.get_trials(deepcopy=False) else None)  # one load a study
    if stored is not None and abs(float(stored) - setup.verify_load) > 1e-9:
        raise ScenarioError(f"study {name!r}: its trials were judged at {float(stored):.3f}x the load, this run "
                            f"asks {setup.verify_load:.3f}x (another --confidence or error model); give another --study")
    if stored is None:                   # a new study (older stored ones were judged at 1x)
        study.set_user_attr("verify_load", setup.verify_load)
    study.set_metric_names(["gpus", setup.objective])
    return study, name


def load_study(storage: str, study_name: str):
    """An existing study, through ``open_storage``."""
    import optuna  # heavy optional dependency: only when a study runs

    return optuna.load_study(study_name=study_name, storage=open_storage(storage))


def stale_batch(study) -> list[tuple[Any, dict]]:
    """Trials left RUNNING by a killed run, as a batch to evaluate again (their parameters were
    fixed when they were asked): a resumed study then holds what an uninterrupted one would."""
    import optuna  # heavy optional dependency: only when a study runs
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    # a live Trial over the stored one, so that constraints and attributes can be set on it
    return [(optuna.trial.Trial(study, t._trial_id), dict(t.params)) for t in sorted(stale, key=lambda t: t.number)]


def enqueue_seeds(study, setup: SearchSetup, ctx: PlacementContext) -> int:
    """On a new study, the greedy placements (``seed_placements``) as its first trials; how many."""
    if study.get_trials(deepcopy=False):
        return 0
    seen = set()
    for label, p in seed_placements(setup, ctx):
        params = seed_params(p, setup)
        key = None if params is None else tuple(sorted(params.items()))
        if params is not None and key not in seen:
            seen.add(key)
            study.enqueue_trial(params, user_attrs={"seed": label})
    return len(seen)


def record_trial(study, trial, out) -> None:
    """Tell the study a trial's outcome: a result dict of ``run_trial`` (constraints as Optuna
    constraints, metrics as user attributes), or the exception it raised (failed)."""
    from optuna.trial import TrialState  # heavy optional dependency: only when a study runs

    if isinstance(out, BaseException):        # a failing or timed-out trial; the study goes on
        trial.set_user_attr("error", f"{type(out).__name__}: {out}"[:500])
        study.tell(trial, state=TrialState.FAIL)
        return
    for name, v in zip(CONSTRAINTS, out["constraints"]):
        trial.set_constraint(name, v)         # Optuna's constraints: feasible iff all <= 0
    trial.set_user_attr("constraints", out["constraints"])
    for k, v in out["metrics"].items():
        trial.set_user_attr(k, v)
    trial.set_user_attr("wall_s", out["wall_s"])
    study.tell(trial, out["values"])


def finished_trials(study) -> int:
    from optuna.trial import TrialState  # heavy optional dependency: only when a study runs

    return sum(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in study.get_trials(deepcopy=False))


def run_batch(study, batch: list[tuple[Any, dict]], setup_ref, traffic_ref, pool: TaskPool, timeout_s: float | None,
              bar) -> None:
    """Evaluate a batch of asked trials (``(trial, params)``) on ``pool`` -- as many at once as it has
    room for -- and tell them in trial-number order, each as soon as every earlier one is in: what
    the study holds after the batch does not depend on the number of workers or the order in which
    trials finished."""
    todo, results, told = list(batch), {}, 0
    while told < len(batch):
        while todo and pool.free > 0:
            trial, params = todo.pop(0)
            pool.submit(trial.number, params, setup_ref, traffic_ref)
        number, out = pool.next_done(timeout_s)
        results[number] = out
        bar.update(1)
        while told < len(batch) and batch[told][0].number in results:
            record_trial(study, batch[told][0], results.pop(batch[told][0].number))
            told += 1


def run_search(setup: SearchSetup, ctx: PlacementContext, traffic: Traffic, options: SearchOptions = SearchOptions(),
               *, timeout_s: float | None = 600.0) -> SearchResult:
    """Run (or resume) the study until ``options.trials`` trials have finished.

    Reproducible: trials are asked ``setup.batch`` at a time (the sampler seeded from ``options.seed`` and
    the number of trials so far, ``batch_sampler``), evaluated in parallel, and told in trial-number
    order, so a seeded study gives the same trials and front on any number of workers, and the
    trials a killed run had in flight are evaluated again when it resumes.  The exception: a trial
    that fails by running past ``timeout_s`` (a matter of timing)."""
    t0 = time.perf_counter()
    trials, seed = options.trials, options.seed
    storage = options.storage or "sqlite:///lora-opt-search.db"
    with optuna_quiet(), tqdm(total=trials, desc="search: greedy seeds", unit="trial",
                              disable=not options.progress) as bar:
        study, study_name = open_study(setup, storage, options.study_name, seed)
        stale = [(t, suggest(t, setup)) for t, _ in stale_batch(study)]   # killed mid-ask: asks what is missing
        if options.seeds:
            enqueue_seeds(study, setup, ctx)
        done0 = finished_trials(study)
        bar.update(done0)
        bar.set_description_str(f"study {study_name}")
        pool = TaskPool(run_trial, workers=options.workers, ray_address=options.ray_address,
                        tasks=max(0, trials - done0))
        setup_ref, traffic_ref = pool.put(setup), pool.put(traffic)
        if stale:
            run_batch(study, stale, setup_ref, traffic_ref, pool, timeout_s, bar)
        while (left := trials - finished_trials(study)) > 0:
            study.sampler = batch_sampler(seed, len(study.get_trials(deepcopy=False)))
            asked = [study.ask() for _ in range(min(setup.batch, left))]
            run_batch(study, [(t, suggest(t, setup)) for t in asked], setup_ref, traffic_ref, pool, timeout_s, bar)
        front = front_rows(study, setup.objective)
        all_trials = study.get_trials(deepcopy=False)
    return SearchResult(study_name, storage, len(all_trials), sum(t.state.name == "COMPLETE" for t in all_trials),
                        sum(t.state.name == "FAIL" for t in all_trials), front, time.perf_counter() - t0,
                        len(stale))


def study_front(study) -> list:
    """The study's Pareto front: Optuna's ``best_trials`` (complete, feasible under the trials'
    constraints, non-dominated), one trial per distinct objective pair (the lowest number), by GPUs."""
    front, seen = [], set()
    for t in sorted(study.best_trials, key=lambda t: (t.values[0], t.values[1], t.number)):
        if tuple(t.values) not in seen:
            seen.add(tuple(t.values))
            front.append(t)
    return front


def front_rows(study, objective: str) -> list[dict]:
    """``study_front`` as rows: trial, GPUs, the objective (ms), parameters, greedy seed label."""
    return [{"trial": t.number, "gpus": int(t.values[0]), objective: t.values[1], "params": t.params,
             "seed": t.user_attrs.get("seed")} for t in study_front(study)]


def nondominated(items, objectives) -> list:
    """The items no other item weakly dominates on the two minimised ``objectives(item)``, in order
    of those objectives (ties keep the input order)."""
    front, kept = [], []
    for it in sorted(items, key=objectives):
        v = objectives(it)
        if not any(k[0] <= v[0] and k[1] <= v[1] for k in kept):
            front.append(it)
            kept.append(v)
    return front


def hypervolume(points, ref) -> float:
    """Area dominated by 2-D minimisation points, bounded by the reference point ``ref``."""
    pts = [(float(x), float(y)) for x, y in points if x < ref[0] and y < ref[1]]
    xs = sorted({x for x, _ in pts})
    area = 0.0
    for j, x in enumerate(xs):            # staircase: best y among points at or left of x
        y = min(py for px, py in pts if px <= x)
        x_next = xs[j + 1] if j + 1 < len(xs) else ref[0]
        area += (x_next - x) * (ref[1] - y)
    return float(area)


def replay_front(front: list[dict], setup: SearchSetup, traffic: Traffic, *, workers: int | None = None,
                 ray_address: str | None = None) -> list[dict]:
    """Replay every front point on (held-out) ``traffic``: its objective there and whether it is
    still feasible; also the placements themselves."""
    out = []
    for f in front:
        p = decode(f["params"], setup)
        lat, ok = heldout_verdict(p, setup.workload, traffic, setup, workers=workers, ray_address=ray_address)
        out.append({**f, "deployment": setup.deployment, "router": setup.fleet.router,
                    "adapters": setup.fleet.adapters, "heldout": lat, "heldout_feasible": ok,
                    "confidence": setup.confidence, "placement": p})
    return out


def heldout_verdict(p: Placement, wl: Workload, traffic: Traffic, setup: SearchSetup, *, workers: int | None = None,
                    ray_address: str | None = None) -> tuple[float, bool]:
    """(the objective on ``traffic``, feasible there) -- at a confidence, feasible also at the setup's
    verification load, as the trials were judged."""
    kw = dict(criterion=setup.criterion, grace_s=setup.grace_s, workers=workers, ray_address=ray_address,
              fleet=setup.fleet)
    ev = replay(p, wl, traffic, **kw)
    ok = served_ok(ev)
    if ok and setup.verify_load != 1.0:
        ok = served_ok(replay(p, wl, traffic, load=setup.verify_load, **kw))
    return objective_value(ev, setup.objective), ok


def merge_fronts(rows: list[dict], objective: str) -> list[dict]:
    """The front across studies (one per deployment and router): the rows no other row weakly
    dominates on (GPUs, ``objective`` on the search traffic)."""
    return nondominated(rows, lambda r: (r["gpus"], r[objective]))


def front_table(rows: list[dict], objective: str) -> str:
    labelled = any(r.get("deployment", DEFAULT_DEPLOYMENT) != DEFAULT_DEPLOYMENT or r.get("router", "static") != "static"
                   or r.get("adapters", "static") != "static" for r in rows)
    lines = [f"{'GPUs':>4} {objective + ' (search)':>20} {objective + ' (held-out)':>22} {'held-out ok':>11}  trial  "
             + ("deployment / router / adapters  " if labelled else "") + "seed"]
    for r in rows:
        what = f"{r.get('deployment', DEFAULT_DEPLOYMENT)} / {r.get('router', 'static')} / {r.get('adapters', 'static')}"
        lines.append(f"{r['gpus']:>4} {r[objective]:>20,.1f} {r['heldout']:>22,.1f} "
                     f"{'yes' if r['heldout_feasible'] else 'NO':>11}  {r['trial']:>5}  "
                     + (f"{what:<40} " if labelled else "") + f"{r.get('seed') or '-'}")
    return "\n".join(lines)
