"""Run many twin simulations in parallel on Ray (a local instance by default).

``run_scenarios`` is the one place where lora-opt fans simulations out: the fidelity report, the
dataset generator and the search all call it.  Scenarios travel as plain dicts (validated again in
the worker), results come back as dicts, in input order, so a serial and a Ray run give the same
rows.  Work is sent in batches so per-task overhead stays small next to the simulations.

Serial or Ray: ``--workers 1`` is serial, ``--workers N > 1`` or a cluster (``--ray-address`` /
``RAY_ADDRESS``) is Ray.  By default (no ``--workers``) the first task runs here and is timed; the
rest goes to Ray only when Ray would finish it sooner despite its start-up (``ray_pays_off``, from
``RAY_STARTUP_S`` and ``RAY_TASK_S`` measured on the 2-core reference machine), so small jobs pay
no start-up tax.  The choice is logged (logger ``lora_opt.parallel``) and shown on progress bars.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqdm import tqdm

import twin
from lora_opt import no_network_env  # noqa: F401  (no-network environment before Ray starts)
from twin.scenario import scenario_from_dict


def simulate_dict(scenario: dict, extra: Callable[[Any], dict] | None = None) -> dict:
    """Simulate one scenario dict; the result dict plus ``wall_s`` and ``steps``.
    A scenario that cannot be simulated returns ``{"status": "error", "error": message}``."""
    try:
        res = twin.simulate(scenario_from_dict(scenario))
    except twin.ScenarioError as exc:
        return {"status": "error", "error": str(exc)}
    out = res.to_dict()
    out["wall_s"] = res.wall_s
    out["steps"] = res.steps
    out["arrived"] = res.arrived
    return out


def _simulate_batch(scenarios: list[dict]) -> list[dict]:
    return [simulate_dict(s) for s in scenarios]


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or connect to) Ray quietly, on loopback, without usage reporting or dashboard.
    A local instance started here is watched by ``start_ray_reaper``: it never outlives this
    process, ``kill -9`` included; a cluster at ``address`` / ``RAY_ADDRESS`` is never touched."""
    import ray  # heavy optional dependency: only when tasks go to Ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                                  configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        reaper = start_ray_reaper()       # before ray.init: a kill during its 5-10 s is covered too
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (lora_opt.no_network_env) keeps the local node on 127.0.0.1
        ctx = ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=200 * 1024**2, **kwargs)
        if reaper is not None:
            reaper.tell(ctx.address_info.get("session_dir") or "")


#: The reaper's program (run as ``python -c``, standard library only, so it starts in ~30 ms).
#: argv: driver pid, Ray's temp root, seconds to wait for Ray's own clean-up.  It reads the session
#: directory the driver sends on stdin, then blocks until stdin closes -- the driver exited, however
#: (the kernel closes a killed process's pipe).  Then every process of that session still alive
#: after the wait (those whose command line names the session directory, or that hold a file in it
#: open: raylet, GCS, workers -- which retitle themselves ``ray::<task>`` -- and agents) is killed,
#: and the session directory is removed.  Without a name (the driver died during
#: ``ray.init``) the session is the one Ray names after the driver's pid, created since the start.
_REAPER = r"""
import glob, os, shutil, signal, sys, time
pid, root, wait_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
signal.signal(signal.SIGINT, signal.SIG_IGN)
started, sent = time.time() - 1, b""
while True:
    chunk = os.read(0, 4096)
    if not chunk:
        break
    sent += chunk
names = [n for n in sent.decode(errors="replace").splitlines() if n.strip()]
if names:
    session = names[-1]
else:
    found = [d for d in glob.glob(os.path.join(root, "session_*_%d" % pid)) if os.path.getmtime(d) >= started]
    session = max(found, key=os.path.getmtime) if found else ""
if not session or not os.path.basename(session).startswith("session_"):
    sys.exit(0)
me, uid, prefix = os.getpid(), os.getuid(), session.rstrip("/") + "/"
def in_session(pid):
    with open("/proc/%s/cmdline" % pid, "rb") as fh:
        if prefix.encode() in fh.read().replace(b"\0", b"/") + b"/":
            return True
    fds = "/proc/%s/fd" % pid          # busy workers retitle themselves (ray::task): their logs tell
    for fd in os.listdir(fds):
        try:
            if os.readlink(os.path.join(fds, fd)).startswith(prefix):
                return True
        except OSError:
            pass
    return False
def members():
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, pid):   # never the driver itself: it may still be
            continue                                          # finishing (its pipe closes at interpreter teardown)
        try:
            if os.stat("/proc/" + entry).st_uid == uid and in_session(entry):
                out.append(int(entry))
        except OSError:
            pass
    return out
def driver_alive():
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
t_end = time.time() + 30.0              # the driver's exit first (its pipe closed while it tears down)
while driver_alive() and time.time() < t_end:
    time.sleep(0.1)
deadline = time.time() + wait_s
while members() and time.time() < deadline:
    time.sleep(0.2)
for sig in (signal.SIGTERM, signal.SIGKILL):
    for p in members():
        try:
            os.kill(p, sig)
        except OSError:
            pass
    time.sleep(0.5)
shutil.rmtree(session, ignore_errors=True)
"""

