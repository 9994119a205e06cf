"""First paper, Fig. 2 (second paper, Fig. 4): memory overhead -- as more LoRA slots are reserved,
the KV cache and the batch shrink, throughput falls, and past a point vLLM cannot start; and (second
paper Fig. 4 right) ITL grows linearly with the batch size, measured on the same real runs.

Real: the bundled measurements (``performance_analysis/memory_overhead/llama-2-7b``, vLLM 0.5.0;
``digital_twin_dynamic/estimators/find_available_gpu_memory...`` for Llama-3.1-8B and Qwen-2.5-7B,
vLLM 0.8.5): logged KV tokens, mean batch, throughput, ``gpu_oom`` status.  Ours: the calibrated
profile's memory model (KV tokens and the start-up check).  These families are the ones the memory
model is FITTED on, so the KV agreement is in-sample; the start-up verdict is also checked on every
other real run of the model (validation families), which no fit saw.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.calibration.model_table import MODEL_PROFILES
from lora_opt.calibration.runs_csv import measured_kv_tokens, num, startup_config
from twin.flags import EngineFlags
from twin.profile import load_profile

NAME = "p1_fig2_memory"
TITLE = ("First paper Fig. 2 / second paper Fig. 4: memory overhead (KV cache, batch, throughput vs LoRA slots; "
         "OOM frontier; ITL vs batch size)")
PAPER = "first"
QUICK = True

FAMILIES = {"llama-2-7b": "performance_analysis/memory_overhead/llama-2-7b",
            "llama-3.1-8b-instruct": "digital_twin_dynamic/estimators/find_available_gpu_memory",
            "qwen-2.5-7b-instruct": "digital_twin_dynamic/estimators/find_available_gpu_memory"}
MML = {"llama-2-7b": 4096}          # vLLM 0.5.0 runs: Llama-2's own context length


def predict(rows: pd.DataFrame, model: str) -> pd.DataFrame:
    """Per run: measured and predicted KV tokens, real status and predicted start-up."""
    prof = load_profile(MODEL_PROFILES[model])
    util, mnbt, n_loras, ranks = startup_config(rows, prof)
    seqs = num(rows["max_num_seqs"])
    kv_pred, starts = [], []
    for u, b, n, r, s in zip(util, mnbt, n_loras, ranks, seqs):
        s = int(s) if np.isfinite(s) else None
        kv_pred.append(prof.kv_capacity_tokens(int(n), int(r), float(u), int(b), enable_lora=n > 0, max_num_seqs=s))
        starts.append(prof.startup_check(EngineFlags(max_loras=int(n), max_lora_rank=int(r), max_num_seqs=s,
                                                     max_num_batched_tokens=int(b), gpu_memory_utilization=float(u),
                                                     max_model_len=MML.get(model)))[0])
    out = rows.loc[:, ["experiment", "max_loras", "max_lora_rank", "status", "running_mean"]].copy()
    out["itl_mean"] = num(rows["mean_itl_ms"])
    out["throughput"] = num(rows["input_throughput"]) + num(rows["output_throughput"])
    out["kv_real"] = measured_kv_tokens(rows)
    out["kv_pred"] = kv_pred
    out["starts_pred"] = starts
    return out


def frontier(d: pd.DataFrame) -> list[list]:
    """Per (dataset, rank): largest slots that started and smallest that OOMed, real vs predicted."""
    rows = []
    for (exp, rank), g in d[d["status"].isin(["ok", "gpu_oom"])].groupby(["experiment", "max_lora_rank"]):
        ok = g[g["status"] == "ok"]["max_loras"]
        oom = g[g["status"] == "gpu_oom"]["max_loras"]
        pred_ok = g[g["starts_pred"]]["max_loras"]
        rows.append([exp.rsplit("/", 1)[-1], int(rank), ok.max() if len(ok) else np.nan,
                     oom.min() if len(oom) else np.nan, pred_ok.max() if len(pred_ok) else np.nan])
    return rows


def itl_vs_batch(d: pd.DataFrame) -> list[list]:
    """Second paper Fig. 4 right: per dataset, the least-squares line mean ITL = slope x mean batch
    + intercept over the runs that started (every rank and slot count), its R^2 and the runs."""
    rows = []
    for exp, g in d[(d["status"] == "ok") & np.isfinite(d["itl_mean"]) & np.isfinite(d["running_mean"])].groupby("experiment"):
        x, y = g["running_mean"].to_numpy(float), g["itl_mean"].to_numpy(float)
        slope, icept = np.polyfit(x, y, 1)
        r2 = 1.0 - float(np.sum((y - (slope * x + icept)) ** 2)) / float(np.sum((y - y.mean()) ** 2))
        rows.append([exp.rsplit("/", 1)[-1], len(g), float(slope), float(icept), r2])
    return rows


def _figure(d: pd.DataFrame, ctx: Context) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    g0 = d[d["experiment"].str.endswith("mean_dataset")]
    for rank, g in g0.groupby("max_lora_rank"):
        g = g.sort_values("max_loras")
        ok, oom = g[g["status"] == "ok"], g[g["status"] == "gpu_oom"]
        line = axes[0].plot(ok["max_loras"], ok["throughput"], marker="o", label=f"rank {int(rank)}")[0]
        if len(oom):
            axes[0].plot(oom["max_loras"].min(), 0, "x", ms=12, c=line.get_color())
        axes[1].plot(ok["max_loras"], ok["running_mean"], marker="o", c=line.get_color())
        axes[2].plot(g["max_loras"], g["kv_real"], "o", c=line.get_color(), label=f"real, rank {int(rank)}")
        axes[2].plot(g["max_loras"], np.maximum(g["kv_pred"], 0), "-", c=line.get_color(), label="profile")
    axes[0].set(xlabel="LoRA slots (max_loras)", ylabel="real throughput (tok/s)",
                title="Llama-2-7B, real (x = first OOM)")
    axes[1].set(xlabel="LoRA slots", ylabel="real mean batch", title="real batch size")
    axes[2].set(xlabel="LoRA slots", ylabel="KV tokens", title="KV capacity: real vs profile")
    ok = d[(d["status"] == "ok") & np.isfinite(d["itl_mean"])]
    for (exp, g), (name, _n, slope, icept, _r2) in zip(ok.groupby("experiment"), itl_vs_batch(d)):
        pts = axes[3].plot(g["running_mean"], g["itl_mean"], "o", ms=4, label=name)[0]
        xs = np.linspace(0, g["running_mean"].max(), 20)
        axes[3].plot(xs, slope * xs + icept, "-", c=pts.get_color(), lw=1)
    axes[3].set(xlabel="real mean batch (running)", ylabel="real mean ITL (ms)", title="ITL vs batch size (lines: fits)")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=6, ncol=2)
    axes[3].legend(fontsize=7)
    return save_figure(fig, ctx)


def _validation_accuracy(df: pd.DataFrame, model: str) -> tuple[float, int]:
    """Start-up accuracy on the model's runs outside the fitted family (status ok / gpu_oom)."""
    v = df[(df["model"] == model) & df["status"].isin(["ok", "gpu_oom"])
           & ~df["experiment"].str.startswith(FAMILIES[model])]
    if not len(v):
        return float("nan"), 0
    p = predict(v, model)
    return float(np.mean(p["starts_pred"] == (p["status"] == "ok"))), len(p)


