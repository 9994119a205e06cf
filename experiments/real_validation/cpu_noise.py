"""The real CPU vLLM measured against itself, and the twin judged against that (issue 35, item 5).

    python experiments/real_validation/cpu_noise.py [--repeats 3] [--half report] [--duration 150]

The committed loop's workloads (``cpu_workloads.WORKLOADS``: light, near saturation, slot-bound, mixed
ranks), each replayed ``--repeats`` times with the same requests (the ``--half``'s seed), **each repeat on
a freshly started server** and the repeats **interleaved across workloads** (repeat 1 of every workload,
then repeat 2 of every workload, ...) so that the machine's slow drift spreads over them evenly.  The
twin is the CPU profile as committed (nothing refitted here).  Per workload and metric:
``lora_opt.validate.repeats.noise_table`` -- the server's own spread (median pairwise SMAPE, min-max)
beside the twin's SMAPE to the real median, and the verdict "within the server's noise" (twin <=
1.25 x real-vs-real).  Writes ``OUT/noise/<workload>.json``, ``OUT/NOISE.md``, ``OUT/noise.json`` and one
MLflow run (experiment ``real_validation_cpu``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from cpu_loop import CLIENT_CORE, OUT, load_probe_tier
from cpu_workloads import SEEDS, WORKLOADS, capacity_rate, validate_one

from lora_opt.io import atomic_write_json, atomic_write_text

#: the metrics the loop's targets name, and the verdict table's order
METRICS = ("throughput_tok_s", "itl_mean_ms", "ttft_mean_ms", "running_mean", "ttft_p99_ms", "itl_p99_ms",
           "waiting_mean")


def stage_measure(tier: dict, out: Path, repeats: int, half: str, duration: float, only) -> dict:
    names = only or list(WORKLOADS)
    rates = {n: WORKLOADS[n]["load"] * capacity_rate(n, tier) for n in names}
    done: dict = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else {}
    for k in range(1, repeats + 1):
        for n in names:
            key = f"{n}-{half}-{k}"
            if key in done and done[key].get("comparison"):
                continue                       # resumable: a finished repeat is kept
            print(f"-- {n} ({half}) repeat {k}/{repeats}: {rates[n]:.3f} req/s", flush=True)
            r = validate_one(n, half, tier, rates[n], out / f"repeat-{k}", duration)
            done[key] = {"workload": n, "half": half, "repeat": k, "rate": rates[n], **r}
            atomic_write_json(out / "runs.json", done, indent=1)
    return done


def stage_judge(out: Path, half: str) -> dict:
    from lora_opt.validate.repeats import noise_table
    done = json.loads((out / "runs.json").read_text())
    result = {}
    for n in WORKLOADS:
        comps = [r["comparison"] for r in sorted(done.values(), key=lambda r: r["repeat"])
                 if r["workload"] == n and r["half"] == half and r.get("comparison")]
        if len(comps) >= 2:
            result[n] = noise_table(comps)
            atomic_write_json(out / "noise" / f"{n}.json", result[n], indent=1, default=float)
    atomic_write_json(out / "noise.json", {n: t["per_metric"] for n, t in result.items()}, indent=1, default=float)
    return result


def report(out: Path, result: dict, half: str, tracking_uri: str | None) -> None:
    from lora_opt.tracking import log_command_run
    lines = ["# The real CPU vLLM against itself, and the twin against that", "",
             f"Command: `python experiments/real_validation/cpu_noise.py` ({half} half's requests; each repeat on a "
             "fresh server, repeats interleaved across workloads). The twin: the committed CPU profile "
             "(`configs/profiles/probe-llama-cpu-vllm032.yaml`), fitted on the probe rows only -- every run here is "
             "held apart from it.", "",
             "Verdict rule (`lora_opt/validate/repeats.py`): **within the server's noise** when the twin's SMAPE to the "
             "real median <= 1.25 x the median SMAPE between two real repeats.", "",
             "| workload | metric | real median | real min-max | real vs real % | twin | twin vs real median % | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for n, t in result.items():
        g = t["per_gpu"][t["gpus"][0]]
        for m in METRICS:
            if m not in g:
                continue
            e = g[m]
            v = e["within_noise"]
            lines.append(f"| {n} | {m} | {e['real_median']:.1f} | {e['real_min']:.1f}-{e['real_max']:.1f} | "
                         f"{e['real_vs_real_smape']:.1f} | {e['twin']:.1f} | {e['twin_vs_real_smape']:.1f} | "
                         f"{'-' if v is None else ('within' if v else '**outside**')} |")
    atomic_write_text(out / "NOISE.md", "\n".join(lines) + "\n")
    metrics = {f"{n}.{m}": {k: t["per_gpu"][t["gpus"][0]][m][k] for k in ("real_vs_real_smape", "twin_vs_real_smape")}
               for n, t in result.items() for m in METRICS if m in t["per_gpu"][t["gpus"][0]]}
    log_command_run("real_validation_cpu", "noise (repeats)", params={"half": half}, metrics=metrics,
                    artifacts=[str(out / "NOISE.md"), str(out / "noise.json")], tracking_uri=tracking_uri, track=True)
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--half", choices=list(SEEDS), default="report")
    ap.add_argument("--duration", type=float, default=150.0)
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS))
    ap.add_argument("--stages", nargs="+", default=["measure", "judge"], choices=["measure", "judge"])
    ap.add_argument("--out", default=str(OUT / "noise_repeats"))
    ap.add_argument("--tracking-uri")
    a = ap.parse_args(argv)
    if a.repeats < 2:
        ap.error("--repeats: must be >= 2 (one run has no spread)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {CLIENT_CORE})
    t0 = time.perf_counter()
    if "measure" in a.stages:
        stage_measure(load_probe_tier(), out, a.repeats, a.half, a.duration, a.workloads)
    if "judge" in a.stages:
        report(out, stage_judge(out, a.half), a.half, a.tracking_uri)
    print(f"== {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
