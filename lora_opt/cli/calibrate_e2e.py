"""``lora-opt calibrate-e2e``: fit the constants only end-to-end runs identify, on half of them."""
from __future__ import annotations

import argparse
import logging

from lora_opt.calibration.realruns import REAL_RUNS_CSV
from lora_opt.errors import InputError
from twin.paths import FROM_WHEEL

from lora_opt.cli.conventions import WORKERS

log = logging.getLogger(__name__)


def register(sub) -> None:
    e = sub.add_parser("calibrate-e2e", help="fit the constants only end-to-end runs identify, on half of them")
    e.add_argument("--model", help="model name as in the CSV (default: every bundled model)")
    e.add_argument("--runs", default=str(REAL_RUNS_CSV))
    e.add_argument("--workers", type=WORKERS, help="parallel workers (default: serial when the work is too small to pay Ray's start-up, else all cores)")
    e.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.calibration.e2e_fit import FIT_HALF, NoFitRuns, fit_model

    if FROM_WHEEL:    # it rewrites the bundled profiles: they are the checkout's files, not site-packages'
        raise InputError("calibrate-e2e rewrites the bundled profiles (configs/profiles/): run it in a checkout "
                         "installed with pip install -e .")
    models = [args.model] if args.model else sorted(FIT_HALF)
    for m in models:
        if m not in FIT_HALF:
            raise InputError(f"--model {m!r}: allowed values: {', '.join(sorted(FIT_HALF))}")
        log.info(f"{m}: replaying its fit-half runs on the twin once per candidate (a line each)")
        try:
            rec = fit_model(m, args.runs, workers=args.workers)
        except NoFitRuns as exc:
            if args.model:
                raise
            log.warning(f"{exc}: skipped")      # every model: those with runs in this CSV
            continue
        print(f"{m}: {rec['params']} (fit half {rec['fit_half']!r}, {rec['fit_runs']} runs, "
              f"loss {rec['fit_half_loss']:.2f} %, {rec['wall_s']:.0f} s); profile "
              + ("rewritten" if rec["profile_written"] else "unchanged (the same values)"))
    return 0
