"""``lora-opt train``: train the throughput / starvation surrogates on a dataset, distil them."""
from __future__ import annotations

import argparse
import json
import logging

from lora_opt.cli.conventions import add_tracking_flag, route_mlflow_prints, show_progress

log = logging.getLogger(__name__)


def register(sub) -> None:
    tr = sub.add_parser("train", help="train the throughput / starvation surrogates on a dataset, distil them")
    tr.add_argument("--dataset", required=True, nargs="+",
                    help="dataset directory (or several, concatenated) written by lora-opt dataset")
    tr.add_argument("--out", required=True, help="output directory for the models, rules and metrics")
    add_tracking_flag(tr)
    tr.add_argument("--fast", action="store_true", help="tiny hyper-parameter grids (smoke runs)")
    tr.add_argument("--intervals-only", action="store_true",
                    help="train nothing: add split-conformal throughput intervals to the surrogate already in --out, "
                         "from --dataset: the dataset it was trained on (its held-out split) or a held-apart one of the "
                         "same profile (grid heldapart: points it was never trained on)")
    tr.add_argument("--json", action="store_true", help="print the metrics (metrics.json's content) as one JSON object")
    tr.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    log.info("training on %s -> %s: importing scikit-learn and MLflow (a few seconds), then one step per fit",
             ", ".join(args.dataset), args.out)
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.surrogates.training import train_cli

    if args.intervals_only:
        from lora_opt.surrogates.training import add_intervals
        iv = add_intervals(args.out, args.dataset)
        if args.json:
            print(json.dumps(iv))
            return 0
        print(intervals_line(iv))
        print(f"intervals -> {args.out}/surrogate.json (metadata.intervals), metrics.json")
        return 0
    route_mlflow_prints()
    m = train_cli(args.dataset, args.out, tracking_uri=args.tracking_uri, fast=args.fast,
                  progress=show_progress(args), track=not args.no_track)
    if args.json:
        print(json.dumps(m, default=str))
        return 0
    ch = m["chosen"]
    reg, clf = m["regressor"][ch["regressor"]], m["classifier"][ch["classifier"]]
    print(f"throughput: {ch['regressor']}, held-out SMAPE {reg['test_smape']:.1f} %")
    print(f"starvation: {ch['classifier']}, threshold {ch['threshold']:.3f}; held-out "
          + ", ".join(f"{k} {v:.3g}" for k, v in clf["test"].items() if isinstance(v, float)))
    if m.get("intervals"):
        print(intervals_line(m["intervals"]))
    print("distilled : " + ", ".join(f"{k} {v} leaves" for k, v in m['distilled']['leaves'].items()))
    print(f"surrogate -> {args.out} (surrogate.json, surrogate.skops, distilled.json, rules.txt, metrics.json)")
    run = m.get("mlflow") or {}
    if run.get("tracking_uri"):        # where the run is: the store a user opens with mlflow ui
        print(f"MLflow    : run {run['run_id']} (experiment {run['experiment']}) in {run['tracking_uri']}")
    return 0


def intervals_line(iv: dict) -> str:
    """The intervals as one line: quantile and measured coverage per confidence."""
    return (f"intervals : split conformal on {iv['calibration_rows']} rows it was not trained on, coverage on "
            f"{iv['coverage_rows']} others: " + ", ".join(f"C {c}: +/-{100 * q:.1f} % covers {100 * iv['coverage'][c]:.0f} %"
                                   for c, q in iv["quantiles"].items()))
