"""First paper, Fig. 1 (second paper, Fig. 1): throughput against the served adapters rises, then
saturates or falls; the optimum (Max_pack, the crosses: the highest throughput still >= 0.9 x the
incoming tokens) moves with the adapter slots, the rates and the adapter sizes.

Real and ours: the committed fidelity replays (``experiments/fidelity/runs.csv``) of the bundled
real sweeps -- Llama-2-7B ``motivation_figure/with_slots`` (the paper's slots panel: rank 16, 0.0125
and 0.025 req/s per adapter, 12-384 slots, 5-minute runs) and the Llama-3.1-8B / Qwen-2.5-7B
``digital_twin_modelling`` sweeps -- and ``experiments/fidelity/max_pack.csv`` (per workload and
A_max: the real Max_pack and the twin's).  The paper's size / rate / output-length panels
(``motivation_figure/without_slots``) are plotted from the real runs only: the bundled log has no
per-adapter rates or durations for them, so they are not replayed.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.calibration.runs_csv import num
from .curves import load_runs

NAME = "p1_fig1_max_pack"
TITLE = "First paper Fig. 1 (the sweeps of second paper Fig. 1): throughput vs served adapters, Max_pack, twin vs real"
PAPER = "first"
QUICK = True

SLOTS_FAM = "motivation_figure/with_slots/llama-2-7b/loaded_adapters_rate_0.0125"
SLOTS_SHOWN = (12, 48, 120, 192, 384)
RHO = 0.9


def _panel_slots(ax, df: pd.DataFrame) -> None:
    g0 = df[df["experiment"] == SLOTS_FAM]
    for slots in SLOTS_SHOWN:
        g = g0[g0["max_loras"] == slots].sort_values("n_served_adapters")
        if not len(g):
            continue
        line = ax.plot(g["n_served_adapters"], g["real_throughput"], "o", label=f"real, {slots} slots")[0]
        ax.plot(g["n_served_adapters"], g["sharegpt_throughput"], "-", c=line.get_color())
        for col, mk in (("real_throughput", "x"), ("sharegpt_throughput", "+")):
            inc = g["real_incoming"] if col.startswith("real") else g["sharegpt_incoming"]
            ok = g[g[col] >= RHO * inc]
            if len(ok):
                b = ok.loc[ok[col].idxmax()]
                ax.plot(b["n_served_adapters"], b[col], mk, ms=13, mew=2, c=line.get_color())
    ax.set(xlabel="served adapters", ylabel="throughput (tok/s)",
           title="Llama-2-7B, 0.0125 req/s: real (dots, x) vs twin (lines, +)")
    ax.legend(fontsize=6)


def _panel_real(ax, raw: pd.DataFrame, fam: str, by: str, title: str) -> None:
    g0 = raw[raw["experiment"] == f"motivation_figure/without_slots/llama-2-7b/{fam}"]
    g0 = g0[g0["status"] == "ok"].copy()
    if by == "output_tokens":     # the log keeps the requested output length only in the run name
        g0[by] = pd.to_numeric(g0["run_name"].str.rsplit("_", n=1).str[-1], errors="coerce")
    keys = sorted(set(num(g0[by])[np.isfinite(num(g0[by]))]))
    for k in keys[:5]:
        g = g0[num(g0[by]) == k].sort_values("n_served_adapters")
        ax.plot(g["n_served_adapters"], num(g["input_throughput"]) + num(g["output_throughput"]), marker=".",
                label=f"{by} {k:g}")
    ax.set(xlabel="served adapters", ylabel="real throughput (tok/s)", title=title)
    ax.legend(fontsize=6)


def run(ctx: Context) -> Row:
    df = load_runs()
    mp = pd.read_csv(REPO / "experiments" / "fidelity" / "max_pack.csv")
    raw = pd.read_csv(REPO / "data" / "real_runs" / "real_runs_vllm_lora.csv", low_memory=False)
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    _panel_slots(axes[0], df)
    _panel_real(axes[1], raw, "varying_adapter_size", "max_lora_rank", "real: adapter size (rank)")
    _panel_real(axes[2], raw, "varying_arrival_rate", "request_rate_by_lora", "real: rate per adapter (req/s)")
    _panel_real(axes[3], raw, "varying_output_length", "output_tokens", "real: output length (tokens)")
    fig.tight_layout()
    figure = save_figure(fig, ctx)
    mp["family"] = mp["experiment"].str.split("/").str[0]
    mp["model"] = mp["experiment"].str.split("/").str[-2].where(mp["family"] == "digital_twin_modelling",
                                                                "llama-2-7b")
    rows, metrics = [], {}
    for model, g in mp.groupby("model"):
        g = g.dropna(subset=["real_max_pack", "twin_max_pack"])
        off = g["grid_steps_off"].abs()
        rows.append([model, len(g), int((off == 0).sum()), int((off <= 1).sum()), float(g["grid_steps_off"].mean()),
                     float(np.mean(np.abs(g["twin_max_pack"] - g["real_max_pack"]) / g["real_max_pack"]) * 100)])
        metrics[f"{model}.exact"] = float((off == 0).mean())
        metrics[f"{model}.within_one_step"] = float((off <= 1).mean())
    tot = [sum(r[i] for r in rows) for i in (1, 2, 3)]
    table = md_table(["model", "workloads x A_max", "Max_pack exact", "within one grid step", "mean steps off",
                      "mean abs error %"], rows)
    table += ("\nA workload = one real sweep of served adapters at one A_max; Max_pack = highest throughput >= 0.9 x "
              "incoming tokens (real: measured; twin: our replay of the same runs). Negative steps = the twin "
              "puts Max_pack at fewer adapters than the real system (conservative).\n")
    valid = mp.dropna(subset=["real_max_pack", "twin_max_pack"])
    under = int((valid["grid_steps_off"] < 0).sum())
    misses = int((valid["grid_steps_off"] != 0).sum())
    return Row(
        name=NAME, title=TITLE,
        paper_value="throughput rises then saturates or falls; the optimum (crosses) moves from tens to 300+ adapters with "
                    "rank, rate, output length and slots",
        ours=(f"twin Max_pack equals the real one on {tot[1]} of {tot[0]} sweeps and is within one grid step on "
              f"{tot[2]} (Llama-2 / Llama-3.1 / Qwen: {', '.join(f'{r[2]}/{r[1]}' for r in rows)} exact)"),
        real=f"{tot[0]} real sweeps (served adapters at one A_max) with a Max_pack; the shape holds in every panel",
        verdict="reproduced",
        why=(f"the real sweeps show the paper's rise-then-fall and moving optimum; our twin finds the same Max_pack or "
             f"the neighbouring grid point on {tot[2]} of {tot[0]} sweeps ({under} of {misses} misses on the conservative "
             f"side; Llama-2's 5-minute runs are the least exact); the size/rate/length "
             f"panels are real-only (not replayable from the bundled log)"),
        metrics=metrics, params={"source": "experiments/fidelity/runs.csv, max_pack.csv"},
        figure=figure, table_md=table)
