"""``lora-opt place``'s work: a workload and a GPU pool in, a checked placement out -- the policy's placement,
or with a deployment the one :mod:`lora_opt.search.recommend` recommends (here, not in ``lora_opt.placement``,
because judging the deployments is this stage's), its verdict and its files: ``placement.json`` and, asked
for, one ``vllm serve`` command per GPU, the router table and the router's configuration.

``place_workload`` is the whole command as one call; ``place_report`` (or ``PlaceOutcome.to_dict``) is what it
prints.  The table, the verdict and the files themselves are ``lora_opt.placement.report``'s."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK, InputError
from lora_opt.io import atomic_write_text
from lora_opt.placement.confidence import ConfidenceSetting, annotate, resolve_bound
from lora_opt.placement.plan import Placement, PlacementError
from lora_opt.placement.policies import DEFAULT_POLICY, PlacementContext, get_policy
from lora_opt.placement.report import clean_outputs, placement_table, table_notes, verdict, write_outputs
from lora_opt.placement.vllm_launch import resolve_vllm_version
from lora_opt.placement.workload_file import Workload, load_request_log
from lora_opt.replan.router_config import router_files
from lora_opt.search.recommend import (DEPLOYMENT_CHOICES, SLO_TTFT_P99_S, Candidate, candidates_table,
                                       judged_note, no_deployment_message, recommend, recommendation_line,
                                       router_config_for, router_note)
from twin.profile import load_profile

#: the fixed capacity headroom greedy-plus verifies with when neither a margin nor an error model is given
DEFAULT_MARGIN = 0.1


@dataclass(frozen=True)
class PlaceOptions:
    """What ``place_workload`` does besides the workload and the pool."""

    policy: str = DEFAULT_POLICY
    """Placement policy (a key of ``lora_opt.placement.policies.POLICIES``)."""
    deployment: str | None = None
    """None or ``static``: the policy's placement is the answer; ``every-gpu``, ``hybrid`` or ``best`` (all
    three): the deployments judged on the fleet twin at the same SLO and load, the one with the fewest GPUs
    returned (``lora_opt.search.recommend``)."""
    confidence: float | None = None
    """Decide at this confidence, in (0, 1) (None: the default where the profile has an error model, else
    the fixed margin; ``lora_opt.placement.confidence.resolve_bound``)."""
    error_model: str | None = None
    """Error model YAML instead of the profile's bundled one."""
    margin: float | None = None
    """Greedy-plus: a fixed capacity headroom over the expected load instead of a confidence."""
    verify_s: float | None = None
    """Greedy-plus: seconds of twin verification per GPU (0 = off; None: the policy's default)."""
    ttft_p99_s: float | None = None
    """p99 TTFT bound: greedy-plus's in its verification, and the SLO the deployments are judged at
    (None: the policy's default, and ``SLO_TTFT_P99_S``)."""
    oracle: str | None = None
    """Greedy-plus: the surrogate to consult (``ORACLE_FILES``; None: full)."""
    progress: bool = False
    """Greedy-plus: a progress bar (stderr)."""
    history: str | None = None
    """Request log: rates estimated from it, and greedy-plus verifies every GPU on its requests."""
    surrogate: str | None = None
    """Surrogate directory or registered version (None: the bundled one for the profile)."""
    out_dir: str | None = None
    """Output directory (None: ``outputs/placement-<workload>``)."""
    emit_vllm: bool = False
    """Also write one ``vllm serve`` command per GPU and ``router.json`` (and, for a deployment judged behind
    a router, that router's configuration)."""
    emit_router: str | None = None
    """Also write this router's configuration (``lora_opt.replan.router_config.ROUTER_CONFIGS``)."""
    model: str | None = None
    """Model for ``vllm serve`` (None: the profile's model)."""
    vllm_version: str | None = None
    """The vLLM release the commands are written for (None: the profile's, else the default)."""

    def __post_init__(self):
        if self.deployment is not None and self.deployment not in DEPLOYMENT_CHOICES:
            raise InputError(f"--deployment: {self.deployment!r} not allowed; allowed values: "
                             f"{', '.join(DEPLOYMENT_CHOICES)}")
        if self.vllm_version is not None:     # refused before any placement work
            resolve_vllm_version(self.vllm_version, error=InputError)

    def policy_options(self) -> dict:
        """The policy's constructor options: greedy-plus's knobs that are set (other policies take none)."""
        if self.policy != "greedy-plus":
            return {}
        opts = {"progress": self.progress}
        for k in ("margin", "verify_s", "ttft_p99_s", "oracle"):
            if getattr(self, k) is not None:
                opts[k] = getattr(self, k)
        return opts


