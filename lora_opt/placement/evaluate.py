"""Replay a placement on the twin: the workload's requests, routed to GPUs as the placement says,
each GPU simulated as its own vLLM instance (in parallel on Ray), results combined exactly.

Routing: an adapter on one GPU sends every request there; an adapter on several GPUs (dLoRA,
LoRAServe, greedy-plus's hot adapters) sends each request to a GPU drawn with the routing weights
from a generator seeded by the evaluation seed -- so a replay is deterministic, serial or on Ray.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

import twin
from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK
from lora_opt.io import atomic_write_json
from lora_opt.parallel import run_batches
from lora_opt.placement.confidence import annotate, at_confidence, resolve_bound
from lora_opt.placement.instances import FleetOptions, gpu_result, gpu_scenario, replay_on_fleet, routing_seed
from lora_opt.placement.plan import Placement, placement_problems
from lora_opt.placement.workload_file import Workload, evaluation_scenario
from lora_opt.tracking import log_command_run
from twin.errors import ScenarioError
from twin.flags import shared_flags
from twin.parsing import check_finite
from twin.profile import load_profile
from twin.scenario import DEFAULT_RHO, scenario_from_dict
from twin.routers import weighted_pick
from twin.simulate import weighted_stats
from twin.workload import Requests, generate_requests

def workload_requests(wl: Workload, max_model_len: int) -> Requests:
    """Every request of the workload's evaluation traffic (all adapters, one stream)."""
    sc = scenario_from_dict(evaluation_scenario(wl, wl.adapters), "workload.evaluation")
    return generate_requests(sc, max_model_len)


def route_requests(p: Placement, req: Requests, seed: int) -> np.ndarray:
    """GPU index of every request (adapter indices follow ``p.adapters``); -1 for adapters the
    placement left unrouted (a policy that could not place them)."""
    n_ad = len(p.adapters)
    single = np.full(n_ad, -1, np.int64)
    multi: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for k, a in enumerate(p.adapters):
        rs = p.routes.get(a.id)
        if not rs:
            continue
        if len(rs) == 1:
            single[k] = rs[0][0]
        else:
            multi[k] = (np.array([g for g, _ in rs]), np.cumsum([w for _, w in rs]))
    gpu = single[req.adapter]
    rng = np.random.default_rng(routing_seed(seed))
    u = rng.random(len(req))        # one draw per request, used or not: routing of one adapter
    for k, (gs, cw) in multi.items():   # never depends on which other adapters are replicated
        sel = np.flatnonzero(req.adapter == k)
        gpu[sel] = gs[weighted_pick(cw, u[sel])]
    return gpu


def _gpu_jobs(p: Placement, wl: Workload, req: Requests, duration_s: float, seed: int,
              timeseries_s: float | None = None, gpu_of: np.ndarray | None = None) -> list[dict]:
    gpu_of = route_requests(p, req, seed) if gpu_of is None else gpu_of
    jobs = []
    for g, on in enumerate(p.by_gpu()):
        sc, local = gpu_scenario(p, wl, g, on, duration_s, timeseries_s)
        sel = np.flatnonzero(gpu_of == g)
        jobs.append({"gpu": g, "scenario": sc,
                     "arrival": req.arrival[sel], "adapter": local[req.adapter[sel]].astype(np.int32),
                     "in_len": req.in_len[sel], "out_len": req.out_len[sel]})
    lost = gpu_of < 0
    return jobs, int(lost.sum()), float((req.in_len[lost].astype(np.int64) + req.out_len[lost]).sum())


def simulate_gpu_jobs(jobs: list[dict]) -> list[dict]:
    """Ray task / serial unit: simulate each GPU's share; result dicts with raw latency samples."""
    out = []
    for job in jobs:
        sc = scenario_from_dict(job["scenario"], f"gpu {job['gpu']}")
        req = Requests(arrival=np.ascontiguousarray(job["arrival"], np.float64),
                       adapter=np.ascontiguousarray(job["adapter"], np.int32),
                       in_len=np.ascontiguousarray(job["in_len"], np.int32),
                       out_len=np.ascontiguousarray(job["out_len"], np.int32))
        res = twin.simulate(sc, requests=req, timeseries=bool(job.get("timeseries")))
        out.append(gpu_result(job["gpu"], res))
    return out


