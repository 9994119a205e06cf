"""The published results, one module per result: each computes our numbers (from the bundled real
data, the profiles, the twin, the surrogates, the committed experiment outputs), draws its figure
and returns one table row -- the paper's number, ours, the real measurement where the bundled data
has one, and a verdict.  ``experiments/reproduce.py`` runs them, one MLflow run each (experiment
``reproduce``); ``experiments/results_section.py`` writes the Results page's table (docs/results.md) from those runs.

A result module defines ``NAME`` (the registry key, also the MLflow run name), ``TITLE`` (which
figure/table of which paper), ``PAPER`` (``first`` = the single-GPU N/G paper, ``second`` = the
placement paper), ``QUICK`` (in the quick set) and ``run(ctx) -> Row``.
"""
from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_opt.io import atomic_write_bytes

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: the verdicts a row may carry
VERDICTS = ("reproduced", "partly", "differs", "not reproducible")


@dataclass
class Context:
    """What a result gets: where to write its figure and table, and the run size."""
    out: Path
    quick: bool = False
    seed: int = 0


@dataclass
class Row:
    """One line of the Results table (all strings short: they land in a README table cell)."""
    name: str
    title: str
    paper_value: str
    ours: str
    real: str
    verdict: str
    why: str
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    figure: str | None = None
    table_md: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"Row.verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib  # heavy optional dependency: only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy optional dependency (see above)

    return plt


def save_figure(fig, ctx: Context, name: str = "figure.png") -> str:
    """Write ``fig`` under the result's output folder (atomically) and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    path = ctx.out / name
    atomic_write_bytes(path, buf.getvalue())
    return str(path)


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats printed with 3 significant digits."""
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"
        return str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