@dataclass
class PlaceOutcome:
    """What ``place_workload`` did."""

    workload: Workload
    """The workload placed (with a request log: at its rates)."""
    placement: Placement
    """The answer: the policy's placement, or the recommended deployment's."""
    code: int
    """The verdict's exit status (``lora_opt.placement.report.verdict``)."""
    message: str
    """The verdict in words."""
    policy: str
    written: list[Path] = field(default_factory=list)
    judged: list[Candidate] | None = None
    """The deployments judged, best first (None: the policy's placement alone)."""
    history: tuple[str, int, float] | None = None
    """(request log, its requests, its span in seconds) when the rates came from one."""

    def to_dict(self) -> dict:
        """The outcome as ``place --json`` prints it: exit status, verdict, files, the placement."""
        extra = {"deployments": [c.to_dict() for c in self.judged]} if self.judged is not None else {}
        return {"exit": self.code, "message": self.message, "files": [str(w) for w in self.written],
                **self.placement.to_dict(), **extra}


def place_workload(wl: Workload, gpus: int, options: PlaceOptions = PlaceOptions()) -> PlaceOutcome:
    """Place ``wl`` on ``gpus`` GPUs with ``options.policy`` (and judge ``options.deployment``'s deployments),
    decide at the confidence, write the files when the verdict allows (an infeasible run removes a previous
    run's files instead)."""
    setting = resolve_bound(load_profile(wl.profile), options.confidence, options.error_model,
                            margin_given=options.margin is not None)
    policy_options = options.policy_options()
    if setting.bound is not None and options.policy == "greedy-plus":
        policy_options.update(confidence=setting.confidence, error_model=options.error_model)
    policy = get_policy(options.policy, **policy_options)
    log, history = None, None
    if options.history:
        wl, log, span = load_request_log(wl, options.history)
        history = (options.history, len(log), span)
    ctx = PlacementContext.for_workload(wl, options.surrogate, history=log, history_s=history[2] if history else 0.0)
    p = policy.place(wl, gpus, ctx)
    judged = None
    if options.deployment and options.deployment != "static":
        p, judged = recommended(wl, gpus, p, policy, setting, options, policy_options.get("margin", DEFAULT_MARGIN))
    if setting is not None and p.meta.get("feasible"):
        annotate(p, wl, setting)          # each GPU's margin and probability of starving at the confidence
    code, message = verdict(p)
    emit_router = options.emit_router
    if judged is not None and not judged[0].ok:
        why = no_deployment_message(judged, gpus)
        # the policy's own verdict first where it is already infeasible (how many GPUs it needs)
        code, message = EXIT_NOT_ACCEPTABLE, (f"{message}\n{why}" if code == EXIT_NOT_ACCEPTABLE else why)
    if judged is not None and code == EXIT_OK and judged[0].fleet.router != "static":
        # judged behind a picker: router.json's fixed weights are not what was judged; with the launch
        # commands comes the configuration of a router that has the picker (unless another was asked for)
        emit_router = emit_router or (router_config_for(judged[0].fleet.router) if options.emit_vllm else None)
        p.meta.setdefault("notes", []).append(router_note(judged[0], emit_router))
    written = _write(p, ctx.profile, wl, code, options, emit_router)
    return PlaceOutcome(wl, p, code, message, policy.name, written, judged, history)


