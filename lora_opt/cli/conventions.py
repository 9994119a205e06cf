"""What every ``lora-opt`` command shares, as Optuna's and vLLM's command lines do: the exit
statuses, the logging flags (``-v/--verbose``, ``-q/--quiet``, ``--log-file``) and the one function
that sets logging up (:func:`setup_logging`), and the environment variables honoured.

Output contract: results the user asked for (tables, JSON) go to stdout, printed by the command's
CLI module; diagnostics go through :mod:`logging` to stderr (and to ``--log-file``); library code
(``lora_opt``, ``twin``) never prints.  Progress bars (tqdm) go to stderr.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from tqdm import tqdm

#: exit statuses (README "Command-line conventions" and ``lora-opt --help`` list them)
EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NOT_ACCEPTABLE = 3
EXIT_NOT_DEPLOYABLE = 4
EXIT_INTERRUPTED = 130

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
  {EXIT_INTERRUPTED:<4} interrupted (Ctrl-C); what was finished is kept

environment: MLFLOW_TRACKING_URI (where runs are recorded; --tracking-uri wins), OPTUNA_STORAGE
(search's default --storage; pareto keeps a sweep's studies in <out>/studies.db), RAY_ADDRESS (an existing Ray cluster); MLflow's, Ray's and Optuna's telemetry
is off unless the user's own environment variables turn it on."""

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
