"""GPU count vs latency fronts: a sweep of feasibility criteria (rho values and SLO targets) for
greedy-plus, the paper's greedy and the search -- one study per deployment searched (``deployments``: a
placement, every adapter on every GPU, a hybrid), each its own front; hypervolume per method; plots, a
table, MLflow.

Every point is a placement replayed on held-out traffic; it counts for a method's front if it is
feasible (no starving GPU, none failing to start, every adapter placed) under the criterion it was
made for.  Hypervolume is computed on (GPUs, log10 latency) against a reference point (pool + 1
GPUs, ``ref_latency_ms``): latencies span milliseconds to minutes, and a linear axis would let the
worst point decide everything.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lora_opt.io import atomic_write_figure, atomic_write_json, atomic_write_text
from lora_opt.placement.confidence import resolve_bound
from lora_opt.placement.evaluate import Criterion
from lora_opt.placement.instances import FleetOptions
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.placement.workload_file import Workload
from lora_opt.search.deployments import DEFAULT_DEPLOYMENT, check_deployment, study_suffix
from lora_opt.search.study import (DEFAULT_OBJECTIVE, REF_LATENCY_MS, SearchOptions, SearchSetup, Traffic,
                                   heldout_verdict, hypervolume, nondominated, replay_front, run_search, traffic_halves)
from lora_opt.tracking import log_dir, log_flat_metrics, log_params, tracked_run

METHODS = ("greedy-plus", "greedy", "search")


def search_method(deployment: str) -> str:
    """The method name of a deployment's search points: ``search`` for a placement (the reports' name since
    the first sweep), ``search every-gpu``, ``search hybrid``."""
    return "search" if deployment == DEFAULT_DEPLOYMENT else f"search {deployment}"


def methods_of(deployments) -> tuple[str, ...]:
    """The methods of a sweep searching ``deployments`` (the default: ``METHODS``)."""
    return ("greedy-plus", "greedy", *(search_method(d) for d in deployments))


def criteria_sweep(rhos, ttft_slos_ms, itl_slos_ms, attainment: float) -> list[Criterion]:
    out = [Criterion(rho=r) for r in rhos]
    out += [Criterion(rho=None, ttft_ms=t, attainment=attainment) for t in ttft_slos_ms or []]
    out += [Criterion(rho=None, itl_ms=t, attainment=attainment) for t in itl_slos_ms or []]
    return out


def criterion_seed(seed: int, index: int) -> int:
    """The sampler seed of the sweep's ``index``-th study: independent streams per criterion (one
    seed for all would make the studies propose the same trials until their constraints differ --
    nine copies of one search), all fixed by ``seed``."""
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0])


def front_key(method: str, confidence: float | None) -> str:
    """A front's name: the method, and the confidence it was decided at when there is one."""
    return method if confidence is None else f"{method} @ C={confidence:g}"


def pareto_points(points: list[dict]) -> list[dict]:
    """Feasible points no other feasible point dominates, by GPUs then latency."""
    return nondominated([p for p in points if p["feasible"]], lambda p: (p["gpus"], p["latency_ms"]))


@dataclass
class ParetoConfig:
    """What a sweep runs besides the workload, pool and traffic."""

    criteria: list[Criterion]
    """Feasibility criteria swept (see ``criteria_sweep``): per criterion one greedy-plus placement
    and one study; the paper's greedy is placed once and judged under each."""
    objective: str = DEFAULT_OBJECTIVE
    """Latency objective (a key of ``lora_opt.search.study.OBJECTIVES``), measured on the replay."""
    trials: int = 24
    """Search trials per criterion (0 = the greedy policies only)."""
    ref_latency_ms: float = REF_LATENCY_MS
    """Hypervolume reference latency (ms); the reference GPU count is the pool + 1."""
    workers: int | None = None
    """Parallel workers for replays and trials (1 = serial, no Ray; None = all cores)."""
    ray_address: str | None = None
    """Existing Ray cluster (None = ``RAY_ADDRESS`` or a local instance)."""
    progress: bool = True
    """A progress bar over the criteria (stderr)."""
    seed: int = 0
    """Seed of the studies' samplers (one stream per criterion, ``criterion_seed``): the same
    trials and fronts whatever ``workers`` (``lora_opt.search.study.run_search``)."""
    confidences: tuple = (None,)
    """Confidences the sweep decides at, one front per method and confidence (None: the point
    estimate -- greedy-plus's fixed margin, the search and the greedy judged at the load itself).  At a
    confidence C, greedy-plus verifies at the error model's load for C and every point counts only when
    the twin also serves it at that load (``lora_opt.placement.confidence``)."""
    error_model: str | None = None
    """Error model file behind ``confidences`` (None: the profile's bundled one)."""
    deployments: tuple = (DEFAULT_DEPLOYMENT,)
    """Deployments searched (``lora_opt.search.deployments.DEPLOYMENTS``), one study per deployment and
    criterion, a front each (``search_method``): the deployment is a dimension of the fronts."""
    fleet: FleetOptions = field(default_factory=FleetOptions)
    """How every point is replayed (router, adapters; default: each GPU alone, the placement's weights) --
    ``every-gpu`` and ``hybrid`` are judged behind a load-aware router (``lora-affinity``)."""

    def __post_init__(self):
        self.deployments = tuple(dict.fromkeys(check_deployment(d) for d in self.deployments))


