"""Second paper, Fig. 11: GPUs needed and latency on a 4-GPU pool under increasing load (1,280
adapters, Azure traces), every policy against the baselines -- as their papers configure them and as
an operator would deploy them (A_max capped to what starts) -- over 3 seeds.

Ours: the committed outputs of ``python experiments/azure_placement.py`` (seed 0) and ``--seed 1/2
--out experiments/azure_placement_seed1/2`` (Llama-3.1-8B profile, twin replay of the second half
hour).  Savings against a baseline are per cell where both serve every adapter without starving or
failing GPUs, averaged per seed; the spread is over the 3 seeds.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure

NAME = "p2_fig11_azure"
TITLE = "Second paper Fig. 11: GPUs and latency on 4 GPUs, Azure traces, 3 seeds, both baseline variants"
PAPER = "second"
QUICK = True

SEED_DIRS = {0: "azure_placement", 1: "azure_placement_seed1", 2: "azure_placement_seed2"}
POLICIES = ("greedy-plus", "greedy-plus-rho", "greedy", "greedy-fast", "dlora", "dlora-capped",
            "loraserve", "loraserve-capped")
CAPPED = ("dlora-capped", "loraserve-capped")
POOL = 4


def load() -> pd.DataFrame:
    frames = []
    for seed, d in SEED_DIRS.items():
        df = pd.read_csv(REPO / "experiments" / d / "results.csv")
        df["seed"] = seed
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def _per_policy(df: pd.DataFrame) -> list[dict]:
    out = []
    for pol in POLICIES:
        g = df[df["policy"] == pol]
        per_seed = g.groupby("seed")
        ok = g[g["served_ok"].astype(bool)]
        gpus_seed = per_seed["gpus"].mean()
        out.append({
            "policy": pol, "cells_served": f"{int(g['served_ok'].sum())}/{len(g)}",
            "gpus_mean": float(gpus_seed.mean()), "gpus_spread": float(gpus_seed.max() - gpus_seed.min()),
            "gpus_std_cells": float(g["gpus"].std()),
            "starving_gpus": int(g["gpus_starving"].sum()), "failing_gpus": int(g["gpus_oom"].sum()),
            "ttft_p99_mean_ms": float(ok["ttft_p99_ms"].mean()) if len(ok) else float("nan"),
            "ttft_p99_worst_ms": float(ok["ttft_p99_ms"].max()) if len(ok) else float("nan"),
            "itl_mean_ms": float(ok["itl_mean_ms"].mean()) if len(ok) else float("nan")})
    return out


def _savings(df: pd.DataFrame, ours: str, base: str) -> tuple[float, float, int]:
    """GPUs saved by ``ours`` against ``base`` on cells both serve: mean of per-seed means, spread, cells."""
    key = ["seed", "trace", "ranks", "load_req_s"]
    a = df[(df["policy"] == ours) & df["served_ok"].astype(bool)].set_index(key)["gpus"]
    b = df[(df["policy"] == base) & df["served_ok"].astype(bool)].set_index(key)["gpus"]
    both = a.index.intersection(b.index)
    if not len(both):
        return float("nan"), float("nan"), 0
    saved = (b.loc[both] - a.loc[both]).groupby(level="seed").mean()
    return float(saved.mean()), float(saved.max() - saved.min()), len(both)


def _figure(df: pd.DataFrame, ctx: Context) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for pol in ("greedy-plus", "greedy-plus-rho", "dlora-capped", "loraserve-capped", "dlora"):
        g = df[df["policy"] == pol].groupby("load_req_s")
        m = g["gpus"].mean()
        axes[0].errorbar(m.index, m.values, yerr=[m - g["gpus"].min(), g["gpus"].max() - m], label=pol,
                         capsize=3, marker="o")
        ok = df[(df["policy"] == pol) & df["served_ok"].astype(bool)].groupby("load_req_s")
        if len(ok):
            axes[1].plot(ok["itl_mean_ms"].mean(), marker="o", label=pol)
            axes[2].plot(ok["ttft_p99_ms"].mean() / 1e3, marker="o", label=pol)
    axes[0].set(xlabel="load (req/s)", ylabel="GPUs used (mean, min-max over cells)", title="GPUs")
    axes[1].set(xlabel="load (req/s)", ylabel="mean ITL (ms)", title="ITL, served cells")
    axes[2].set(xlabel="load (req/s)", ylabel="p99 TTFT (s)", title="p99 TTFT, served cells", yscale="log")
    axes[0].legend(fontsize=7)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    df = load()
    pols = _per_policy(df)
    by = {p["policy"]: p for p in pols}
    table = md_table(["policy", "cells served (3 seeds)", "GPUs used (mean over cells)", "spread of the seed means", "starving GPUs",
                      "GPUs failing to start", "p99 TTFT mean (ms)", "p99 TTFT worst (ms)", "mean ITL (ms)"],
                     [[p["policy"], p["cells_served"], p["gpus_mean"], p["gpus_spread"], p["starving_gpus"],
                       p["failing_gpus"], p["ttft_p99_mean_ms"], p["ttft_p99_worst_ms"], p["itl_mean_ms"]]
                      for p in pols])
    metrics, sav_rows = {}, []
    for ours in ("greedy-plus", "greedy-plus-rho"):
        for base in CAPPED:
            mean, spread, n = _savings(df, ours, base)
            sav_rows.append([ours, base, n, mean, spread])
            metrics[f"saved.{ours}.vs.{base}"] = mean
            metrics[f"saved_spread.{ours}.vs.{base}"] = spread
    table += "\nGPUs saved on cells both serve (mean of the 3 seeds' means; spread = max - min over seeds):\n\n"
    table += md_table(["ours", "baseline", "cells", "GPUs saved", "spread"], sav_rows)
    for p in pols:
        for k in ("gpus_mean", "gpus_spread", "starving_gpus", "failing_gpus", "ttft_p99_mean_ms", "itl_mean_ms"):
            metrics[f"{p['policy']}.{k}"] = float(p[k])
    gp, rho, dc, lc = by["greedy-plus"], by["greedy-plus-rho"], by["dlora-capped"], by["loraserve-capped"]
    s_d = metrics["saved.greedy-plus.vs.dlora-capped"]
    s_l = metrics["saved.greedy-plus.vs.loraserve-capped"]
    s_rho = POOL - rho["gpus_mean"]
    return Row(
        name=NAME, title=TITLE,
        paper_value="baselines always 4 GPUs; Proposed saves 2.4 of 4 on average (60 %), with worse ITL",
        ours=(f"papers' criterion (greedy-plus-rho): {rho['gpus_mean']:.2f} GPUs (saves {s_rho:.2f}, "
              f"{rho['starving_gpus']} starving GPUs, p99 TTFT worst {rho['ttft_p99_worst_ms'] / 1e3:.0f} s); default "
              f"greedy-plus {gp['gpus_mean']:.2f} +- {gp['gpus_spread']:.2f} GPUs, saves {s_d:.2f} / {s_l:.2f} vs "
              f"dLoRA / LoRAServe capped; p99 TTFT {gp['ttft_p99_mean_ms']:.0f} vs {dc['ttft_p99_mean_ms']:.0f} / "
              f"{lc['ttft_p99_mean_ms']:.0f} ms, ITL {gp['itl_mean_ms']:.1f} vs {dc['itl_mean_ms']:.1f} / "
              f"{lc['itl_mean_ms']:.1f} ms"),
        real="no real multi-GPU runs bundled (twin replay only)",
        verdict="partly",
        why=(f"the 2.4-GPU saving is reproduced only under the papers' starvation criterion (p99 TTFT up to "
             f"minutes); the paper-configured baselines fail to start ({by['dlora']['failing_gpus']} dLoRA, "
             f"{by['loraserve']['failing_gpus']} LoRAServe GPUs of 240); against operator-capped ones our default "
             f"saves {(s_d + s_l) / 2:.2f} GPUs, measured, at about twice their p99 TTFT and 1.4x their ITL"),
        metrics=metrics, params={"seeds": "0,1,2", "source": ",".join(SEED_DIRS.values()), "pool": POOL},
        figure=_figure(df, ctx), table_md=table)
