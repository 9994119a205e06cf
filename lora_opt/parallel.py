"""Run many twin simulations in parallel on Ray (a local instance by default).

``run_scenarios`` is the one place where lora-opt fans simulations out: the fidelity report, the
dataset generator and the search all call it.  Scenarios travel as plain dicts (validated again in
the worker), results come back as dicts, in input order, so a serial and a Ray run give the same
rows.  Work is sent in batches so per-task overhead stays small next to the simulations.
"""
from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqdm import tqdm

import twin
from lora_opt import settings  # noqa: F401  (no-network environment before Ray starts)
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
    """Start (or connect to) Ray quietly, on loopback, without usage reporting or dashboard."""
    import ray  # heavy optional dependency: only when tasks go to Ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                                  configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (lora_opt.settings) keeps the local node on 127.0.0.1
        ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=200 * 1024**2, **kwargs)


def _batches(items: Sequence, size: int) -> Iterable[tuple[int, list]]:
    for i in range(0, len(items), size):
        yield i, list(items[i:i + size])


def use_ray(workers: int | None, ray_address: str | None) -> bool:
    """Serial in this process only when asked for one worker and no cluster is named."""
    return not (workers == 1 and not (ray_address or os.environ.get("RAY_ADDRESS")))


def run_batches(fn: Callable[[list], list], batches: Sequence[list], on_done: Callable[[int, list], None], *,
                workers: int | None = None, ray_address: str | None = None) -> None:
    """Run ``fn(batch)`` for every batch -- as Ray tasks, or serially -- and call
    ``on_done(index, result)`` in the driver as each one finishes (in completion order)."""
    if not use_ray(workers, ray_address):
        for i, batch in enumerate(batches):
            on_done(i, fn(batch))
        return
    import ray  # heavy optional dependency: only when tasks go to Ray

    init_ray(ray_address, workers)
    remote = ray.remote(num_cpus=1)(fn)
    pending = {remote.remote(batch): i for i, batch in enumerate(batches)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            on_done(pending.pop(ref), ray.get(ref))


def run_scenarios(scenarios: Sequence[dict], *, workers: int | None = None, ray_address: str | None = None,
                  batch_size: int | None = None, desc: str = "simulating", progress: bool = True) -> list[dict]:
    """Simulate every scenario; results in input order.

    ``workers=1`` runs serially in this process (no Ray).  Otherwise tasks go to Ray: a local
    instance with ``workers`` CPUs, or the cluster at ``ray_address`` / ``RAY_ADDRESS``.
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
                    ray_address=ray_address)
    return results  # type: ignore[return-value]


def idle_task(seconds: float = 0.0) -> float:
    """A task that only waits: starts Ray workers ahead of timed work, and exercises timeouts."""
    time.sleep(seconds)
    return seconds


class TaskPool:
    """Submit tasks one by one and take them back as they finish -- Ray tasks on ``workers`` CPUs
    (local instance or ``ray_address``), or inline when serial.  For drivers that decide the next
    task from the last result (Optuna's ask/tell).  A task that raises, or runs past ``timeout_s``
    (it is cancelled), comes back as the exception instead of a result."""

    def __init__(self, fn: Callable, *, workers: int | None = None, ray_address: str | None = None):
        self.serial = not use_ray(workers, ray_address)
        self.workers = 1 if self.serial else (workers or os.cpu_count() or 1)
        self.fn = fn
        self._done: collections.deque = collections.deque()
        self._pending: dict[Any, tuple[Any, float]] = {}
        if not self.serial:
            import ray  # heavy optional dependency: only when tasks go to Ray
            init_ray(ray_address, workers)
            if ray_address or os.environ.get("RAY_ADDRESS"):
                self.workers = workers or int(ray.cluster_resources().get("CPU", 1))
            self._remote = ray.remote(num_cpus=1, max_retries=0)(fn)

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
            try:
                self._done.append((key, self.fn(*args)))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller as the result
                self._done.append((key, exc))
            return
        self._pending[self._remote.remote(*args)] = (key, time.monotonic())

    def next_done(self, timeout_s: float | None = None):
        """(key, result or exception) of a finished task; blocks until one finishes."""
        if self._done:
            return self._done.popleft()
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
