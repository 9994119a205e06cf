"""``lora-opt error-model``: the twin's capacity error on held-apart real runs, as conformal bounds."""
from __future__ import annotations

import argparse

from lora_opt.calibration.realruns import REAL_RUNS_CSV
from lora_opt.cli.conventions import add_ray_flags, add_tracking_flag


def register(sub) -> None:
    e = sub.add_parser("error-model", help="fit the twin's error model (conformal capacity bounds behind --confidence) "
                                           "on held-apart real runs; coverage and the Max_pack trade-off")
    e.add_argument("--runs", default=str(REAL_RUNS_CSV), help="real runs CSV (default: the bundled one)")
    e.add_argument("--family", help="only experiments containing this text")
    e.add_argument("--out", default="outputs/error_model", help="report directory")
    e.add_argument("--models-dir", help="where the error model files (one YAML per profile) go (default: OUT/models; "
                                        "configs/error_models is the bundled set `place --confidence` reads)")
    add_ray_flags(e)
    add_tracking_flag(e)
    e.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.calibration.error_fit import run_error_model

    cmd = ("lora-opt error-model" + (f" --family {args.family}" if args.family else "") + f" --out {args.out}"
           + (f" --models-dir {args.models_dir}" if args.models_dir else ""))
    s = run_error_model(args.runs, out_dir=args.out, models_dir=args.models_dir, family=args.family,
                        workers=args.workers, ray_address=args.ray_address, command=cmd,
                        tracking_uri=args.tracking_uri, track=not args.no_track)
    print(f"{s['n_runs']} runs replayed in {s['wall_s']:.0f} s; {s['report_runs_capacity_observed']} held-apart runs "
          f"with the real capacity observed (support C <= {s['max_confidence_pooled']:.3f} pooled)")
    print("coverage on runs the bounds were not fitted on (C: report half / fit half):")
    cov = {}
    for r in s["coverage"]:
        cov.setdefault(r["confidence"], {})[r["scored_on"]] = r["coverage"]
    for c, v in cov.items():
        print(f"  C={c:<6g} {v.get('report half', float('nan')):.3f} / {v.get('fit half', float('nan')):.3f}")
    print("Max_pack on the report half (cross-fitted): rule, starving picks, no pick, mean / worst regret %")
    if not s["tradeoff"]:
        print("  none: no workload of these runs was tested at two or more served-adapter counts")
    for r in s["tradeoff"]:
        print(f"  {r['rule']:<20} {r['starving_picks']:>3} {r['no_pick']:>3}  {r['mean_regret_pct']:6.2f} / "
              f"{r['worst_regret_pct']:6.2f}")
    for path in s["error_models"]:
        print(f"  -> {path}")
    print(f"report -> {args.out}/report.md")
    return 0
