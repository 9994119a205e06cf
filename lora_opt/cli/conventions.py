"""What every ``lora-opt`` command shares, as Optuna's and vLLM's command lines do: the exit
statuses listed (defined in :mod:`lora_opt.errors`), the logging flags (``-v/--verbose``,
``-q/--quiet``, ``--log-file``) and the one function that sets logging up (:func:`setup_logging`),
the environment variables honoured, and the flags several commands share, spelled once,
with the argparse types every numeric flag uses: :func:`finite_float` and :func:`int_range`
refuse NaN, infinities and values outside the flag's range with argparse's own error
(``lora-opt CMD: error: argument --flag: ...``, exit status 2).

Output contract: results the user asked for (tables, JSON) go to stdout, printed by the command's
CLI module; diagnostics go through :mod:`logging` to stderr (and to ``--log-file``); library code
(``lora_opt``, ``twin``) never prints.  Progress bars (tqdm) go to stderr.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from tqdm import tqdm

# the exit statuses are defined in lora_opt.errors (library code returns them too); EPILOG lists them
from lora_opt.errors import (EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_NOT_ACCEPTABLE,
                             EXIT_NOT_DEPLOYABLE, EXIT_OK, EXIT_TWIN_FAILED)

EPILOG = f"""\
global options (before or after the command): -v/--verbose (repeat for more), -q/--quiet,
--log-file PATH.  Results (tables, --json) go to stdout; diagnostics, warnings and progress
bars to stderr.

exit status:
  {EXIT_OK:<4} success
  {EXIT_BAD_INPUT:<4} bad input: a flag, file or field (the message names it and the allowed values)
  {EXIT_NOT_ACCEPTABLE:<4} it ran, but the result is not acceptable (outputs still written): the placement
       starves or a GPU would not start (evaluate), the pool is too small (place), no feasible
       point (search, pareto), requests failed (validate)
  {EXIT_NOT_DEPLOYABLE:<4} place: the placement has instances that would not start (written, no launch commands)
  {EXIT_TWIN_FAILED:<4} validate: the live side was measured and written, the twin step failed (the reason
       is in <out>/twin_error.json and on stderr)
  {EXIT_INTERRUPTED:<4} interrupted (Ctrl-C); what was finished is kept
  {EXIT_BROKEN_PIPE:<4} stdout's reader went away (lora-opt ... | head): the files were written

environment: MLFLOW_TRACKING_URI (where runs are recorded; --tracking-uri wins), OPTUNA_STORAGE
(search's default --storage; pareto keeps a sweep's studies in <out>/studies.db), RAY_ADDRESS (an existing Ray cluster); MLflow's, Ray's and Optuna's telemetry
is off unless the user's own environment variables turn it on."""

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


def _confidence(text: str) -> float:
    x = finite_float(0.0, 1.0, lo_open=True)(text)
    if x >= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1) (a probability below 1: no finite set of runs "
                                         f"supports certainty), got {text}")
    return x


_confidence.__name__ = "probability"
#: --confidence: a probability in the open interval (0, 1)
CONFIDENCE = _confidence


def _confidence_or_point(text: str) -> float | None:
    return None if text.strip().lower() == "point" else _confidence(text)


_confidence_or_point.__name__ = "probability or 'point'"
#: pareto's --confidence list: a probability in (0, 1), or ``point`` (the point estimate)
CONFIDENCE_OR_POINT = _confidence_or_point
POSITIVE_MS = finite_float(0.0, 1e9, lo_open=True)       # latency targets
POSITIVE_S = finite_float(0.0, MAX_SECONDS, lo_open=True)
NONNEGATIVE_S = finite_float(0.0, MAX_SECONDS)


def add_ray_flags(p: argparse.ArgumentParser, workers_help: str = WORKERS_HELP) -> None:
    """``--workers`` and ``--ray-address``: where simulations run."""
    p.add_argument("--workers", type=WORKERS, help=f"{workers_help}; 1..{MAX_WORKERS}")
    p.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")


#: --scrape-interval-s's default (s): twin.fleet.SCRAPE_INTERVAL_S, spelled here so --help needs no import
SCRAPE_DEFAULT_S = 0.1