def _sweep_point(c, conf, i: int, wl, pool: int, ctx, config: ParetoConfig, traffic: dict, storage_dir: Path,
                 greedy_p, cost: dict) -> list[dict]:
    """The points of one criterion ``c`` at one confidence setting ``conf`` (``ConfidenceSetting`` or
    None): greedy-plus placed for them, the paper's greedy judged under them, the study's front."""
    objective, workers, ray_address = config.objective, config.workers, config.ray_address
    history_ctx = traffic["history_ctx"] or ctx
    setup = SearchSetup.build(wl, pool, ctx, c, objective, confidence=conf, fleet=config.fleet)
    tag = {"criterion": c.label, "confidence": setup.confidence}
    points = []
    t = time.perf_counter()
    opts = {} if setup.confidence is None else {"confidence": setup.confidence, "error_model": config.error_model}
    p = get_policy("greedy-plus", ttft_p99_s=None, criterion=c, **opts).place(wl, pool, history_ctx)
    if p.meta["feasible"]:
        lat, ok = heldout_verdict(p, wl, traffic["eval"], setup, workers=workers, ray_address=ray_address)
        points.append({"method": "greedy-plus", **tag, "gpus": len(p.gpus), "latency_ms": lat, "feasible": ok})
    else:
        points.append({"method": "greedy-plus", **tag, "gpus": p.meta["gpus_needed"], "latency_ms": math.nan,
                       "feasible": False})
    cost["greedy-plus"]["wall_s"] += time.perf_counter() - t
    t = time.perf_counter()
    lat, ok = heldout_verdict(greedy_p, wl, traffic["eval"], setup, workers=workers, ray_address=ray_address)
    points.append({"method": "greedy", **tag, "gpus": len(greedy_p.gpus), "latency_ms": lat,
                   "feasible": ok and bool(greedy_p.meta["feasible"])})
    cost["greedy"]["wall_s"] += time.perf_counter() - t
    for deployment in config.deployments if config.trials > 0 else ():
        t = time.perf_counter()
        method = search_method(deployment)
        dsetup = SearchSetup.build(wl, pool, ctx, c, objective, confidence=conf, fleet=config.fleet,
                                   deployment=deployment)
        name = f"{wl.name or 'workload'}-{pool}gpus-{objective}-{c.label}".replace(" ", "").replace("<=", "le")
        name += "" if setup.confidence is None else f"-C{setup.confidence:g}"
        name += study_suffix(deployment, config.fleet.router, config.fleet.adapters)
        res = run_search(dsetup, history_ctx, traffic["search"], SearchOptions(
            trials=config.trials, storage=f"sqlite:///{storage_dir / 'studies.db'}", study_name=name,
            seed=criterion_seed(config.seed, i), workers=workers, ray_address=ray_address, progress=False))
        for r in replay_front(res.front, dsetup, traffic["eval"], workers=workers, ray_address=ray_address):
            points.append({"method": method, **tag, "gpus": r["gpus"], "latency_ms": r["heldout"],
                           "feasible": r["heldout_feasible"], "search_latency_ms": r[objective], "trial": r["trial"],
                           "seed": r.get("seed")})
        cost[method]["wall_s"] += time.perf_counter() - t
        cost[method]["trials"] += res.trials
    return points


