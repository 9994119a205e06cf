"""``lora-opt replan``'s and ``lora-opt schedule``'s work, each command as one call: the inputs read (the new
demand from a workload, a request log or Prometheus; a schedule's steps from a drift or workload files), the
policy built from ``ReplanOptions``, the replan or the schedule run, the verdict, the files written
(``plan.json`` and the new placement's files; ``schedule.json``, ``.csv``, ``.png`` and every step's
``placement.json`` and ``plan.json``), and the text the commands print.

``replan_running`` and ``schedule_horizon`` are the commands; ``replan_report`` and ``schedule_report``
(``SCHEDULE_HEADER``, ``schedule_row``) are what they print.  The re-placement itself is
``lora_opt.replan.replan``'s, the step-by-step schedule ``lora_opt.replan.schedule``'s."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK, InputError
from lora_opt.io import atomic_write_json, atomic_write_text
from lora_opt.placement.confidence import resolve_bound
from lora_opt.placement.evaluate import workload_from_placement
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.placement.policies.greedy import GreedyPlus
from lora_opt.placement.prometheus_demand import read_demand, workload_from_demand
from lora_opt.placement.report import verdict, write_outputs
from lora_opt.placement.workload_file import Workload, load_request_log, load_workload
from lora_opt.replan.drift import drift_workloads, load_drift
from lora_opt.replan.replan import ReplanCosts, replan
from lora_opt.replan.replan_steps import step_counts
from lora_opt.replan.schedule import Step, run_schedule, schedule_plot

#: where a command's progress lines go (``print``; None: nowhere, e.g. with ``--json``)
Say = Callable[[str], None] | None


@dataclass(frozen=True)
class ReplanOptions:
    """What ``replan``, ``schedule`` and ``operate`` share: the costs, consolidation, the surrogate and
    greedy-plus's GPU test (the test replan judges instances with)."""

    costs: ReplanCosts = ReplanCosts()
    """What a move and a restart cost against a GPU (default: lexicographic, GPUs first)."""
    consolidate: bool = True
    """Empty and stop a running instance to save a GPU."""
    surrogate: str | None = None
    """Surrogate directory or registered version (None: the bundled one for the profile)."""
    margin: float | None = None
    """Greedy-plus: capacity headroom over the load (None: the policy's default)."""
    confidence: float | None = None
    """Greedy-plus: verify each GPU at the load the profile's error model derives for this confidence
    (None: the fixed margin); refused beside ``margin``."""
    error_model: str | None = None
    """Error model YAML for ``confidence`` (None: the profile's bundled one)."""
    verify_s: float | None = None
    """Greedy-plus: seconds of twin verification per GPU (0 = off; None: the policy's default)."""
    ttft_p99_s: float | None = None
    """Greedy-plus: p99 TTFT bound in the verification (None: the policy's default)."""
    oracle: str | None = None
    """Greedy-plus: surrogate to consult (None: full)."""

    def policy(self, profile) -> GreedyPlus:
        """greedy-plus with these settings; with ``confidence``, verifying at the load the profile's error
        model derives (refused beside ``margin``: ``resolve_bound``)."""
        opts = {k: getattr(self, k) for k in ("margin", "verify_s", "ttft_p99_s", "oracle")
                if getattr(self, k) is not None}
        if self.confidence is not None:
            resolve_bound(profile, self.confidence, self.error_model, margin_given=self.margin is not None)
            opts.update(confidence=self.confidence, error_model=self.error_model)
        return get_policy("greedy-plus", **opts)


# ---- lora-opt replan ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplanRequest:
    """What ``replan_running`` does besides the running placement and the ``ReplanOptions``: where the new
    demand comes from (the first of ``workload``, ``prometheus``, ``history`` given), the files, the
    running instances' endpoints."""

    workload: str | None = None
    """The new demand: a workload YAML/JSON (same profile)."""
    history: str | None = None
    """The new demand estimated from a request log (the running placement's adapters at its rates)."""
    prometheus: str | None = None
    """The new demand from a Prometheus server that scrapes the gateway, over ``window``."""
    window: str = "1h"
    """``prometheus``: the window ending now."""
    out_dir: str | None = None
    """Output directory (None: ``outputs/replan-<workload>``)."""
    scratch: bool = True
    """Also place from scratch (the alternative the costs compare against)."""
    emit_vllm: bool = False
    """Also write the new placement's ``vllm serve`` commands and ``router.json`` (as place does)."""
    host: str = "127.0.0.1"
    """Host of the running instances."""
    base_port: int = 8000
    """GPU i of the running placement listens on base_port + i."""

    def __post_init__(self):
        if not 1 <= self.base_port <= 65535:
            raise InputError(f"--base-port: must be a port in 1..65535, got {self.base_port}")