#: seconds the reaper lets Ray's own clean-up run (raylet and GCS die with the driver within ~1 s)
REAPER_WAIT_S = 1.0


class RayReaper:
    """The handle of a running reaper: ``tell`` it the session directory once Ray has started."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def tell(self, session_dir: str) -> None:
        try:
            self.proc.stdin.write(session_dir.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            log.warning("the Ray reaper is gone: Ray may outlive this process if it is killed")


def ray_temp_root() -> str:
    """Where a local Ray keeps its sessions (Ray's own rule: RAY_TMPDIR, TMPDIR on Linux, /tmp)."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if sys.platform.startswith("linux") else None)
    return os.path.join(base or "/tmp", "ray")


def start_ray_reaper() -> RayReaper | None:
    """Start the watchdog that kills a local Ray instance started by this process when this process
    ends -- normally, by an exception, or by ``kill -9`` (Ray's own fate sharing leaves busy workers
    running for up to ~30 s, and nothing removes the session directory).  It runs in its own session,
    so a signal to the driver's process group (Ctrl-C, ``kill -- -PGID``) does not stop it first.
    Linux only (it finds Ray's processes in /proc); elsewhere None."""
    if not sys.platform.startswith("linux"):
        return None
    proc = subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), ray_temp_root(), str(REAPER_WAIT_S)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    reaper = RayReaper(proc)
    _REAPERS.append(reaper)           # the pipe's write end stays open (referenced) until this process ends
    return reaper


_REAPERS: list[RayReaper] = []


def _batches(items: Sequence, size: int) -> Iterable[tuple[int, list]]:
    for i in range(0, len(items), size):
        yield i, list(items[i:i + size])


log = logging.getLogger(__name__)

#: Ray's start-up on a local instance (s): ``import ray`` 0.3, ``ray.init`` 5.0, the first task on
#: every fresh worker (imports lora_opt and twin, loads the Numba kernel) 2.2, ``ray.shutdown`` at
#: exit 1.4.  Measured on the 2-core reference machine by ``lora-opt bench ray`` (median of 3 fresh
#: processes); rerun it on another machine and set these from its output.
RAY_STARTUP_S = 9.2
#: Ray's overhead per task once started (s): submit, schedule, (de)serialise, ``ray.wait``; same bench.
RAY_TASK_S = 0.0013


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def ray_forced(workers: int | None, ray_address: str | None) -> bool:
    """The user asked for Ray: more than one worker, or a cluster (``--ray-address`` / ``RAY_ADDRESS``)."""
    return bool(ray_address or os.environ.get("RAY_ADDRESS")) or (workers is not None and workers > 1)


def use_ray(workers: int | None, ray_address: str | None) -> bool | None:
    """True: Ray (asked for); False: serial in this process (``workers=1``, no cluster); None: the
    default -- decided from the work (``ray_pays_off``)."""
    if ray_forced(workers, ray_address):
        return True
    return False if workers == 1 else None


