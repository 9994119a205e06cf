"""Issue 25 item 3, its second half: ``lora-opt search`` over (deployment, router) on the fleet twin --
the GPU-count vs latency front across deployments, on the Azure trace the fleet comparison uses
(tracked in MLflow by the search itself, experiment ``search``).

    python experiments/fleet_search.py [--traces azure-conv azure-code] [--adapters 1000] [--trials 64] [--gpus 6]
        [--deployments placement every-gpu hybrid]

The trace's hour mapped to ``--adapters`` adapters with power-law popularity and ranks {8, 16, 32}
(``fleet_comparison.powerlaw_split``: the same adapters, requests and seed), time compressed 8x,
written as a workload (``workload.yaml``: rates from the first half) and a request log
(``history.csv``: the whole hour), then::

    lora-opt search --workload workload.yaml --history history.csv --gpus G --trials T
        --deployment placement every-gpu hybrid --router static lora-affinity --adapters on-demand

-- six studies: lora-opt's placement routed by its weights (static: an adapter's requests go only
to the GPUs it is placed on, so on-demand loading never happens) or by the LoRA-affinity picker
among all GPUs (on demand: it may leave the placement when queues grow); every adapter on every GPU
(one A_max) behind a uniform router (static) or the picker; the hybrid (the study's hot count of adapters on
every GPU, the tail split as a placement) behind its weights or the picker.  Each study searches on the log's first
half and replays its front on the held-out second half; the fronts are merged.  Writes
experiments/fleet_search/ (report.md; per trace: front.json, studies.db, workload.yaml, one folder per
study with its plots; the front placements and history.csv are regenerated, not committed).
"""
import argparse
import csv
import json
import time
from pathlib import Path

import yaml

from fleet_comparison import PROFILE, powerlaw_split
from lora_opt.cli import main as lora_opt_main

OUT = Path(__file__).resolve().parent / "fleet_search"


def write_inputs(out: Path, trace: str, adapters: int, compress: float, seed: int) -> tuple[Path, Path]:
    wl, replay, T, history, half = powerlaw_split(trace, adapters, compress, seed)
    wl_path = out / "workload.yaml"
    wl_path.write_text(yaml.safe_dump({
        "profile": PROFILE, "name": wl.name, "rho": 0.9,
        "adapters": [{"id": a.id, "rank": a.rank, "rate": a.rate} for a in wl.adapters],
        "evaluation": {"lengths": "sharegpt", "duration_s": float(T), "seed": seed}}, sort_keys=False))
    log = out / "history.csv"
    with open(log, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp_s", "adapter", "input_tokens", "output_tokens"])
        for part, shift in ((history, 0.0), (replay, half)):
            for t, a, i, o in zip(part.arrival.tolist(), part.adapter.tolist(), part.in_len.tolist(),
                                  part.out_len.tolist()):
                w.writerow([f"{t + shift:.6f}", wl.adapters[a].id, i, o])
    return wl_path, log


def study_fronts(storage: str, names: list[str]) -> dict[str, list[dict]]:
    """Each study's own front (GPUs, p99 TTFT on the search half), from the Optuna storage."""
    from lora_opt.search.study import front_rows, load_study
    return {n: front_rows(load_study(storage, n), "p99_ttft") for n in names}


def report(docs: dict, fronts: dict, command: str, wall_s: float) -> str:
    lines = ["# The GPU-count vs latency front across deployments (fleet twin)", "",
             f"Command: `{command}` ({wall_s / 60:.0f} min on this machine). Each study searches on the first half of "
             "the trace's (compressed) hour and its front is replayed on the held-out second half; a point is "
             "feasible when no GPU starves (rho 0.9), the objective is the fleet's p99 TTFT.", ""]
    for trace, doc in docs.items():
        lines += [f"## {trace}", "", "Each study's front (GPUs: p99 TTFT ms on the search half):", "",
                  "| deployment / router | trials | front |", "|---|---:|---|"]
        for s in doc["studies"]:
            pts = ", ".join(f"{r['gpus']}: {r['p99_ttft']:,.0f}" for r in fronts[trace][s["study"]])
            lines.append(f"| {s['deployment']} / {s['router']} | {s['complete']} | {pts} |")
        lines += ["", "The front across them (held out: the second half):", "",
                  "| GPUs | p99 TTFT ms (search) | p99 TTFT ms (held out) | feasible held out | deployment / router |",
                  "|---:|---:|---:|---|---|"]
        for r in sorted(doc["front"], key=lambda r: r["gpus"]):
            lines.append(f"| {r['gpus']} | {r['p99_ttft']:,.0f} | {r['heldout']:,.0f} | "
                         f"{'yes' if r['heldout_feasible'] else 'NO'} | {r['deployment']} / {r['router']} |")
        lines.append("")
    return "\n".join(lines)


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=["azure-conv", "azure-code"])
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--compress", type=float, default=8.0)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deployments", nargs="+", default=["placement", "every-gpu", "hybrid"])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tracking-uri")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.perf_counter()
    docs, fronts = {}, {}
    for trace in args.traces:
        where = out / trace
        where.mkdir(parents=True, exist_ok=True)
        wl_path, log = write_inputs(where, trace, args.adapters, args.compress, args.seed)
        storage = f"sqlite:///{where / 'studies.db'}"
        argv = ["search", "--workload", str(wl_path), "--history", str(log), "--gpus", str(args.gpus),
                "--trials", str(args.trials), "--deployment", *args.deployments, "--router", "static",
                "lora-affinity", "--adapters", "on-demand", "--out", str(where), "--storage", storage,
                "--seed", str(args.seed)]
        if args.tracking_uri:
            argv += ["--tracking-uri", args.tracking_uri]
        code = lora_opt_main(argv)
        docs[trace] = json.loads((where / "front.json").read_text())
        fronts[trace] = study_fronts(storage, [s["study"] for s in docs[trace]["studies"]])
        print(f"{trace}: search exit {code}", flush=True)
    wall = time.perf_counter() - t0
    command = "python experiments/fleet_search.py" + "".join(
        f" --{k} {getattr(args, k)}" for k in ("adapters", "trials", "gpus"))
    if args.deployments != ["placement", "every-gpu", "hybrid"]:
        command += " --deployments " + " ".join(args.deployments)
    (out / "report.md").write_text(report(docs, fronts, command, wall))
    print(f"report -> {out / 'report.md'}")


if __name__ == "__main__":
    run()
