"""The benchmarks ``lora-opt bench`` runs -- speed and memory, reported as numbers, not tests.

``twin`` (``bench_twin``): wall time per simulated hour, steps/s, requests/s, peak memory.

The scenarios mirror the published twin's measurements on this kind of machine (one core, one
simulated hour): 1.2 s at 2 req/s (8 adapters), 5.4 s at 10 req/s (32 adapters, 16 slots), 14-18 s
at 30-60 req/s (96-128 adapters, 32 slots, saturated), 39 s on average over the papers' workloads.
Each scenario runs in a fresh process, once to warm the Numba cache, then ``repeats`` times, best
kept; that is done ``TWIN_ROUNDS`` times round-robin over the scenarios, and the fastest round is
reported with the slowest beside it (the machine's noise, in the report).  Memory: peak RSS of that
process (its own high-water mark), and ``sim MB`` = peak RSS minus the RSS after importing the twin
and loading its compiled kernel (what the simulation itself adds); the largest over the rounds.
Saturated scenarios are also timed with ``early_stop`` (alternating with the full run in one process:
separate processes differ by more than the saving) to show what stopping certainly-starving runs saves.

Each ``bench_*`` returns its report as lines of text (``lora-opt bench`` prints them: library code
does not print) and writes its numbers as JSON when given ``out``.

``dataset`` (``bench_dataset``): rows/s of labelling a grid sample with 1 and 2 workers.
``place`` (``lora_opt.bench.place``): CPU time of the placement policies and its growth, 1k-1M adapters.
``search`` (``bench_search``): parallel efficiency of search trials on Ray.
``ray`` (``bench_ray``): Ray's start-up and per-task overhead, from which the fan-out's
serial-or-Ray threshold (``lora_opt.parallel.RAY_STARTUP_S``, ``RAY_TASK_S``) is set.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time

import numpy as np
from tqdm import tqdm

from lora_opt.io import atomic_write_json
from lora_opt.parallel import TaskPool, init_ray, run_batches
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.trace_split import trace_split
from lora_opt.search.study import AMAX_MAX, SearchSetup, Traffic, run_trial
from lora_opt.surrogates import dataset as ds
from lora_opt.tracking import profile_hash
from twin.profile import load_profile
from twin.scenario import scenario_dict

BASE = {"profile": "llama-3.1-8b-h100-64gb", "duration_s": 3600, "seed": 0,
        "engine": {"max_lora_rank": 16, "max_num_seqs": 2048, "max_num_batched_tokens": 2048}}

SCENARIOS = [
    # name, published twin seconds, target seconds, adapters, max_loras
    ("2 req/s, 8 adapters", 1.2, 0.06, [{"count": 8, "rank": 16, "rate": 0.25}], 8),
    ("10 req/s, 32 adapters, 16 slots", 5.4, 0.3, [{"count": 32, "rank": 16, "rate": 0.3125}], 16),
    ("30 req/s, 96 adapters, 32 slots", 14.0, 0.9, [{"count": 96, "rank": 16, "rate": 0.3125}], 32),
    ("60 req/s, 128 adapters, 32 slots", 18.0, 0.9, [{"count": 128, "rank": 16, "rate": 0.46875}], 32),
    ("papers' workload: 128 adapters, rates 0.1/0.05/0.025, 128 slots", 39.0, 1.95,
     [{"count": 43, "rank": 16, "rate": 0.1}, {"count": 43, "rank": 16, "rate": 0.05},
      {"count": 42, "rank": 16, "rate": 0.025}], 128),
    ("papers' workload: 192 adapters, rates 1.6/0.8/0.4, 64 slots", 39.0, 1.95,
     [{"count": 64, "rank": 16, "rate": 1.6}, {"count": 64, "rank": 16, "rate": 0.8},
      {"count": 64, "rank": 16, "rate": 0.4}], 64),
]

#: issue 17's (and 25's) target on the three reference scenarios: 50x the published twin as measured
#: there (1.58, 4.98, 93.6 s per simulated hour, one core, in process) on the issue's scenarios:
#: these three run with ``max_cpu_loras`` = adapters and seed 1, as the issue states them
TARGETS_50X_S = {"2 req/s, 8 adapters": 1.58 / 50, "10 req/s, 32 adapters, 16 slots": 4.98 / 50,
                 "30 req/s, 96 adapters, 32 slots": 93.6 / 50}

#: issue 17's target: the papers' whole grid labelled in an hour on a 2-core machine
GRID_TARGET_H = 1.0

_CHILD = r"""
import json, resource, sys, time
import twin
from twin.scenario import scenario_from_dict
def peak_rss_mb():
    # VmHWM: this process's own high-water mark. Not ru_maxrss: on Linux it keeps the parent's RSS
    # at fork/exec, so a child of a large process would report the parent's size
    try:
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 * (1024 if sys.platform == "darwin" else 1))
spec = json.loads(sys.argv[1])
sc = scenario_from_dict(spec["scenario"])
tiny = scenario_from_dict(dict(spec["scenario"], duration_s=5))
twin.simulate(tiny)                             # load the compiled kernel
base_rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
starving = twin.simulate(sc).starving          # warm (the result is not kept: it would count in the peak)
# a starving scenario is also timed with early stop, alternating with the full run in this process
# (separate processes differ by +-10-20 %, more than the saving)
variants = {"full": sc}
if starving:
    variants["early"] = scenario_from_dict(dict(spec["scenario"], early_stop=True))
    twin.simulate(variants["early"])
