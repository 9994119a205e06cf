"""``lora-opt train``: train the throughput / starvation surrogates on a dataset, distil them."""
from __future__ import annotations

import argparse

from lora_opt.cli.common import add_tracking_flag


def register(sub) -> None:
    tr = sub.add_parser("train", help="train the throughput / starvation surrogates on a dataset, distil them")
    tr.add_argument("--dataset", required=True, nargs="+",
                    help="dataset directory (or several, concatenated) written by lora-opt dataset")
    tr.add_argument("--out", required=True, help="output directory for the models, rules and metrics")
    add_tracking_flag(tr)
    tr.add_argument("--fast", action="store_true", help="tiny hyper-parameter grids (smoke runs)")
    tr.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.surrogates.training import train_cli

    m = train_cli(args.dataset, args.out, tracking_uri=args.tracking_uri, fast=args.fast, track=not args.no_track)
    ch = m["chosen"]
    reg, clf = m["regressor"][ch["regressor"]], m["classifier"][ch["classifier"]]
    print(f"throughput: {ch['regressor']}, held-out SMAPE {reg['test_smape']:.1f} %")
    print(f"starvation: {ch['classifier']}, threshold {ch['threshold']:.3f}; held-out "
          + ", ".join(f"{k} {v:.3g}" for k, v in clf["test"].items() if isinstance(v, float)))
    print("distilled : " + ", ".join(f"{k} {v} leaves" for k, v in m['distilled']['leaves'].items()))
    print(f"surrogate -> {args.out} (surrogate.json, surrogate.skops, distilled.json, rules.txt, metrics.json)")
    return 0
