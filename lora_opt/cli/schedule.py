"""``lora-opt schedule --drift DRIFT.yaml``: the GPU count and placement per step of a horizon, each
step replanned from the previous one, and what it saves against re-placing from scratch and against
static provisioning for the peak (a table, schedule.json, schedule.csv, schedule.png, and every step's
placement.json and plan.json).

The work (the steps read, the schedule, the files) is ``lora_opt.replan.run``'s; this module reads the
flags, calls it and prints.
"""
from __future__ import annotations

import argparse
import json
import sys

from lora_opt.cli.conventions import int_range
from lora_opt.cli.replan import add_replan_flags, replan_options


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
    from lora_opt.replan.run import ScheduleRequest, schedule_horizon, schedule_report

    request = ScheduleRequest(drift=args.drift, workloads=tuple(args.workloads or ()), steps=args.steps,
                              step_s=args.step_s, out_dir=args.out, evaluate=not args.no_evaluate)
    done = schedule_horizon(request, replan_options(args), say=None if args.json else _say)
    if args.json:
        sys.stdout.write(json.dumps({"exit": done.code, **done.doc}) + "\n")
    else:
        print(schedule_report(done))
    return done.code


def _say(line: str) -> None:
    print(line, flush=True)            # the table's rows as the steps are done
