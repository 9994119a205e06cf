"""Greedy vs search on the Azure-trace workload of the placement experiment: GPU count vs p99 TTFT
fronts over a sweep of feasibility criteria, hypervolume per method, cost (tracked in MLflow).

    python experiments/pareto_azure.py [--trace azure-conv] [--ranks 8 16 32] [--load 15] [--trials 24]

1,280 adapters, requests of the trace spread uniformly, per-adapter rates estimated on the first
half of the (time-compressed) hour -- the search and greedy-plus's verification run on those
observed requests -- and every point replayed on the second half (held out).  Writes
experiments/pareto_azure/ (report.md, pareto.json, pareto_front.png).  Reproducible: the same
points and hypervolumes for any ``--workers`` (the studies ask fixed batches of trials and tell
them in trial order).  Runs with lora-opt installed (``pip install -e .`` in the checkout): it imports the installed package.
"""
import argparse
import shlex
import sys
from pathlib import Path

from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.trace_split import trace_split
from lora_opt.search.pareto import ParetoConfig, criteria_sweep, run_pareto, write_outputs
from lora_opt.search.study import Traffic
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run

OUT = Path(__file__).resolve().parent / "pareto_azure"

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--load", type=float, default=15.0, help="req/s")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--trials", type=int, default=24, help="search trials per criterion")
    ap.add_argument("--rhos", type=float, nargs="+", default=[0.70, 0.75, 0.80, 0.85, 0.90, 0.95])
    ap.add_argument("--ttft-slos-ms", type=float, nargs="*", default=[1000.0, 5000.0])
    ap.add_argument("--itl-slos-ms", type=float, nargs="*", default=[100.0])
    ap.add_argument("--seed", type=int, default=0, help="trace split and sampler seed")
    ap.add_argument("--workers", type=int, default=2,
                    help="parallel replays and trials (the results do not depend on it: studies ask fixed batches)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tracking-uri")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sp = trace_split(a.trace, profile="llama-3.1-8b-h100-64gb", n_adapters=1280, ranks=a.ranks,
                     target_rate=a.load, seed=a.seed)
    ctx = PlacementContext.for_workload(sp.workload)
    hctx = PlacementContext.for_workload(sp.workload, history=sp.history, history_s=sp.history_s)
    criteria = criteria_sweep(a.rhos, a.ttft_slos_ms, a.itl_slos_ms, 0.9)
    (out / "studies.db").unlink(missing_ok=True)          # a fresh study per run
    command = "python experiments/pareto_azure.py " + shlex.join(sys.argv[1:])
    with tracked_run("pareto-azure", run_name=sp.workload.name, tracking_uri=a.tracking_uri):
        import mlflow
        mlflow.log_params({"trace": a.trace, "ranks": str(a.ranks), "load": a.load, "pool": a.gpus,
                           "trials_per_criterion": a.trials, "criteria": "; ".join(c.label for c in criteria),
                           "seed": a.seed})
        res = run_pareto(sp.workload, a.gpus, ctx, ParetoConfig(criteria, trials=a.trials, workers=a.workers, seed=a.seed),
                         search_traffic=Traffic(sp.history, sp.history_s),
                         eval_traffic=Traffic(sp.replay, sp.duration_s), storage_dir=out, history_ctx=hctx)
        res["split"] = sp.info
        write_outputs(res, out, f"Greedy vs search: {sp.workload.name}, pool {a.gpus}", command)
        log_flat_metrics("hypervolume", res["hypervolume"])
        log_flat_metrics("cost", res["cost"])
        log_dir(out)
    print((out / "report.md").read_text().split("## Every point")[0])