def ray_pays_off(tasks_left: int, task_s: float, cpus: int | None = None) -> bool:
    """Whether Ray would finish ``tasks_left`` tasks of ``task_s`` seconds each sooner than this
    process does serially: ``startup + ceil(tasks / cpus) * (task_s + RAY_TASK_S) < tasks * task_s``
    (start-up 0 when Ray already runs in this process).  With 2 CPUs and tasks of ``t`` seconds, Ray
    pays off from about ``2 * RAY_STARTUP_S / t`` tasks: below ~18 s of serial work, serial wins."""
    cpus = cpus or os.cpu_count() or 1
    if tasks_left <= 1 or cpus <= 1:
        return False
    startup = 0.0 if _ray_running() else RAY_STARTUP_S
    return startup + math.ceil(tasks_left / cpus) * (task_s + RAY_TASK_S) < tasks_left * task_s


def _say(report: Callable[[str], None] | None, msg: str) -> None:
    if report is not None:
        log.debug(msg)              # the progress bar shows it
        report(msg)
    else:
        log.info(msg)


def run_batches(fn: Callable[[list], list], batches: Sequence[list], on_done: Callable[[int, list], None], *,
                workers: int | None = None, ray_address: str | None = None,
                report: Callable[[str], None] | None = None, what: str | None = None) -> str:
    """Run ``fn(batch)`` for every batch -- as Ray tasks, or serially -- and call
    ``on_done(index, result)`` in the driver as each one finishes (in completion order).

    By default (``use_ray`` is None) batches run here, timed, while ``ray_pays_off`` says the rest
    is too little work for Ray; the rest goes to Ray once it pays off.  ``report`` receives the
    choice as one line, naming the work ``what`` (default: "N tasks"), e.g. ``serial: 3 GPU
    replays, below the Ray threshold``.  Returns ``"serial"`` or ``"ray"``."""
    mode, n, start = use_ray(workers, ray_address), len(batches), 0
    what = what or f"{n} tasks"
    if mode is not True:
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            if mode is None and i > 0 and ray_pays_off(n - i, (time.perf_counter() - t0) / i, workers):
                start = i
                break
            on_done(i, fn(batch))
        else:
            _say(report, f"serial: {what}, {'--workers 1' if mode is False else 'below the Ray threshold'}")
            return "serial"
    import ray  # heavy optional dependency: only when tasks go to Ray

    address = ray_address or os.environ.get("RAY_ADDRESS")
    where = f"the cluster at {address}" if address else f"{workers or os.cpu_count()} workers"
    why = "asked for" if mode else f"above the Ray threshold ({start} of {n} tasks ran here, timed)"
    _say(report, f"Ray: {what} on {where}, {why}")
    init_ray(ray_address, workers)
    remote = ray.remote(num_cpus=1)(fn)
    pending = {remote.remote(batches[i]): i for i in range(start, n)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            on_done(pending.pop(ref), ray.get(ref))
    return "ray"


def run_scenarios(scenarios: Sequence[dict], *, workers: int | None = None, ray_address: str | None = None,
                  batch_size: int | None = None, desc: str = "simulating", progress: bool = True) -> list[dict]:
    """Simulate every scenario; results in input order.

    ``workers=1`` runs serially in this process (no Ray); ``workers > 1`` sends tasks to Ray (a
    local instance with ``workers`` CPUs), as does a cluster at ``ray_address`` / ``RAY_ADDRESS``;
    the default (None) runs serially unless the work is large enough to pay Ray's start-up
    (``run_batches``), then on a local instance with all cores.
    """
    n = len(scenarios)
    if n == 0:
        return []
    cpus = workers or os.cpu_count() or 1
    size = batch_size or max(1, min(16, n // (4 * cpus) or 1))
    starts_batches = list(_batches(scenarios, size))
    results: list[dict | None] = [None] * n
    with tqdm(total=n, desc=desc, unit="sim", disable=not progress, smoothing=0.1) as bar:
        def done(i: int, rows: list) -> None:
            start = starts_batches[i][0]
            results[start:start + len(rows)] = rows
            bar.update(len(rows))

        run_batches(_simulate_batch, [b for _, b in starts_batches], done, workers=workers,
                    ray_address=ray_address, what=f"{n} simulations",
                    report=lambda msg: bar.set_description_str(f"{desc} ({msg})"))
    return results  # type: ignore[return-value]


def idle_task(seconds: float = 0.0) -> float:
    """A task that only waits: starts Ray workers ahead of timed work, and exercises timeouts."""
    time.sleep(seconds)
    return seconds


class TaskPool:
    """Submit tasks one by one and take them back as they finish -- Ray tasks on ``workers`` CPUs
    (local instance or ``ray_address``), or inline when serial.  For drivers that decide the next
    task from the last result (Optuna's ask/tell).  A task that raises, or runs past ``timeout_s``
    (it is cancelled), comes back as the exception instead of a result.

    By default (no ``workers``, no cluster) with ``tasks`` (how many will be submitted) given, tasks
    run inline, timed, until ``ray_pays_off`` for the ones left; then the rest go to Ray.  Without
    ``tasks`` the default is Ray.  ``mode`` says which was chosen, and why."""

    def __init__(self, fn: Callable, *, workers: int | None = None, ray_address: str | None = None,
                 tasks: int | None = None):
        asked = use_ray(workers, ray_address)
        self.fn, self._workers, self._address = fn, workers, ray_address
        self._done: collections.deque = collections.deque()
        self._pending: dict[Any, tuple[Any, float]] = {}
        self._auto = asked is None and tasks is not None
        self._tasks, self._ran, self._ran_s = tasks or 0, 0, 0.0
        self.serial, self.workers = True, 1
        if asked is False or self._auto:
            self.mode = f"serial: {tasks or 'the'} tasks, {'--workers 1' if asked is False else 'below the Ray threshold'}"
        else:
            self._start_ray("asked for" if asked else "the default when the number of tasks is not known")
        log.info(self.mode)

    def _start_ray(self, why: str) -> None:
        import ray  # heavy optional dependency: only when tasks go to Ray
        init_ray(self._address, self._workers)
        self.serial = False
        address = self._address or os.environ.get("RAY_ADDRESS")
        self.workers = self._workers or (int(ray.cluster_resources().get("CPU", 1)) if address else os.cpu_count() or 1)
        self._remote = ray.remote(num_cpus=1, max_retries=0)(self.fn)
        self.mode = f"Ray: {self.workers} workers{' at ' + address if address else ''}, {why}"

    def put(self, obj):
        """Share a large argument once (an object-store reference under Ray)."""
        if self.serial:
            return obj
        import ray  # heavy optional dependency: only when tasks go to Ray
        return ray.put(obj)

    #: tasks queued per worker: a second one waiting in Ray hides the driver's round trip
    QUEUE_PER_WORKER = 2

    @property
    def free(self) -> int:
        slots = self.workers if self.serial else self.QUEUE_PER_WORKER * self.workers
        return slots - len(self._pending) - len(self._done)

    @property
    def busy(self) -> int:
        return len(self._pending) + len(self._done)

    def submit(self, key, *args) -> None:
        if self.serial:
            t0 = time.perf_counter()
            try:
                out = self.fn(*args)
            except Exception as exc:  # noqa: BLE001 - handed back to the caller as the result
                out = exc
            took = time.perf_counter() - t0
            self._done.append((key, out, took))
            self._ran, self._ran_s = self._ran + 1, self._ran_s + took
            if self._auto and ray_pays_off(self._tasks - self._ran, self._ran_s / self._ran, self._workers):
                self._auto = False
                self._start_ray(f"above the Ray threshold ({self._ran} of {self._tasks} tasks ran here, timed)")
                log.info(self.mode)
            return
        self._pending[self._remote.remote(*args)] = (key, time.monotonic())

    def next_done(self, timeout_s: float | None = None):
        """(key, result or exception) of a finished task; blocks until one finishes."""
        if self._done:        # inline: a task is not cut short, but one that ran too long fails as on Ray
            key, out, took = self._done.popleft()
            if timeout_s is not None and took > timeout_s:
                return key, TimeoutError(f"task ran longer than {timeout_s:g} s")
            return key, out
        import ray  # heavy optional dependency: only when tasks go to Ray
        while True:
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=1.0)
            if ready:
                key, _ = self._pending.pop(ready[0])
                try:
                    return key, ray.get(ready[0])
                except Exception as exc:  # noqa: BLE001 - a failed task is a result
                    return key, exc
            if timeout_s is not None:
                now = time.monotonic()
                for ref, (key, t0) in list(self._pending.items()):
                    if now - t0 > timeout_s:
                        ray.cancel(ref, force=True)
                        del self._pending[ref]
                        return key, TimeoutError(f"task ran longer than {timeout_s:g} s")
