"""The errors lora-opt reports as bad input (exit status 2, a message, no traceback).

Two kinds, one per layer: the twin's ``ScenarioError`` for scenario and profile fields (the twin knows
nothing of lora_opt), and ``InputError`` for everything lora-opt reads itself -- CLI flags, workload,
grid, placement, request-log and trace files, surrogate directories.  Both name the file, flag or
field, the value and what is allowed.
"""
from __future__ import annotations

from twin.errors import ScenarioError


class InputError(ValueError):
    """Bad input to lora-opt outside a scenario: a CLI flag, a workload, grid, placement, request-log,
    trace or model file.  The message names the flag, file or field and the allowed values."""


#: what the CLI reports as bad input (exit status 2)
BAD_INPUT = (InputError, ScenarioError)
