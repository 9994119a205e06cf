"""Twin-vs-real curves from the committed fidelity replays (``experiments/fidelity/runs.csv``), shared
by the first paper's Fig. 7 and the second paper's Fig. 8."""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, pyplot, save_figure
from lora_opt.smape import smape

RUNS = REPO / "experiments" / "fidelity" / "runs.csv"
METRICS = (("throughput", "throughput (tok/s)", 1.0), ("itl_mean", "mean ITL (ms)", 1.0),
           ("ttft_mean", "mean TTFT (s)", 1e-3))


def load_runs() -> pd.DataFrame:
    return pd.read_csv(RUNS)


def curve_smape(df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """SMAPE (full scale) of ours (ShareGPT lengths) and the published twin on these runs, per metric."""
    out = {}
    for m, _, _ in METRICS:
        real = df["real_throughput"] if m == "throughput" else df[f"real_{m}"]
        out[m] = {"ours": smape(df[f"sharegpt_{m}"], real),
                  "peer": smape(df[f"peer_{m}"], real) if f"peer_{m}" in df else float("nan")}
    return out


def plot_panels(panels: list[tuple[str, pd.DataFrame]], x: str, xlabel: str, ctx: Context,
                extra: dict[str, np.ndarray] | None = None) -> str:
    """One row per panel (a set of runs), one column per metric: real (dots), ours, the published twin;
    ``extra`` adds a throughput curve per panel title (e.g. the surrogate's prediction)."""
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 3, figsize=(13, 3.2 * len(panels)), squeeze=False)
    for row, (title, g) in zip(axes, panels):
        g = g.sort_values(x)
        for ax, (m, label, scale) in zip(row, METRICS):
            real = g["real_throughput"] if m == "throughput" else g[f"real_{m}"]
            ax.plot(g[x], real * scale, "ko", label="real")
            ax.plot(g[x], g[f"sharegpt_{m}"] * scale, "-", label="ours (twin)")
            if f"peer_{m}" in g and g[f"peer_{m}"].notna().any():
                ax.plot(g[x], g[f"peer_{m}"] * scale, "--", label="published twin")
            if m == "throughput" and extra and title in extra:
                ax.plot(g[x], extra[title], ":", label="ours (surrogate)")
            ax.set(xlabel=xlabel, ylabel=label, title=title if m == "throughput" else "")
            if m == "ttft_mean":
                ax.set_yscale("log")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, ctx)