@dataclass
class ReplanOutcome:
    """What ``replan_running`` did."""

    code: int
    """The exit status: the new placement's verdict, or ``EXIT_NOT_ACCEPTABLE`` for a starving transition."""
    message: str
    plan: dict
    """``plan.json`` as written (``replan --json`` prints it)."""
    written: list[Path] = field(default_factory=list)


def replan_running(current: str | Path, request: ReplanRequest = ReplanRequest(),
                   options: ReplanOptions = ReplanOptions(), say: Say = None) -> ReplanOutcome:
    """Re-place the running placement ``current`` (placement.json or the folder place wrote) for the new
    demand of ``request``; judge it and its transition; write the new placement's files and ``plan.json``.
    ``say`` sees the Prometheus demand's summary."""
    running = Placement.load(current)
    wl = new_demand(running, request, say)
    ctx = PlacementContext.for_workload(wl, options.surrogate)
    policy = options.policy(ctx.profile)
    r = replan(running, wl, policy, ctx, costs=options.costs, consolidate=options.consolidate,
               scratch=request.scratch, host=request.host, base_port=request.base_port)
    code, message = verdict(r.placement)
    if code == EXIT_OK and not r.plan["transition_ok"]:
        code, message = EXIT_NOT_ACCEPTABLE, "the transition has a state where an instance the plan loaded starves"
    out_dir = Path(request.out_dir or f"outputs/replan-{wl.name or 'workload'}")
    written = write_outputs(r.placement, ctx.profile, out_dir, emit_vllm=request.emit_vllm and code == EXIT_OK,
                            model=None)
    plan = {"current": str(current), "workload": wl.name, "exit": code, "message": message, **r.plan}
    written.append(atomic_write_json(out_dir / "plan.json", plan, indent=1))
    return ReplanOutcome(code, message, plan, written)


def new_demand(current: Placement, request: ReplanRequest, say: Say = None) -> Workload:
    """The new demand of ``request``: its workload file, else Prometheus's, else the request log's."""
    if request.workload:
        return load_workload(request.workload)
    if request.prometheus:
        return prometheus_workload(current, request.prometheus, request.window, say)
    return history_workload(current, request.history)


def history_workload(current: Placement, log: str) -> Workload:
    """The running placement's adapters (ids, ranks, its engine flags and rho) with the rates of a
    request log; the log's problems as ``--history`` errors.  The instances are then judged on
    Poisson traffic at these rates (``place --history`` also replays the log's bursts)."""
    base = workload_from_placement(current)
    try:
        wl, _, span = load_request_log(base, log)
    except InputError as exc:
        raise InputError(f"--history: {exc} (the adapters are the running placement's)") from None
    return dataclasses.replace(wl, name=f"{base.name or 'placement'}-history", meta={**wl.meta, "history_s": span})


def prometheus_workload(current: Placement, url: str, window: str, say: Say = None) -> Workload:
    """The running placement's adapters with the demand Prometheus saw over ``window`` (its summary to
    ``say``)."""
    base = workload_from_placement(current)
    demand = read_demand(url, window)
    wl = workload_from_demand(base, demand)
    if say is not None:
        say(demand.summary())
    return dataclasses.replace(wl, name=f"{base.name or 'placement'}-prometheus")


def replan_report(done: ReplanOutcome) -> str:
    """What ``lora-opt replan`` prints: the plan's summary, the verdict and the files written."""
    return "\n".join([plan_summary(done.plan), done.message, *(f"  -> {w}" for w in done.written)])