best, res = {}, {}
for _ in range(spec["repeats"]):
    for key, x in variants.items():
        t, c = time.perf_counter(), time.process_time(); res[key] = twin.simulate(x)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        w0, c0 = best.get(key, (dt, dc))
        best[key] = (min(w0, dt), min(c0, dc))
r = res["full"]
out = {"wall_s": best["full"][0], "cpu_s": best["full"][1], "steps": r.steps, "requests": r.arrived,
       "starving": r.starving, "stopped_early_s": r.stopped_early_s, "throughput": r.throughput_tok_s,
       "peak_rss_mb": peak_rss_mb(), "base_rss_mb": base_rss}
if "early" in res:
    out["early"] = {"wall_s": best["early"][0], "cpu_s": best["early"][1], "stopped_early_s": res["early"].stopped_early_s}
print(json.dumps(out))
"""


def _dump(out: str | None, obj) -> None:
    """Write a benchmark's results as JSON when ``--out`` is given."""
    if out:
        atomic_write_json(out, obj, indent=2)


def _run(scenario: dict, repeats: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({"scenario": scenario, "repeats": repeats})],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


#: bench twin runs every scenario this many times, round-robin (a fresh process each): this VM has
#: slow spells of several seconds that best-of-``repeats`` inside one process cannot step around
TWIN_ROUNDS = 3


def _bench_scenario(name: str, adapters: list, slots: int) -> dict:
    engine = dict(BASE["engine"], max_loras=slots)
    seed = BASE["seed"]
    if name in TARGETS_50X_S:                  # the reference scenario, as it states it
        engine["max_cpu_loras"] = sum(a["count"] for a in adapters)
        seed = 1
    return scenario_dict(BASE["profile"], adapters, engine=engine, duration_s=BASE["duration_s"], seed=seed,
                         lengths={"source": "sharegpt"})


