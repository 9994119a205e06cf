"""Where the twin's error lives: signed errors per model, half and regime, and the Max_pack regret.

``lora-opt fidelity`` gives SMAPE per model and half; these tables split the same replay by what a
cost model could get wrong -- light load or a queue, the batch the real server ran, the slots
(``max_loras``), the LoRA rank -- so that a candidate form is judged on where it moves the error, not on
one number.  The signed error is ``(twin - real) / real`` in %: negative = the twin is too slow for
throughput, too fast for ITL and TTFT.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lora_opt.io import atomic_write_figure

#: (name in the tables, real column, twin column suffix)
RESIDUAL_METRICS = (("throughput", "real_throughput", "throughput"), ("itl_mean", "real_itl_mean", "itl_mean"),
                    ("ttft_mean", "real_ttft_mean", "ttft_mean"))
#: edges of the real running-request bins (mean running requests of the run)
RUNNING_EDGES = (0, 8, 32, 128, 512, np.inf)
#: a run with a real mean waiting queue of at least this is "queued" (else "light")
QUEUED_WAITING = 1.0


def with_regimes(df):
    """``df`` (``fidelity``'s runs table) with the regime columns the tables group by."""
    import pandas as pd  # heavy optional dependency: only when tables are built

    out = df.copy()
    out["load"] = np.where(out["real_waiting_mean"] >= QUEUED_WAITING, "queued", "light")
    labels = [f"{int(a)}-{'' if not np.isfinite(b) else int(b)}" for a, b in zip(RUNNING_EDGES, RUNNING_EDGES[1:])]
    # ordered: the tables list the bins by size, not alphabetically
    out["running"] = pd.cut(out["real_running_mean"], RUNNING_EDGES, labels=labels, right=False)
    out["slots"] = out["max_loras"].astype(int)
    out["rank"] = out["max_lora_rank"].astype(int)
    return out


def signed_error_table(df, variant: str, by: list[str]):
    """Per group of ``by`` (model and half first): runs, and per metric the median signed error (%) and
    the SMAPE (%) of the twin's ``variant``."""
    import pandas as pd  # heavy optional dependency: only when tables are built

    d = with_regimes(df)
    rows = []
    for key, g in d.groupby(["model", "half", *by], sort=True, observed=True):
        row = dict(zip(["model", "half", *by], key if isinstance(key, tuple) else (key,)))
        row["runs"] = len(g)
        for name, real_col, suffix in RESIDUAL_METRICS:
            real, twin = g[real_col].to_numpy(float), g[f"{variant}_{suffix}"].to_numpy(float)
            ok = np.isfinite(real) & np.isfinite(twin) & (real > 0)
            row[f"{name}_median_err"] = float(np.median((twin[ok] - real[ok]) / real[ok] * 100)) if ok.any() else np.nan
            row[f"{name}_smape"] = (float(np.mean(np.abs(twin[ok] - real[ok]) / ((np.abs(twin[ok]) + real[ok]) / 2)) * 100)
                                    if ok.any() else np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def markdown_table(table, by: list[str]) -> list[str]:
    """``signed_error_table``'s rows as markdown: median signed error (SMAPE) per metric."""
    head = ["model", "half", *by, "runs"] + [f"{m} err % (SMAPE)" for m, *_ in RESIDUAL_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in table.iterrows():
        cells = [str(r["model"]), str(r["half"]), *(str(r[b]) for b in by), str(int(r["runs"]))]
        cells += [f"{r[f'{m}_median_err']:+.1f} ({r[f'{m}_smape']:.1f})" if np.isfinite(r[f"{m}_smape"]) else "n/a"
                  for m, *_ in RESIDUAL_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def residual_plot(df, variant: str, out_dir: Path) -> str:
    """Signed error vs the real run's mean running requests, one panel per model and metric, fit half and
    report half apart.  The file name."""
    import matplotlib  # heavy optional dependency: only when plots are drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy optional dependency: only when plots are drawn

    models = sorted(df["model"].unique())
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 3.6 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        g = df[df["model"] == m]
        for j, (name, real_col, suffix) in enumerate(RESIDUAL_METRICS):
            ax = axes[i, j]
            for half, mk in (("fit", "o"), ("report", "s")):
                h = g[g["half"] == half]
                err = (h[f"{variant}_{suffix}"] - h[real_col]) / h[real_col] * 100
                queued = h["real_waiting_mean"] >= QUEUED_WAITING
                ax.scatter(h["real_running_mean"][~queued], err[~queued], marker=mk, s=14, alpha=0.7,
                           label=f"{half} half, light")
                ax.scatter(h["real_running_mean"][queued], err[queued], marker=mk, s=14, alpha=0.7,
                           facecolors="none", edgecolors=f"C{2 if half == 'fit' else 3}", label=f"{half} half, queued")
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xscale("log")
            if name.startswith("ttft"):     # queueing makes TTFT errors of 1000s of %: keep +-100 % readable
                ax.set_yscale("symlog", linthresh=100)
            ax.set_xlabel("real mean running requests")
            ax.set_ylabel(f"{name}: twin vs real (%)")
            ax.set_title(f"{m}: {name}", fontsize=9)
        axes[i, 0].legend(fontsize=6)
    fig.tight_layout()
    path = out_dir / "residuals.png"
    atomic_write_figure(path, fig, dpi=70)
    plt.close(fig)
    return path.name


def max_pack_regret(maxpack, df, rho: float):
    """``maxpack`` (``fidelity.max_pack_table``) with the real throughput at the twin's pick, the regret
    (% of the real pick's throughput lost by deploying the twin's pick) and whether the twin's pick starves
    the real server (its real run below ``rho`` x incoming)."""
    if maxpack.empty:                   # no workload with two served counts: nothing to pick between
        return maxpack
    out = maxpack.copy()
    real_at, regret, starves = [], [], []
    for _, r in out.iterrows():
        g = df[(df["experiment"] == r["experiment"]) & (df["max_loras"] == r["max_loras"])]
        # no pick (None, NaN in the table) matches no run
        at = g[g["n_served_adapters"] == r["twin_max_pack"]]
        best = g[g["n_served_adapters"] == r["real_max_pack"]]
        if len(at) and len(best):
            thr, ref = float(at["real_throughput"].iloc[0]), float(best["real_throughput"].iloc[0])
            real_at.append(thr)
            regret.append(max(0.0, (ref - thr) / ref * 100))
            starves.append(bool(thr < rho * float(at["real_incoming"].iloc[0])))
        else:
            real_at.append(np.nan)
            regret.append(np.nan)
            starves.append(bool(len(at)) and bool(float(at["real_throughput"].iloc[0])
                                                  < rho * float(at["real_incoming"].iloc[0])))
    out["real_throughput_at_twin_pick"] = real_at
    out["regret_pct"] = regret
    out["twin_pick_starves_real"] = starves
    out["half"] = out["experiment"].map(df.drop_duplicates("experiment").set_index("experiment")["half"])
    out["model"] = out["experiment"].map(df.drop_duplicates("experiment").set_index("experiment")["model"])
    return out


def regret_summary(maxpack) -> dict:
    """Per model and half: workloads compared, mean and worst regret (%), twin picks that starve the real
    server, workloads where the twin picks nothing while the real server had a non-starving count."""
    out: dict = {}
    for (m, half), g in maxpack.groupby(["model", "half"]):
        r = g["regret_pct"].dropna()
        no_pick = int((g["twin_max_pack"].isna() & g["real_max_pack"].notna()).sum())
        out[f"{m}, {half} half"] = {"workloads": int(len(r)), "mean_regret_pct": float(r.mean()) if len(r) else None,
                                     "worst_regret_pct": float(r.max()) if len(r) else None,
                                     "starving_picks": int(g["twin_pick_starves_real"].sum()),
                                     "no_pick": no_pick}
    return out