def _write(p: Placement, profile, wl: Workload, code: int, options: PlaceOptions, emit_router: str | None) -> list:
    """The files the verdict allows, under ``options.out_dir``; none for an infeasible placement (a previous
    run's removed: they must not pass for this one's)."""
    out_path = Path(options.out_dir or f"outputs/placement-{wl.name or 'workload'}")
    written = []
    router_text = {}
    if emit_router and code == EXIT_OK:             # refused (PlacementError) before anything is written
        router_text = router_files(p, emit_router, vllm_release=resolve_vllm_version(
            options.vllm_version, getattr(profile, "vllm_version", None), PlacementError))
    if code != EXIT_NOT_ACCEPTABLE:                 # infeasible: nothing placed to write
        written = write_outputs(p, profile, out_path, emit_vllm=options.emit_vllm and code == EXIT_OK,
                                model=options.model, vllm_version=options.vllm_version)
        for name, text in router_text.items():
            (out_path / name).parent.mkdir(parents=True, exist_ok=True)
            written.append(atomic_write_text(out_path / name, text, 0o755 if name.endswith(".sh") else None))
    elif out_path.is_dir():
        clean_outputs(out_path)
    return written


def recommended(wl: Workload, gpus: int, static: Placement, policy, setting: ConfidenceSetting | None,
                options: PlaceOptions, margin: float) -> tuple[Placement, list[Candidate]]:
    """(the placement of the recommended deployment -- the static one when none meets the SLO --, the judged
    candidates, best first): ``recommend`` at the confidence's verification load (without an error model:
    1 + the fixed ``margin``) and the p99 TTFT bound ``options.ttft_p99_s`` (else ``SLO_TTFT_P99_S``)."""
    ttft_p99_s = options.ttft_p99_s or SLO_TTFT_P99_S
    load = setting.bound.verification_load if setting is not None and setting.bound is not None else 1.0 + margin
    t0 = time.perf_counter()
    judged = recommend(wl, gpus, static, policy=policy, load=load,
                       ctx_for=lambda w: PlacementContext.for_workload(w, options.surrogate),
                       ttft_p99_s=ttft_p99_s, deployment=options.deployment)
    best = judged[0]
    how = (f"derived from the confidence {setting.confidence:g}" if setting is not None and setting.bound is not None
           else f"the fixed margin {margin:g}")
    p = best.placement if best.ok and best.placement is not None else static
    p.meta.setdefault("notes", []).append(judged_note(wl, load, how, ttft_p99_s, options.history))
    if not best.ok or best.placement is None:
        return static, judged
    p.meta.update(deployment=best.deployment, judged_load=load, judged_router=best.fleet.router,
                  # the wall time of the whole answer: the policy's placement, then the judging
                  policy_wall_ms=static.meta.get("policy_wall_ms", 0.0) + (time.perf_counter() - t0) * 1000)
    if p is static:
        return static, judged
    p.meta.setdefault("gpus_pool", gpus)
    on = p.by_gpu()
    p.meta.setdefault("incoming_rate_req_s",
                      [sum(p.adapters[k].rate * w for k, w in on[g]) for g in range(len(p.gpus))])
    return p, judged


def place_report(done: PlaceOutcome) -> str:
    """What ``lora-opt place`` prints: the workload, the judged deployments and the recommendation, the
    placement's table and notes, the verdict and the files written."""
    wl, p, judged = done.workload, done.placement, done.judged
    deployed = f"; deployment {p.meta['deployment']}" if judged is not None and "deployment" in p.meta else ""
    lines = [f"workload {wl.name}: {len(wl.adapters)} adapters, {wl.total_rate:.2f} req/s; policy {done.policy}"
             f"{deployed}; profile {wl.profile}"]
    if done.history is not None:
        path, n, span = done.history
        lines.append(f"rates from {path}: {n:,} requests over {span:,.0f} s")
    if judged is not None:
        lines += [candidates_table(judged), recommendation_line(judged)]
    lines.append(placement_table(p))
    lines += [f"  {note}" for note in table_notes(p)]          # what the columns mean, for the values shown
    lines += [f"note: {note}" for note in p.meta.get("notes", [])]
    lines.append(done.message)
    lines += [f"  -> {w}" for w in done.written]
    return "\n".join(lines) + "\n"