def bench_twin(out: str | None = None, repeats: int = 3, rounds: int = TWIN_ROUNDS) -> list[str]:
    scenarios = [(name, published, target, _bench_scenario(name, adapters, slots))
                 for name, published, target, adapters, slots in SCENARIOS]
    runs: dict[str, list[dict]] = {name: [] for name, *_ in scenarios}
    with tqdm(total=rounds * len(scenarios), desc="bench twin", unit="run") as bar:
        for _ in range(rounds):
            for name, _p, _t, sc in scenarios:
                runs[name].append(_run(sc, repeats))
                bar.update(1)
    rows = []
    for name, published, target, sc in scenarios:
        r = min(runs[name], key=lambda x: x["cpu_s"])          # the fastest round; its spread is reported
        hours = sc["duration_s"] / 3600
        row = {"scenario": name, "wall_s_per_sim_hour": r["wall_s"] / hours, "cpu_s_per_sim_hour": r["cpu_s"] / hours,
               "cpu_s_per_sim_hour_rounds": [x["cpu_s"] / hours for x in runs[name]],
               "published_s": published, "target_50x_s": TARGETS_50X_S.get(name),
               "target_s": target, "speedup_vs_published": published / (r["wall_s"] / hours),
               "steps_per_s": r["steps"] / r["wall_s"], "requests_per_s": r["requests"] / r["wall_s"],
               "peak_rss_mb": max(x["peak_rss_mb"] for x in runs[name]),
               "sim_rss_mb": max(x["peak_rss_mb"] - x["base_rss_mb"] for x in runs[name]),
               "starving": r["starving"]}
        if "early" in r:
            e = r["early"]
            row["early_stop_wall_s"] = e["wall_s"]
            row["early_stop_cpu_s"] = e["cpu_s"]
            row["early_stop_at_s"] = e["stopped_early_s"]
            row["early_stop_saving"] = 1 - e["cpu_s"] / r["cpu_s"]
        rows.append(row)
    lines: list[str] = []          # the report: lora-opt bench prints it
    lines.append(f"{'scenario':<66} {'s/sim-h':>8} {'CPU s':>7} {'slowest':>7} {'target':>7} {'x publ.':>8} "
                 f"{'steps/s':>10} {'req/s':>9} {'RSS MB':>7} {'sim MB':>7}  early stop")
    for r in rows:
        es = (f"stop at {r['early_stop_at_s']:.0f} s, saves {100 * r['early_stop_saving']:.0f} %"
              if r.get("early_stop_at_s") is not None else
              ("starving, bound never certain" if r["starving"] else "-"))
        lines.append(f"{r['scenario']:<66} {r['wall_s_per_sim_hour']:8.3f} {r['cpu_s_per_sim_hour']:7.3f} "
              f"{max(r['cpu_s_per_sim_hour_rounds']):7.3f} {r['target_s']:7.2f} "
              f"{r['speedup_vs_published']:8.0f} {r['steps_per_s']:10,.0f} {r['requests_per_s']:9,.0f} "
              f"{r['peak_rss_mb']:7.0f} {r['sim_rss_mb']:7.0f}  {es}")
    _dump(out, rows)
    return lines


def _time_class(row: dict) -> str:
    """Which kind of run a labelled dataset row was (``bench dataset``'s time breakdown)."""
    if row["status"] == "oom":
        return "fails to start (OOM)"
    stopped = row["stopped_early_s"]
    if stopped is None or math.isnan(stopped):
        return "full hour, starving" if row["starving"] else "full hour, not starving"
    return "stopped within 10 s" if stopped <= 10.0 else "stopped later"


def bench_dataset(grid: str = "papers", sample: int = 64, seed: int = 0) -> list[str]:
    """Rows/s of labelling a random sample of a grid with 1 and 2 workers, and the extrapolated
    time of the whole grid (Ray started and warmed before timing)."""
    profile, g = ds.load_grid(grid)
    points = g.points()
    ids = sorted(random.Random(seed).sample(range(len(points)), min(sample, len(points))))
    prof = load_profile(profile)
    name, phash = prof.name, profile_hash(prof)
    items = [{"point": points[j], "point_id": j, "groups": g.groups, "profile_name": name, "profile_hash": phash,
              "twin_version": "bench", "scenario": ds.point_scenario(points[j], j, g, profile)} for j in ids]
    ds.label_points(items[:1])                                   # load the compiled kernel
    t = time.perf_counter()
    rows1 = ds.label_points(items)
    serial = time.perf_counter() - t
    init_ray(None, 2)
    run_batches(ds.label_points, [items[:1], items[1:2]], lambda i, r: None, workers=2)   # warm workers
    t = time.perf_counter()
    got = []
    half = [items[k::2] for k in range(2)]
    batches = [b[i:i + 8] for b in half for i in range(0, len(b), 8)]
    run_batches(ds.label_points, batches, lambda i, r: got.extend(r), workers=2)
    two = time.perf_counter() - t
    stopped = sum(1 for r in rows1 if r["stopped_early_s"] == r["stopped_early_s"])
    r1, r2 = len(items) / serial, len(items) / two
    lines: list[str] = []          # the report: lora-opt bench prints it
    lines.append(f"grid {grid}: {len(points):,} points; sample of {len(items)} (seed {seed}), {stopped} stopped early")
    lines.append(f"1 worker : {r1:6.2f} rows/s   2 workers: {r2:6.2f} rows/s   speed-up {r2 / r1:.2f}x")
    hours = len(points) / r2 / 3600
    target = (f" (target <= {GRID_TARGET_H:g} h: {'met' if hours <= GRID_TARGET_H else 'NOT met'})"
              if grid == "papers" else "")
    lines.append(f"whole grid, extrapolated: {hours:.2f} h on 2 workers{target} "
                 f"({len(points) / r1 / 3600:.2f} h on 1)")
    # where the time goes (serial run's per-point wall time)
    kinds = {"fails to start (OOM)": 0.0, "full hour, not starving": 0.0, "full hour, starving": 0.0,
             "stopped within 10 s": 0.0, "stopped later": 0.0}
    counts = dict.fromkeys(kinds, 0)
    for r in rows1:
        kind = _time_class(r)
        kinds[kind] += r["wall_s"]
        counts[kind] += 1
    total = sum(kinds.values()) or 1.0
    for kind, w in kinds.items():
        lines.append(f"  {kind:<24} {counts[kind]:5d} points  {100 * w / total:5.1f} % of the time")
    return lines


