"""Second paper, Fig. 9: running and waiting requests over time under non-stationary arrivals (every
5 minutes each adapter's rate doubles or halves, within bounds, and its process is re-drawn between
Poisson and log-normal) -- the twin's side only.

The bundled data has NO real run with non-stationary arrivals (every real run is Poisson), so the
paper's twin-vs-real comparison (and Table 1's unpredictable-arrivals columns) cannot be reproduced;
this result shows what our twin does on the paper's kind of trace (``arrivals: nonstationary``,
Llama-3.1-8B profile, the paper's validation workload shapes), beside the same workload under
stationary Poisson arrivals, so the dynamics can be compared when real traces exist.
"""
from __future__ import annotations

import numpy as np

import twin
from . import Context, Row, md_table, pyplot, save_figure
from twin.scenario import build_scenario

NAME = "p2_fig9_nonstationary"
TITLE = "Second paper Fig. 9: running / waiting over time under non-stationary arrivals (twin only)"
PAPER = "second"
QUICK = True

PROFILE = "llama-3.1-8b-h100-64gb"
#: (label, adapters per rate group, rates, max_loras): the paper's two rate regimes, rank 16
WORKLOADS = (("high rates 1.6/0.8/0.4, 18 adapters, 16 slots", 6, (1.6, 0.8, 0.4), 16),
             ("low rates 0.1/0.05/0.025, 192 adapters, 64 slots", 64, (0.1, 0.05, 0.025), 64))


def simulate(per_group: int, rates, slots: int, process: str, duration_s: float, seed: int):
    adapters = [{"count": per_group, "rank": 16, "rate": r} for r in rates]
    sc = build_scenario(PROFILE, adapters, engine={"max_loras": slots, "max_lora_rank": 16},
                        arrivals={"process": process}, duration_s=duration_s, seed=seed)
    return twin.simulate(sc, timeseries=True)


def run(ctx: Context) -> Row:
    duration = 1800.0 if ctx.quick else 3600.0
    plt = pyplot()
    fig, axes = plt.subplots(len(WORKLOADS), 2, figsize=(12, 3.3 * len(WORKLOADS)), squeeze=False)
    rows, metrics = [], {}
    for (label, per, rates, slots), ax_row in zip(WORKLOADS, axes):
        for ax, process in zip(ax_row, ("nonstationary", "poisson")):
            r = simulate(per, rates, slots, process, duration, ctx.seed)
            ts = r.timeseries
            ax.plot(ts["time_s"] / 60, ts["running"], label="running")
            ax.plot(ts["time_s"] / 60, ts["waiting"], label="waiting")
            ax.set(title=f"{label}: {process}", xlabel="minutes", ylabel="requests")
            for x in np.arange(5, duration / 60, 5) if process == "nonstationary" else ():
                ax.axvline(x, c="grey", lw=0.4)
            cv_run = float(np.std(ts["running"]) / max(np.mean(ts["running"]), 1e-9))
            rows.append([label, process, r.throughput_tok_s, float(np.mean(ts["running"])), float(np.max(ts["waiting"])),
                         cv_run, r.ttft_ms["p99"] / 1e3, bool(r.starving)])
            key = f"{'high' if rates[0] > 1 else 'low'}.{process}"
            metrics.update({f"{key}.throughput": r.throughput_tok_s, f"{key}.running_mean": rows[-1][3],
                            f"{key}.waiting_max": rows[-1][4], f"{key}.running_cv": cv_run})
        ax_row[0].legend(fontsize=7)
    fig.tight_layout()
    figure = save_figure(fig, ctx)
    table = md_table(["workload", "arrivals", "throughput tok/s", "mean running", "max waiting", "running CV",
                      "p99 TTFT (s)", "starving"], rows)
    table += (f"\nTwin only, {duration / 60:.0f} simulated minutes each; no real non-stationary run is bundled.\n")
    ns = [r for r in rows if r[1] == "nonstationary"]
    st = [r for r in rows if r[1] == "poisson"]
    return Row(
        name=NAME, title=TITLE,
        paper_value="running / waiting of the twin track the real system's under rate and process changes every 5 min; "
                    "Table 1 (unpredictable): throughput <= 5.16 %, ITL <= 9.87 %, TTFT <= 20.74 % (papers' scale)",
        ours=(f"twin: running varies {ns[0][5]:.2f} / {ns[1][5]:.2f} (CV) under non-stationary arrivals vs "
              f"{st[0][5]:.2f} / {st[1][5]:.2f} under Poisson (high / low rates); max waiting {ns[0][4]:.0f} / "
              f"{ns[1][4]:.0f} vs {st[0][4]:.0f} / {st[1][4]:.0f}"),
        real="none: every bundled real run has Poisson arrivals",
        verdict="not reproducible",
        why="no real run with non-stationary arrivals is bundled, so neither Fig. 9's comparison nor Table 1's "
            "unpredictable columns can be checked; the twin's side is shown",
        metrics=metrics, params={"profile": PROFILE, "duration_s": duration}, figure=figure, table_md=table)
