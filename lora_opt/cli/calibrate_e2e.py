"""``lora-opt calibrate-e2e``: fit the constants only end-to-end runs identify, on half of them."""
from __future__ import annotations

import argparse

from lora_opt.calibration.realruns import REAL_RUNS_CSV
from lora_opt.cli.conventions import WORKERS


def register(sub) -> None:
    e = sub.add_parser("calibrate-e2e", help="fit the constants only end-to-end runs identify, on half of them")
    e.add_argument("--model", help="model name as in the CSV (default: every bundled model)")
    e.add_argument("--runs", default=str(REAL_RUNS_CSV))
    e.add_argument("--workers", type=WORKERS, help="parallel workers (default: serial when the work is too small to pay Ray's start-up, else all cores)")
    e.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.calibration.e2e_fit import fit_models

    def say(m: str, rec: dict) -> None:
        print(f"{m}: {rec['params']} (fit half {rec['fit_half']!r}, {rec['fit_runs']} runs, "
              f"loss {rec['fit_half_loss']:.2f} %, {rec['wall_s']:.0f} s); profile "
              + ("rewritten" if rec["profile_written"] else "unchanged (the same values)"))
    fit_models(args.model, args.runs, workers=args.workers, on_fit=say)
    return 0
