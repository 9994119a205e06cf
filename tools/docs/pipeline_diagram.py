"""Draw the pipeline picture shown in README.md and on the docs' home page: docs/img/pipeline.png.

    python tools/docs/pipeline_diagram.py

Real vLLM measurements are fitted into a profile; the twin (one vLLM engine, simulated) labels the
surrogates' training data and verifies placements; ``place`` writes the launch commands; live
endpoints are measured against the twin and feed calibration again (the live loop).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "img" / "pipeline.png"

#: (x, y, label, colour) of each box, centres in axes units (0..12 x 0..6)
BOXES = {
    "runs": (1.4, 4.9, "real vLLM runs\n(data/real_runs)", "#e8e8e8"),
    "calibrate": (1.4, 3.0, "calibrate\n-> profile\n(model, GPU, vLLM)", "#d6e6f5"),
    "twin": (4.5, 3.0, "digital twin\none vLLM engine:\nscheduler, KV, LoRA slots\n(simulate, emulate)", "#c6dbef"),
    "surrogate": (4.5, 0.9, "surrogates\ndataset -> train\n(throughput, starvation)", "#dadaeb"),
    "place": (7.6, 3.0, "place\npolicy proposes,\ntwin verifies", "#fdd0a2"),
    "outputs": (10.6, 4.6, "placement.json\nvllm serve per GPU\nrouter.json", "#fee6ce"),
    "search": (7.6, 0.9, "evaluate, search,\npareto (on the twin)", "#fdd0a2"),
    "live": (10.6, 1.7, "live loop\nvalidate, probe,\ningest", "#c7e9c0"),
}
#: (from, to, label, curvature)
ARROWS = [
    ("runs", "calibrate", "fit", 0.0), ("calibrate", "twin", "profile", 0.0), ("twin", "surrogate", "labels", 0.0),
    ("surrogate", "place", "oracle", 0.15), ("twin", "place", "verify", 0.0), ("place", "outputs", "", 0.0),
    ("place", "search", "", 0.0), ("outputs", "live", "deploy", 0.0),
]
#: the live loop back to calibration, drawn under the other boxes: (from, to, label)
LOOP = ("live", "calibrate", "new measurements (rows for calibrate)")


def draw(path: Path = OUT) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    from lora_opt.io import atomic_write_figure

    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.5, 6)
    ax.axis("off")
    size = {}
    for name, (x, y, label, colour) in BOXES.items():
        w, h = 2.4, 0.35 * (label.count("\n") + 1) + 0.35
        size[name] = (w, h)
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05,rounding_size=0.15",
                                    facecolor=colour, edgecolor="#444444", linewidth=1.2))
        ax.text(x, y, label, ha="center", va="center", fontsize=9)
    for a, b, label, rad in ARROWS:
        (xa, ya, *_), (xb, yb, *_) = BOXES[a], BOXES[b]
        start, end = _edge(size[a], xa, ya, xb, yb), _edge(size[b], xb, yb, xa, ya)
        ax.add_patch(FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                     mutation_scale=14, linewidth=1.3, color="#333333", shrinkA=0, shrinkB=0))
        if label:
            mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
            ax.text(mx + 0.08, my + 0.1, label, ha="left" if start[0] == end[0] else "center", va="bottom",
                    fontsize=8.5, style="italic", color="#333333")
    a, b, label = LOOP
    (xa, ya, *_), (xb, yb, *_) = BOXES[a], BOXES[b]
    low = -0.1
    ax.plot([xa, xa, xb], [ya - size[a][1] / 2 - 0.08, low, low], color="#333333", linewidth=1.3)
    ax.add_patch(FancyArrowPatch((xb, low), (xb, yb - size[b][1] / 2 - 0.08), arrowstyle="-|>", mutation_scale=14,
                                 linewidth=1.3, color="#333333", shrinkA=0, shrinkB=0))
    ax.text((xa + xb) / 2, low - 0.06, label, ha="center", va="top", fontsize=8.5, style="italic", color="#333333")
    ax.set_title("lora-opt: measure, simulate, place, check on live endpoints", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_figure(path, fig, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def _edge(box: tuple[float, float], x: float, y: float, x_to: float, y_to: float) -> tuple[float, float]:
    """Where the line from a box's centre (x, y) towards (x_to, y_to) leaves the box (with a small
    gap): arrows start and end at the edges, not the centres."""
    w, h = box
    dx, dy = x_to - x, y_to - y
    t = min((w / 2 + 0.08) / abs(dx) if dx else float("inf"), (h / 2 + 0.08) / abs(dy) if dy else float("inf"))
    return x + t * dx, y + t * dy


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(draw())