def plan_summary(plan: dict) -> str:
    """The candidates, the instances' fate, the step counts and the transition's verdict, as text."""
    lines = [f"{'candidate':<19} {'GPUs':>4} {'moves':>6} {'loads':>6} {'unloads':>7} {'restarts':>8} "
             f"{'launches':>8} {'cost':>7}"]
    for c in plan["candidates"]:
        mark = " <- chosen" if c["name"] == plan["chosen"] else ""
        lines.append(f"{c['name']:<19} {c['gpus']:>4} {c['moves']:>6} {c['loads']:>6} {c['unloads']:>7} "
                     f"{c['restarts']:>8} {c['launches']:>8} {c['cost_gpu_equivalents']:>7.2f}{mark}"
                     + ("" if c["feasible"] else "  (infeasible)"))
    acts: dict[str, list[str]] = {}
    for it in plan["instances"]:
        acts.setdefault(it["action"], []).append(it["instance"])
    lines.append("instances: " + "; ".join(f"{k} {', '.join(v)}" for k, v in acts.items()))
    lines.append(f"steps: {len(plan['steps'])} ({step_counts(plan['steps']) or 'none'}); "
                 f"peak GPUs during the transition {plan['peak_gpus']}")
    if plan["starving_at_start"]:
        lines.append(f"starving under the new demand before the plan: {', '.join(plan['starving_at_start'])}")
    bad = [s for s in plan["states"][1:] if not s["ok"]]
    lines.append(f"intermediate states judged: {len(plan['states']) - 1}, "
                 + ("all ok (no instance the plan loads starves)" if not bad else
                    f"{len(bad)} NOT ok: " + "; ".join(f"{s['label']}: {', '.join(s['starving'])}" for s in bad[:3])))
    if any(s["action"] in ("load", "unload") for s in plan["steps"]):
        lines.append(f"runtime loads/unloads need {plan['env']} on the running instances")
    return "\n".join(lines)


# ---- lora-opt schedule --------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleRequest:
    """Where ``schedule_horizon``'s steps come from -- a drift (``drift``) or one workload file per step
    (``workloads``) --, how many, and where the files go."""

    drift: str | None = None
    """A drift YAML (``lora_opt.replan.drift``) or a bundled one by name."""
    workloads: tuple[str, ...] = ()
    """One workload file per step, in order (without ``drift``)."""
    steps: int | None = None
    """Only the first N steps (None: all)."""
    step_s: float | None = None
    """Seconds per step with ``workloads`` (None: 3600; a drift file gives its own)."""
    out_dir: str | None = None
    """Output directory (None: ``outputs/schedule-<name>``)."""
    evaluate: bool = True
    """Replay every step's placement on the twin (the independent check)."""


@dataclass
class ScheduleOutcome:
    """What ``schedule_horizon`` did."""

    code: int
    """``EXIT_OK``, or ``EXIT_NOT_ACCEPTABLE`` when a transition was not ok or a step's GPU starved."""
    doc: dict
    """``schedule.json`` as written: the totals and the rows (``schedule --json`` prints it, with ``exit``)."""
    files: list[Path]


def schedule_horizon(request: ScheduleRequest, options: ReplanOptions = ReplanOptions(),
                     say: Say = None) -> ScheduleOutcome:
    """Replan through the steps of ``request`` (step 0 placed from scratch, ``run_schedule``); write every
    step's ``placement.json`` and ``plan.json`` as it is done, then ``schedule.json``, ``schedule.csv`` and
    ``schedule.png``.  ``say`` sees the table's header, then each step's row as it is done."""
    workloads, step_s, name = schedule_steps(request)
    out = Path(request.out_dir or f"outputs/schedule-{name}")
    out.mkdir(parents=True, exist_ok=True)
    contexts: dict = {}

    def ctx_for(wl):          # one context (profile, surrogate) per profile
        if wl.profile not in contexts:
            contexts[wl.profile] = PlacementContext.for_workload(wl, options.surrogate)
        return contexts[wl.profile]

    policy = options.policy(ctx_for(workloads[0]).profile)

    def on_step(row, placement, plan):
        d = out / "steps" / f"step-{row.step:03d}"
        d.mkdir(parents=True, exist_ok=True)
        placement.save(d / "placement.json")
        if plan is not None:
            atomic_write_json(d / "plan.json", plan, indent=1)
        if say is not None:
            say(schedule_row(row))

    if say is not None:
        say(SCHEDULE_HEADER)
    result = run_schedule(workloads, policy, ctx_for, costs=options.costs, consolidate=options.consolidate,
                          evaluate=request.evaluate, step_s=step_s, on_step=on_step)
    rows, tot = result["steps"], result["totals"]
    doc = {"totals": tot, "steps": [dataclasses.asdict(r) for r in rows]}
    files = [atomic_write_json(out / "schedule.json", doc, indent=1)]
    fields = list(doc["steps"][0])
    files.append(atomic_write_text(out / "schedule.csv", "\n".join(
        [",".join(fields)] + [",".join(str(r[f]) for f in fields) for r in doc["steps"]]) + "\n"))
    files.append(out / "schedule.png")
    schedule_plot(rows, files[-1], step_s)
    ok = not tot["transitions_not_ok"] and not tot["steps_starving"]
    return ScheduleOutcome(EXIT_OK if ok else EXIT_NOT_ACCEPTABLE, doc, files)


