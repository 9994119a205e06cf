"""Flags several commands share, spelled once, and the argparse types every numeric flag uses:
:func:`finite_float` and :func:`int_range` refuse NaN, infinities and values outside the flag's
range with argparse's own error (``lora-opt CMD: error: argument --flag: ...``, exit status 2)."""
from __future__ import annotations

import argparse
import math

WORKERS_HELP = ("parallel workers (1 = serial, no Ray; N > 1 = Ray; default: serial when the work is too small "
                "to pay Ray's start-up, else Ray on all cores)")
#: the largest --workers (Ray tasks in flight) and --gpus (GPUs in a pool) accepted
MAX_WORKERS, MAX_GPUS = 4096, 100_000
#: the largest seed (int64) and the longest time a flag may give in seconds (~3.2 years)
MAX_SEED, MAX_SECONDS = 2**63 - 1, 1e8


def finite_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False):
    """An argparse ``type``: a finite float in [lo, hi] (``lo_open``: lo excluded)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (lo is not None and (x <= lo if lo_open else x < lo)) or (hi is not None and x > hi):
            if lo is not None and hi is not None:
                raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {text}")
            if lo is not None:
                raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {text}")
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}, got {text}")
        return x
    parse.__name__ = "number"
    return parse


def int_range(lo: int, hi: int):
    """An argparse ``type``: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            x = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if x < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text}")
        if x > hi:
            raise argparse.ArgumentTypeError(f"must be an integer <= {hi}, got {text}")
        return x
    parse.__name__ = "integer"
    return parse


#: the types of the flags many commands share
SEED = int_range(0, MAX_SEED)
GPUS = int_range(1, MAX_GPUS)
WORKERS = int_range(1, MAX_WORKERS)
FRACTION = finite_float(0.0, 1.0, lo_open=True)          # rho, attainment: (0, 1]
POSITIVE_MS = finite_float(0.0, 1e9, lo_open=True)       # latency targets
POSITIVE_S = finite_float(0.0, MAX_SECONDS, lo_open=True)
NONNEGATIVE_S = finite_float(0.0, MAX_SECONDS)


def add_ray_flags(p: argparse.ArgumentParser, workers_help: str = WORKERS_HELP) -> None:
    """``--workers`` and ``--ray-address``: where simulations run."""
    p.add_argument("--workers", type=WORKERS, help=f"{workers_help}; 1..{MAX_WORKERS}")
    p.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")


def add_tracking_flag(p: argparse.ArgumentParser) -> None:
    """``--tracking-uri`` (where MLflow records the run) and ``--no-track``."""
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else "
                                          "sqlite:///mlruns/mlflow.db in the current directory, artifacts in mlruns/artifacts; "
                                          "browse: mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db)")
    try:
        p.add_argument("--no-track", action="store_true", help="do not log an MLflow run")
    except argparse.ArgumentError:      # the command declares it itself (validate, probe)
        pass
