"""``lora-opt dataset``: label a grid of single-GPU configurations with the twin (Ray, resumable)."""
from __future__ import annotations

import argparse

from lora_opt.cli.conventions import add_ray_flags, add_tracking_flag, int_range, show_progress
from lora_opt.surrogates.dataset import GRIDS_DIR
from twin.profile import bundled_profiles


def register(sub) -> None:
    grids = ", ".join(sorted(f.stem for f in GRIDS_DIR.glob("*.yaml")))
    d = sub.add_parser("dataset", help="label a grid of single-GPU configurations with the twin (Ray, resumable)")
    d.add_argument("--profile", help="profile YAML, or a bundled profile name "
                                     f"({', '.join(bundled_profiles())}; default: the grid file's profile)")
    d.add_argument("--grid", required=True, help=f"grid YAML, or a bundled grid name ({grids})")
    d.add_argument("--out", required=True, help="dataset directory (Parquet shards); rerun to resume")
    add_ray_flags(d)
    d.add_argument("--limit", type=int_range(1, 10**12), help="only the first N grid points")
    add_tracking_flag(d)
    d.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.surrogates.dataset import generate

    s = generate(args.profile, args.grid, args.out, workers=args.workers, ray_address=args.ray_address,
                 limit=args.limit, tracking_uri=args.tracking_uri, progress=show_progress(args),
                 track=not args.no_track)
    print(f"{s['rows']:,} rows in {args.out} ({s['rows_resumed']:,} already there, {s['rows_labelled_now']:,} "
          f"labelled in {s['wall_s']:.1f} s, {s['rows_per_s']:.1f} rows/s); dataset hash {s['dataset_hash']}")
    return 0
