"""A study's plots, drawn by Optuna's own matplotlib visualisations (PNG, Agg backend): the Pareto
front over every trial (feasible and infeasible marked) and the hypervolume history."""
from __future__ import annotations

from pathlib import Path

from lora_opt.io import atomic_write_bytes
from lora_opt.search.study import REF_LATENCY_MS, optuna_quiet


def _save(ax, path: Path) -> Path:
    import io

    import matplotlib.pyplot as plt  # heavy optional dependency: only when a plot is drawn

    fig = ax.figure
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def write_study_plots(study, out: Path, pool: int, objective: str,
                      ref_latency_ms: float = REF_LATENCY_MS) -> list[Path]:
    """``pareto_front.png`` (Optuna's ``plot_pareto_front``: GPUs vs the latency objective, log
    scale -- latencies span milliseconds to minutes) and ``hypervolume_history.png`` (Optuna's
    ``plot_hypervolume_history`` of the feasible trials against (pool + 1 GPUs, ``ref_latency_ms``),
    on linear axes as Optuna computes it) in ``out``; the paths written."""
    import matplotlib  # heavy optional dependency: only when a plot is drawn
    matplotlib.use("Agg")
    from optuna.visualization.matplotlib import plot_hypervolume_history, plot_pareto_front

    out = Path(out)
    written = []
    with optuna_quiet():
        ax = plot_pareto_front(study, target_names=["GPUs", f"{objective} (ms)"])
        ax.set_yscale("log")
        written.append(_save(ax, out / "pareto_front.png"))
        ax = plot_hypervolume_history(study, reference_point=[pool + 1, ref_latency_ms])
        ax.set_title(f"Hypervolume history (reference: {pool + 1} GPUs, {ref_latency_ms:,.0f} ms)", fontsize=9)
        written.append(_save(ax, out / "hypervolume_history.png"))
    return written
