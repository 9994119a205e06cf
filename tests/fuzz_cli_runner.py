"""Runs lora-opt CLI commands for the end-to-end fuzz cases (tests/test_fuzz_inputs.py), each in a
forked child under hard limits: address space (``resource.setrlimit(RLIMIT_AS)``: what the child had
at the fork plus ``mem_bytes``) and wall time (killed after ``timeout_s``).

Started once per test run (``python tests/fuzz_cli_runner.py [--warm-surrogate]``): it imports
lora-opt and warms the twin's kernel (and, asked to, the bundled surrogate), prints ``ready``, then
reads one JSON request a line on stdin -- ``{"argv": [...], "timeout_s": s, "mem_bytes": n}`` -- and
answers one JSON line: the exit status (``rc``; 70 = an exception escaped ``main``, its traceback in
``stderr``), the tails of stdout and stderr, ``killed`` (ran past its time), the child's peak RSS
(``VmHWM``) and its growth over the child's RSS when it started, and the wall time.  Forking keeps a case's cost to the
command itself (no interpreter start, no imports).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback

from lora_opt.cli import main

WARM_WORKLOAD = """profile: llama-3.1-8b-h100-64gb
adapters:
  - {count: 3, rank: 8, rate: 0.5, prefix: w-}
evaluation: {duration_s: 30}
"""


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _quiet_main(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def warm(surrogate: bool) -> None:
    """Load what every case would otherwise load again in its child: the twin's kernel, and with
    ``surrogate`` the bundled surrogate greedy-plus consults (~15 s once)."""
    with tempfile.TemporaryDirectory() as d:
        wl = os.path.join(d, "w.yaml")
        with open(wl, "w") as fh:
            fh.write(WARM_WORKLOAD)
        policy = "greedy-plus" if surrogate else "greedy-fast"
        out = os.path.join(d, "o")
        assert _quiet_main(["place", "--workload", wl, "--gpus", "2", "--policy", policy, "--verify-s", "90",
                            "--out", out]) == 0
        # 3: evaluated, and the placement starves in this short window (the warm-up only loads things)
        assert _quiet_main(["evaluate", out, "--workers", "1", "--duration-s", "30", "--grace-s", "10",
                            "--json", "--no-track"]) in (0, 3)


def run_child(argv: list[str], mem_bytes: int, out_path: str, err_path: str) -> None:
    """In the forked child: limits, then ``main``; never returns."""
    rc, start_rss = 70, 0
    try:
        # the files take over file descriptors 1 and 2: what C code or a library writes there too
        for fd, path in ((1, out_path), (2, err_path)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        start_rss = _status_kib("VmRSS")
        vm = _status_kib("VmSize") * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + mem_bytes, vm + mem_bytes))
        try:
            rc = main(argv)
        except BaseException:  # noqa: BLE001 - what escapes main is the finding: its traceback
            traceback.print_exc()
            rc = 70
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        try:                # this child's peak RSS (its high-water mark started at the fork's RSS)
            with open(out_path + ".hwm", "w") as fh:
                fh.write(f"{_status_kib('VmHWM')} {start_rss}")
        except OSError:
            pass
        os._exit(rc if isinstance(rc, int) else 70)


def run_case(req: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out_path, err_path = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            run_child(req["argv"], int(req["mem_bytes"]), out_path, err_path)
        killed = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > req["timeout_s"]:
                os.kill(pid, signal.SIGKILL)
                killed = True
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        wall = time.monotonic() - t0
        rc = os.waitstatus_to_exitcode(status)

        def tail(path: str) -> str:
            try:
                with open(path, errors="replace") as fh:
                    return fh.read()[-20000:]
            except OSError:
                return ""
        try:
            peak, start = (int(x) for x in tail(out_path + ".hwm").split())
        except ValueError:
            peak, start = 0, 0
        return {"rc": rc, "killed": killed, "stdout": tail(out_path), "stderr": tail(err_path),
                "peak_rss_kib": peak, "rss_growth_kib": max(0, peak - start), "wall_s": wall}


def serve() -> None:
    warm("--warm-surrogate" in sys.argv)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_case(json.loads(line))), flush=True)


if __name__ == "__main__":
    serve()
