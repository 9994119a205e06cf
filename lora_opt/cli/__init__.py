"""The ``lora-opt`` command line: one module per command, each with ``register(subparsers)``
(adds its parser; choices come from the registries: policies, objectives, bundled grids, ...)
and ``run(args) -> int`` (the exit status).  Heavy imports happen inside each ``run`` so that
``lora-opt --help`` and ``lora-opt simulate`` start quickly.

Bad input -- ``lora_opt.errors.BAD_INPUT``: a CLI flag, a lora-opt input file, a scenario or
profile field -- is reported as ``lora-opt CMD: error: ...`` with exit status 2, no traceback.
Exit statuses, the logging flags and the environment variables: ``lora_opt.cli.conventions``.
"""
from __future__ import annotations

import argparse
import os
import sys

from lora_opt import no_network_env  # noqa: F401  (sets the no-network environment defaults)
from lora_opt import __version__
from lora_opt.cli import (apply, bench, calibrate, calibrate_e2e, dataset, emulate, error_model, evaluate, fidelity,
                          ingest, operate, pareto, place, probe, replan, schedule, search, simulate, train,
                          validate)
from lora_opt.cli.conventions import EPILOG, add_logging_flags, setup_logging, verbosity
from lora_opt.errors import BAD_INPUT, EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED

#: the commands, in the order ``lora-opt --help`` lists them
COMMANDS = (simulate, bench, calibrate, calibrate_e2e, dataset, train, place, evaluate, replan, schedule, search,
            pareto, fidelity, error_model, emulate, validate, ingest, probe, apply, operate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lora-opt",
        description="Serve many LoRA adapters on vLLM with as few GPUs as possible: a calibrated\n"
                    "digital twin of the engine and the tools built on it.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"lora-opt {__version__}")
    add_logging_flags(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    for command_parser in sub.choices.values():     # the logging flags also after the command
        add_logging_flags(command_parser)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (argparse's errors, e.g. a flag out of range, are 2)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:          # --help (0) or a bad flag (2, message already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        setup_logging(verbosity(args), getattr(args, "log_file", None))
    except OSError as exc:
        print(f"lora-opt {args.command}: error: --log-file: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return args.run(args)
    except BAD_INPUT as exc:
        print(f"lora-opt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        # an output path that cannot be made (--out names a file, no permission): the user's to fix
        print(f"lora-opt {args.command}: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"lora-opt {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`lora-opt place ... | head`): what was written is all it wanted.  Point
        # stdout at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