def run_pareto(wl, pool: int, ctx, config: ParetoConfig, *, search_traffic: Traffic, eval_traffic: Traffic,
               storage_dir: Path, history_ctx=None) -> dict:
    """Points, fronts, hypervolumes and costs of every method over ``config.criteria`` (and
    ``config.confidences``: a front per method and confidence).  Studies are stored in
    ``storage_dir/studies.db``.  ``history_ctx``: a PlacementContext with observed requests for
    greedy-plus and the search (else ``ctx``)."""
    criteria = config.criteria
    settings = [None if c is None else resolve_bound(ctx.profile, c, config.error_model) for c in config.confidences]
    points: list[dict] = []
    methods = methods_of(config.deployments)
    cost = {m: {"wall_s": 0.0, "trials": 0} for m in methods}
    t = time.perf_counter()
    greedy_p = get_policy("greedy").place(wl, pool, ctx)
    cost["greedy"]["wall_s"] += time.perf_counter() - t
    traffic = {"search": search_traffic, "eval": eval_traffic, "history_ctx": history_ctx}
    runs = [(i, c, conf) for conf in settings for i, c in enumerate(criteria)]
    for i, c, conf in tqdm(runs, desc="criteria", unit="criterion", disable=not config.progress):
        points += _sweep_point(c, conf, i, wl, pool, ctx, config, traffic, storage_dir, greedy_p, cost)
    ref = (pool + 1, math.log10(config.ref_latency_ms))
    fronts, hv = {}, {}
    confidences = [None if s is None else s.confidence for s in settings]
    for conf in confidences:
        for m in methods:
            key = front_key(m, conf)
            front = pareto_points([p for p in points if p["method"] == m and p["confidence"] == conf
                                   and not math.isnan(p["latency_ms"])])
            fronts[key] = front
            hv[key] = hypervolume([(f["gpus"], math.log10(max(f["latency_ms"], 1e-3))) for f in front], ref)
    return {"points": points, "fronts": fronts, "hypervolume": hv, "cost": cost,
            "reference": {"gpus": ref[0], "latency_ms": config.ref_latency_ms}, "objective": config.objective,
            "criteria": [c.label for c in criteria], "pool": pool, "trials_per_criterion": config.trials,
            "confidences": confidences, "methods": list(methods),
            "fleet": {"router": config.fleet.router, "adapters": config.fleet.adapters},
            "confidence_settings": [None if s is None else s.to_dict() for s in settings]}


def _step(front: list[dict], pool: int) -> tuple[list, list]:
    xs = [p["gpus"] for p in front]
    ys = [p["latency_ms"] for p in front]
    return xs + [pool + 0.5], ys + [ys[-1]]


def plot_fronts(result: dict, path: Path) -> Path:
    """Every point (dots) and each method's front (a step line; one per confidence, solid for the
    first, then dashed and dotted, the area between the lowest and the highest confidence's fronts
    shaded: the band a confidence moves the front in)."""
    import matplotlib  # heavy optional dependency: only when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    methods = result.get("methods", METHODS)
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    offsets = {m: 0.16 * i / max(1, len(methods) - 1) - 0.08 for i, m in enumerate(methods)}
    styles = ("-", "--", ":", "-.")
    confidences = result.get("confidences", [None])
    pool = result["pool"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in methods:
        pts = [p for p in result["points"] if p["method"] == m and not math.isnan(p["latency_ms"])]
        ax.scatter([p["gpus"] + offsets[m] for p in pts],
                   [p["latency_ms"] for p in pts], s=14, alpha=0.35, color=colors[m],
                   marker="o", edgecolors="none")
        for j, conf in enumerate(confidences):
            key = front_key(m, conf)
            f = result["fronts"][key]
            if f:
                xs, ys = _step(f, pool)
                ax.step(xs, ys, where="post", color=colors[m], lw=2, ls=styles[j % len(styles)],
                        label=f"{key} (HV {result['hypervolume'][key]:.2f})")
        ends = [result["fronts"][front_key(m, c)] for c in (confidences[0], confidences[-1])]
        if len(confidences) > 1 and all(ends):
            grid = np.arange(1, pool + 1)
            lo, hi = ([min([p["latency_ms"] for p in f if p["gpus"] <= g], default=np.nan) for g in grid] for f in ends)
            ax.fill_between(grid, lo, hi, step="post", color=colors[m], alpha=0.12, lw=0)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"{result['objective']} (ms, held-out replay)")
    ax.set_xticks(range(1, pool + 1))
    ax.legend(fontsize=7)
    title = "Pareto fronts (lines) and every point (dots)"
    if len(confidences) > 1:
        title += "; band: the front between the lowest and highest confidence"
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=120)
    plt.close(fig)
    return path