def bench_search(out: str | None = None, trials: int = 48, seed: int = 0) -> list[str]:
    """Parallel efficiency of trial evaluation: the same ``trials`` parameter sets (seeded, drawn
    from the search space) evaluated serially and as Ray tasks on 2 workers (Ray started and its
    workers warmed before timing), best of 3 each.  Efficiency = serial time / (2 x parallel time)."""
    sp = trace_split("azure-conv", profile="llama-3.1-8b-h100-64gb", n_adapters=1280, ranks=(8, 16, 32),
                     target_rate=15.0, seed=seed)
    ctx = PlacementContext.for_workload(sp.workload)
    setup = SearchSetup.build(sp.workload, 4, ctx)
    traffic = Traffic(sp.history, sp.history_s)
    rng = np.random.default_rng(seed)
    params = []
    for _ in range(trials):
        k = int(rng.integers(1, 5))
        p = {"gpus": k}
        for g in range(k):
            p[f"share_{g}"] = float(rng.uniform(0.2, 1.0))
            p[f"amax_{g}"] = int(rng.integers(8, AMAX_MAX))
        params.append(p)

    def timed(workers: int) -> float:
        pool = TaskPool(run_trial, workers=workers)
        s_ref, t_ref = pool.put(setup), pool.put(traffic)
        for i in range(pool.workers):                  # warm: Numba kernels loaded in each worker
            pool.submit(-1 - i, params[0], s_ref, t_ref)
        for _ in range(pool.workers):
            pool.next_done()
        t0 = time.perf_counter()
        queue = list(enumerate(params))
        while queue or pool.busy:
            while queue and pool.free > 0:
                i, p = queue.pop(0)
                pool.submit(i, p, s_ref, t_ref)
            _, res = pool.next_done()
            if isinstance(res, BaseException):
                raise res
        return time.perf_counter() - t0

    t1 = min(timed(1) for _ in range(3))         # best of 3: the machine has 2 cores and other jobs
    t2 = min(timed(2) for _ in range(3))
    eff = t1 / (2 * t2)
    row = {"trials": trials, "serial_s": t1, "two_workers_s": t2, "speedup": t1 / t2, "efficiency": eff,
           "s_per_trial_serial": t1 / trials}
    lines: list[str] = []          # the report: lora-opt bench prints it
    lines.append(f"{trials} trials (1,280 adapters, azure-conv at 15 req/s, {sp.history_s:.0f} s of traffic each): "
          f"1 worker {t1:.1f} s, 2 workers {t2:.1f} s -> speed-up {t1 / t2:.2f}x, parallel efficiency {eff:.0%} "
          f"(target >= 80 %)")
    _dump(out, row)
    return lines


