"""Second paper, Table 1 (first paper, Sec. 4.1): the twin's SMAPE against real vLLM runs.

Ours: the replays of ``lora-opt fidelity --out experiments/fidelity`` (its committed ``runs.csv``: every usable
1-hour ShareGPT run of Llama-3.1-8B and Qwen-2.5-7B, vLLM 0.8.5), on the report half no fit saw,
with two length inputs: ``sharegpt`` (lengths drawn from the fitted ShareGPT model, closest to the
paper's "Original") and ``mean`` (every request at the workload mean, the paper's "Mean").  The
published twin's own simulations of the same runs (``data/real_runs/peer_twin_validation.csv``)
are scored the same way: that is how we know the papers' percentages are SMAPE without the /2.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.smape import smape

NAME = "p2_table1_twin_smape"
TITLE = "Second paper Table 1 / first paper Sec. 4.1: twin SMAPE vs real vLLM"
PAPER = "second"
QUICK = True

RUNS = REPO / "experiments" / "fidelity" / "runs.csv"
MODELS = {"llama-3.1-8b-instruct": "Llama-3.1-8B", "qwen-2.5-7b-instruct": "Qwen-2.5-7B"}
METRICS = ("throughput", "itl_mean", "ttft_mean")
#: the papers' numbers (predictable arrivals).  Second paper Table 1: maxima over both models and
#: variants; first paper (its twin = the Mean variant): per model.
PAPER_MAX = {"throughput": 5.08, "itl_mean": 9.63, "ttft_mean": 18.95}
PAPER_FIRST = {("llama-3.1-8b-instruct", "throughput"): 4.2, ("qwen-2.5-7b-instruct", "throughput"): 5.1,
               ("llama-3.1-8b-instruct", "itl_mean"): 9.1, ("qwen-2.5-7b-instruct", "itl_mean"): 9.6,
               ("llama-3.1-8b-instruct", "ttft_mean"): 17.4, ("qwen-2.5-7b-instruct", "ttft_mean"): 17.9}


def _scores(df: pd.DataFrame) -> dict:
    out = {}
    for model in MODELS:
        rep = df[(df["model"] == model) & (df["half"] == "report")]
        peer = df[(df["model"] == model) & df["has_peer"].astype(bool)]
        for m in METRICS:
            real = f"real_{m}" if m != "throughput" else "real_throughput"
            out[(model, m)] = {
                "sharegpt": smape(rep[f"sharegpt_{m}"], rep[real]),
                "mean": smape(rep[f"mean_{m}"], rep[real]),
                "peer": smape(peer[f"peer_{m}"], peer[real]) if f"peer_{m}" in peer else float("nan"),
                "runs": len(rep), "peer_runs": len(peer)}
    return out


def _figure(scores: dict, ctx: Context) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, m in zip(axes, METRICS):
        x = np.arange(len(MODELS))
        for i, (label, key) in enumerate((("ours, ShareGPT lengths", "sharegpt"), ("ours, mean lengths", "mean"),
                                          ("published twin (same runs)", "peer"))):
            ax.bar(x + (i - 1.5) * 0.2, [scores[(mod, m)][key] / 2 for mod in MODELS], 0.2, label=label)
        ax.bar(x + 1.5 * 0.2, [PAPER_FIRST[(mod, m)] for mod in MODELS], 0.2, label="paper's quoted", color="k")
        ax.axhline(PAPER_MAX[m], ls="--", c="grey", lw=1)
        ax.set_xticks(x, list(MODELS.values()))
        ax.set_title(f"{m}: SMAPE, papers' scale (no /2)")
        ax.set_ylabel("%")
    axes[0].legend(fontsize=7)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    df = pd.read_csv(RUNS)
    s = _scores(df)
    rows, metrics = [], {}
    for (model, m), v in s.items():
        rows.append([MODELS[model], m, v["sharegpt"], v["sharegpt"] / 2, v["mean"] / 2, v["peer"], v["peer"] / 2,
                     PAPER_FIRST[(model, m)], PAPER_MAX[m]])
        for k in ("sharegpt", "mean", "peer"):
            metrics[f"{model}.{m}.{k}_full"] = v[k]
            metrics[f"{model}.{m}.{k}_half"] = v[k] / 2
    table = md_table(["model", "metric", "ours full scale", "ours papers' scale", "ours mean lengths, papers' scale",
                      "published twin full", "published twin papers' scale", "paper (first)", "paper max (second)"],
                     rows)
    table += ("\nOurs: report half (no fit saw it). Published twin: every run it simulated. Unpredictable "
              "arrivals (Table 1, right): the bundled data has no such real runs -- not reproducible.\n")
    L, Q = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"

    def pair(m, k="sharegpt", div=2):
        return f"{s[(L, m)][k] / div:.1f} / {s[(Q, m)][k] / div:.1f}"

    return Row(
        name=NAME, title=TITLE,
        paper_value="thr 4.2 / 5.1, ITL 9.1-9.6, TTFT 17.4-17.9 (max 5.08 / 9.63 / 18.95) % (Llama / Qwen)",
        ours=(f"papers' scale: thr {pair('throughput')}, ITL {pair('itl_mean')}, TTFT {pair('ttft_mean')} %; "
              f"full scale: thr {pair('throughput', div=1)}, ITL {pair('itl_mean', div=1)}, "
              f"TTFT {pair('ttft_mean', div=1)} %"),
        real=(f"published twin on the same runs, papers' scale: thr {pair('throughput', 'peer')}, "
              f"ITL {pair('itl_mean', 'peer')}, TTFT {pair('ttft_mean', 'peer')} %"),
        verdict="partly",
        why=(f"the papers' % is SMAPE without the factor 2 (their twin scores {pair('throughput', 'peer')} that "
             f"way here, their quoted 4.2 / 5.1); on that scale our throughput and ITL are at or below the quoted "
             f"numbers, TTFT with mean lengths ({pair('ttft_mean', 'mean')}) is above 17.4-17.9 (their twin: "
             f"{pair('ttft_mean', 'peer')}); unpredictable arrivals: no real runs bundled"),
        metrics=metrics, params={"source": "experiments/fidelity/runs.csv", "half": "report"},
        figure=_figure(s, ctx), table_md=table)
