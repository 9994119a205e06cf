"""Second paper, Table 2 (first paper, Table 1 right): the twin's cost per simulated hour (wall time on
one core, memory) -- ours measured here with ``lora-opt bench twin`` (``lora_opt.bench.stages.bench_twin``:
six one-hour scenarios, each in a fresh process, best of ``repeats`` after a warm run), beside the
published twin's 38.9 +- 5.6 s (Llama) / 41.4 s (Qwen) per simulated hour and ~200 MB.
"""
from __future__ import annotations

import json

import numpy as np

from . import Context, Row, md_table, pyplot, save_figure
from lora_opt.bench.stages import bench_twin

NAME = "p2_table2_twin_cost"
TITLE = "Second paper Table 2: twin cost per simulated hour (ours measured here vs theirs)"
PAPER = "second"
QUICK = True

PAPER_S_PER_HOUR = 38.94      # Llama-3.1-8B, mean over their validation workloads (Qwen: 41.4)
PAPER_MB = 200.0


def _figure(rows: list[dict], ctx: Context) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r["published_s"] for r in rows], 0.4, label="published twin (scenario's measurement)")
    ax.barh(y + 0.2, [r["wall_s_per_sim_hour"] for r in rows], 0.4, label="ours, measured here")
    ax.set_yticks(y, [r["scenario"][:45] for r in rows], fontsize=7)
    ax.set(xscale="log", xlabel="wall seconds per simulated hour (one core)")
    ax.legend(fontsize=7)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    path = ctx.out / "bench_twin.json"
    repeats = 1 if ctx.quick else 3
    bench_twin(out=str(path), repeats=repeats, rounds=1)     # one round: 40-400x faster is not a noise question
    rows = json.loads(path.read_text())
    table = md_table(["scenario", "ours s / sim-hour", "published s", "speed-up", "peak RSS MB", "sim MB", "starving"],
                     [[r["scenario"], r["wall_s_per_sim_hour"], r["published_s"], r["speedup_vs_published"],
                       r["peak_rss_mb"], r["sim_rss_mb"], r["starving"]] for r in rows])
    papers = [r for r in rows if r["scenario"].startswith("papers'")]
    worst = max(r["wall_s_per_sim_hour"] for r in rows)
    papers_s = [r["wall_s_per_sim_hour"] for r in papers]
    rss = max(r["peak_rss_mb"] for r in rows)
    sim_mb = max(r["sim_rss_mb"] for r in rows)
    metrics = {"worst_s_per_sim_hour": worst, "papers_workloads_s_per_sim_hour_max": max(papers_s),
               "speedup_vs_published_min": min(r["speedup_vs_published"] for r in rows),
               "peak_rss_mb_max": rss, "sim_rss_mb_max": sim_mb}
    for r in rows:
        metrics[f"s_per_hour.{r['scenario'][:40]}"] = r["wall_s_per_sim_hour"]
    return Row(
        name=NAME, title=TITLE,
        paper_value=f"{PAPER_S_PER_HOUR} +- 5.58 s per simulated hour (Llama; Qwen 41.4 s), 1 core, ~{PAPER_MB:.0f} MB",
        ours=(f"{min(papers_s):.2f}-{max(papers_s):.2f} s per simulated hour on the papers' workloads, worst scenario "
              f"{worst:.2f} s ({metrics['speedup_vs_published_min']:.0f}x or more faster); peak RSS {rss:.0f} MB of "
              f"which the simulation adds {sim_mb:.0f} MB (best of {repeats}, this 2-core VM)"),
        real="(a cost, no real counterpart)",
        verdict="reproduced",
        why=(f"the cost claim holds and ours is cheaper: {max(papers_s):.1f} s vs ~39 s per simulated hour on the "
             f"same kind of workload; memory is mostly the Python/Numba runtime (the simulation adds {sim_mb:.0f} MB)"),
        metrics=metrics, params={"repeats": repeats}, figure=_figure(rows, ctx), table_md=table)