def _combined(results: list[dict], key: str) -> dict:
    vals, cnts = [], []
    for r in results:
        s = r.get("samples") or {}
        if key == "ttft" and "ttft_ms" in s:
            vals.append(s["ttft_ms"])
            cnts.append(np.ones(len(s["ttft_ms"]), np.int64))
        elif key == "itl" and "itl_ms" in s:
            vals.append(s["itl_ms"])
            cnts.append(s["itl_count"])
    if not vals:
        return {"mean": None, "median": None, "p99": None}
    return weighted_stats(np.concatenate(vals), np.concatenate(cnts))


#: default grace period (s) of the starvation verdict, see ``evaluate_placement``
GRACE_S = 60.0


def check_grace_below_window(grace_s: float, window_s: float, grace: str, window: str, *, note: str = "",
                             hint: str = "", error: type[Exception] = ScenarioError) -> None:
    """The starvation verdict judges the requests that arrive ``grace_s`` before the end of the
    window: a grace of the whole window or more leaves none due, and every GPU would pass unjudged.
    ``grace`` / ``window`` name the caller's own fields in the message (``note`` follows the grace,
    ``hint`` ends the message)."""
    if not grace_s < window_s:
        raise error(f"{grace} {grace_s:g} s{note} must be below {window} {window_s:g} s "
                    f"(otherwise no request is due and every GPU passes){hint}")


