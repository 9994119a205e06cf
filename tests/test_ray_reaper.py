"""A local Ray started by lora-opt never outlives its driver, ``kill -9`` included (issue 12).

Measured before the reaper (``lora-opt evaluate ... --workers 2`` killed with ``kill -9`` while its
workers simulate): raylet and GCS die with the driver within ~1 s (Ray's fate sharing), but busy
workers linger 10-30 s and the session directory under /tmp/ray is never removed.  The reaper
(``lora_opt.parallel.start_ray_reaper``) kills what is left after ``REAPER_WAIT_S`` and removes it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lora_opt.parallel import REAPER_WAIT_S

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux only)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"     # a zombie is dead, only not reaped
    except OSError:
        return False


def _session_processes(session: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if session.encode() in fh.read() and _alive(int(entry)):
                        out.append(int(entry))
            except OSError:
                pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(check, limit_s: float) -> float | None:
    """Seconds until ``check()`` is false, or None if still true after ``limit_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if not check():
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


DRIVER = textwrap.dedent("""
    import subprocess, sys, time
    from lora_opt.parallel import start_ray_reaper
    session, other = sys.argv[1], sys.argv[2]
    reaper = start_ray_reaper()
    reaper.tell(session)
    # stand-ins for Ray's processes: detached (own session, like Ray's workers), their command
    # lines naming the session directory; one of another session must survive
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", arg],
                              start_new_session=True) for arg in (session + "/sockets/raylet", other)]
    print(" ".join(str(p.pid) for p in procs), flush=True)
    time.sleep(600)
""")


def test_reaper_kills_what_names_the_session_when_the_driver_is_killed(tmp_path):
    session = tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_1"
    other = tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_2"
    for d in (session, other):
        (d / "logs").mkdir(parents=True)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(session), str(other)], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    mine, theirs = (int(x) for x in driver.stdout.readline().split())
    try:
        assert _alive(mine) and _alive(theirs)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        took = _wait_gone(lambda: _alive(mine) or session.exists(), REAPER_WAIT_S + 10)
        assert took is not None, "the session's process or directory outlived the driver by 10 s"
        assert _alive(theirs) and other.exists(), "the reaper touched another session"
    finally:
        for pid in (mine, theirs):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


RAY_DRIVER = textwrap.dedent("""
    import sys, time
    import ray
    from lora_opt.parallel import idle_task, init_ray
    init_ray(None, 2)
    task = ray.remote(num_cpus=1)(idle_task)
    refs = [task.remote(600) for _ in range(2)]
    print(ray._private.worker.global_worker.node.get_session_dir_path(), flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_no_ray_process_outlives_a_killed_driver():
    """A real local Ray with two busy workers: ``kill -9`` of the driver leaves no process of its
    session and no session directory after a few seconds (the reaper waits REAPER_WAIT_S for Ray's
    own clean-up first).  Takes ~15-30 s: Ray's start-up."""
    driver = subprocess.Popen([sys.executable, "-c", RAY_DRIVER], env=ENV, stdout=subprocess.PIPE, text=True)
    session = driver.stdout.readline().strip()
    try:
        assert session and Path(session).is_dir()
        busy = _wait_gone(lambda: sum("default_worker" in _cmdline(p) for p in _session_processes(session)) < 2, 60)
        assert busy is not None, "Ray's two workers did not start"
        time.sleep(1.0)                                      # both are inside idle_task now
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        took = _wait_gone(lambda: bool(_session_processes(session)) or Path(session).exists(), REAPER_WAIT_S + 10)
        assert took is not None, f"left after 10 s: {_session_processes(session)}, dir {Path(session).exists()}"
    finally:
        for pid in _session_processes(session) if session else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
