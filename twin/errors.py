"""Errors the twin raises on bad input. The CLI prints them without a traceback."""


class ScenarioError(ValueError):
    """Invalid scenario, profile, workload or trace; the message names the field and what is allowed."""