_RAY_CHILD = r"""
import json, os, time
from lora_opt.parallel import idle_task, init_ray, simulate_dict
sc = json.loads(os.environ["LORA_OPT_BENCH_SCENARIO"])
t0 = time.perf_counter()
import ray
t_import = time.perf_counter() - t0
simulate_dict(sc)                                   # the driver's kernel load, not timed
t = time.perf_counter(); simulate_dict(sc); sim_s = time.perf_counter() - t
cpus = os.cpu_count() or 1
t = time.perf_counter()
init_ray(None, None)
t_init = time.perf_counter() - t
sim = ray.remote(num_cpus=1)(simulate_dict)
ray.get([sim.remote(sc) for _ in range(cpus)])      # fresh workers: imports, kernel load, one simulation
t_first = time.perf_counter() - t
idle = ray.remote(num_cpus=1)(idle_task)
ray.get([idle.remote(0.0) for _ in range(cpus)])
n = 400
t = time.perf_counter(); ray.get([idle.remote(0.0) for _ in range(n)]); t_tasks = time.perf_counter() - t
t = time.perf_counter(); ray.shutdown(); t_down = time.perf_counter() - t
print(json.dumps({"import_ray_s": t_import, "init_s": t_init, "first_tasks_s": t_first - t_init - sim_s,
                  "shutdown_s": t_down, "startup_s": t_import + t_first - sim_s + t_down, "tiny_sim_s": sim_s,
                  "task_s": t_tasks * cpus / n, "cpus": cpus}))
"""


def bench_ray(out: str | None = None, repeats: int = 3) -> list[str]:
    """Ray's start-up (``import ray``, ``ray.init``, the first task on every fresh worker -- imports,
    Numba kernel load; a tiny simulation's own time subtracted -- and ``ray.shutdown``, which a
    command pays on exit) and its overhead per task once warm (400 empty tasks, wall x CPUs /
    tasks), each in a fresh process, median of ``repeats``.  Prints the
    constants ``lora_opt.parallel`` uses and the serial work below which serial execution wins."""
    import os
    from lora_opt import parallel

    sc = scenario_dict(BASE["profile"], [{"count": 1, "rank": 16, "rate": 1.0}], engine=BASE["engine"], duration_s=5,
                       seed=0)
    env = dict(os.environ, LORA_OPT_BENCH_SCENARIO=json.dumps(sc))
    env.pop("RAY_ADDRESS", None)
    rows = []
    for _ in tqdm(range(repeats), desc="fresh Ray instances", unit="run"):
        res = subprocess.run([sys.executable, "-c", _RAY_CHILD], capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    cpus = int(med["cpus"])
    # serial work W*c at which startup + ceil(m/cpus)(c + o) = m c, for many small tasks: ~ startup * cpus/(cpus-1)
    break_even = med["startup_s"] * cpus / (cpus - 1) if cpus > 1 else math.inf
    lines: list[str] = []          # the report: lora-opt bench prints it
    lines.append(f"Ray on this machine ({cpus} CPUs, median of {repeats} fresh processes):")
    lines.append(f"  import ray                {med['import_ray_s']:7.2f} s")
    lines.append(f"  ray.init                  {med['init_s']:7.2f} s")
    lines.append(f"  first task on every fresh worker  {med['first_tasks_s']:7.2f} s")
    lines.append(f"  ray.shutdown              {med['shutdown_s']:7.2f} s")
    lines.append(f"  start-up in all           {med['startup_s']:7.2f} s"
          f"   (lora_opt.parallel.RAY_STARTUP_S = {parallel.RAY_STARTUP_S:g})")
    lines.append(f"  per task once warm        {med['task_s'] * 1e3:7.2f} ms  (lora_opt.parallel.RAY_TASK_S = {parallel.RAY_TASK_S:g})")
    lines.append(f"  serial wins below ~{break_even:.1f} s of serial work (start-up x cpus / (cpus - 1))")
    _dump(out, {"runs": rows, "median": med, "break_even_serial_s": break_even,
                "constants": {"RAY_STARTUP_S": parallel.RAY_STARTUP_S, "RAY_TASK_S": parallel.RAY_TASK_S}})
    return lines
