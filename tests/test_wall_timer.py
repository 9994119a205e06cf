"""The emulator engine's wake-ups (lora_opt/emulate/wall_timer.py): one pending wake-up, run on the loop's
thread; a replaced or cancelled one never runs, even when its thread had already handed it to the loop;
close ends the thread.  How close to the instant it wakes is measured by ``lora-opt bench emulate``
(timer error) and shown end to end by test_probe's known-profile recovery, not timed here."""
from __future__ import annotations

import asyncio
import threading
import time

from lora_opt.emulate.wall_timer import WallTimer


def _run(coro):
    return asyncio.run(coro)


def test_a_wake_up_runs_once_on_the_loop_thread():
    async def main():
        loop, ran = asyncio.get_running_loop(), []
        timer = WallTimer(loop)
        timer.set(time.perf_counter() + 0.01, lambda: ran.append(threading.get_ident()))
        await asyncio.sleep(0.2)
        timer.close()
        return ran
    ran = _run(main())
    assert ran == [threading.get_ident()]


def test_a_replaced_wake_up_runs_only_the_new_one():
    async def main():
        timer, ran = WallTimer(asyncio.get_running_loop()), []
        timer.set(time.perf_counter() + 0.05, lambda: ran.append("old"))
        timer.set(time.perf_counter() + 0.02, lambda: ran.append("new"))
        await asyncio.sleep(0.2)
        timer.close()
        return ran
    assert _run(main()) == ["new"]


def test_a_cancelled_wake_up_never_runs():
    async def main():
        timer, ran = WallTimer(asyncio.get_running_loop()), []
        timer.set(time.perf_counter() + 0.02, lambda: ran.append("x"))
        timer.cancel()
        await asyncio.sleep(0.1)
        timer.close()
        return ran
    assert _run(main()) == []


def test_a_wake_up_handed_to_the_loop_then_cancelled_is_dropped():
    async def main():
        timer, ran = WallTimer(asyncio.get_running_loop()), []
        timer.set(time.perf_counter() - 1.0, lambda: ran.append("stale"))     # due: the thread hands it over
        time.sleep(0.1)                 # the loop is held: the handed-over callback waits in its queue
        timer.cancel()
        await asyncio.sleep(0.05)       # the callback runs now and finds itself stale
        timer.close()
        return ran
    assert _run(main()) == []


def test_close_ends_the_thread_and_later_sets_are_ignored():
    async def main():
        timer, ran = WallTimer(asyncio.get_running_loop()), []
        timer.set(time.perf_counter() + 10.0, lambda: ran.append("x"))
        timer.close()
        for _ in range(100):
            if not timer.alive:
                break
            await asyncio.sleep(0.01)
        timer.set(time.perf_counter(), lambda: ran.append("after close"))
        await asyncio.sleep(0.05)
        return timer.alive, ran
    assert _run(main()) == (False, [])
