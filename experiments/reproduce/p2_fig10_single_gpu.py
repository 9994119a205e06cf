"""Second paper, Fig. 10: one GPU, more and more served adapters -- the throughput each method reaches
and the A_max it configures, each curve up to where the method calls the placement infeasible or the
GPU starves or fails to start.

Ours, on the twin (Llama-3.1-8B profile): seeded workloads of N adapters (ranks from {8, 16, 32},
per-adapter rates drawn from a low or a high set), placed on a pool of ONE GPU by the paper's greedy
(full surrogate), our default greedy-plus, dLoRA and LoRAServe as their papers configure them
(A_max = adapters) and as an operator would (A_max capped to what starts); the placement replayed
on the twin (Poisson arrivals).  No real counterpart is bundled (the real runs are not placements).
"""
from __future__ import annotations

import numpy as np

from . import Context, Row, md_table, pyplot, save_figure
from lora_opt.bench.place import bench_workload
from lora_opt.placement.evaluate import evaluate_placement, served_ok
from lora_opt.placement.policies import PlacementContext, get_policy

NAME = "p2_fig10_single_gpu"
TITLE = "Second paper Fig. 10: single-GPU throughput and A_max vs served adapters, ours vs baselines (twin)"
PAPER = "second"
QUICK = True

POLICIES = ("greedy", "greedy-plus", "dlora", "loraserve", "dlora-capped", "loraserve-capped")
REGIMES = {"low rates (0.003-0.0125 req/s)": ((0.003125, 0.00625, 0.0125), (128, 256, 384, 512, 640, 768, 1024)),
           "high rates (0.05-0.2 req/s)": ((0.05, 0.1, 0.2), (16, 32, 64, 96, 128, 192, 256))}
QUICK_N = {"low rates (0.003-0.0125 req/s)": (128, 384, 640, 1024), "high rates (0.05-0.2 req/s)": (16, 64, 128, 256)}


def point(n: int, rates, policy: str, duration_s: float, seed: int) -> dict:
    wl = bench_workload(n, rates, seed=seed)
    p = get_policy(policy).place(wl, 1, PlacementContext.for_workload(wl))
    if not p.meta.get("feasible", True) or len(p.gpus) != 1 or any(not p.routes.get(a.id) for a in wl.adapters):
        return {"served": False, "why": "infeasible", "a_max": np.nan, "throughput": np.nan}
    ev = evaluate_placement(p, wl, duration_s=duration_s, workers=1, progress=False)
    ok = served_ok(ev)
    why = "" if ok else ("fails to start" if ev["gpus_failing_startup"] else "starves")
    return {"served": ok, "why": why, "a_max": p.gpus[0].max_loras, "throughput": ev["throughput_tok_s"],
            "itl_ms": ev["itl_ms"].get("mean") if isinstance(ev["itl_ms"], dict) else None}


def run(ctx: Context) -> Row:
    duration = 600.0 if ctx.quick else 1800.0
    results: dict = {}
    for regime, (rates, ns) in REGIMES.items():
        for n in (QUICK_N[regime] if ctx.quick else ns):
            for pol in POLICIES:
                results[(regime, pol, n)] = point(n, rates, pol, duration, ctx.seed)
    plt = pyplot()
    fig, axes = plt.subplots(2, len(REGIMES), figsize=(12, 7), squeeze=False)
    rows, metrics, reach = [], {}, {}
    for j, regime in enumerate(REGIMES):
        for pol in POLICIES:
            pts = sorted((n, r) for (rg, p_, n), r in results.items() if rg == regime and p_ == pol)
            ok = [(n, r) for n, r in pts if r["served"]]
            reach[(regime, pol)] = max([n for n, _ in ok], default=0)
            if ok:
                axes[0][j].plot([n for n, _ in ok], [r["throughput"] for _, r in ok], marker="o", label=pol)
                axes[1][j].plot([n for n, _ in ok], [r["a_max"] for _, r in ok], marker="o", label=pol)
            for n, r in pts:
                rows.append([regime, pol, n, r["served"] or r["why"], r["a_max"], r["throughput"]])
            metrics[f"{regime.split(' ')[0]}.{pol}.max_adapters_served"] = float(reach[(regime, pol)])
            best = max([r["throughput"] for _, r in ok], default=0.0)
            metrics[f"{regime.split(' ')[0]}.{pol}.max_throughput"] = float(best)
        axes[0][j].set(title=regime, ylabel="throughput (tok/s)")
        axes[1][j].set(xlabel="served adapters (one GPU)", ylabel="A_max configured")
    axes[0][0].legend(fontsize=7)
    figure = save_figure(fig, ctx)
    table = md_table(["regime", "policy", "adapters", "served (or why not)", "A_max", "throughput tok/s"], rows)
    table += f"\nTwin replay of {duration:.0f} s per point; one GPU; a curve stops at its first failure.\n"
    low, high = list(REGIMES)
    ours = (f"largest N served on one GPU, low / high rates: greedy {reach[(low, 'greedy')]} / {reach[(high, 'greedy')]}, "
            f"greedy-plus {reach[(low, 'greedy-plus')]} / {reach[(high, 'greedy-plus')]}, dLoRA "
            f"{reach[(low, 'dlora')]} / {reach[(high, 'dlora')]}, LoRAServe {reach[(low, 'loraserve')]} / "
            f"{reach[(high, 'loraserve')]}, capped dLoRA {reach[(low, 'dlora-capped')]} / {reach[(high, 'dlora-capped')]}")
    base_low = max(reach[(low, b)] for b in ("dlora", "loraserve"))
    capped_low = max(reach[(low, b)] for b in ("dlora-capped", "loraserve-capped"))
    ours_low = max(reach[(low, "greedy")], reach[(low, "greedy-plus")])
    starved_high = [pol for pol in POLICIES if any(r["why"] == "starves" for (rg, p_, _), r in results.items()
                                                   if rg == high and p_ == pol)]
    return Row(
        name=NAME, title=TITLE,
        paper_value="low rates: Proposed serves > 500 adapters on one GPU, baselines < 200, > 2x throughput; high rates: "
                    "Proposed stops early (the GPU would starve) while baselines pack until they starve",
        ours=ours, real="none (twin replay)",
        verdict="reproduced" if ours_low > base_low and ours_low >= capped_low else "partly",
        why=(f"against the paper-configured baselines yes (at low rates ours serves {ours_low} adapters, they "
             f"{base_low}: A_max = N does not start under the default max_model_len); but the operator-capped "
             f"baselines serve {capped_low} at the same throughput (ours stops where the surrogate's training range "
             f"ends); at high rates greedy-plus stops before starving while {', '.join(starved_high) or 'none'} starve"),
        metrics=metrics, params={"duration_s": duration, "profile": "llama-3.1-8b-h100-64gb"},
        figure=figure, table_md=table)
