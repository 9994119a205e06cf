"""Every output file is written whole or not at all (issue 12): through ``lora_opt.io``.

A static check keeps it that way (no module writes a file by any other route), and failures
injected in the middle of a write -- the disk refusing the flush, a figure failing while it
renders -- leave the previous file byte for byte, with no temporary left beside it.
"""
from __future__ import annotations

import os
import re

import pytest

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_bytes, atomic_write_csv, atomic_write_figure
from lora_opt.surrogates.reporting import write_json
from twin.paths import REPO_ROOT

#: ways of writing a file without lora_opt.io (a path argument, not an in-memory buffer)
DIRECT_WRITES = re.compile(r"""open\([^)]*["'][wax]b?\+?["']|\.write_text\(|\.write_bytes\(|json\.dump\(|"""
                           r"""savefig\((?!buf\b)|\.to_(csv|parquet|json)\((?!\)|buf\b|\w+=)|safe_dump\([^)]*,\s*fh""")
#: direct writes that are not whole outputs: scenario files the emulator benchmark puts in its own
#: TemporaryDirectory, read back by the server it launches and deleted with the directory; the log a
#: launched vLLM server streams into while it runs (`probe --launch`) and the one a Prometheus started
#: for a test streams into, which no rename could make whole
NOT_OUTPUTS = {("lora_opt/bench/prometheus_server.py", 'self.log = open(self.dir / "prometheus.log", "w")'),
               ("lora_opt/bench/emulate.py", "Path(path).write_text(yaml.safe_dump(scenario))"),
               ("lora_opt/bench/emulate.py", "Path(path).write_text(yaml.safe_dump(CAPACITY_SCENARIO))"),
               ("lora_opt/probe/launch.py", 'log = open(self.log_path, "wb")')}


def test_no_module_writes_a_file_except_through_lora_opt_io():
    found = []
    for pkg in ("lora_opt", "twin"):
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel == "lora_opt/io.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if DIRECT_WRITES.search(code) and (rel, code.strip()) not in NOT_OUTPUTS:
                    found.append(f"{rel}:{n}: {code.strip()}")
    assert not found, "write these through lora_opt.io (atomic):\n" + "\n".join(found)


def _leftovers(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.endswith(".tmp"))


def test_a_failed_flush_leaves_the_old_file(tmp_path, monkeypatch):
    """The disk refusing the data at fsync (EIO, ENOSPC): an InputError naming the file, the old
    content intact, the temporary removed."""
    target = tmp_path / "summary.json"
    write_json(target, {"version": 1})
    before = target.read_bytes()

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(InputError, match=r"cannot write .*summary\.json: No space left on device"):
        write_json(target, {"version": 2})
    monkeypatch.undo()
    assert target.read_bytes() == before and _leftovers(tmp_path) == []


def test_a_figure_that_fails_to_render_leaves_the_old_png(tmp_path):
    """A figure is rendered in memory first: one that fails half-way (bad mathtext, found only when
    drawn) leaves the old PNG as it was."""
    from matplotlib.figure import Figure  # heavy optional dependency: plotting

    target = tmp_path / "plot.png"
    good = Figure(figsize=(2, 2))
    good.subplots().plot([0, 1], [0, 1])
    atomic_write_figure(target, good, dpi=50)
    before = target.read_bytes()
    assert before.startswith(b"\x89PNG")
    bad = Figure(figsize=(2, 2))
    bad.subplots().set_title(r"$\frac{$")
    with pytest.raises(ValueError):
        atomic_write_figure(target, bad, dpi=50)
    assert target.read_bytes() == before and _leftovers(tmp_path) == []


def test_an_interrupted_write_leaves_the_old_table(tmp_path, monkeypatch):
    """A KeyboardInterrupt (or any exception) in the middle of writing the bytes: old table kept."""
    import pandas as pd  # heavy optional dependency: tables

    target = tmp_path / "runs.csv"
    atomic_write_csv(target, pd.DataFrame({"a": [1, 2]}), index=False)
    before = target.read_bytes()
    real_fdopen = os.fdopen

    class Interrupting:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[: len(data) // 2])      # half the bytes reach the temporary file
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Interrupting(real_fdopen(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        atomic_write_csv(target, pd.DataFrame({"a": list(range(1000))}), index=False)
    monkeypatch.undo()
    assert target.read_bytes() == before and _leftovers(tmp_path) == []


def test_a_directory_in_the_way_is_a_clean_error(tmp_path):
    (tmp_path / "out.json").mkdir()
    with pytest.raises(InputError, match="is a directory"):
        atomic_write_bytes(tmp_path / "out.json", b"{}")
