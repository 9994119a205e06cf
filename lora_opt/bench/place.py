"""``lora-opt bench place``: how fast the placement policies are, and how their cost grows.

Two tables, both in CPU seconds (``time.process_time``: the machine is shared, wall time swings
+-30 % with the neighbours' load, CPU time far less):

* **cases** -- the papers' setting (1,280 adapters on 4 GPUs) for every oracle policy, next to
  the paper's time and our target.
* **scaling** -- ``greedy-fast`` and ``greedy`` on the seeded bench workload (``bench_workload``:
  ranks 8/16/32, rates 0.05/0.1/0.2 req/s drawn uniformly) at 1k, 10k, 100k and 1M adapters
  with a proportional pool (one GPU per 100 adapters), the growth exponent fitted to them
  (least squares of log time on log adapters) and the targets beside it.  The oracle is counted
  too (rows asked per adapter, calls per GPU): unlike a time, that count is the same on every
  machine, so it shows an algorithm that asks superlinearly many questions exactly.

``--out`` writes the rows as JSON (``experiments/readme_tables.py`` turns such a file into the
README's tables; ``tests/test_bench_place.py`` checks a small case's growth against
``tests/data/bench_place_baseline.json``).
"""
from __future__ import annotations

import gc
import math
import os
import platform
import resource
import time

import numpy as np
from tqdm import tqdm

from lora_opt.calibration.error_model import DEFAULT_CONFIDENCE
from lora_opt.io import atomic_write_json
from lora_opt.placement.confidence import annotate, resolve_bound
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.placement.workload_file import load_workload, workload_from_dict
from lora_opt.surrogates.oracle import Oracle

#: adapters per GPU of the pool in the scaling table (the pool is never the limit: ~190 fit)
ADAPTERS_PER_POOL_GPU = 100
SCALING_SIZES = (1_000, 10_000, 100_000, 1_000_000)
SCALING_RATES = (0.05, 0.1, 0.2)
SCALING_POLICIES = ("greedy-fast", "greedy")
#: CPU seconds of ``place`` at (policy, adapters) the issue asks for
SCALING_TARGETS_S = {("greedy-fast", 100_000): 0.5, ("greedy", 100_000): 5.0, ("greedy-fast", 1_000_000): 10.0}
MAX_GROWTH_EXPONENT = 1.15
MAX_RSS_MB_1M = 4096
#: a policy's largest size is skipped when its extrapolated time for it is above this (CPU s)
SKIP_ABOVE_S = 120.0

#: (case, adapters, pool, per-adapter rates, policy, options, paper's seconds, target seconds)
PLACE_CASES = [
    ("1,280 adapters / 4 GPUs", 1280, 4, (0.0125, 0.025, 0.05), "greedy-fast", {}, 0.004, 0.004),
    ("1,280 adapters / 4 GPUs", 1280, 4, (0.0125, 0.025, 0.05), "greedy", {}, 1.59, 0.050),
    ("1,280 adapters / 4 GPUs", 1280, 4, (0.0125, 0.025, 0.05), "greedy-plus",
     {"verify_s": 0.0, "oracle": "distilled"}, None, None),
    ("1,280 adapters / 4 GPUs", 1280, 4, (0.0125, 0.025, 0.05), "greedy-plus", {}, None, None),
]


def bench_workload(n: int, rates, seed: int = 0, ranks=(8, 16, 32)):
    """A seeded synthetic workload of ``n`` adapters (ranks and rates drawn uniformly)."""
    rng = np.random.default_rng(seed)
    rk = rng.choice(ranks, n)
    rt = rng.choice(rates, n)
    doc = {"profile": "llama-3.1-8b-h100-64gb", "name": f"bench-{n}",
           "adapters": [{"id": f"a{i}", "rank": r, "rate": q} for i, (r, q) in enumerate(zip(rk.tolist(), rt.tolist()))]}
    if n > 100_000:   # an hour of 1M adapters' traffic is over the 50 M requests a workload may ask to evaluate
        doc["evaluation"] = {"duration_s": 60.0}
    return workload_from_dict(doc)


