"""First paper, Fig. 4 (second paper, Fig. 6): adapter loading cost relative to the request's decode
latency (TPOT x (output - 1)), from disk and from CPU memory, for three request lengths.

Real: ``performance_analysis/loading_overhead/latency/llama-2-7b`` (vLLM 0.5.0; the disk->CPU load
logged at 0.1 s resolution; CPU->GPU below that resolution, not identifiable) and
``digital_twin_dynamic/estimators/predictor_loading`` (vLLM 0.8.5, Llama-3.1-8B / Qwen-2.5-7B: per-load
times from disk and from CPU memory).  Ours: the calibrated profiles' loading tables (fitted on these
families: in-sample), divided by the real runs' decode latency.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.calibration.model_table import MODEL_PROFILES
from lora_opt.calibration.runs_csv import num
from twin.profile import load_profile

NAME = "p1_fig4_loading"
TITLE = "First paper Fig. 4: adapter loading cost relative to request latency, disk vs CPU"
PAPER = "first"
QUICK = True

L2_FAM = "performance_analysis/loading_overhead/latency/llama-2-7b/"
V1_FAM = "digital_twin_dynamic/estimators/predictor_loading/"


def llama2_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Per (dataset, rank): decode latency and the load costs relative to it, real and profile."""
    rows = df[df["experiment"].str.startswith(L2_FAM) & (df["status"] == "ok")].copy()
    prof = load_profile(MODEL_PROFILES["llama-2-7b"])
    out_tok = num(rows["total_output_tokens"]) / num(rows["completed"])
    rows["latency_ms"] = num(rows["mean_tpot_ms"]) * (out_tok - 1)
    rows["out_tokens"] = out_tok
    rows["disk_real_ms"] = num(rows["lora_loading_time_s"]) * 1e3
    rows["dataset_name"] = rows["experiment"].str.rsplit("/", n=1).str[-1]
    out = []
    for (ds, rank), g in rows.groupby(["dataset_name", "max_lora_rank"]):
        lat = g["latency_ms"].mean()
        disk_real = g["disk_real_ms"].dropna()
        out.append({"dataset": ds, "rank": int(rank), "out_tokens": g["out_tokens"].mean(), "latency_ms": lat,
                    "disk_real_pct": 100 * disk_real.mean() / lat if len(disk_real) else np.nan,
                    "disk_profile_pct": 100 * prof.loading.disk_ms(int(rank)) / lat,
                    "cpu_profile_pct": 100 * prof.loading.cpu_ms(int(rank)) / lat})
    return pd.DataFrame(out)


def v1_loads(df: pd.DataFrame) -> list[list]:
    """Per (model, rank): measured per-load time from disk and from CPU vs the profile's."""
    rows = df[df["experiment"].str.startswith(V1_FAM) & (df["status"] == "ok")]
    out = []
    for (model, rank), g in rows.groupby(["model", "max_lora_rank"]):
        prof = load_profile(MODEL_PROFILES[model])
        disk = (num(g["adapter_load_time_from_disk_s"]) / num(g["adapter_loads_from_disk"])).mean() * 1e3
        cpu = (num(g["adapter_load_time_from_memory_s"]) / num(g["adapter_loads_from_memory"])).mean() * 1e3
        out.append([model, int(rank), disk, prof.loading.disk_ms(int(rank)), cpu, prof.loading.cpu_ms(int(rank)),
                    100 * cpu / float(num(g["mean_tpot_ms"]).mean())])
    return out


def _figure(r: pd.DataFrame, ctx: Context) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    order = ["p25_dataset", "mean_dataset", "p75_dataset"]
    for rank, g in r.groupby("rank"):
        g = g.set_index("dataset").loc[order]
        line = axes[0].plot(order, g["disk_profile_pct"], "-", label=f"profile, rank {rank}")[0]
        axes[0].plot(order, g["disk_real_pct"], "o", c=line.get_color(), label=f"real, rank {rank}")
        axes[1].plot(order, g["cpu_profile_pct"], "-o", c=line.get_color(), label=f"profile, rank {rank}")
    axes[0].set(ylabel="load / request decode latency (%)", title="from disk (Llama-2-7B)")
    axes[1].set(ylabel="load / request decode latency (%)", title="from CPU memory (profile)")
    for ax in axes:
        ax.legend(fontsize=7)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    df = pd.read_csv(REPO / "data" / "real_runs" / "real_runs_vllm_lora.csv", low_memory=False)
    r = llama2_ratios(df)
    v1 = v1_loads(df)
    table = md_table(["dataset", "rank", "output tokens", "decode latency (ms)", "disk real %", "disk profile %",
                      "CPU profile %"],
                     [[x["dataset"], x["rank"], x["out_tokens"], x["latency_ms"], x["disk_real_pct"],
                       x["disk_profile_pct"], x["cpu_profile_pct"]] for _, x in r.iterrows()])
    table += "\nPer load, vLLM 0.8.5 (ms):\n\n" + md_table(
        ["model", "rank", "disk real", "disk profile", "CPU real", "CPU profile", "CPU load / TPOT %"], v1)
    short = r[r["dataset"] == "p25_dataset"]
    long_ = r[r["dataset"] == "p75_dataset"]
    disk_v1 = np.array([x[2] for x in v1])
    cpu_v1 = np.array([x[4] for x in v1])
    metrics = {"cpu_pct_short_min": float(short["cpu_profile_pct"].min()),
               "cpu_pct_short_max": float(short["cpu_profile_pct"].max()),
               "cpu_pct_long_max": float(long_["cpu_profile_pct"].max()),
               "disk_real_pct_max": float(r["disk_real_pct"].max()),
               "disk_profile_pct_max": float(r["disk_profile_pct"].max()),
               "disk_over_cpu_v1_min": float((disk_v1 / cpu_v1).min()),
               "disk_over_cpu_v1_max": float((disk_v1 / cpu_v1).max())}
    return Row(
        name=NAME, title=TITLE,
        paper_value="CPU loads add 7-16 % to short requests, < 2 % to long ones; disk up to ~80 %; disk much slower than CPU",
        ours=(f"profile (Llama-2-7B): CPU {metrics['cpu_pct_short_min']:.1f}-{metrics['cpu_pct_short_max']:.1f} % of a "
              f"short (27-token) request, <= {metrics['cpu_pct_long_max']:.1f} % of a long one; disk up to "
              f"{metrics['disk_profile_pct_max']:.0f} %"),
        real=(f"disk (Llama-2-7B, 0.1 s resolution) up to {metrics['disk_real_pct_max']:.0f} % of a short request; "
              f"vLLM 0.8.5 per load: disk {disk_v1.min():.0f}-{disk_v1.max():.0f} ms, CPU {cpu_v1.min():.1f}-"
              f"{cpu_v1.max():.1f} ms ({metrics['disk_over_cpu_v1_min']:.0f}-{metrics['disk_over_cpu_v1_max']:.0f}x)"),
        verdict="partly",
        why=(f"disk reproduced (real and profile reach {metrics['disk_real_pct_max']:.0f} / "
             f"{metrics['disk_profile_pct_max']:.0f} % of a short request, < 7 % of long ones); CPU differs: the paper's "
             f"7-16 % implies ~40-90 ms per CPU load on vLLM 0.5.0, which the bundled log cannot resolve (0.1 s), so "
             f"the profile uses vLLM 0.8.5's measured ~7 ms ({metrics['cpu_pct_short_max']:.1f} %)"),
        metrics=metrics, params={"families": f"{L2_FAM};{V1_FAM}"}, figure=_figure(r, ctx), table_md=table)
