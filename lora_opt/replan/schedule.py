"""A GPU-count schedule over a horizon: one placement per step, each replanned from the previous
one (``lora_opt.replan.replan``), and what that saves.

Per step: the GPUs, the moves and restarts from the previous step, the transition's verdict, and,
for comparison, the policy's placement of the step from scratch -- its GPU count and the moves a
deployment that re-places from scratch every step would make (each scratch placement matched to the
previous scratch placement, as replan matches).  Totals: GPU-hours of the replanned schedule, of
re-placing from scratch, and of static provisioning for the peak (the largest from-scratch GPU
count of any step, held all horizon -- a lower bound on a static deployment, which must also serve
every adapter that ever arrives), moves of both.  With ``evaluate``, every step's placement is also
replayed on the twin with the step's evaluation traffic (``evaluate_placement``): starving GPUs per
step, the independent check.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from lora_opt.io import atomic_write_figure
from lora_opt.placement.evaluate import evaluate_placement
from lora_opt.placement.plan import Placement
from lora_opt.replan.replan import (ReplanCosts, current_state, from_scratch, instance_names, replan,
                                       scratch_placement)
from lora_opt.placement.workload_file import Workload


@dataclass
class Step:
    """One step's outcome (a row of schedule.csv)."""

    step: int
    workload: str
    adapters: int
    rate_req_s: float
    gpus: int
    moves: int
    loads: int
    unloads: int
    restarts: int
    peak_gpus: int
    transition_ok: bool
    scratch_gpus: int
    scratch_moves: int
    scratch_restarts: int
    gpus_starving: int | None = None
    """Starving GPUs when the step's placement is replayed on the twin (None = not evaluated)."""
    wall_s: float = 0.0
    restart_kept: int = 0
    """Adapters the step's restarted instances keep (not moves: a restart starts with them)."""
    scratch_restart_kept: int = 0
    """The same for re-placing from scratch."""
    candidate: str = ""
    """The replan candidate chosen (``incremental``, ``incremental-restart``, ``from-scratch``;
    empty for step 0, placed from scratch)."""


def run_schedule(workloads: list[Workload], policy, ctx_for: Callable[[Workload], object], *,
                 costs: ReplanCosts = ReplanCosts(), consolidate: bool = True, evaluate: bool = True,
                 step_s: float = 3600.0, on_step: Callable[[Step, Placement, dict | None], None] | None = None) -> dict:
    """Replan through ``workloads`` (step 0 is placed from scratch); the rows and the totals.
    ``on_step(row, placement, plan)`` sees every step as it is done (plan None for step 0)."""
    rows: list[Step] = []
    prev = prev_scratch = None
    for k, wl in enumerate(workloads):
        t0 = time.perf_counter()
        ctx = ctx_for(wl)
        scratch = scratch_placement(wl, policy, ctx)
        if prev is None:
            p, plan = scratch, None
            p.meta["instances"] = instance_names(p)
            row = Step(k, wl.name, len(wl.adapters), wl.total_rate, len(p.gpus), 0, 0, 0, 0, len(p.gpus), True,
                       len(scratch.gpus), 0, 0)
        else:
            r = replan(prev, wl, policy, ctx, costs=costs, consolidate=consolidate, scratch_p=scratch)
            p, plan = r.placement, r.plan
            start, retired, _ = current_state(prev_scratch, wl)
            s = from_scratch(start, retired, wl, scratch)
            row = Step(k, wl.name, len(wl.adapters), wl.total_rate, len(p.gpus), r.chosen.moves, r.chosen.loads,
                       r.chosen.unloads, r.chosen.restarts, plan["peak_gpus"], plan["transition_ok"],
                       len(scratch.gpus), s.moves, s.restarts, restart_kept=r.chosen.restart_kept,
                       scratch_restart_kept=s.restart_kept, candidate=r.chosen.name)
        if evaluate:
            ev = evaluate_placement(p, wl, workers=1, progress=False)
            row.gpus_starving = ev["gpus_starving"] + ev["gpus_failing_startup"]
        row.wall_s = time.perf_counter() - t0
        rows.append(row)
        if on_step:
            on_step(row, p, plan)
        prev, prev_scratch = p, scratch
    return {"steps": rows, "totals": totals(rows, step_s)}


def totals(rows: list[Step], step_s: float) -> dict:
    """GPU-hours and moves of the replanned schedule against re-placing from scratch and static peak."""
    h = step_s / 3600.0
    peak = max(r.scratch_gpus for r in rows)
    gh = sum(r.gpus for r in rows) * h
    static = peak * len(rows) * h
    return {
        "steps": len(rows), "step_s": step_s,
        "gpu_hours": gh, "gpu_hours_from_scratch": sum(r.scratch_gpus for r in rows) * h,
        "gpu_hours_static_peak": static, "static_peak_gpus": peak,
        "saved_vs_static_peak": 1.0 - gh / static if static else 0.0,
        "moves": sum(r.moves for r in rows), "moves_from_scratch": sum(r.scratch_moves for r in rows),
        "restarts": sum(r.restarts for r in rows), "restarts_from_scratch": sum(r.scratch_restarts for r in rows),
        "restart_kept": sum(r.restart_kept for r in rows),
        "restart_kept_from_scratch": sum(r.scratch_restart_kept for r in rows),
        "candidates_chosen": {c: sum(r.candidate == c for r in rows) for c in sorted({r.candidate for r in rows} - {""})},
        "transitions_not_ok": [r.step for r in rows if not r.transition_ok],
        "steps_starving": [r.step for r in rows if r.gpus_starving],
        "peak_gpus_during_transitions": max(r.peak_gpus for r in rows),
    }


def schedule_plot(rows: list[Step], path, step_s: float) -> None:
    """GPUs per step (replanned, from scratch, static peak) and the total request rate, one PNG."""
    import matplotlib  # heavy optional dependency: only when a plot is drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    hours = [r.step * step_s / 3600.0 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(hours, [r.gpus for r in rows], where="post", label="replanned (lora-opt schedule)", lw=2)
    ax.step(hours, [r.scratch_gpus for r in rows], where="post", label="from scratch each step", ls="--")
    ax.axhline(max(r.scratch_gpus for r in rows), color="grey", ls=":", label="static, provisioned for the peak")
    ax.set_xlabel("hour")
    ax.set_ylabel("GPUs")
    ax.set_ylim(bottom=0)
    rate = ax.twinx()
    rate.plot([h + step_s / 7200.0 for h in hours], [r.rate_req_s for r in rows], color="tab:red", alpha=0.6,
              label="load (req/s)")
    rate.set_ylabel("total request rate (req/s)")
    rate.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = rate.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title(f"GPUs and load over {len(rows)} steps")
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=110)
    plt.close(fig)
