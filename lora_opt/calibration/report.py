"""Fit report for :mod:`lora_opt.calibration.profile_fit`: ``fit_report.md`` plus one small PNG per estimator.

matplotlib is imported by the first plot, so that calibrating without a report never imports it.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from lora_opt.io import atomic_write_figure, atomic_write_text

DPI = 80
FIGSIZE = (8.0, 3.4)


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib  # heavy optional dependency: only when a report is written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy optional dependency: only when a report is written
    return plt


def _save(fig, path: Path) -> str:
    plt = _pyplot()
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=DPI)
    plt.close(fig)
    return path.name


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.4g}"
    return str(x)


# ---- plots --------------------------------------------------------------------------------------
def plot_memory(fit, out: Path) -> str:
    p = fit.plot
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE)
    for rank in sorted(set(p["r"].astype(int))):
        sel = p["r"] == rank
        a.scatter(p["n"][sel], p["y"][sel] / 1000, s=14, label=f"measured r={rank}")
        order = np.argsort(p["n"][sel])
        a.plot(p["n"][sel][order], p["pred"][sel][order] / 1000, lw=1)
        b.scatter(p["n"][sel], 100 * (p["pred"][sel] / p["y"][sel] - 1), s=14, label=f"r={rank}")
    if len(p["n_oom"]):
        a.scatter(p["n_oom"], np.maximum(p["pred_oom"], 0) / 1000, marker="x", c="k", s=18,
                  label="gpu_oom (predicted KV)")
    a.axhline(p["mml"] / 1000, ls=":", c="grey", lw=1)
    a.set_xlabel("max_loras")
    a.set_ylabel("KV cache (k tokens)")
    a.legend(fontsize=6)
    b.axhline(2, ls=":", c="grey")
    b.axhline(-2, ls=":", c="grey")
    b.set_xlabel("max_loras")
    b.set_ylabel("KV error (%)")
    b.set_title("fit residuals (dotted: +-2 %)", fontsize=8)
    return _save(fig, out / "memory.png")


def plot_max_num_seqs(fit, out: Path) -> str | None:
    if fit is None:
        return None
    p = fit.plot
    plt = _pyplot()
    fig, a = plt.subplots(figsize=(4.5, 3.2))
    order = np.argsort(p["x"])
    a.scatter(p["x"], p["y"], s=14, label=p.get("label", "measured (no LoRA)"))
    if "line_x" in p:     # a fitted line over a wider range than the points
        a.plot(p["line_x"], p["line_y"], lw=1, c="C1", label="fit")
    else:
        a.plot(p["x"][order], p["pred"][order], lw=1, c="C1", label="fit")
    a.set_xlabel("max_num_seqs")
    a.set_ylabel(p.get("ylabel", "KV cache (GiB)"))
    a.legend(fontsize=6, loc="upper right")
    return _save(fig, out / "memory_max_num_seqs.png")


def plot_decode(fit, out: Path) -> str:
    p = fit.plot
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE)
    sc = a.scatter(p["b"], p["y"], c=p["ctx_k"], s=16, cmap="viridis", label="measured")
    a.scatter(p["b"], p["pred"], marker="x", c="k", s=14, label="model")
    fig.colorbar(sc, ax=a, label="context (k tokens)")
    a.set_xlabel("running batch B")
    a.set_ylabel("ITL (ms)")
    a.legend(fontsize=7)
    b.scatter(p["b"], 100 * (p["pred"] / p["y"] - 1), s=14)
    b.axhline(0, c="grey", lw=1)
    b.set_xlabel("running batch B")
    b.set_ylabel("residual (%)")
    return _save(fig, out / "step_decode.png")


def plot_prefill(fit, out: Path) -> str | None:
    p = fit.plot
    if not p:
        return None
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE)
    a.scatter(p["x"] / 1e3, p["y"] / 1e3, s=16, label="measured")
    a.scatter(p["x"] / 1e3, p["pred"] / 1e3, marker="x", c="k", s=14, label="model")
    a.set_xlabel("prefill tokens beyond one per sequence (k)")
    a.set_ylabel("run duration (s)")
    a.legend(fontsize=7)
    b.scatter(p["x"] / 1e3, 100 * (p["pred"] / p["y"] - 1), s=14)
    b.axhline(0, c="grey", lw=1)
    b.set_xlabel("prefill tokens (k)")
    b.set_ylabel("residual (%)")
    return _save(fig, out / "step_prefill.png")


def plot_lora(fit, out: Path) -> str:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE)
    for rank, p in sorted(fit.plot.items()):
        order = np.argsort(p["x"])
        a.scatter(p["x"], p["y"], s=14, label=f"max_lora_rank {rank}")
        a.plot(p["x"][order], p["pred"][order], lw=1)
        b.scatter(p["x"], 100 * (p["pred"] / p["y"] - 1), s=14, label=f"r={rank}")
        if not np.allclose(p["served"], p["x"]):
            a.scatter(p["served"], p["y"], s=10, marker="^", alpha=0.4,
                      label=f"same runs vs served adapters (r={rank})")
    a.set_xlabel("distinct adapters in the batch D")
    a.set_ylabel("LoRA factor")
    a.legend(fontsize=6)
    b.axhline(0, c="grey", lw=1)
    b.set_xlabel("D")
    b.set_ylabel("residual (%)")
    return _save(fig, out / "lora_overhead.png")


def plot_loading(fit, out: Path) -> str:
    p = fit.plot
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=FIGSIZE)
    a.scatter(p["rank"], p["disk"], s=16, label="measured")
    ranks = sorted(p["disk_tab"])
    a.plot(ranks, [p["disk_tab"][r] for r in ranks], "k-", lw=1, label="table")
    a.set_xlabel("adapter rank")
    a.set_ylabel("disk -> CPU (ms per load)")
    a.legend(fontsize=7)
    if p["cpu"] is not None:
        b.scatter(p["rank"][p["diag"]], p["cpu"][p["diag"]], s=16, label="rank = max_lora_rank")
        b.scatter(p["rank"][~p["diag"]], p["cpu"][~p["diag"]], s=16, marker="^", label="smaller than slot")
    ranks = sorted(p["cpu_tab"])
    b.plot(ranks, [p["cpu_tab"][r] for r in ranks], "k-", lw=1, label="table")
    b.set_xlabel("adapter rank")
    b.set_ylabel("CPU -> GPU (ms per load)")
    b.legend(fontsize=7)
    return _save(fig, out / "loading.png")


# ---- markdown -----------------------------------------------------------------------------------
def _kv_line(name: str, s: dict[str, Any]) -> str:
    if not s.get("n"):
        return f"| {name} | 0 | - | - | - |"
    return (f"| {name} | {s['n']} | {100 * s['max_abs_rel_error']:.2f} % | "
            f"{100 * s['mean_abs_rel_error']:.2f} % | {100 * s['within_2pct']:.0f} % |")


def _memory_section(prof, fits, check) -> list[str]:
    mem = prof["fit"]["estimators"]["memory"]
    m = prof["memory"]
    lines = ["## Memory (MemorySpec)", "",
             f"Families: {', '.join('`' + f + '`' for f in mem['families'])}; {mem['n_kv_points']} KV "
             f"measurements + {mem['n_oom_constraints']} `gpu_oom` constraints, all at max_num_seqs "
             f"{mem['max_num_seqs_of_fit']}.", "",
             "| parameter | value | how |", "|---|---|---|",
             f"| weights_gib | {_fmt(m['weights_gib'])} | config.json parameter count x 2 B (not identifiable from KV alone) |",
             f"| non_kv_overhead_gib | {_fmt(m['non_kv_overhead_gib'])} | fitted (sum minus weights) |",
             f"| slot_fixed_mib | {_fmt(m['slot_fixed_mib'])} | fitted (>= 0) |",
             f"| slot_rank_scale | {_fmt(m['slot_rank_scale'])} | "
             + ("fitted: F-test p = %.2g; code value without embedding/lm_head LoRA = %.4f"
                % (mem["slot_rank_scale_test"]["p_value"], mem["slot_rank_scale_test"]["code_value_without_embedding_lora"])
                if mem["slot_rank_scale_test"]["fitted"] else
                "1.0 (free fit %.4f not significant, p = %.2g)"
                % (mem["slot_rank_scale_test"]["free_value"], mem["slot_rank_scale_test"]["p_value"])) + " |",
             "", f"Fit: R^2 = {mem['r2']}, max |relative KV error| = {100 * mem['max_abs_rel_kv_error']:.2f} %, "
             f"RMS = {100 * mem['rms_rel_kv_error']:.2f} %, violated OOM constraints = {mem['oom_constraints_violated']}.",
             "", "![memory](memory.png)", ""]
    term = fits.get("max_num_seqs_term")
    if term is not None:
        t = prof["fit"]["estimators"]["max_num_seqs_term"]
        r2 = f"R^2 {t['r2']}, " if "r2" in t else ""
        lines += ["### max_num_seqs", "",
                  f"From `{'`, `'.join(t['families'])}`: the non-KV memory grows by "
                  f"{_fmt(t['params']['slope_gib_per_1k_seqs'])} GiB per 1000 `max_num_seqs` above a knee of "
                  f"{_fmt(t['params']['knee_seqs'])} ({r2}n {t['n_points']}): the profiling run's "
                  "sampler tensors `[max_num_seqs, vocab]`. `non_kv_overhead_gib` is valid at "
                  f"max_num_seqs {mem['max_num_seqs_of_fit']}; `MemorySpec.overhead_gib_per_1k_seqs` and "
                  f"`seqs_knee` carry the change ({_fmt(t['overhead_vs_memory_family_gib'])} GiB between "
                  "the knee and that value)." + (f" {t['note']}." if "max_num_seqs_values" in t else ""), "",
                  "![max_num_seqs](memory_max_num_seqs.png)", ""]
    lines += ["### Memory check (all real runs of the model, validation families included; check only)", "",
              f"Start-up prediction (`Profile.startup_check`) on {check['n_runs']} runs with status ok/gpu_oom: "
              f"**accuracy {100 * check['accuracy']:.1f} %** (target >= 98 %); confusion {check['confusion']}.", "",
              "| family | start-up accuracy |", "|---|---|"]
    lines += [f"| `{f}` | {100 * a:.1f} % |" for f, a in check["accuracy_by_family"].items()]
    lines += ["", "KV capacity vs logged `gpu_kv_cache_tokens` / `gpu_kv_blocks*16` (target: within 2 %):", "",
              "| runs | n | max error | mean error | within 2 % |", "|---|---|---|---|---|",
              _kv_line("ok runs, all", check["kv_ok_runs"]),
              _kv_line(f"ok LoRA runs at max_num_seqs {check['calibrated_max_num_seqs']}",
                       check["kv_ok_runs_at_calibrated_max_num_seqs"]),
              _kv_line("gpu_oom runs (KV logged before refusal)", check["kv_gpu_oom_runs"])]
    lines += [_kv_line(f"ok runs, `{f}`", s) for f, s in check["kv_by_family_ok_runs"].items()]
    lines += [_kv_line(f"ok runs, max_num_seqs {s}", v) for s, v in check["kv_by_max_num_seqs_ok_runs"].items()]
    lines += ["", "Largest KV errors:", "", "| experiment | max_loras | rank | max_num_seqs | status | measured | predicted | error |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| `{w['experiment']}` | {w['max_loras']} | {w['max_lora_rank']} | {w['max_num_seqs']:.0f} | "
              f"{w['status']} | {w['measured']} | {w['predicted']} | {100 * w['rel_error']:+.1f} % |"
              for w in check["worst_kv"]]
    if check["misclassified"]:
        lines += ["", "Misclassified start-ups:", "", "| experiment | max_loras | rank | status | predicted KV | measured KV |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| `{w['experiment']}` | {w['max_loras']} | {w['max_lora_rank']} | {w['status']} | "
                  f"{w['predicted_kv']} | {w['measured_kv']} |" for w in check["misclassified"]]
    return lines + [""]


def _step_section(prof, fits) -> list[str]:
    est = prof["fit"]["estimators"]
    lat = prof["latency"]
    dec, pre, lora = est["step_decode"], est["step_prefill_per_token"], est["lora_overhead"]
    lines = ["## Step time (LatencySpec)", "",
             "`model_ms = (base + per_seq*n_seqs + per_token*(n_tokens - n_seqs) + per_ctx*ctx/1000) * factor(D)`; "
             "one step = scheduler_ms + loads + model_ms.", "",
             "### Decode: base_ms, per_seq_ms, per_ctx_ktoken_ms", "",
             f"Families: {', '.join('`' + f + '`' for f in dec['families'])} (n {dec['n_points']}). Target: {dec['target']}.", "",
             f"base_ms = {_fmt(lat['base_ms'])}, per_seq_ms = {_fmt(lat['per_seq_ms'])}, "
             f"per_ctx_ktoken_ms = {_fmt(lat['per_ctx_ktoken_ms'])}; R^2 = {dec['r2']}, "
             f"max |residual| = {100 * dec['max_abs_rel_error']:.1f} %.", "", "![decode](step_decode.png)", "",
             "### Prefill: per_token_ms", ""]
    if "per_request_overhead_ms" in pre:
        lines += [f"Family `{pre['families'][0]}` (n {pre['n_points']}): output-1 synthetic prompts sent at once. "
                  "`running_mean < 1` there only because each request lives one step, and the engine's "
                  "waiting queue was long, yet the durations carry a per-request cost the step model lacks "
                  "(HTTP front end / IPC). The run duration is regressed on the prefill tokens of the simulated "
                  "chunked-prefill steps (budget 2048) plus a per-request intercept; base/per_seq come from the "
                  "decode fit. Only the slope is identifiable as a step cost.", "",
                  f"per_token_ms = **{_fmt(lat['per_token_ms'])}** (R^2 {pre['r2']}); per-request intercept "
                  f"{_fmt(pre['per_request_overhead_ms'])} ms (not in the profile); naive duration slope "
                  f"{_fmt(pre['naive_duration_slope_ms_per_token'])} ms/token; independent cross-check from the "
                  f"vidur H100 kernel profile scaled by linear FLOPs: {_fmt(pre['vidur_cross_check_per_token_ms'])} ms/token.",
                  "", "![prefill](step_prefill.png)", ""]
    else:
        lines += [f"Not identifiable from this model's runs (V0: whole-prompt prefill steps interleaved with "
                  f"preemption). Taken from `{pre['families'][0]}` (this model's H100 kernel profile, linear ops, "
                  f"num_tokens >= 1024, R^2 {pre['r2']}): per_token_ms = **{_fmt(lat['per_token_ms'])}**. Attention "
                  "kernels are not in that file.", ""]
    lines += ["### LoRA factor: jump, slope, n_sat per max_lora_rank", "",
              f"Family `{lora['families'][0]}`. x = {lora['x_variable']}."
              + (f" Target: {lora['target']}." if "target" in lora else ""), "",
              "| max_lora_rank | jump | slope | n_sat | R^2 | n | n_sat F-test p | max abs residual |",
              "|---|---|---|---|---|---|---|---|"]
    for rank, p in lat["lora"].items():
        e = lora[f"rank_{rank}"]
        lines.append(f"| {rank} | {_fmt(p['jump'])} | {_fmt(p['slope'])} | {_fmt(p['n_sat'])} | {e['r2']:.4f} | "
                     f"{e['n_points']} | {_fmt(e['n_sat_test']['p_value'])} | {100 * e['max_abs_rel_error']:.1f} % |")
    lines += ["", "![lora](lora_overhead.png)", "",
              "### Scheduler", "", est["scheduler"]["note"] + ".", ""]
    return lines


def _loading_section(prof, fits) -> list[str]:
    ld = prof["fit"]["estimators"]["loading"]
    lines = ["## Loading (LoadingSpec)", "", f"Family `{ld['families'][0]}` (n {ld['n_points']}).", "",
             "| rank | disk -> CPU (ms) | CPU -> GPU (ms) |", "|---|---|---|"]
    ranks = sorted(set(prof["loading"]["disk_to_cpu_ms"]) | set(prof["loading"]["cpu_to_gpu_ms"]))
    for r in ranks:
        lines.append(f"| {r} | {_fmt(prof['loading']['disk_to_cpu_ms'].get(r, float('nan')))} | "
                     f"{_fmt(prof['loading']['cpu_to_gpu_ms'].get(r, float('nan')))} |")
    lines += ["", f"disk -> CPU: {ld['disk_to_cpu']}", "", f"CPU -> GPU: {ld['cpu_to_gpu']}", ""]
    if "cpu_to_gpu_off_diagonal_ms" in ld:
        lines += [f"CPU -> GPU with an adapter smaller than the slot (not representable; the table uses "
                  f"rank = max_lora_rank runs): {ld['cpu_to_gpu_off_diagonal_ms']}", ""]
    return lines + ["![loading](loading.png)", ""]


def write_report(report_dir: Path, entry, prof: dict[str, Any], fits: dict[str, Any], check: dict[str, Any]) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    for old in report_dir.glob("*.png"):
        old.unlink()
    plot_memory(fits["memory"], report_dir)
    plot_max_num_seqs(fits.get("max_num_seqs_term"), report_dir)
    plot_decode(fits["decode"], report_dir)
    plot_prefill(fits["prefill"], report_dir)
    plot_lora(fits["lora"], report_dir)
    plot_loading(fits["loading"], report_dir)
    fit = prof["fit"]
    lines = [f"# Calibration report: {prof['name']}", "",
             f"Model `{entry.csv_name}` ({entry.spec.name}), vLLM {entry.vllm_version} ({entry.engine} engine), "
             f"{entry.gpu.name} {fit['setup']['gpu_memory_gib']} GiB, util {fit['setup']['gpu_memory_utilization']}.", "",
             f"Command: `{fit['command']}`", "",
             f"Data: `{fit['data']['file']}` sha256 `{fit['data']['sha256']}`. Fitted only on estimator families "
             "(`digital_twin_dynamic/estimators/*`, `performance_analysis/*_overhead/*`); validation families are "
             "used only by the memory check.", ""]
    for note in fit.get("notes", []):
        lines += [f"Note: {note}", ""]
    lines += _memory_section(prof, fits, check)
    lines += _step_section(prof, fits)
    lines += _loading_section(prof, fits)
    path = report_dir / "fit_report.md"
    atomic_write_text(path, "\n".join(lines))
    return path