@dataclass(frozen=True)
class Criterion:
    """When a GPU counts as serving its traffic (every part that is set must hold)."""

    rho: float | None = DEFAULT_RHO
    """Fraction of due tokens served (the papers' starvation threshold); None = not checked."""
    ttft_ms: float | None = None
    """SLO: TTFT target; at least ``attainment`` of the due requests must meet it."""
    itl_ms: float | None = None
    """SLO: inter-token latency target; at least ``attainment`` of the tokens must meet it."""
    attainment: float = 0.9
    """Fraction that must meet the SLO targets, in (0, 1]."""

    def __post_init__(self):
        if self.rho is None and self.ttft_ms is None and self.itl_ms is None:
            raise ScenarioError("criterion: give rho, a TTFT target or an ITL target")
        for name in ("rho", "ttft_ms", "itl_ms", "attainment"):      # NaN passes every comparison
            if getattr(self, name) is not None:
                check_finite(getattr(self, name), f"criterion.{name}")
        if self.rho is not None and not 0 < self.rho <= 1:
            raise ScenarioError(f"criterion.rho: must be in (0, 1], got {self.rho}")
        if not 0 < self.attainment <= 1:
            raise ScenarioError(f"criterion.attainment: must be in (0, 1], got {self.attainment}")
        for name in ("ttft_ms", "itl_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ScenarioError(f"criterion.{name}: must be > 0, got {v}")

    @property
    def label(self) -> str:
        parts = [f"rho {self.rho:g}"] if self.rho is not None else []
        if self.ttft_ms is not None:
            parts.append(f"TTFT <= {self.ttft_ms:g} ms")
        if self.itl_ms is not None:
            parts.append(f"ITL <= {self.itl_ms:g} ms")
        if self.ttft_ms is not None or self.itl_ms is not None:
            parts.append(f"for {self.attainment:.0%}")
        return ", ".join(parts)

    def check(self, r, T: float, grace_s: float = GRACE_S) -> dict:
        """served_fraction, ttft_attainment, itl_attainment and ok for one GPU's result (a twin
        ``Result`` or its dict with ``samples``).  A grace of the whole window ``T`` or more is
        refused: no request would be due, and every GPU would pass unjudged."""
        check_grace_below_window(grace_s, T, "starvation verdict: the grace", "the judged window")
        if not isinstance(r, dict):
            r = {**r.to_dict(), "samples": r.samples}
        out = {"served_fraction": served_fraction(r, T, grace_s), "ttft_attainment": None, "itl_attainment": None}
        s = r.get("samples") or {}
        if self.ttft_ms is not None and "arrival_s" in s:
            due = s["arrival_s"] < T - grace_s
            met = np.zeros(due.shape, bool)
            met[np.flatnonzero(s["done"])] = s["ttft_ms"] <= self.ttft_ms
            out["ttft_attainment"] = float((met & due).sum() / max(1, due.sum()))
        if self.itl_ms is not None and "itl_ms" in s:
            c = s["itl_count"]
            out["itl_attainment"] = float(c[s["itl_ms"] <= self.itl_ms].sum() / max(1, c.sum()))
        ok = r.get("status", "ok") == "ok"
        if self.rho is not None:
            ok &= out["served_fraction"] >= self.rho
        for key in ("ttft_attainment", "itl_attainment"):
            if out[key] is not None:
                ok &= out[key] >= self.attainment
        out["ok"] = bool(ok)
        return out


def served_fraction(r, T: float, grace_s: float) -> float:
    """Fraction of the tokens of requests that arrived before T - grace completed by T (``r``: a
    twin ``Result`` or its dict with ``samples``)."""
    if not isinstance(r, dict):
        r = {**r.to_dict(), "samples": r.samples}
    s = r.get("samples") or {}
    if "arrival_s" not in s:
        return r["throughput_tok_s"] / r["incoming_token_rate"] if r["incoming_token_rate"] > 0 else 1.0
    m = s["arrival_s"] < T - grace_s
    due = float(s["tokens"][m].sum())
    return float(s["tokens"][m & s["done"]].sum()) / due if due > 0 else 1.0


def evaluate_placement(p: Placement, wl: Workload, *, requests: Requests | None = None,
                       duration_s: float | None = None, workers: int | None = None,
                       ray_address: str | None = None, progress: bool = True,
                       grace_s: float = GRACE_S, criterion: Criterion | None = None,
                       timeseries_s: float | None = None, raw: list | None = None,
                       gpu_of: np.ndarray | None = None) -> dict[str, Any]:
    """Replay ``requests`` (default: the workload's evaluation traffic) on every GPU of ``p``
    (``gpu_of``: each request's GPU, as ``route_requests`` drew it for a larger set of which these
    are a subset -- validate leaves out what the live servers refused; default: drawn here).

    Starvation verdict per GPU: fewer than rho of the tokens of requests that arrived before
    ``T - grace_s`` completed by T.  benchmark_serving's definition (completed tokens / all
    arrived tokens in the window) also counts requests that arrived in the last seconds and are
    still running -- several per cent of a short window; a GPU that cannot keep up carries a
    backlog longer than the grace and is caught all the same.  ``grace_s=0`` is that definition;
    both verdicts are in the result (``starving`` and ``starving_window``).  ``criterion``
    replaces the rho verdict (default: the workload's rho), e.g. by SLO attainment.
    ``timeseries_s``: also record each GPU's running / waiting / KV usage every that many
    seconds; ``raw``: a list that receives each GPU's raw result (samples, time series).
    :func:`evaluate_on_fleet` replays the GPUs as one fleet with a router policy instead."""
    criterion, T, req = _replay_inputs(p, wl, requests, duration_s, grace_s, criterion)
    jobs, unrouted, unrouted_tokens = _gpu_jobs(p, wl, req, T, wl.evaluation.seed, timeseries_s, gpu_of)
    for j in jobs:
        j["timeseries"] = timeseries_s is not None
    results: list[dict | None] = [None] * len(jobs)
    with tqdm(total=len(jobs), desc="replaying GPUs", unit="gpu", disable=not progress) as bar:
        def done(i: int, rows: list) -> None:
            results[i] = rows[0]
            bar.update(1)
        run_batches(simulate_gpu_jobs, [[j] for j in jobs], done, workers=workers, ray_address=ray_address,
                    what=f"{len(jobs)} GPU replays", report=lambda msg: bar.set_description_str(f"replaying GPUs ({msg})"))
    res: list[dict] = results  # type: ignore[assignment]
    if raw is not None:
        raw.extend(res)
    return evaluation_from_results(p, wl, res, req, T, grace_s, criterion, unrouted, unrouted_tokens)


def _replay_inputs(p: Placement, wl: Workload, requests: Requests | None, duration_s: float | None, grace_s: float,
                   criterion: Criterion | None) -> tuple[Criterion, float, Requests]:
    """(criterion, replayed window, requests) of a replay, the placement and the grace checked."""
    criterion = criterion or Criterion(rho=wl.rho)
    if not p.gpus:
        raise ScenarioError("placement: no GPUs to evaluate")
    T = duration_s or wl.evaluation.duration_s
    check_finite(grace_s, "evaluate --grace-s", 0.0)
    check_grace_below_window(grace_s, T, "evaluate --grace-s:", "the replayed duration (--duration-s)",
                             hint="; 0 = benchmark_serving's definition")
    problems = [q for q in placement_problems(p, None, include_startup=False) if "does not exist" in q
                or "unknown adapter" in q or "weights" in q]
    if problems:
        raise ScenarioError("placement: cannot be replayed:\n  - " + "\n  - ".join(problems[:20]))
    ids = [a.id for a in wl.adapters]
    if ids != [a.id for a in p.adapters]:
        raise ScenarioError("placement and workload list different adapters (ids or order); evaluate the "
                            "placement with the workload it was made for")
    mml = min(g.max_model_len for g in p.gpus)
    req = requests if requests is not None else workload_requests(wl, mml)
    return criterion, T, req


def evaluate_on_fleet(p: Placement, wl: Workload, fleet: FleetOptions, *, requests: Requests | None = None,
                      duration_s: float | None = None, grace_s: float = GRACE_S, criterion: Criterion | None = None,
                      timeseries_s: float | None = None, raw: list | None = None) -> dict[str, Any]:
    """:func:`evaluate_placement` with the GPUs as one fleet (``twin.fleet``, one process): ``fleet.router``
    chooses each request's GPU, adapters ``static`` or ``on-demand``.  The result also names the
    router, the adapters, the scrape interval and the adapter loads of the whole fleet."""
    criterion, T, req = _replay_inputs(p, wl, requests, duration_s, grace_s, criterion)
    res, unrouted, unrouted_tokens = replay_on_fleet(p, wl, req, T, fleet, timeseries_s)
    if raw is not None:
        raw.extend(res)
    ev = evaluation_from_results(p, wl, res, req, T, grace_s, criterion, unrouted, unrouted_tokens)
    ev.update(router=fleet.router, adapters=fleet.adapters, scrape_interval_s=fleet.scrape_interval_s,
              adapter_loads_cpu=sum(r["adapter_loads_cpu"] for r in res),
              adapter_loads_disk=sum(r["adapter_loads_disk"] for r in res))
    return ev


def evaluation_from_results(p: Placement, wl: Workload, res: list[dict], req: Requests, T: float, grace_s: float,
                            criterion: Criterion, unrouted: int, unrouted_tokens: float) -> dict[str, Any]:
    """The evaluation of per-GPU results (a twin's, or measured ones in the same dict shape: the
    ``RESULT_KEYS`` plus ``gpu``, ``arrived``, ``oom_reason`` and ``samples``), combined exactly."""
    per_gpu = []
    counts = [len(on) for on in p.by_gpu()]
    for r, cfg in zip(res, p.gpus):
        per_gpu.append({
            "gpu": r["gpu"], "adapters": counts[r["gpu"]], "max_loras": cfg.max_loras,
            "max_lora_rank": cfg.max_lora_rank, "status": r["status"],
            "oom_reason": r.get("oom_reason", ""), "arrived": r["arrived"], "completed": r["completed"],
            "incoming_token_rate": r["incoming_token_rate"], "throughput_tok_s": r["throughput_tok_s"],
            "served_fraction": served_fraction(r, T, grace_s), "starving_window": bool(r["starving"]),
            "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"], "preemptions": r["preemptions"],
            "adapter_loads_cpu": r["adapter_loads_cpu"], "kv_cache_tokens": r["kv_cache_tokens"],
        })
    # requests of unrouted adapters are incoming load nobody serves
    for g, r in zip(per_gpu, res):
        c = criterion.check(r, T, grace_s)
        g.update(ttft_attainment=c["ttft_attainment"], itl_attainment=c["itl_attainment"])
        g["starving"] = g["status"] != "ok" or not c["ok"]
    incoming = sum(g["incoming_token_rate"] for g in per_gpu) + unrouted_tokens / T
    thr = sum(g["throughput_tok_s"] for g in per_gpu)
    active = [g for g in per_gpu if g["arrived"] > 0 or g["adapters"] > 0]
    return {
        "policy": p.policy, "workload": wl.name, "rho": wl.rho, "criterion": criterion.label,
        "duration_s": T, "grace_s": grace_s,
        "gpus_used": len(active), "gpus_starving": sum(g["starving"] and g["status"] == "ok" for g in per_gpu),
        "gpus_starving_window": sum(g["starving_window"] and g["status"] == "ok" for g in per_gpu),
        "gpus_failing_startup": sum(g["status"] == "oom" for g in per_gpu),
        "requests": int(len(req)), "completed": int(sum(g["completed"] for g in per_gpu)),
        "unrouted_adapters": sum(1 for a in p.adapters if not p.routes.get(a.id)),
        "unrouted_requests": unrouted,
        "incoming_token_rate": incoming, "throughput_tok_s": thr,
        "served_fraction": thr / incoming if incoming > 0 else math.nan,
        "ttft_ms": _combined(res, "ttft"), "itl_ms": _combined(res, "itl"),
        "per_gpu": per_gpu,
    }


