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


def _holds_open(pid: str, session: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(session + "/"):
                return True
        except OSError:
            pass
    return False


def _session_processes(session: str) -> list[int]:
    """Processes naming ``session`` on their command line or holding a file in it open (a busy Ray
    worker retitles itself ``ray::<task>``, so its command line no longer says)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    named = session.encode() in fh.read()
            except OSError:
                continue
            if named or _holds_open(entry, session):
                out.append(int(entry))
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
    import os, subprocess, sys, time
    from lora_opt.parallel import start_ray_reaper
    session, other = sys.argv[1], sys.argv[2]
    reaper = start_ray_reaper()
    reaper.tell(session)
    # stand-ins for Ray's processes, detached (own session, like Ray's workers): one whose command
    # line names the session directory (raylet), one that only holds a log file in it open (a busy
    # worker, retitled), one of another session, which must survive
    sleep = "import os, time; log = open(os.environ['LOG'], 'a'); time.sleep(600)"
    procs = [subprocess.Popen([sys.executable, "-c", sleep, arg], start_new_session=True,
                              env={**os.environ, "LOG": log})
             for arg, log in ((session + "/sockets/raylet", other + "/logs/a.log"),
                              ("worker", session + "/logs/worker.log"),
                              (other, other + "/logs/b.log"))]
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
    named, holding, theirs = (int(x) for x in driver.stdout.readline().split())
    try:
        assert _wait_gone(lambda: not _holds_open(str(holding), str(session)), 10) is not None
        assert _alive(named) and _alive(holding) and _alive(theirs)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        took = _wait_gone(lambda: _alive(named) or _alive(holding) or session.exists(), REAPER_WAIT_S + 10)
        assert took is not None, "the session's processes or directory outlived the driver by 10 s"
        assert _alive(theirs) and other.exists(), "the reaper touched another session"
    finally:
        for pid in (named, holding, theirs):
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
        # a worker running a task retitles itself ray::<task> (no session on its command line)
        busy = _wait_gone(lambda: sum(_cmdline(p).startswith("ray::idle_task")
                                      for p in _session_processes(session)) < 2, 60)
        assert busy is not None, "Ray's two workers did not start idle_task"
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        took = _wait_gone(lambda: bool(_session_processes(session)) or Path(session).exists(), REAPER_WAIT_S + 10)
        assert took is not None, f"left after 10 s: {_session_processes(session)}, dir {Path(session).exists()}"
    finally:
        driver.kill()
        for pid in _session_processes(session) if session else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
