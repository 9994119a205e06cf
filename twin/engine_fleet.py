"""What a fleet's driver (``twin.fleet``: N engines, a router deciding at each arrival) needs of the
kernel besides ``twin.engine.step`` and ``twin.engine_state.add_request``: advancing an engine to a
time without knowing which requests its router will send it next, and the metrics a router
scrapes.  Nothing here runs in a single-engine simulation (``run_engine`` never calls it).

Advancing to ``h`` runs every step that *starts* before ``h`` (a request arriving at ``h`` joins the
first step starting at or after it: the batch kernel's rule), with the fast forward stopped at
``h`` (``s.horizon``): the engine does not know yet whether a request arrives then; the next advance
resumes those repeats without a full step (a fleet advancing engines at every arrival would
otherwise lose the fast forward), and without a pass over the running requests: a fast forward
stopped at the horizon is left pending, the requests caught up only before a step reads them
(``twin.engine_fast_forward.settle``; :func:`finish` too).  So a fleet
whose router sends an engine exactly the requests a single-engine run holds gets that run's
numbers, bit for bit."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine import DONE, STEPPED, step
from twin.engine_cost import step_seconds
from twin.engine_fast_forward import settle, skip_steady_steps, steady


@njit(cache=True)
def advance_to(s, h, check=False):
    """Run the steps of ``s`` that start before ``h`` (fast forward included, stopped at ``h``;
    ``check``: assert the invariants after every step, no fast forward)."""
    s.horizon = h
    if not check and s.n_batch > 0 and steady(s):
        # the last step was steady: resume its repeats where the previous horizon stopped them (what
        # run_engine does after it; a no-op when they stopped for any other reason)
        skip_steady_steps(s)
    while s.t < h:
        settle(s)                    # a step reads the requests' progress (a no-op: none pending)
        outcome = step(s, check)
        if outcome >= DONE:          # idle with no request known, the end, or stalled
            break
        if outcome == STEPPED and not check and steady(s):
            skip_steady_steps(s)


@njit(cache=True)
def advance_all(states, alive, h, check=False):
    """:func:`advance_to` every live engine of ``states`` (a typed list) to ``h``."""
    for e in range(len(states)):
        if alive[e]:
            advance_to(states[e], h, check)


@njit(cache=True)
def finish(s):
    """Lift the horizon: no request will be added any more (``run_engine`` takes it from here)."""
    settle(s)
    s.horizon = np.inf


@njit(cache=True)
def _step_floor(s, ctx):
    """The least of one repeat's seconds at context ``ctx``, with or without the waiting requests
    the last step scanned (a full step taken amid the repeats, at a time-series sample, scans none)."""
    return min(step_seconds(s.lat, s.n_batch, s.n_batch, ctx, s.n_distinct, s.n_running, s.scanned, 0.0),
               step_seconds(s.lat, s.n_batch, s.n_batch, ctx, s.n_distinct, s.n_running, 0, 0.0))


@njit(cache=True)
def finishes_none_before(s):
    """A time up to which advancing ``s`` finishes (or drops) no request, so the count of requests
    in flight a router reads holds until then unless one is added; ``s.t`` when unknown.

    Known only for a fast forward left pending at the horizon with no request about to arrive: its
    ``left`` remaining repeats finish nothing (the step after them does), nor admit a waiting
    request (the fast forward's own premise: what kept it waiting -- a full LoRA set, the KV blocks,
    the budget -- does not ease before a request finishes, and a full step taken amid the repeats at
    a time-series sample finds the same); with enough
    free blocks for all of them no preemption can shrink the batch, so each takes at least the
    least of the first and the last one's seconds (a step's seconds are affine in the context);
    the margin covers the rounding of the clock's sums.  A router that reads every engine at every
    arrival then advances an engine about once per finish, not once per step."""
    if s.ff_done == 0 or s.next_arr < s.n_req or s.n_running == 0:
        return s.t
    left = s.ff_until - 1 - s.ff_done
    # each running request needs at most left // bs + 1 blocks over the next left steps
    per_request = s.free_blocks // s.n_running
    left = min(left, s.cfg.block_size * per_request - 1)
    if left <= 0:
        return s.t
    first = s.ctx + s.n_batch
    floor = min(_step_floor(s, first), _step_floor(s, first + (left - 1) * s.n_batch))
    return s.t + left * floor * (1.0 - 1e-6)


@njit(cache=True)
def in_flight(states, alive):
    """Per engine: requests sent to it not finished (nor dropped) yet -- what a router counts."""
    out = np.zeros(len(states), np.int64)
    for e in range(len(states)):
        if alive[e]:
            s = states[e]
            out[e] = s.n_req - s.n_finished - s.n_dropped
    return out


@njit(cache=True)
def scrape(s):
    """The engine's metrics as vLLM exports them: (``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` as a fraction, the adapters of running
    requests and of waiting requests -- ``vllm:lora_requests_info``'s ``running_lora_adapters`` and
    ``waiting_lora_adapters``).  Requests at the client (its in-flight cap) are not waiting."""
    run = np.empty(s.n_running, np.int64)
    for j in range(s.n_running):
        run[j] = s.req_adapter[s.running[j]]
    n_ad = s.a_wait.shape[0]
    if s.n_waiting < n_ad:                   # walk WAITING, or scan the adapters, whichever is shorter
        wait = np.empty(s.n_waiting, np.int64)
        k = 0
        r = s.ghead
        while r != -1 and k < s.n_waiting:
            wait[k] = s.req_adapter[r]
            k += 1
            r = s.gnext[r]
    else:
        wait = np.empty(n_ad, np.int64)
        k = 0
        for a in range(n_ad):
            if s.a_wait[a] > 0:
                wait[k] = a
                k += 1
    kv = (s.cfg.kv_blocks - s.free_blocks) / max(1, s.cfg.kv_blocks)
    return s.n_running, s.n_waiting, kv, np.unique(run), np.unique(wait[:k])