def schedule_steps(request: ScheduleRequest) -> tuple[list[Workload], float, str]:
    """(the steps' workloads, seconds per step, the schedule's name) of ``request``; its problems as the
    flags' errors."""
    if request.drift:
        if request.step_s is not None:
            raise InputError("--step-s: only with --workloads (a drift file gives step_s)")
        cfg = load_drift(request.drift)
        # the first N steps of the whole drift (a trace shape cuts its windows for cfg.steps)
        return drift_workloads(cfg)[:request.steps], cfg.step_s, cfg.name
    workloads = [load_workload(w) for w in request.workloads][:request.steps]
    step_s = 3600.0 if request.step_s is None else request.step_s
    if not 0 < step_s <= 86400:
        raise InputError(f"--step-s: must be in (0, 86400] s, got {step_s:g}")
    if len({w.profile for w in workloads}) > 1:
        raise InputError("--workloads: every step must use the same profile")
    return workloads, step_s, workloads[0].name or "workloads"


SCHEDULE_HEADER = (f"{'step':>4} {'adapters':>8} {'req/s':>6} {'GPUs':>4} {'moves':>5} {'restarts':>8} {'peak':>4} "
                   f"{'trans':>5} {'scratch GPUs':>12} {'scratch moves':>13} {'starving':>8} {'s':>5}")


def schedule_row(r: Step) -> str:
    """One step as a line of ``lora-opt schedule``'s table (under ``SCHEDULE_HEADER``)."""
    starving = "-" if r.gpus_starving is None else str(r.gpus_starving)
    return (f"{r.step:>4} {r.adapters:>8} {r.rate_req_s:>6.1f} {r.gpus:>4} {r.moves:>5} {r.restarts:>8} "
            f"{r.peak_gpus:>4} {'ok' if r.transition_ok else 'NO':>5} {r.scratch_gpus:>12} {r.scratch_moves:>13} "
            f"{starving:>8} {r.wall_s:>5.1f}")


def schedule_report(done: ScheduleOutcome) -> str:
    """What ``lora-opt schedule`` prints after the table: the totals and the files written."""
    return "\n".join([totals_text(done.doc["totals"]), *(f"  -> {f}" for f in done.files)])


def totals_text(t: dict) -> str:
    """A schedule's totals (``lora_opt.replan.schedule.totals``) as text."""
    return (f"GPU-hours: {t['gpu_hours']:.1f} replanned, {t['gpu_hours_from_scratch']:.1f} from scratch each step, "
            f"{t['gpu_hours_static_peak']:.1f} static for the peak ({t['static_peak_gpus']} GPUs): "
            f"{t['saved_vs_static_peak']:.0%} saved\n"
            f"moves: {t['moves']} replanned vs {t['moves_from_scratch']} from scratch; restarts {t['restarts']} vs "
            f"{t['restarts_from_scratch']}; peak GPUs during a transition {t['peak_gpus_during_transitions']}\n"
            f"transitions not ok: {t['transitions_not_ok'] or 'none'}; steps with a starving GPU on the twin: "
            f"{t['steps_starving'] or 'none'}\n"
            f"adapters kept across restarts (not moves): {t['restart_kept']} replanned vs "
            f"{t['restart_kept_from_scratch']} from scratch; candidates chosen: "
            + (", ".join(f"{k} {v}" for k, v in t["candidates_chosen"].items()) or "none"))