class CountingOracle(Oracle):
    """An oracle that counts the questions asked of the one it wraps (calls and rows)."""

    def __init__(self, inner: Oracle):
        self.inner = inner
        self.feature_names, self.threshold, self.metadata = inner.feature_names, inner.threshold, inner.metadata
        self.calls = self.rows = 0

    def predict(self, X):
        self.calls += 1
        self.rows += len(X)
        return self.inner.predict(X)


class CountingContext(PlacementContext):
    """A placement context whose oracles count their questions (``counters``: kind -> CountingOracle)."""

    def oracle(self, kind: str) -> Oracle:
        counters = self.__dict__.setdefault("counters", {})
        if kind not in counters:
            counters[kind] = CountingOracle(super().oracle(kind))
        return counters[kind]

    def questions(self) -> tuple[int, int]:
        """(calls, rows) asked so far, all oracles."""
        cs = self.__dict__.get("counters", {}).values()
        return sum(c.calls for c in cs), sum(c.rows for c in cs)


def time_place(policy, wl, pool: int, ctx: CountingContext, repeats: int) -> dict:
    """CPU seconds of ``assign`` (the algorithm) and of the whole ``place`` (plus flags, checker,
    start-up checks), the best of ``repeats`` each, and the oracle questions of one ``assign``."""
    t_assign, t_place = [], []
    calls0, rows0 = ctx.questions()
    for k in range(repeats):
        t = time.process_time()
        policy.assign(wl, pool, ctx)
        t_assign.append(time.process_time() - t)
        if k == 0:
            calls, rows = (a - b for a, b in zip(ctx.questions(), (calls0, rows0)))
        t = time.process_time()
        p = policy.place(wl, pool, ctx)
        t_place.append(time.process_time() - t)
    return {"assign_cpu_s": min(t_assign), "place_cpu_s": min(t_place), "gpus": len(p.gpus),
            "feasible": p.meta["feasible"], "oracle_calls": calls, "oracle_rows": rows, "repeats": repeats}


def growth_exponent(sizes, seconds) -> float:
    """Slope of log(seconds) on log(sizes), least squares (1 = linear)."""
    if len(sizes) < 2:
        return math.nan
    return float(np.polyfit(np.log(np.asarray(sizes, float)), np.log(np.asarray(seconds, float)), 1)[0])


