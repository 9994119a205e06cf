"""KV blocks: a request holds ``ceil(tokens / block_size)`` blocks of the ``kv_blocks`` pool;
recompute preemption frees them all and sends the request back to WAITING."""
from __future__ import annotations

from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine_queues import requeue


@njit(cache=True)
def blocks_for(tokens, block_size):
    """Blocks that hold ``tokens`` tokens."""
    return (tokens + block_size - 1) // block_size


@njit(cache=True)
def preempt_newest(s):
    """Recompute-preempt the most recently admitted running request: its blocks are freed, its KV
    is lost (computed = 0) and it goes to the head of WAITING.  Returns it."""
    victim = s.running[s.n_running - 1]
    s.n_running -= 1
    s.free_blocks += s.held[victim]
    s.held[victim] = 0
    s.computed[victim] = 0
    s.preemptions += 1
    s.preempted = True
    requeue(s, victim)
    return victim
