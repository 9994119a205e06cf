"""Second paper, Fig. 8: twin (and, for throughput, the surrogate) vs real throughput, ITL and TTFT
against the served adapters under two arrival-rate sets.

Ours: the committed fidelity replays (``experiments/fidelity/runs.csv``, ShareGPT lengths) of the
real Llama-3.1-8B runs at 8 and 32 LoRA slots, the published twin's simulations of the same runs, and
the bundled surrogate's throughput prediction for each configuration.  The rank-32 families are
the report half (no fit saw them); the rank-16 ones the fit half.
"""
from __future__ import annotations

import numpy as np

from . import REPO, Context, Row, md_table
from .curves import curve_smape, load_runs, plot_panels
from .p2_tables45_surrogates import real_table
from lora_opt.smape import smape
from lora_opt.surrogates.features import FEATURES
from lora_opt.surrogates.oracle import Surrogate

NAME = "p2_fig8_twin_vs_real"
TITLE = "Second paper Fig. 8: twin and surrogate vs real vs served adapters (Llama-3.1-8B)"
PAPER = "second"
QUICK = True

FAM = "digital_twin_modelling/real_results/llama-3.1-8b-instruct/"
RHO = 0.9
PANELS = (("rank_32_rates_1.6_0.8_0.4", 32), ("rank_32_rates_0.1_0.05_0.025", 32),
          ("rank_16_rates_1.6_0.8_0.4", 8), ("rank_16_rates_0.1_0.05_0.025", 8))


def run(ctx: Context) -> Row:
    df = load_runs()
    feats = real_table().set_index("source_dir")
    sur = Surrogate.load(REPO / "configs" / "surrogates" / "llama-3.1-8b-h100-64gb")
    panels, rows, metrics, extra = [], [], {}, {}
    for fam, slots in PANELS:
        g = df[(df["experiment"] == FAM + fam) & (df["max_loras"] == slots)].sort_values("n_served_adapters")
        title = f"{fam}, {slots} slots ({g['half'].iloc[0]} half)"
        X = feats.loc[g["source_dir"], list(FEATURES)].to_numpy(float)
        pred = sur.predict(X)[0]
        feasible = (g["real_throughput"] >= RHO * g["real_incoming"]).to_numpy()
        extra[title] = np.where(feasible, pred, np.nan)    # the regressor answers "if it does not starve"
        panels.append((title, g))
        s = curve_smape(g)
        s_sur = smape(pred[feasible], g["real_throughput"].to_numpy()[feasible])
        rows.append([fam, slots, g["half"].iloc[0], len(g), s["throughput"]["ours"], s_sur, s["throughput"]["peer"],
                     s["itl_mean"]["ours"], s["itl_mean"]["peer"], s["ttft_mean"]["ours"], s["ttft_mean"]["peer"]])
        for m in s:
            metrics[f"{fam}.{slots}.{m}.ours"] = s[m]["ours"]
            metrics[f"{fam}.{slots}.{m}.peer"] = s[m]["peer"]
        metrics[f"{fam}.{slots}.throughput.surrogate"] = s_sur
    table = md_table(["family", "slots", "half", "points", "throughput twin", "throughput surrogate",
                      "throughput published", "ITL twin", "ITL published", "TTFT twin", "TTFT published"], rows)
    table += ("\nSMAPE % (full scale) over each curve's points; the surrogate's over the real non-starving points only "
              "(its regressor predicts the throughput of a configuration that does not starve; the classifier "
              "answers the rest).\n")
    rep = [r for r in rows if r[2] == "report"]
    return Row(
        name=NAME, title=TITLE,
        paper_value="throughput and ITL closely matched (twin and ML); TTFT deviates, most at higher arrival rates",
        ours=(f"per-curve SMAPE, twin: throughput {', '.join(f'{r[4]:.1f}' for r in rows)} %, surrogate "
              f"{', '.join(f'{r[5]:.1f}' for r in rows)} %, ITL {', '.join(f'{r[7]:.0f}' for r in rows)} %, TTFT "
              f"{', '.join(f'{r[9]:.0f}' for r in rows)} %"),
        real=(f"{sum(r[3] for r in rows)} real runs; published twin on them: throughput "
              f"{', '.join(f'{r[6]:.1f}' for r in rows)} %, TTFT {', '.join(f'{r[10]:.0f}' for r in rows)} %"),
        verdict="reproduced",
        why=(f"throughput is matched by the twin (report half <= {max(r[4] for r in rep):.1f} %) and by the surrogate "
             f"where the real GPU keeps up (<= {np.nanmax([r[5] for r in rows]):.1f} %); ITL less, TTFT worst -- the "
             f"paper's picture, with our TTFT far closer than the published twin's (<= {max(r[9] for r in rows):.0f} "
             f"vs {np.nanmax([r[10] for r in rows]):.0f} %)"),
        metrics=metrics, params={"source": "experiments/fidelity/runs.csv"},
        figure=plot_panels(panels, "n_served_adapters", "served adapters", ctx, extra), table_md=table)
