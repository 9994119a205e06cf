"""``lora-opt ingest``: ``vllm bench serve`` result JSONs and ``lora-opt validate`` outputs -> rows of
the real-runs CSV format (``calibrate --runs`` / ``fidelity --runs`` read them)."""
from __future__ import annotations

import argparse

from lora_opt.cli.conventions import int_range


def register(sub) -> None:
    i = sub.add_parser("ingest", help="vllm bench serve results / validate outputs -> real-runs CSV rows")
    i.add_argument("sources", nargs="+", help="vllm bench serve --save-result JSON files, or lora-opt validate "
                                              "output directories (one row per GPU)")
    i.add_argument("--out", required=True, help="the rows (CSV, the real-runs columns)")
    i.add_argument("--placement", help="bench serve JSONs: the placement whose GPU the server ran (its flags, "
                                       "adapters and rates)")
    i.add_argument("--gpu-index", type=int_range(0, 100_000), default=0, help="that GPU (default 0)")
    i.add_argument("--model", help="the CSV model name (configs/models.yaml; default: the placement's profile's)")
    i.add_argument("--lengths", default="mean", help="bench serve JSONs: the request lengths, sharegpt or mean "
                                                      "(fixed at the run's means; default)")
    i.add_argument("--label", default="run", help="experiment label: rows get experiment ingested/LABEL")
    i.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.io import atomic_write_text
    from lora_opt.validate.ingest import ingest, rows_csv

    rows = ingest(args.sources, placement=args.placement, gpu_index=args.gpu_index, model=args.model,
                  lengths=args.lengths, label=args.label)
    atomic_write_text(args.out, rows_csv(rows))
    print(f"{len(rows)} row(s) -> {args.out} (lora-opt fidelity --runs {args.out} replays them)")
    return 0
