"""``lora-opt bench search`` (backends): the same study run by both backends -- ask/tell over Ray tasks
(the default) and a Ray Tune experiment -- side by side: wall time, the time the trials themselves
took, the overhead per trial, and the fronts they found."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from lora_opt.io import atomic_write_json
from lora_opt.parallel import TaskPool, init_ray
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.trace_split import trace_split
from lora_opt.search.study import SearchOptions, SearchSetup, Traffic, load_study, run_search, run_trial
from lora_opt.search.tune import run_tune_search


def _trial_seconds(storage: str, study_name: str) -> float:
    return sum(t.user_attrs.get("wall_s") or 0.0 for t in load_study(storage, study_name).get_trials(deepcopy=False))


def bench_backends(out: str | None = None, trials: int = 48, workers: int = 2, seed: int = 0) -> list[str]:
    """Both backends on the 1,280-adapter Azure workload of ``pareto_azure`` (pool 4, ~0.1 s
    trials), ``trials`` trials each on ``workers`` Ray workers, same sampler seed, no greedy seeds
    (their placement time is not the backends').  Ray is started and its workers warmed before
    either is timed; Tune's own start-up (its controller, trial actors) is counted, as a user pays
    it.  Overhead per trial = wall / trials - trial time / (workers x trials): the wall time a trial
    costs beyond its share of the work."""
    sp = trace_split("azure-conv", profile="llama-3.1-8b-h100-64gb", n_adapters=1280, ranks=(8, 16, 32),
                     target_rate=15.0, seed=seed)
    ctx = PlacementContext.for_workload(sp.workload)
    setup = SearchSetup.build(sp.workload, 4, ctx)
    traffic = Traffic(sp.history, sp.history_s)
    init_ray(None, workers)
    pool = TaskPool(run_trial, workers=workers)              # warm: Ray's workers started, Numba kernels loaded
    warm = {"gpus": 2, "share_0": 0.5, "amax_0": 64, "share_1": 0.5, "amax_1": 64}
    for i in range(workers):
        pool.submit(i, warm, setup, traffic)
    for _ in range(workers):
        pool.next_done()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="lora-opt-bench-search-") as tmp:
        storage = f"sqlite:///{Path(tmp) / 'bench.db'}"
        for backend in ("ask-tell", "tune"):
            options = SearchOptions(trials=trials, storage=storage, study_name=backend, seed=seed, workers=workers,
                                    seeds=False, progress=True)
            t0 = time.perf_counter()
            if backend == "tune":
                res = run_tune_search(setup, ctx, traffic, options, tune_dir=Path(tmp) / "tune")
            else:
                res = run_search(setup, ctx, traffic, options)
            wall = time.perf_counter() - t0
            work = _trial_seconds(storage, backend)
            rows[backend] = {"trials": res.trials, "complete": res.complete, "wall_s": wall, "trial_s": work,
                             "overhead_per_trial_s": wall / trials - work / (workers * trials),
                             "front": [(f["gpus"], round(f[setup.objective], 1)) for f in res.front]}
    lines: list[str] = []          # the report: lora-opt bench prints it
    lines.append(f"{trials} trials per backend, {workers} Ray workers (warm), 1,280 adapters (azure-conv, 15 req/s, pool 4), "
          f"seed {seed}:")
    lines.append(f"{'backend':>9} {'wall s':>7} {'trial s':>8} {'overhead/trial s':>17}  front (GPUs: p99 TTFT ms, search traffic)")
    for name, r in rows.items():
        front = ", ".join(f"{g}: {v:,.0f}" for g, v in r["front"]) or "-"
        lines.append(f"{name:>9} {r['wall_s']:>7.1f} {r['trial_s']:>8.1f} {r['overhead_per_trial_s']:>17.3f}  {front}")
    if out:
        atomic_write_json(out, json.loads(json.dumps(rows)), indent=1)
    return lines
