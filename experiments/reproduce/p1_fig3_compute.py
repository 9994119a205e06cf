"""First paper, Fig. 3 (second paper, Fig. 5): compute overhead -- step time (ITL) against the
distinct adapters in the batch, a large jump from no adapter to one, then a slow linear rise.

Real: ``digital_twin_dynamic/estimators/predictor_latency_overhead`` (vLLM 0.8.5, batch ~210, 300
slots of rank 8; no-LoRA points from ``initial_points_small``).  Ours: the calibrated profile's step
model at the runs' batch, context and expected distinct adapters (the calibration's hypergeometric
estimate).  The LoRA factor is FITTED on these runs, so the agreement is in-sample; what is tested
is the shape the papers claim (linear in distinct adapters, a jump at 1, rank-independent).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.calibration.model_table import MODEL_PROFILES
from lora_opt.calibration.runs_csv import num, per_request_lengths
from lora_opt.calibration.step_fit import decode_ctx_per_seq, expected_distinct_adapters
from twin.profile import load_profile

NAME = "p1_fig3_compute"
TITLE = "First paper Fig. 3 / second paper Fig. 5: compute overhead vs distinct adapters in the batch"
PAPER = "first"
QUICK = True

MODELS = ("llama-3.1-8b-instruct", "qwen-2.5-7b-instruct")
FAM = "digital_twin_dynamic/estimators/predictor_latency_overhead/{m}/"


def points(df: pd.DataFrame, model: str) -> pd.DataFrame:
    """Real mean ITL and the profile's step time per run (no-LoRA runs: D = 0)."""
    rows = df[(df["model"] == model) & df["experiment"].str.startswith(FAM.format(m=model))
              & df["experiment"].str.endswith("/output") & (df["status"] == "ok")]
    prof = load_profile(MODEL_PROFILES[model])
    b = num(rows["running_mean"])
    inp, out = per_request_lengths(rows)
    ctx = b * decode_ctx_per_seq(inp, out)
    lora = num(rows["enable_lora"]) == 1
    served = np.nan_to_num(num(rows["n_served_adapters"]), nan=0.0)
    dist = np.where(lora, expected_distinct_adapters(np.maximum(served, 1), b, num(rows["num_prompts"])), 0.0)
    rank = np.nan_to_num(num(rows["max_lora_rank"]), nan=8).astype(int)
    slots = np.nan_to_num(num(rows["max_loras"]), nan=0).astype(int)
    pred = [prof.latency.model_ms(int(round(bb)), int(round(bb)), int(c), int(round(d)) if d > 0 else 0, int(r), int(s))
            + prof.latency.scheduler_ms(int(round(bb)), 0) for bb, c, d, r, s in zip(b, ctx, dist, rank, slots)]
    return pd.DataFrame({"served": np.where(lora, served, 0), "distinct": dist, "batch": b, "output": out,
                         "itl_real": num(rows["mean_itl_ms"]), "itl_pred": pred})


def _figure(data: dict, ctx: Context) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (model, d) in zip(axes, data.items()):
        d = d.sort_values("distinct")
        base = d[d["distinct"] == 0]["itl_real"].mean()
        ax.plot(d["distinct"], d["itl_real"] / base, "o", label="real")
        ax.plot(d["distinct"], d["itl_pred"] / base, "-", label="profile")
        ax.set(xlabel="distinct adapters in the batch (expected)", ylabel="ITL / no-LoRA ITL", title=model)
        ax.legend(fontsize=8)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    df = pd.read_csv(REPO / "data" / "real_runs" / "real_runs_vllm_lora.csv", low_memory=False)
    data = {m: points(df, m) for m in MODELS}
    rows, metrics = [], {}
    for m, d in data.items():
        err = np.abs(d["itl_pred"] / d["itl_real"] - 1) * 100
        no, one, top = d[d["served"] == 0], d[d["served"] == 1], d[d["served"] == d["served"].max()]
        vals = [no["itl_real"].mean(), one["itl_real"].mean(), top["itl_real"].mean(),
                no["itl_pred"].mean(), one["itl_pred"].mean(), top["itl_pred"].mean()]
        rows.append([m, len(d), *vals, float(err.median()), float(err.max())])
        metrics.update({f"{m}.itl_err_median_pct": float(err.median()), f"{m}.itl_err_max_pct": float(err.max()),
                        f"{m}.real_jump_ratio": vals[1] / vals[0], f"{m}.pred_jump_ratio": vals[4] / vals[3],
                        f"{m}.real_top_ratio": vals[2] / vals[0], f"{m}.pred_top_ratio": vals[5] / vals[3]})
    table = md_table(["model", "runs", "real ITL no LoRA (ms)", "real 1 adapter", "real 300 adapters",
                      "profile no LoRA", "profile 1 adapter", "profile 300 adapters", "median abs error %",
                      "max abs error %"], rows)
    table += ("\nBatch ~210 (max_num_seqs 220), 300 slots of rank 8, outputs of 100 and 200 tokens. The LoRA factor "
              "is fitted on these runs (in-sample). Llama-2-7B's compute-overhead family (vLLM 0.5.0) is fitted by "
              "the same calibration: experiments/calibration/llama-2-7b-h100-64gb/lora_overhead.png.\n")
    L = rows[0]
    return Row(
        name=NAME, title=TITLE,
        paper_value="0 -> 1 adapter is the largest jump, then ITL rises linearly (sub-proportionally) with distinct "
                    "adapters; rank matters little",
        ours=(f"profile ITL (Llama-3.1-8B, batch ~210): {L[5]:.1f} / {L[6]:.1f} / {L[7]:.1f} ms at 0 / 1 / 300 "
              f"adapters; median abs error {rows[0][8]:.1f} / {rows[1][8]:.1f} % (Llama / Qwen, in-sample)"),
        real=(f"Llama-3.1-8B: {L[2]:.1f} / {L[3]:.1f} / {L[4]:.1f} ms (x{L[3] / L[2]:.2f} for the first adapter, "
              f"x{L[4] / L[2]:.2f} at 300); Qwen-2.5-7B: x{rows[1][3] / rows[1][2]:.2f} / x{rows[1][4] / rows[1][2]:.2f}"),
        verdict="reproduced",
        why=("the real runs show the papers' shape (a ~2x jump at the first adapter, then linear) and the profile's "
             "linear factor in expected distinct adapters follows them; in-sample fit, rank 8 only at 0.8.5 (no "
             "rank 16/32 overhead runs bundled)"),
        metrics=metrics, params={"family": FAM.format(m="*")}, figure=_figure(data, ctx), table_md=table)
