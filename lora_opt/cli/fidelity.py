"""``lora-opt fidelity``: replay the real vLLM runs on the twin and compare, with the published twin."""
from __future__ import annotations

import argparse

from lora_opt.calibration.realruns import REAL_RUNS_CSV
from lora_opt.cli.conventions import add_ray_flags, add_tracking_flag


def register(sub) -> None:
    f = sub.add_parser("fidelity", help="replay the real vLLM runs on the twin and compare, with the published twin")
    f.add_argument("--runs", default=str(REAL_RUNS_CSV),
                   help="real runs CSV (default: the bundled one)")
    f.add_argument("--family", help="only experiments containing this text (e.g. rank_32_rates_1.6: 67 report-half runs "
                                    "of two models, a few minutes; a family of the fit half -- rank_16_ for Llama-3.1 and "
                                    "Qwen, rate_0.0125 for Llama-2 -- was fitted on, and is reported as such)")
    f.add_argument("--out", default="outputs/fidelity", help="report directory")
    f.add_argument("--before", metavar="SUMMARY_JSON",
                   help="an earlier fidelity summary.json (e.g. experiments/fidelity/before/summary.json): the report "
                        "shows each model's report-half SMAPE and Max_pack regret before and after")
    add_ray_flags(f)
    add_tracking_flag(f)
    f.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.calibration.fidelity import run_fidelity

    cmd = ("lora-opt fidelity" + (f" --family {args.family}" if args.family else "") + f" --out {args.out}"
           + (f" --before {args.before}" if args.before else ""))
    summary = run_fidelity(args.runs, family=args.family, out_dir=args.out, workers=args.workers,
                           ray_address=args.ray_address, command=cmd, before=args.before,
                           tracking_uri=args.tracking_uri, track=not args.no_track)
    o = summary["smape"]["report half"]
    if o["n_runs"]:
        print(f"{summary['n_runs']} runs in {summary['wall_s']:.0f} s; report half ({o['n_runs']} runs), SMAPE % "
              "(ours sharegpt / ours mean / published twin on its runs):")
    else:                       # every run of the family is in the fit half: say so, show them anyway
        o = summary["smape"]["all runs"]
        print(f"{summary['n_runs']} runs in {summary['wall_s']:.0f} s, all of the fit half (calibrate-e2e fitted "
              "on them: not a validation); SMAPE % (ours sharegpt / ours mean / published twin on its runs):")
    for name in ("throughput", "itl_mean", "ttft_mean", "tpot_mean", "running_mean"):
        e = o[name]
        peer = f" / {e['peer']:.1f}" if e.get("peer") is not None and e.get("peer_runs") else ""
        print(f"  {name:<13} {e['sharegpt']:6.1f} / {e['mean']:6.1f}{peer}")
    mp = summary["max_pack"]
    print(f"  Max_pack exact {mp['exact']}/{mp['n']}, within one step {mp['within_one']}/{mp['n']}")
    for k, v in mp.get("regret", {}).items():
        if k.endswith("report half") and v["workloads"]:
            print(f"  Max_pack regret {k}: mean {v['mean_regret_pct']:.1f} %, worst {v['worst_regret_pct']:.1f} %, "
                  f"{v['starving_picks']} pick(s) that starve the real server")
    print(f"report -> {args.out}/report.md")
    return 0
