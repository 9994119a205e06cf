"""The errors lora-opt reports as bad input (exit status 2, a message, no traceback), and every
exit status a command returns (the one definition: the CLI, ``lora_opt.placement.report`` and
``lora_opt.validate.report`` import them from here; ``tests/test_one_owner.py`` keeps it so).

Two kinds, one per layer: the twin's ``ScenarioError`` for scenario and profile fields and request traces
(the twin knows nothing of lora_opt) -- raised as well by the readers of inputs made of the twin's kinds,
grid files (``lora_opt.surrogates.dataset``) and the real-runs CSV (``lora_opt.calibration.runs_csv``) --
and ``InputError`` for the rest of what lora-opt reads -- CLI flags, workload, placement, request-log and
drift files, surrogate directories.  Both name the file, flag or field, the value and what is allowed.
"""
from __future__ import annotations

from twin.errors import ScenarioError


class InputError(ValueError):
    """Bad input to lora-opt outside a scenario: a CLI flag, a workload, placement, request-log, drift
    or model file.  The message names the flag, file or field and the allowed values."""


#: what the CLI reports as bad input (exit status 2)
BAD_INPUT = (InputError, ScenarioError)


# Exit statuses of every ``lora-opt`` command (``lora-opt --help`` lists them: lora_opt.cli.conventions'
# EPILOG).  Library code returns them too (a placement's verdict, validate's outcome), so they live here,
# importable without the CLI.
#: success
EXIT_OK = 0
#: bad input: a flag, file or field (``BAD_INPUT``; the message names it and the allowed values)
EXIT_BAD_INPUT = 2
#: it ran, but the result is not acceptable (outputs still written): a placement that starves or does
#: not start (evaluate), a pool too small (place: infeasible), no feasible point (search, pareto),
#: requests failed (validate), a probe family failed (probe)
EXIT_NOT_ACCEPTABLE = 3
#: place: the placement has instances that would not start (written, no launch commands)
EXIT_NOT_DEPLOYABLE = 4
#: validate: the live side was measured and written, the twin step failed
EXIT_TWIN_FAILED = 5
#: interrupted (Ctrl-C); what was finished is kept
EXIT_INTERRUPTED = 130
#: stdout's reader went away (``lora-opt ... | head``): 128 + SIGPIPE, as a shell reports a command killed by it
EXIT_BROKEN_PIPE = 141
