"""``lora-opt schedule --drift DRIFT.yaml``: the GPU count and placement per step of a horizon, each
step replanned from the previous one, and what it saves against re-placing from scratch and against
static provisioning for the peak (a table, schedule.json, schedule.csv, schedule.png, and every step's
placement.json and plan.json).

The schedule logic lives in ``lora_opt.replan.schedule``; this module reads the flags and writes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from lora_opt.cli.conventions import int_range
from lora_opt.cli.replan import add_replan_flags, policy_from_flags


def register(sub) -> None:
    sc = sub.add_parser("schedule", help="GPUs and placement per step of a drifting day: replan step by step; "
                                         "GPU-hours and moves saved")
    src = sc.add_mutually_exclusive_group(required=True)
    src.add_argument("--drift", help="a drift YAML (lora_opt.replan.drift), or a bundled one by name: day, "
                                     "traces (the Azure conversation and code traces stitched)")
    src.add_argument("--workloads", nargs="+", metavar="WL.yaml", help="one workload file per step, in order")
    sc.add_argument("--steps", type=int_range(1, 168), help="only the first N steps")
    sc.add_argument("--step-s", type=float, default=None,
                    help="seconds per step with --workloads (default 3600; a drift file gives its own)")
    sc.add_argument("--out", help="output directory (default: outputs/schedule-<name>)")
    add_replan_flags(sc)
    sc.add_argument("--no-evaluate", action="store_true",
                    help="do not replay every step's placement on the twin (the independent check)")
    sc.add_argument("--json", action="store_true", help="print the totals and rows as one JSON object")
    sc.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK, InputError
    from lora_opt.io import atomic_write_json, atomic_write_text
    from lora_opt.replan.drift import drift_workloads, load_drift
    from lora_opt.placement.policies import PlacementContext
    from lora_opt.replan.replan import ReplanCosts
    from lora_opt.replan.schedule import run_schedule, schedule_plot
    from lora_opt.placement.workload_file import load_workload

    if args.drift:
        if args.step_s is not None:
            raise InputError("--step-s: only with --workloads (a drift file gives step_s)")
        cfg = load_drift(args.drift)
        # the first N steps of the whole drift (a trace shape cuts its windows for cfg.steps)
        workloads, step_s, name = drift_workloads(cfg)[:args.steps], cfg.step_s, cfg.name
    else:
        workloads = [load_workload(w) for w in args.workloads][:args.steps]
        step_s = 3600.0 if args.step_s is None else args.step_s
        if not 0 < step_s <= 86400:
            raise InputError(f"--step-s: must be in (0, 86400] s, got {step_s:g}")
        if len({w.profile for w in workloads}) > 1:
            raise InputError("--workloads: every step must use the same profile")
        name = workloads[0].name or "workloads"
    out = Path(args.out or f"outputs/schedule-{name}")
    out.mkdir(parents=True, exist_ok=True)
    contexts: dict = {}

    def ctx_for(wl):          # one context (profile, surrogate) per profile
        if wl.profile not in contexts:
            contexts[wl.profile] = PlacementContext.for_workload(wl, args.surrogate)
        return contexts[wl.profile]

    policy = policy_from_flags(args, ctx_for(workloads[0]).profile)

    def on_step(row, placement, plan):
        d = out / "steps" / f"step-{row.step:03d}"
        d.mkdir(parents=True, exist_ok=True)
        placement.save(d / "placement.json")
        if plan is not None:
            atomic_write_json(d / "plan.json", plan, indent=1)
        if not args.json:
            print(_row_line(row), flush=True)

    if not args.json:
        print(HEADER)
    result = run_schedule(workloads, policy, ctx_for, costs=ReplanCosts(args.move_cost, args.restart_cost),
                          consolidate=not args.no_consolidate, evaluate=not args.no_evaluate, step_s=step_s,
                          on_step=on_step)
    rows, tot = result["steps"], result["totals"]
    doc = {"totals": tot, "steps": [dataclasses.asdict(r) for r in rows]}
    files = [atomic_write_json(out / "schedule.json", doc, indent=1)]
    fields = list(doc["steps"][0])
    files.append(atomic_write_text(out / "schedule.csv", "\n".join(
        [",".join(fields)] + [",".join(str(r[f]) for f in fields) for r in doc["steps"]]) + "\n"))
    files.append(out / "schedule.png")
    schedule_plot(rows, files[-1], step_s)
    ok = not tot["transitions_not_ok"] and not tot["steps_starving"]
    code = EXIT_OK if ok else EXIT_NOT_ACCEPTABLE
    if args.json:
        sys.stdout.write(json.dumps({"exit": code, **doc}) + "\n")
        return code
    print(totals_text(tot))
    for f in files:
        print(f"  -> {f}")
    return code


HEADER = (f"{'step':>4} {'adapters':>8} {'req/s':>6} {'GPUs':>4} {'moves':>5} {'restarts':>8} {'peak':>4} "
          f"{'trans':>5} {'scratch GPUs':>12} {'scratch moves':>13} {'starving':>8} {'s':>5}")


def _row_line(r) -> str:
    starving = "-" if r.gpus_starving is None else str(r.gpus_starving)
    return (f"{r.step:>4} {r.adapters:>8} {r.rate_req_s:>6.1f} {r.gpus:>4} {r.moves:>5} {r.restarts:>8} "
            f"{r.peak_gpus:>4} {'ok' if r.transition_ok else 'NO':>5} {r.scratch_gpus:>12} {r.scratch_moves:>13} "
            f"{starving:>8} {r.wall_s:>5.1f}")


def totals_text(t: dict) -> str:
    return (f"GPU-hours: {t['gpu_hours']:.1f} replanned, {t['gpu_hours_from_scratch']:.1f} from scratch each step, "
            f"{t['gpu_hours_static_peak']:.1f} static for the peak ({t['static_peak_gpus']} GPUs): "
            f"{t['saved_vs_static_peak']:.0%} saved\n"
            f"moves: {t['moves']} replanned vs {t['moves_from_scratch']} from scratch; restarts {t['restarts']} vs "
            f"{t['restarts_from_scratch']}; peak GPUs during a transition {t['peak_gpus_during_transitions']}\n"
            f"transitions not ok: {t['transitions_not_ok'] or 'none'}; steps with a starving GPU on the twin: "
            f"{t['steps_starving'] or 'none'}\n"
            f"adapters kept across restarts (not moves): {t['restart_kept']} replanned vs "
            f"{t['restart_kept_from_scratch']} from scratch; candidates chosen: "
            + (", ".join(f"{k} {v}" for k, v in t["candidates_chosen"].items()) or "none"))