def scaling_rows(sizes=SCALING_SIZES, policies=SCALING_POLICIES, repeats: int = 3, progress: bool = True) -> dict:
    """The scaling table: every policy at every size (best of ``repeats``; 1 at 1M adapters),
    the fitted exponents and the peak RSS after the largest greedy-fast run."""
    rows, notes, rss = [], [], None
    warm = bench_workload(1000, SCALING_RATES)
    for name in policies:                         # surrogates loaded, kernels compiled
        get_policy(name).place(warm, 10, PlacementContext.for_workload(warm))
    bar = tqdm(total=len(sizes) * len(policies), desc="bench place scaling", unit="run", disable=not progress)
    for n in sizes:
        gc.collect()
        wl = bench_workload(n, SCALING_RATES)
        ctx = CountingContext.for_workload(wl)
        pool = max(1, n // ADAPTERS_PER_POOL_GPU)
        for name in policies:
            done = [r for r in rows if r["policy"] == name]
            if len(done) >= 2:
                e = growth_exponent([r["adapters"] for r in done[-2:]], [r["place_cpu_s"] for r in done[-2:]])
                guess = done[-1]["place_cpu_s"] * (n / done[-1]["adapters"]) ** max(e, 1.0)
                if guess * 2 > SKIP_ABOVE_S:
                    notes.append(f"{name} at {n:,} adapters skipped: ~{guess:.0f} CPU s per run extrapolated")
                    bar.update(1)
                    continue
            r = time_place(get_policy(name), wl, pool, ctx, repeats if n < 1_000_000 else 1)
            rows.append({"policy": name, "adapters": n, "pool": pool, **r,
                         "target_s": SCALING_TARGETS_S.get((name, n))})
            if name == "greedy-fast" and n == max(sizes):
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            bar.update(1)
        del wl, ctx
    bar.close()
    exps = {}
    for name in policies:
        done = [r for r in rows if r["policy"] == name]
        xs = [r["adapters"] for r in done]
        exps[name] = {"assign": growth_exponent(xs, [r["assign_cpu_s"] for r in done]),
                      "place": growth_exponent(xs, [r["place_cpu_s"] for r in done]),
                      "place_steps": [growth_exponent(xs[i:i + 2], [r["place_cpu_s"] for r in done[i:i + 2]])
                                      for i in range(len(done) - 1)]}
    return {"rows": rows, "exponents": exps, "max_exponent": MAX_GROWTH_EXPONENT, "peak_rss_mb": rss,
            "rss_target_mb": MAX_RSS_MB_1M, "largest": max(sizes), "notes": notes}


def growth_case(policy: str = "greedy", small: int = 1_000, large: int = 10_000, repeats: int = 3) -> dict:
    """How ``assign``'s cost grows from ``small`` to ``large`` adapters (proportional pool): the
    CPU-time ratio (best of ``repeats`` per size, the sizes alternated so both see the same
    neighbours' load) and the ratio of oracle rows asked (the same on every machine).  A quadratic
    algorithm shows ~100x for 10x the adapters, a linear one ~10x."""
    wls = {n: bench_workload(n, SCALING_RATES) for n in (small, large)}
    ctxs = {n: CountingContext.for_workload(wl) for n, wl in wls.items()}
    pol = get_policy(policy)
    pol.assign(wls[small], max(1, small // ADAPTERS_PER_POOL_GPU), ctxs[small])      # warm
    best, rows = {small: math.inf, large: math.inf}, {}
    for _ in range(repeats):
        for n in (small, large):
            c0 = ctxs[n].questions()[1]
            t = time.process_time()
            pol.assign(wls[n], max(1, n // ADAPTERS_PER_POOL_GPU), ctxs[n])
            best[n] = min(best[n], time.process_time() - t)
            rows[n] = ctxs[n].questions()[1] - c0
    return {"policy": policy, "small": small, "large": large, "cpu_s": {str(n): best[n] for n in best},
            "cpu_ratio": best[large] / best[small], "oracle_rows": {str(n): rows[n] for n in rows},
            "rows_ratio": rows[large] / rows[small]}


def case_label(name: str, opts: dict) -> str:
    """A case's policy as the tables name it: the policy, then its options, e.g.
    ``greedy-plus (verify_s=0.0, oracle=distilled)``."""
    return name + ("" if not opts else " (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")")


def case_rows(repeats: int = 3, cases=None) -> list[dict]:
    """``cases`` (default ``PLACE_CASES``: the papers' setting for every oracle policy), CPU seconds,
    best of ``repeats``; twin verification once."""
    rows, cache = [], {}
    cases = PLACE_CASES if cases is None else cases
    for case, n, pool, rates, name, opts, paper, target in tqdm(cases, desc="bench place cases", unit="case"):
        wl = cache.get((n, rates)) or cache.setdefault((n, rates), bench_workload(n, rates))
        ctx = CountingContext.for_workload(wl)
        pol = get_policy(name, **opts)
        pol.place(wl, pool, ctx)                         # warm
        reps = 1 if name == "greedy-plus" and opts.get("verify_s", 1) else repeats
        rows.append({"case": case, "policy": case_label(name, opts), **time_place(pol, wl, pool, ctx, reps),
                     "paper_s": paper, "target_s": target})
    return rows


def example_case(repeats: int = 1) -> dict:
    """``place`` on the bundled example as the command runs it, at the default confidence (greedy-plus
    verifying at the derived load, then each GPU's twin capacity for its margin and P(starve)) against
    the fixed margin 0.1 (the behaviour before confidences), CPU seconds, best of ``repeats`` each,
    the two measured in the same run, alternating."""
    wl = load_workload("example")
    ctx = PlacementContext.for_workload(wl)
    setting = resolve_bound(ctx.profile, None)
    times: dict[str, list[float]] = {"confidence": [], "fixed": []}
    gpus = {}
    get_policy("greedy-plus").place(wl, 4, ctx)              # warm (compiled kernels, surrogate)
    for _ in range(repeats):
        for kind in ("fixed", "confidence"):
            t = time.process_time()
            if kind == "fixed":
                p = get_policy("greedy-plus", margin=0.1).place(wl, 4, ctx)
            else:
                p = get_policy("greedy-plus", confidence=DEFAULT_CONFIDENCE).place(wl, 4, ctx)
                annotate(p, wl, setting)
            times[kind].append(time.process_time() - t)
            gpus[kind] = len(p.gpus)
    best = {k: min(v) for k, v in times.items()}
    return {"confidence": DEFAULT_CONFIDENCE, "confidence_cpu_s": best["confidence"], "fixed_cpu_s": best["fixed"],
            "ratio": best["confidence"] / best["fixed"], "gpus": gpus, "repeats": repeats}


def _ms(x) -> str:
    return "-" if x is None else (f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s")


def place_lines(doc: dict) -> list[str]:
    """The two tables, as lines of text."""
    lines: list[str] = []
    lines.append(f"{'case':<26} {'policy':<46} {'assign':>10} {'place':>10} {'GPUs':>5} {'target':>9} {'paper':>9}")
    for r in doc["cases"]:
        lines.append(f"{r['case']:<26} {r['policy']:<46} {_ms(r['assign_cpu_s']):>10} {_ms(r['place_cpu_s']):>10} "
              f"{r['gpus']:>5} {_ms(r['target_s']):>9} {_ms(r['paper_s']):>9}")
    s = doc["scaling"]
    lines.append(f"\nscaling (bench workload, one pool GPU per {ADAPTERS_PER_POOL_GPU} adapters; CPU time, best of "
          f"{doc['repeats']}, 1 run at 1M):")
    lines.append(f"{'policy':<12} {'adapters':>10} {'GPUs':>6} {'assign':>10} {'place':>10} {'target':>9} "
          f"{'oracle rows/adapter':>20} {'calls/GPU':>10}")
    for r in s["rows"]:
        lines.append(f"{r['policy']:<12} {r['adapters']:>10,} {r['gpus']:>6} {_ms(r['assign_cpu_s']):>10} "
              f"{_ms(r['place_cpu_s']):>10} {_ms(r['target_s']):>9} {r['oracle_rows'] / r['adapters']:>20.2f} "
              f"{r['oracle_calls'] / r['gpus']:>10.2f}")
    for name, e in s["exponents"].items():
        steps = ", ".join(f"{x:.2f}" for x in e["place_steps"])
        lines.append(f"growth exponent {name}: place {e['place']:.2f}, assign {e['assign']:.2f} (target <= "
              f"{s['max_exponent']}); between sizes: {steps}")
    if s["peak_rss_mb"] is not None:
        lines.append(f"peak RSS after greedy-fast at {s['largest']:,} adapters: {s['peak_rss_mb']:,.0f} MB "
              f"(target <= {s['rss_target_mb']:,} MB; the whole bench process)")
    for note in s["notes"]:
        lines.append(f"note: {note}")
    if doc.get("example"):
        e = doc["example"]
        lines.append(f"place on the bundled example (greedy-plus, CPU time, best of {e['repeats']}): at confidence "
                     f"{e['confidence']:g} {_ms(e['confidence_cpu_s'])} ({e['gpus']['confidence']} GPUs, with each GPU's "
                     f"capacity replay), fixed margin 0.1 {_ms(e['fixed_cpu_s'])} ({e['gpus']['fixed']} GPUs): "
                     f"{e['ratio']:.2f}x (target <= 1.5x)")
    lines.append("assign = the algorithm (order, oracle questions, packing); place = assign + per-GPU flags, "
          "placement, checker and start-up checks.")
    return lines


def bench_place(out: str | None = None, repeats: int = 3, sizes=SCALING_SIZES) -> list[str]:
    """``lora-opt bench place``: the cases table and the scaling table (see the module docstring)."""
    t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    doc = {"benchmark": "place", "repeats": repeats, "cases": case_rows(repeats),
           "scaling": scaling_rows(sizes, repeats=repeats), "example": example_case(min(repeats, 2)),
           "machine": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                       "load_average_1min_at_start": load0}}
    doc["bench_wall_s"], doc["bench_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    lines = place_lines(doc)
    doc["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    lines.append(f"bench took {doc['bench_wall_s']:.0f} s wall, {doc['bench_cpu_s']:.0f} s CPU (target <= 300 s); load average "
          f"{doc['machine']['load_average_1min_at_start']:.1f} at start, {doc['machine']['load_average_1min_at_end']:.1f} at end "
          f"on {doc['machine']['cpus']} CPUs")
    if out:
        atomic_write_json(out, doc, indent=1)
    return lines