def served_ok(ev: dict) -> bool:
    """An evaluation with no starving GPU, none failing to start and every request routed."""
    return ev["gpus_starving"] == 0 and ev["gpus_failing_startup"] == 0 and ev["unrouted_requests"] == 0


@dataclass(frozen=True)
class JudgeOptions:
    """How ``judge_placement`` replays and judges a placement, besides the placement and the workload."""

    fleet: FleetOptions = FleetOptions()
    """The router and adapter mode the GPUs are served with (static / static: each GPU replayed alone)."""
    grace_s: float = GRACE_S
    """The starvation verdict ignores requests arriving this close to the end (s)."""
    confidence: float | None = None
    """Also judge each GPU at this confidence, in (0, 1) (None: not)."""
    error_model: str | None = None
    """Error model YAML for ``confidence`` (None: the profile's bundled one)."""
    workers: int | None = None
    """Parallel workers of the per-GPU replay (1: serial; None: serial while the work is too small to pay Ray's
    start-up, else Ray on all cores; ``lora_opt.parallel.run_batches``)."""
    ray_address: str | None = None
    """An existing Ray cluster (None: RAY_ADDRESS or a local instance)."""
    progress: bool = False
    """A progress bar (stderr) over the per-GPU replay."""


def judge_placement(p: Placement, wl: Workload, options: JudgeOptions = JudgeOptions()) -> tuple[dict, int]:
    """(the evaluation, its exit status): ``p`` replayed under ``wl``'s evaluation traffic -- each GPU alone
    (``evaluate_placement``, on Ray when it pays) for static routing of static adapters, else the GPUs as one
    fleet behind ``options.fleet``'s router (``evaluate_on_fleet``) --; ``EXIT_OK`` when every GPU served its
    traffic (``served_ok``), else ``EXIT_NOT_ACCEPTABLE``.  At ``options.confidence`` (with its error model,
    else the profile's bundled one), each GPU is also judged at it (``ev["at_confidence"]``, the margins in
    ``p.meta``): a GPU whose margin at C is below rho - 1 makes the placement not acceptable."""
    o = options
    if (o.fleet.router, o.fleet.adapters) == ("static", "static"):       # today's per-GPU replay (on Ray)
        ev = evaluate_placement(p, wl, workers=o.workers, ray_address=o.ray_address, progress=o.progress,
                                grace_s=o.grace_s)
    else:
        ev = evaluate_on_fleet(p, wl, o.fleet, grace_s=o.grace_s)
    code = EXIT_OK if served_ok(ev) else EXIT_NOT_ACCEPTABLE
    if o.confidence is not None:
        annotate(p, wl, resolve_bound(load_profile(p.profile), o.confidence, o.error_model))
        ev["at_confidence"] = at_confidence(p, wl.rho)
        if ev["at_confidence"]["gpus_below"]:
            code = EXIT_NOT_ACCEPTABLE
    return ev, code


