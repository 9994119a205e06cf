"""Flags several commands share, spelled once."""
from __future__ import annotations

import argparse

WORKERS_HELP = "parallel workers (1 = serial, no Ray; default: all cores)"


def add_ray_flags(p: argparse.ArgumentParser, workers_help: str = WORKERS_HELP) -> None:
    """``--workers`` and ``--ray-address``: where simulations run."""
    p.add_argument("--workers", type=int, help=workers_help)
    p.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")


def add_tracking_flag(p: argparse.ArgumentParser) -> None:
    """``--tracking-uri``: where MLflow records the run."""
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: local mlruns/)")