def run(ctx: Context) -> Row:
    df = pd.read_csv(REPO / "data" / "real_runs" / "real_runs_vllm_lora.csv", low_memory=False)
    metrics, summary, front_rows, fig_data = {}, [], [], None
    for model, fam in FAMILIES.items():
        rows = df[(df["model"] == model) & df["experiment"].str.startswith(fam)]
        d = predict(rows, model)
        ok = d[(d["status"] == "ok") & (d["kv_real"] > 0)]
        err = np.abs(ok["kv_pred"] - ok["kv_real"]) / ok["kv_real"] * 100
        s = d[d["status"].isin(["ok", "gpu_oom"])]
        acc = float(np.mean(s["starts_pred"] == (s["status"] == "ok")))
        vacc, vn = _validation_accuracy(df, model)
        summary.append([model, len(ok), float(err.median()), float(err.max()), acc, vacc, vn])
        metrics.update({f"{model}.kv_err_median_pct": float(err.median()), f"{model}.kv_err_max_pct": float(err.max()),
                        f"{model}.startup_acc_fit_family": acc, f"{model}.startup_acc_validation": vacc})
        front_rows += [[model] + r for r in frontier(d)]
        if model == "llama-2-7b":
            fig_data = d
    table = md_table(["model", "ok runs", "KV error median %", "KV error max %", "start-up accuracy (fitted family)",
                      "start-up accuracy (other families)", "other runs"], summary)
    table += "\nOOM frontier per dataset and rank (LoRA slots):\n\n" + md_table(
        ["model", "dataset", "rank", "real: largest that started", "real: smallest OOM", "profile: largest that starts"],
        front_rows)
    l2 = [r for r in front_rows if r[0] == "llama-2-7b" and r[1] == "mean_dataset"]
    real_f = ", ".join(f"r{r[2]} {r[3]:.0f}-{r[4]:.0f}" for r in l2)
    pred_f = ", ".join(f"r{r[2]} {r[5]:.0f}" for r in l2)
    g = fig_data[(fig_data["experiment"].str.endswith("mean_dataset")) & (fig_data["max_lora_rank"] == 8)
                 & (fig_data["status"] == "ok")].sort_values("max_loras")
    drop = 1 - g["throughput"].iloc[-1] / g["throughput"].iloc[0]
    worst_v = min(r[5] for r in summary)
    exact = [r for r in front_rows if r[3] == r[5]]
    off = [r for r in front_rows if r[3] != r[5]]
    off_txt = "; ".join(f"{r[0]} {r[1]} r{r[2]}: {r[5]:.0f} vs {r[3]:.0f}" for r in off)
    metrics["frontier_exact_cells"] = len(exact)
    metrics["frontier_cells"] = len(front_rows)
    itl = itl_vs_batch(fig_data)
    for name, _n, slope, icept, r2 in itl:
        metrics.update({f"itl_vs_batch.{name}.slope_ms": slope, f"itl_vs_batch.{name}.intercept_ms": icept,
                        f"itl_vs_batch.{name}.r2": r2})
    table += "\nITL vs batch size (Llama-2-7B real runs that started; least squares, second paper Fig. 4 right):\n\n" + md_table(
        ["dataset", "runs", "ms per running request", "intercept ms", "R^2"], itl)
    itl_txt = "; ".join(f"{n}: {sl:.2f} ms/request + {ic:.1f} ms, R^2 {r2:.3f}" for n, _k, sl, ic, r2 in itl)
    return Row(
        name=NAME, title=TITLE,
        paper_value="batch falls linearly with loaded adapters, throughput falls faster near the end; crosses where "
                    "no memory is left (Llama-2-7B/13B, ranks 8-32); ITL linear in the batch size",
        ours=(f"profile OOM frontier (Llama-2-7B, mean dataset, slots) {pred_f}; KV error median "
              f"{'/'.join(f'{r[2]:.1f}' for r in summary)} % (Llama-2 / Llama-3.1 / Qwen, in-sample); start-up "
              f"verdict right on >= {worst_v * 100:.1f} % of the {sum(r[6] for r in summary)} other real runs"),
        real=(f"started-OOM frontier {real_f}; rank-8 throughput falls {drop * 100:.0f} % from 1 to "
              f"{g['max_loras'].iloc[-1]:.0f} slots while the batch shrinks linearly; ITL vs batch {itl_txt}"),
        verdict="reproduced",
        why=(f"the real runs show the paper's shape (linear batch loss, steep throughput loss near the frontier); "
             f"the profile's frontier equals the real one on {len(exact)} of {len(front_rows)} cells ({off_txt}); "
             f"KV is in-sample, the start-up verdict on other families is out of sample; ITL is linear in the batch "
             f"on the real runs (R^2 >= {min(r[4] for r in itl):.2f})"),
        metrics=metrics, params={"families": ";".join(sorted(set(FAMILIES.values())))},
        figure=_figure(fig_data, ctx), table_md=table)
