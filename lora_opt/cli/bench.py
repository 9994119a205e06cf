"""``lora-opt bench``: benchmarks (speed and memory), reported as numbers, not tests.

The benchmarks themselves live in ``lora_opt.bench``; this module maps each name to the call
with the flags it takes.
"""
from __future__ import annotations

import argparse

from lora_opt.cli.conventions import finite_float, int_range


# imports inside each runner: only the command that runs pays for them (start-up time); each
# benchmark returns its report's lines, printed here
def _twin(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.stages import bench_twin
    return bench_twin(out=args.out, repeats=args.repeats)


def _dataset(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.stages import bench_dataset
    return bench_dataset(grid=args.grid, sample=args.sample)


def _place(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.place import bench_place
    return bench_place(out=args.out, repeats=args.repeats)


def _search(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.stages import bench_search
    from lora_opt.bench.search_backends import bench_backends  # both backends side by side (JSON: <out stem>.backends.json)
    return bench_search(out=args.out) + bench_backends(out=args.out and args.out.rsplit(".", 1)[0] + ".backends.json")


def _ray(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.stages import bench_ray
    return bench_ray(out=args.out, repeats=args.repeats)


def _emulate(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.emulate import bench_emulate
    return bench_emulate(out=args.out, concurrency=args.concurrency, duration_s=args.duration, pin=args.pin)


def _fleet(args: argparse.Namespace) -> list[str]:
    from lora_opt.bench.fleet import bench_fleet
    return bench_fleet(out=args.out, repeats=args.repeats)


#: benchmark name -> its runner; ``lora-opt bench``'s choices
BENCHMARKS = {"twin": _twin, "dataset": _dataset, "place": _place, "search": _search, "ray": _ray, "emulate": _emulate,
              "fleet": _fleet}


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (speed and memory), reported as numbers, not tests")
    b.add_argument("what", choices=list(BENCHMARKS), help="what to benchmark")
    b.add_argument("--grid", default="papers", help="dataset: grid to sample (default: papers)")
    b.add_argument("--sample", type=int_range(1, 1_000_000), default=64, help="dataset: grid points to label per worker count")
    b.add_argument("--out", help="also write the results as JSON here")
    b.add_argument("--repeats", type=int_range(1, 1000), default=3, help="timed repetitions per scenario (best is kept)")
    b.add_argument("--concurrency", type=int_range(1, 100_000), default=600, help="emulate: streams kept open")
    b.add_argument("--duration", type=finite_float(1.0, 86_400.0), default=30.0,
                   help="emulate: measured seconds (after 8 s warm-up)")
    b.add_argument("--pin", action="store_true", help="emulate: pin the server to one CPU, the client to the others")
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print("\n".join(BENCHMARKS[args.what](args)))
    return 0