def judge_and_record(placement_file: str, p: Placement, wl: Workload, options: JudgeOptions = JudgeOptions(), *,
                     out: str | None = None, tracking_uri: str | None = None, track: bool = False) -> tuple[dict, int]:
    """``lora-opt evaluate`` on a loaded placement (read from ``placement_file``) and workload:
    ``judge_placement``, the evaluation written to ``out`` when given, and, when ``track``, the command's MLflow
    run (experiment ``evaluate``: the evaluation's numbers, ``out`` and the placement as artifacts) in
    ``tracking_uri``."""
    ev, code = judge_placement(p, wl, options)
    if out:
        atomic_write_json(out, ev, indent=1)
    fleet = {"router": options.fleet.router, "adapters": options.fleet.adapters} if "router" in ev else {}
    log_command_run("evaluate", f"{wl.name} ({p.policy})", params={
                    "placement": placement_file, "workload": wl.name, "policy": p.policy,
                    "arrivals": wl.evaluation.arrivals.process, "trace": wl.evaluation.arrivals.trace,
                    "duration_s": wl.evaluation.duration_s, "grace_s": options.grace_s, **fleet},
                    metrics={k: v for k, v in ev.items() if k != "per_gpu"}, artifacts=[out, placement_file],
                    profile=p.profile, seeds={"evaluation": wl.evaluation.seed}, tracking_uri=tracking_uri,
                    track=track)
    return ev, code


