"""The emulator engine's wake-ups, on time to the operating system's sleep (~0.1 ms), not the loop's
millisecond.

asyncio's own timers (``loop.call_at``) wake on whole milliseconds: the default loop's epoll timeout is
rounded up to one, uvloop's (libuv's) clock counts them.  A timer set for a step's end fired up to 1 ms
off, by an amount fixed by the step's length -- a bias, not noise, in any difference of two latencies:
``lora-opt probe``'s adapter load (TTFT of lone requests that load minus those that do not) read a
6.6-ms load as 7.0-7.1 ms (tests/test_probe.py's known profile, rank 8; sd of the estimate 0.08 ms).
Two ways that do not work: sleeping the rest of the millisecond on the loop holds back every request
sent meanwhile (at speed 10 they queued: mean TTFT +7 %), and waking at a dithered instant makes the
mean right but leaves two possible errors per step length, so medians stay biased.

So one thread per engine sleeps until the instant (a condition variable's timed wait: the kernel's
monotonic clock) and hands the callback to the loop with ``call_soon_threadsafe``, which wakes the
loop at once.  The engine sets one wake-up at a time; a callback queued before a later :meth:`set` or
:meth:`cancel` is dropped on the loop, so the engine only ever sees its current wake-up.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable


class WallTimer:
    """One pending wake-up: ``fn()`` run on ``loop`` at a :func:`time.perf_counter` instant.
    :meth:`set` replaces it, :meth:`cancel` drops it, :meth:`close` ends the thread; all three are
    called from the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "emulator-wall-timer"):
        self._loop = loop
        self._cv = threading.Condition()
        self._when: float | None = None     # perf_counter instant of the pending wake-up
        self._fn: Callable[[], None] | None = None
        self._generation = 0                # bumped by set / cancel: a wake-up queued before is stale
        self._closed = False
        self._thread = threading.Thread(target=self._sleep_until_due, name=name, daemon=True)
        self._thread.start()

    def set(self, when: float, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                return
            self._generation += 1
            self._when, self._fn = when, fn
            self._cv.notify()

    def cancel(self) -> None:
        with self._cv:
            self._generation += 1           # even with nothing pending: one may wait on the loop already
            if self._when is not None:      # the thread sleeps to a deadline: wake it to drop that
                self._when = self._fn = None
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self.cancel()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _sleep_until_due(self) -> None:
        with self._cv:
            while not self._closed:
                if self._when is None:
                    self._cv.wait()
                    continue
                left = self._when - time.perf_counter()
                if left > 0:
                    self._cv.wait(left)         # woken early by set / cancel / close: look again
                    continue
                generation, fn = self._generation, self._fn
                self._when = self._fn = None
                try:
                    self._loop.call_soon_threadsafe(self._run_if_current, generation, fn)
                except RuntimeError:            # the loop closed under the engine: nothing left to wake
                    return

    def _run_if_current(self, generation: int, fn: Callable[[], None]) -> None:
        if generation == self._generation:      # read on the loop's thread, the only one that bumps it
            fn()
