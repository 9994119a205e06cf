"""The real CPU vLLM measured against itself, and the twin judged against that (issue 35, item 5).

    python experiments/real_validation/cpu_noise.py [--repeats 3] [--half report] [--duration 150]
    python experiments/real_validation/cpu_noise.py --stages judge speed      # from the stored runs
    python experiments/real_validation/cpu_noise.py --stages retwin judge speed   # the twin side redone
    python experiments/real_validation/cpu_noise.py --stages order     # time-free: first-token order, TTFT by adapter

The committed loop's workloads (``cpu_workloads.WORKLOADS``: light, near saturation, slot-bound, mixed
ranks), each replayed ``--repeats`` times with the same requests (the ``--half``'s seed), **each repeat on
a freshly started server** and the repeats **interleaved across workloads** (repeat 1 of every workload,
then repeat 2 of every workload, ...) so that the machine's slow drift spreads over them evenly.  The
twin is the CPU profile as committed (nothing refitted here).  Per workload and metric:
``lora_opt.validate.repeats.noise_table`` -- the server's own spread (median pairwise SMAPE, min-max)
beside the twin's SMAPE to the real median, and the verdict "within the server's noise" (twin <=
1.25 x real-vs-real).  Writes ``OUT/noise/<workload>.json``, ``OUT/NOISE.md``, ``OUT/noise.json`` and one
MLflow run (experiment ``real_validation_cpu``).  ``speed`` (``lora_opt.validate.speed_match``): the twin
again at the step-time factor that matches each run's measured mean ITL, and at the light run's factor
-- what the machine's speed explains apart from the twin's scheduling and cost shape: ``OUT/SPEED.md``,
``OUT/speed.json``, a second MLflow run.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from cpu_tier import CLIENT_CORE, OUT, load_probe_tier
from cpu_workloads import SEEDS, WORKLOADS, capacity_rate, retwin_run, validate_one

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


def stage_retwin(out: Path, half: str) -> int:
    """The twin's side of every stored run redone with the twin and profile as they are now (``lora-opt
    validate --twin-only``: the same requests, routing and admission; the measured side is read, never
    changed); the new comparisons replace the stored ones in ``runs.json``."""
    done = json.loads((out / "runs.json").read_text())
    rc = 0
    for key, r in sorted(done.items()):
        if r["half"] != half or not r.get("comparison"):
            continue
        run = out / f"repeat-{r['repeat']}" / "validation" / f"{r['workload']}-{half}"
        rc |= retwin_run(run, out / f"repeat-{r['repeat']}" / f"retwin_{r['workload']}-{half}.txt")
        r["comparison"] = json.loads((run / "out" / "comparison.json").read_text())
        print(f"-- {key}: twin side redone", flush=True)
    atomic_write_json(out / "runs.json", done, indent=1)
    return rc


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


def _run_files(out: Path, n: int, half: str, k: int):
    from lora_opt.placement.plan import Placement
    from lora_opt.placement.workload_file import load_workload
    run = out / f"repeat-{k}" / "validation" / f"{n}-{half}"
    return run / "out", Placement.load(run / "placement" / "placement.json"), load_workload(str(run / "workload.yaml"))


#: the what-if of the speed stage: the profile's front-end TTFT terms off
FRONT_END_OFF = {"ttft_frontend_ms": 0.0, "ttft_frontend_per_running_ms": 0.0}


def stage_speed(out: Path, half: str) -> dict:
    """Speed against scheduling (``lora_opt.validate.speed_match``): per run, the step-time factor at which
    the twin's mean ITL is the server's, and the comparison there; per repeat, the light run's factor
    applied to the other workloads.  Judged against the same real-vs-real spread."""
    from lora_opt.validate.repeats import noise_table
    from lora_opt.validate.speed_match import speed_factor, twin_at_speed
    import tempfile
    done = json.loads((out / "runs.json").read_text())
    repeats = sorted({r["repeat"] for r in done.values() if r["half"] == half and r.get("comparison")})
    factors: dict = {}
    matched: dict = {}
    at_light: dict = {}
    no_front: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in repeats:
            runs = {n: _run_files(out, n, half, k) for n in WORKLOADS
                    if done.get(f"{n}-{half}-{k}", {}).get("comparison")}
            for n, (run, p, wl) in runs.items():
                s, comp = speed_factor(run, p, wl)
                factors.setdefault(n, {})[k] = s
                matched.setdefault(n, []).append(comp)
                # the front end's TTFT term (calibrate-e2e's, per running request) off, at the run's own speed
                no_front.setdefault(n, []).append(twin_at_speed(run, p, wl, s, Path(tmp), FRONT_END_OFF))
                print(f"-- {n} repeat {k}: step-time factor {s:.3f}", flush=True)
            light = factors.get("light", {}).get(k)
            if light is None:
                continue
            for n, (run, p, wl) in runs.items():
                at_light.setdefault(n, []).append(twin_at_speed(run, p, wl, light, Path(tmp)))
    result = {"factors": factors, "matched": {n: noise_table(c) for n, c in matched.items() if len(c) >= 2},
              "at_light_speed": {n: noise_table(c) for n, c in at_light.items() if len(c) >= 2},
              "front_end_off": {n: noise_table(c) for n, c in no_front.items() if len(c) >= 2}}
    atomic_write_json(out / "speed.json", result, indent=1, default=float)
    return result


def speed_report(out: Path, noise: dict, speed: dict) -> list[str]:
    """SPEED.md's table: per workload and metric, the server's own spread, the twin as it is, the twin at
    the light run's speed, the twin at each run's own speed (ITL fitted there, not judged)."""
    def cell(table, n, m):
        if n not in table:
            return "-", "-"
        g = table[n]["per_gpu"][table[n]["gpus"][0]].get(m)
        if g is None:
            return "-", "-"
        v = g["within_noise"]
        return f"{g['twin_vs_real_smape']:.1f}", "-" if v is None else ("within" if v else "**outside**")
    lines = ["# Speed or scheduling: the twin at the server's own speed", "",
             "Command: `python experiments/real_validation/cpu_noise.py --stages speed` (from the stored runs; "
             "`lora_opt/validate/speed_match.py`). Step-time factor s: every millisecond estimator of the CPU profile's "
             "latency section x s, s chosen per run so that the twin's mean ITL equals the server's (ITL is then fitted, "
             "not judged). 'at light's s': the factor of the same repeat's light run (one or two sequences a step: the "
             "machine's speed alone) applied to the workload. Last column: at its own s with the profile's front-end TTFT "
             "terms (`ttft_frontend_ms`, `ttft_frontend_per_running_ms`, fitted by calibrate-e2e) set to 0.", "",
             "| workload | s per repeat | at light's s (per repeat) |", "|---|---|---|"]
    for n, f in speed["factors"].items():
        light = speed["factors"].get("light", {})
        lines.append(f"| {n} | {', '.join(f'{v:.3f}' for _, v in sorted(f.items()))} | "
                     f"{', '.join(f'{light[k]:.3f}' for k in sorted(f) if k in light)} |")
    lines += ["", "SMAPE to the real median (%), and the verdict (twin <= 1.25 x real-vs-real):", "",
              "| workload | metric | real vs real % | twin as is | at light's s | at its own s | own s, front-end TTFT term off |",
              "|---|---|---|---|---|---|---|"]
    for n in noise:
        g0 = noise[n]["per_gpu"][noise[n]["gpus"][0]]
        for m in METRICS:
            if m not in g0:
                continue
            a, b, c = cell(noise, n, m), cell(speed["at_light_speed"], n, m), cell(speed["matched"], n, m)
            d = cell(speed.get("front_end_off", {}), n, m)
            own = "fitted" if m == "itl_mean_ms" else f"{c[0]} {c[1]}"
            lines.append(f"| {n} | {m} | {g0[m]['real_vs_real_smape']:.1f} | {a[0]} {a[1]} | {b[0]} {b[1]} | {own} | "
                         f"{d[0]} {d[1]} |")
    atomic_write_text(out / "SPEED.md", "\n".join(lines) + "\n")
    return lines


def stage_order(out: Path, half: str) -> dict:
    """Time-free (``lora_opt.validate.order``): per run, Kendall's tau between the real and the twin's
    first-token order, and the mean TTFT per adapter -- the twin as is and with the front-end TTFT term off
    (the engine's part alone).  Writes ``OUT/ORDER.md`` and ``OUT/order.json``."""
    import csv
    import tempfile

    from lora_opt.validate.order import first_token_order
    from lora_opt.validate.speed_match import twin_at_speed
    done = json.loads((out / "runs.json").read_text())
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, r in sorted(done.items(), key=lambda kv: (kv[1]["workload"], kv[1]["repeat"])):
            if r["half"] != half or not r.get("comparison"):
                continue
            run, p, wl = _run_files(out, r["workload"], half, r["repeat"])
            with (run / "requests.csv").open(newline="") as f:
                rows = list(csv.DictReader(f))
            entry = {}
            for tag, latency in (("as_is", None), ("front_end_off", FRONT_END_OFF)):
                twin = twin_at_speed(run, p, wl, 1.0, Path(tmp), latency, summary=True)
                entry[tag] = first_token_order(rows, twin["twin_raw"][0])
            result.setdefault(r["workload"], {})[r["repeat"]] = entry
    atomic_write_json(out / "order.json", result, indent=1)
    lines = ["# Time-free: the order of first tokens, and TTFT by adapter", "",
             f"Command: `python experiments/real_validation/cpu_noise.py --stages order` (from the stored runs; "
             "`lora_opt/validate/order.py`). Kendall's tau between the real and the twin's first-token instants of "
             "the same requests (1: the same order). TTFT means (ms) per adapter: real / twin as is / twin with the "
             "front-end TTFT term off (the engine's part alone).", "",
             "| workload | repeat | requests | tau | TTFT real | twin | twin, front end off | per adapter: real / twin / front end off |",
             "|---|---|---|---|---|---|---|---|"]
    for n, reps in result.items():
        for k, e in sorted(reps.items()):
            a, f = e["as_is"], e["front_end_off"]
            per = "; ".join(f"{ad} {v['real_ms']:.0f}/{v['twin_ms']:.0f}/{f['per_adapter'][ad]['twin_ms']:.0f}"
                            for ad, v in a["per_adapter"].items())
            lines.append(f"| {n} | {k} | {a['requests']} | {a['kendall_tau']:.3f} | {a['ttft_mean_ms']['real']:.0f} | "
                         f"{a['ttft_mean_ms']['twin']:.0f} | {f['ttft_mean_ms']['twin']:.0f} | {per} |")
    atomic_write_text(out / "ORDER.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--half", choices=list(SEEDS), default="report")
    ap.add_argument("--duration", type=float, default=150.0)
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS))
    ap.add_argument("--stages", nargs="+", default=["measure", "judge", "speed"],
                    choices=["measure", "retwin", "judge", "speed", "order"])
    # noise_all: the four workloads in one sitting (2026-12-03 17:18-17:54); noise_repeats: the first sitting
    # (light and near saturation only, 15:32-15:51): --out experiments/real_validation/cpu/noise_repeats
    ap.add_argument("--out", default=str(OUT / "noise_all"))
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
    if "retwin" in a.stages and stage_retwin(out, a.half) != 0:
        raise SystemExit("retwin: a run's twin side failed (its log is beside it: retwin_*.txt)")
    noise = None
    if "judge" in a.stages:
        noise = stage_judge(out, a.half)
        report(out, noise, a.half, a.tracking_uri)
    if "speed" in a.stages:
        noise = noise if noise is not None else stage_judge(out, a.half)
        speed = stage_speed(out, a.half)
        print("\n".join(speed_report(out, noise, speed)))
        from lora_opt.tracking import log_command_run
        log_command_run("real_validation_cpu", "speed vs scheduling", params={"half": a.half},
                        metrics={f"factor.{n}.r{k}": v for n, f in speed["factors"].items() for k, v in f.items()},
                        artifacts=[str(out / "SPEED.md"), str(out / "speed.json")], tracking_uri=a.tracking_uri,
                        track=True)
    if "order" in a.stages:
        stage_order(out, a.half)
    print(f"== {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