def add_fleet_flags(p: argparse.ArgumentParser, routers, adapter_modes, *, several: bool = False) -> None:
    """``--router`` (``routers``: twin.routers.ROUTERS; ``several``: one or more, each its own run),
    ``--adapters`` and ``--scrape-interval-s``: how the GPUs of a replay are served as one fleet (evaluate, search)."""
    p.add_argument("--router", choices=list(routers), nargs="+" if several else None,
                   default=["static"] if several else "static",
                   help="router policy choosing each request's GPU (default static: the placement's weights, "
                        "router.json); any other replays the GPUs as one fleet on the fleet twin (docs: concepts/fleet)"
                        + ("; several: one study each, fronts merged" if several else ""))
    p.add_argument("--adapters", choices=list(adapter_modes), default="static",
                   help="static: a GPU serves the adapters placed on it (default); on-demand: any adapter its "
                        "--max-lora-rank admits, loaded on first use (disk -> CPU cache -> GPU slot, LRU)")
    p.add_argument("--scrape-interval-s", type=NONNEGATIVE_S,
                   help=f"fleet: seconds between the router's reads of the GPUs' metrics (default "
                        f"{SCRAPE_DEFAULT_S:g}; 0 = exact state at every arrival)")


def add_tracking_flag(p: argparse.ArgumentParser) -> None:
    """``--tracking-uri`` (where MLflow records the run) and ``--no-track``."""
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else "
                                          "sqlite:///mlruns/mlflow.db in the current directory, artifacts in mlruns/artifacts; "
                                          "browse: mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db)")
    try:
        p.add_argument("--no-track", action="store_true", help="do not log an MLflow run")
    except argparse.ArgumentError:      # the command declares it itself (validate, probe)
        pass


#: the packages whose loggers are ours: INFO shown by default
OWN_LOGGERS = ("lora_opt", "twin")
#: third-party loggers known to chat at INFO (or to install their own handlers): WARNING and above
#: only, unless -v.  MLflow is told not to install its handler (MLFLOW_CONFIGURE_LOGGING) so its
#: records reach ours; alembic/sqlalchemy run under MLflow's SQLite store.
NOISY_LOGGERS = ("mlflow", "ray", "numba", "urllib3", "httpx", "httpcore", "uvicorn", "uvicorn.access",
                 "uvicorn.error", "optuna", "filelock", "asyncio")
#: loggers whose INFO is a firehose (every SQL statement, every migration step): WARNING unless -vv
FIREHOSE_LOGGERS = ("sqlalchemy", "alembic")

_CONSOLE_FORMAT = "%(message)s"
_FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def add_logging_flags(p: argparse.ArgumentParser) -> None:
    """``-v``, ``-q``, ``--log-file`` on ``p``.  Defaults are SUPPRESS so that the same flags on
    the top-level parser and on a command's parser combine (``lora-opt -v place ...`` and
    ``lora-opt place ... -v`` both work; the command's parser does not reset the first)."""
    g = p.add_argument_group("logging (also before the command)")
    g.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="more diagnostics on stderr: -v adds lora-opt's debug lines and third-party "
                        "INFO (MLflow, Ray, uvicorn, httpx), -vv everything")
    g.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                   help="errors only on stderr (no notes; no progress bars from place, evaluate, dataset, train, validate)")
    g.add_argument("--log-file", metavar="PATH", default=argparse.SUPPRESS,
                   help="also write every diagnostic (debug level, with times) to PATH (appended)")


def verbosity(args: argparse.Namespace) -> int:
    """-1 quiet, 0 default, 1 -v, 2 -vv (quiet wins over verbose)."""
    if getattr(args, "quiet", False):
        return -1
    return min(int(getattr(args, "verbose", 0) or 0), 2)


def show_progress(args: argparse.Namespace) -> bool:
    """Whether a command draws progress bars: not with --json (its stdout is data) nor -q."""
    return not getattr(args, "json", False) and verbosity(args) >= 0