def evaluation_table(ev: dict) -> str:
    """Plain-text table of an evaluation (one line per GPU and a total)."""
    def f(x, spec="8.1f"):
        return format(x, spec) if x is not None else f"{'n/a':>{spec.split('.')[0]}}"
    lines = [f"{'GPU':>3} {'adapters':>8} {'A_max':>5} {'status':>9} {'served':>6} {'incoming':>9} {'thr tok/s':>9} "
             f"{'TTFT mean':>9} {'TTFT p99':>9} {'ITL mean':>8} {'ITL p99':>8}",
             f"{'':>3} {'':>8} {'':>5} {'':>9} {'':>6} {'tok/s':>9} {'':>9} {'ms':>9} {'ms':>9} {'ms':>8} {'ms':>8}"]
    for g in ev["per_gpu"]:
        status = ("OOM" if g["status"] == "oom" else "DOWN" if g["status"] == "unreachable"
                  else "STARVING" if g["starving"] else "ok")
        lines.append(f"{g['gpu']:>3} {g['adapters']:>8} {g['max_loras']:>5} {status:>9} {g['served_fraction']:>6.1%} "
                     f"{g['incoming_token_rate']:>9.0f} {g['throughput_tok_s']:>9.0f} "
                     f"{f(g['ttft_ms']['mean'], '9.1f')} {f(g['ttft_ms']['p99'], '9.1f')} "
                     f"{f(g['itl_ms']['mean'], '8.1f')} {f(g['itl_ms']['p99'], '8.1f')}")
    lines.append(f"{'all':>3} {sum(g['adapters'] for g in ev['per_gpu']):>8} {'':>5} "
                 f"{ev['gpus_starving']:>3} starv {'':>6} {ev['incoming_token_rate']:>9.0f} {ev['throughput_tok_s']:>9.0f} "
                 f"{f(ev['ttft_ms']['mean'], '9.1f')} {f(ev['ttft_ms']['p99'], '9.1f')} "
                 f"{f(ev['itl_ms']['mean'], '8.1f')} {f(ev['itl_ms']['p99'], '8.1f')}")
    lines.append(f"GPUs used {ev['gpus_used']}, starving {ev['gpus_starving']} (failing {ev['criterion']} on the "
                 f"requests due {ev['grace_s']:g} s before the end; served < rho over the whole window: "
                 f"{ev['gpus_starving_window']}), failing to start {ev['gpus_failing_startup']}; "
                 f"{ev['completed']:,} of {ev['requests']:,} requests completed in {ev['duration_s']:,.0f} s")
    if ev.get("unrouted_requests"):
        lines.append(f"{ev['unrouted_requests']:,} requests of {ev['unrouted_adapters']} unplaced adapters were not served")
    return "\n".join(lines)


def workload_from_placement(p: Placement):
    """A workload for a placement file alone: its adapters, profile and rho; Poisson replay."""
    from lora_opt.placement.workload_file import PlacementEngine, Workload

    if not p.gpus:
        raise ScenarioError("placement: no GPUs to evaluate")
    g = p.gpus[0]
    # rho as the placement recorded it; with_evaluation / workload_from_dict check it like a workload's
    return Workload(profile=p.profile, adapters=tuple(p.adapters), rho=p.meta.get("rho", DEFAULT_RHO),
                    engine=PlacementEngine(**shared_flags(g)),
                    name=str(p.meta.get("workload", "")))


def with_evaluation(wl, **overrides):
    """The workload with evaluation fields replaced (``None`` values ignored), validated."""
    from lora_opt.placement.workload_file import workload_from_dict

    d = wl.to_dict()
    ev = d["evaluation"]
    for k, v in overrides.items():
        if v is None:
            continue
        if k in ("process", "trace", "mapping", "time_scale", "start_s", "alpha"):
            ev["arrivals"][k] = v
        elif k == "lengths":
            ev["lengths"] = {"source": v}
        else:
            ev[k] = v
    if overrides.get("trace") and not overrides.get("process"):
        ev["arrivals"]["process"] = "trace"
    return workload_from_dict(d, "evaluation")