def report_md(result: dict, title: str, command: str) -> str:
    confs = [c for c in result.get("confidences", [None]) if c is not None]
    settings = [s for s in result.get("confidence_settings", []) if s]
    lines = [f"# {title}", "", f"Reproduce: `{command}`", "",
             f"Objective {result['objective']} (held-out replay); pool {result['pool']} GPUs; criteria: "
             + "; ".join(result["criteria"]) + f"; search: {result['trials_per_criterion']} trials per criterion.",
             f"Hypervolume on (GPUs, log10 ms) against ({result['reference']['gpus']} GPUs, "
             f"{result['reference']['latency_ms']:,.0f} ms)."]
    fleet = result.get("fleet") or {"router": "static", "adapters": "static"}
    if fleet["router"] != "static" or fleet["adapters"] != "static":
        lines.append(f"Every point replayed as one fleet behind the {fleet['router']} router, {fleet['adapters']} "
                     "adapters (the fleet twin).")
    if confs:
        lines.append("Confidences: " + "; ".join(
            f"C={s['confidence']:g}: a point counts when the twin also serves it at {s['verification_load']:.3f}x the "
            f"load (real capacity >= {s['capacity_ratio_bound']:.3f} x the twin's, {s['samples']} runs, n={s['n']})"
            for s in settings) + (" -- and without C: the point estimate" if None in result["confidences"] else "") + ".")
    lines += ["", "| method | hypervolume | front (GPUs: latency ms) | wall s | trials |", "|---|---|---|---|---|"]
    for key, f in result["fronts"].items():
        pts = ", ".join(f"{p['gpus']}: {p['latency_ms']:,.0f} ({p['criterion']})" for p in f) or "-"
        c = result["cost"][key.split(" @ ")[0]]
        lines.append(f"| {key} | {result['hypervolume'][key]:.3f} | {pts} | {c['wall_s']:.0f} | {c['trials'] or '-'} |")
    # the confidence column only where a sweep has one (the point estimate's reports keep their shape)
    lines += ["", "## Every point", "", "| method | criterion | " + ("confidence | " if confs else "")
              + "GPUs | latency ms | feasible |", "|---|---|---|" + ("---|" if confs else "") + "---|---|"]
    for p in result["points"]:
        lat = "-" if math.isnan(p["latency_ms"]) else f"{p['latency_ms']:,.0f}"
        conf = ("-" if p.get("confidence") is None else f"{p['confidence']:g}") + " | " if confs else ""
        lines.append(f"| {p['method']} | {p['criterion']} | {conf}{p['gpus']} | {lat} | "
                     f"{'yes' if p['feasible'] else 'no'} |")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, out: Path, title: str, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "pareto.json", result, indent=1, default=str)
    atomic_write_text(out / "report.md", report_md(result, title, command))
    plot_fronts(result, out / "pareto_front.png")
    return [out / "pareto.json", out / "report.md", out / "pareto_front.png"]


def pareto_report(wl: Workload, pool: int, config: ParetoConfig, *, history: str | None = None,
                  out: str | Path | None = None, tracking_uri: str | None = None,
                  command: str = "lora-opt pareto ...", track: bool = True) -> tuple[dict, Path]:
    """``lora-opt pareto``: the sweep on ``wl``, its outputs (``write_outputs``) in ``out`` (default
    ``outputs/pareto-<workload>``), the run tracked in MLflow; (result, output directory).
    ``history``: a request log -- greedy-plus verifies and the search searches on its first half
    (which also sets the rates every policy sees), every point is replayed on the second.
    ``command`` is the reproduce line of the report."""
    wl, search_traffic, eval_traffic, ctx_kw = traffic_halves(wl, history)
    out = Path(out or f"outputs/pareto-{wl.name}")
    out.mkdir(parents=True, exist_ok=True)
    ctx = PlacementContext.for_workload(wl)
    history_ctx = PlacementContext.for_workload(wl, **ctx_kw) if ctx_kw else None
    with tracked_run("pareto", run_name=wl.name, tracking_uri=tracking_uri, track=track, profile=wl.profile,
                     seeds={"evaluation": wl.evaluation.seed, "sampler": config.seed}):
        log_params({"workload": wl.name, "pool": pool, "objective": config.objective,
                           "trials_per_criterion": config.trials,
                           "criteria": "; ".join(c.label for c in config.criteria),
                           "confidences": ", ".join("point" if c is None else f"{c:g}" for c in config.confidences),
                           "deployments": ", ".join(config.deployments), "router": config.fleet.router,
                           "adapters": config.fleet.adapters})
        res = run_pareto(wl, pool, ctx, config, search_traffic=search_traffic, eval_traffic=eval_traffic,
                         storage_dir=out, history_ctx=history_ctx)
        write_outputs(res, out, f"Pareto fronts: {wl.name}", command)
        log_flat_metrics("hypervolume", res["hypervolume"])
        log_flat_metrics("cost", res["cost"])
        log_dir(out)
    return res, out