class _Console(logging.Formatter):
    """``lora-opt: message`` (INFO), ``lora-opt: warning: message``; third-party records carry
    their logger's name instead of ``lora-opt``."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        own = record.name.split(".")[0] in OWN_LOGGERS
        who = "lora-opt" if own else record.name
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"{who}: {level}{msg}"


class _ConsoleHandler(logging.StreamHandler):
    """A stderr handler that writes through ``tqdm.write``: a log line above a progress bar, not
    through it.  Without an explicit stream it writes to ``sys.stderr`` as it is at each record
    (a replaced or captured stderr, as in tests, is followed, never written to once closed)."""

    def __init__(self, stream=None):
        super().__init__(stream)
        self._explicit = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self._explicit or sys.stderr)
        except Exception:                    # logging's contract: never raise from emit
            self.handleError(record)


class _Threshold(logging.Filter):
    """Per-handler thresholds: one for our loggers, one for everybody else's."""

    def __init__(self, own: int, other: int):
        super().__init__()
        self.own, self.other = own, other

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.split(".")[0] in OWN_LOGGERS
        return record.levelno >= (self.own if own else self.other)


#: (our threshold, third-party threshold) on the console per verbosity
_CONSOLE_LEVELS = {-1: (logging.ERROR, logging.ERROR), 0: (logging.INFO, logging.WARNING),
                   1: (logging.DEBUG, logging.INFO), 2: (logging.DEBUG, logging.DEBUG)}


def setup_logging(level: int = 0, log_file: str | None = None, stream=None) -> None:
    """The CLI's logging, set once per process: a console handler on stderr (thresholds by
    ``level``: -1 quiet, 0 default, 1 -v, 2 -vv), optionally a file handler (``log_file``, debug
    for lora-opt, INFO for third parties, with times), warnings routed into logging, and the
    third-party loggers that install their own handlers routed to ours."""
    # MLflow installs its own stderr handler on import unless told not to: its records should
    # pass our thresholds and reach --log-file like everybody's (the user's setting wins)
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    own_c, other_c = _CONSOLE_LEVELS[level]
    console = _ConsoleHandler(stream)
    console.setFormatter(_Console(_CONSOLE_FORMAT))
    console.addFilter(_Threshold(own_c, other_c))
    handlers: list[logging.Handler] = [console]
    own_min, other_min = own_c, other_c
    if log_file:
        fh = logging.FileHandler(log_file, encoding="utf-8")
        fh.setFormatter(logging.Formatter(_FILE_FORMAT))
        other_f = logging.DEBUG if level >= 2 else logging.INFO
        fh.addFilter(_Threshold(logging.DEBUG, other_f))
        handlers.append(fh)
        own_min, other_min = logging.DEBUG, min(other_c, other_f)
    root = logging.getLogger()
    for h in list(root.handlers):            # one setup per process (tests call main() repeatedly)
        if getattr(h, "_lora_opt", False):
            root.removeHandler(h)
            h.close()
    for h in handlers:
        h._lora_opt = True                   # type: ignore[attr-defined]
        root.addHandler(h)
    # logger levels decide which records are made at all (a DEBUG sqlalchemy.engine would log every
    # statement); the handlers' filters decide where each goes
    root.setLevel(other_min)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own_min)
    for name in NOISY_LOGGERS + FIREHOSE_LOGGERS:
        lg = logging.getLogger(name)
        floor = logging.WARNING if name in FIREHOSE_LOGGERS else logging.INFO
        lg.setLevel(max(other_min, floor) if level < 2 else logging.DEBUG)
        lg.propagate = True
        lg.handlers = [h for h in lg.handlers if not isinstance(h, logging.StreamHandler)
                       or isinstance(h, logging.FileHandler)]
    logging.captureWarnings(True)



class _LinesToLog:
    """A text stream whose lines become INFO records of one logger (MLflow's event prints)."""

    def __init__(self, logger: logging.Logger):
        self.logger, self.enabled, self._buf = logger, True, ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.strip() and self.enabled:
                self.logger.info(line)
        return len(text)

    def flush(self) -> None:
        pass


def route_mlflow_prints() -> None:
    """MLflow prints some events itself (``Successfully registered model ...``, ``Created version
    ...``) to its own stream, not through logging (and toggles that stream around model logging):
    make that stream's lines INFO records of the ``mlflow`` logger, shown with -v and in
    --log-file like MLflow's other INFO.  Only for commands that import MLflow anyway."""
    import mlflow.utils.logging_utils as mlflow_logging  # heavy optional dependency: this command logs to MLflow

    if not isinstance(mlflow_logging.MLFLOW_LOGGING_STREAM, _LinesToLog):
        mlflow_logging.MLFLOW_LOGGING_STREAM = _LinesToLog(logging.getLogger("mlflow"))
