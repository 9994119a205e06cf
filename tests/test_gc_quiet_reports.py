"""tests/gc_quiet_reports.py keeps a failing test's report from crashing pytest: an inner pytest run of
a test that fails while garbage with a raising finalizer waits for collection (a collection at every
allocation, each leaving such garbage for the next) ends in an INTERNALERROR without the plugin, and reports the failure with it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INNER = '''
import gc
import time

#: until when a collected one leaves another behind (the report is made within this)
UNTIL = time.monotonic() + 3


class RaisesWhenCollected:
    def __init__(self):
        self.d = {}
        self.me = self      # a cycle: only a collection frees it

    def __del__(self):
        if time.monotonic() < UNTIL:
            RaisesWhenCollected()   # garbage for the next collection
        x = self.d["k"] + 1     # a partial-line segment: 3.11 parses it to place its carets


def test_fails_with_garbage_waiting():
    RaisesWhenCollected()
    gc.set_threshold(1)     # a collection at every allocation
    assert 1 + 1 == 3
'''


def run_inner(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *plugin, str(tmp_path / "test_inner.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the nested-parse crash is CPython 3.11's")
def test_without_the_plugin_pytest_crashes(tmp_path):
    out = run_inner(tmp_path)
    assert out.returncode == 3 and "AST constructor recursion depth mismatch" in out.stdout + out.stderr, out.stdout


def test_with_the_plugin_the_failure_is_reported(tmp_path):
    out = run_inner(tmp_path, "-p", "gc_quiet_reports")
    assert out.returncode == 1 and "INTERNALERROR" not in out.stdout + out.stderr, out.stdout
    # the failure, its source and its line, as pytest reports any failure
    assert ">       assert 1 + 1 == 3" in out.stdout and "test_inner.py:23: AssertionError" in out.stdout
    assert "FAILED test_inner.py::test_fails_with_garbage_waiting" in out.stdout
