"""A pytest plugin (tests/conftest.py loads it): failing tests' reports are made with the garbage
collector off.

Making a failing test's report parses its source (``ast.parse``).  A collection in the middle of that
can run a finalizer that raises; pytest's unraisable-exception hook formats its traceback at once, and
Python 3.11 formats it with a nested ``ast.parse`` -- CPython then fails the outer parse
("SystemError: AST constructor recursion depth mismatch", its AST state is shared) and pytest stops
with an INTERNALERROR that hides the failure and every test after it (CI of stop 32).
tests/test_gc_quiet_reports.py reproduces it with and without this plugin.
"""
from __future__ import annotations

import gc

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The report made with collection off; collection resumes after it (the module says why)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        if was_enabled:
            gc.enable()
