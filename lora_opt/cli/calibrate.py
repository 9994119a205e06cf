"""``lora-opt calibrate``: fit a profile's estimators on real vLLM measurements."""
from __future__ import annotations

import argparse

from lora_opt.cli.conventions import add_tracking_flag


def register(sub) -> None:
    c = sub.add_parser("calibrate", help="fit a profile's estimators on real vLLM measurements")
    c.add_argument("--runs", required=True, help="CSV of real runs (data/real_runs/real_runs_vllm_lora.csv)")
    c.add_argument("--model", required=True, help="model name as in the CSV's model column (lora-opt probe rows: "
                                                  "the profile whose model dimensions and memory model are kept)")
    c.add_argument("--out", required=True, help="profile YAML to write")
    c.add_argument("--report", help="directory for the fit report (markdown + PNG)")
    add_tracking_flag(c)
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.calibration.profile_fit import calibrate_runs

    _, probe_rows = calibrate_runs(args.runs, args.model, args.out, args.report, tracking_uri=args.tracking_uri,
                                   track=not args.no_track)
    if probe_rows:
        print(f"profile -> {args.out} (fitted on lora-opt probe rows)")
        return 0
    print(f"profile -> {args.out}" + (f"; report -> {args.report}" if args.report else ""))
    return 0
