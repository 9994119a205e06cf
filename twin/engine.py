"""The engine loop: one vLLM instance serving many LoRA adapters, one scheduler step at a time.

This is the simulator core.  It is compiled with Numba (``cache=True``) because a simulated hour
is 10^4..10^5 steps over up to thousands of requests; everything works on flat arrays held by one
state object (``twin.engine_state.EngineState``), and each concern is a small function of it in
its own module (map below).

One call of :func:`step` = one vLLM engine step (V1 scheduler, reference §3.1):

1. arrivals with ``arrival <= now`` join the tail of WAITING (``engine_queues.take_arrivals``);
2. RUNNING loop in admission order: each request asks for ``prompt + generated - computed``
   tokens (1 for a decode, the rest of the prompt for a prefill chunk), capped by the step's token
   budget; when its KV blocks cannot be allocated, the most recently admitted running request is
   recompute-preempted to the head of WAITING, until the allocation fits or the victim is the
   request itself (then the loop stops) (``engine_schedule.schedule_running``);
3. the LoRA set: adapters of the requests scheduled so far (0.8.5) or of every running request
   (0.33);
4. WAITING loop (only when nothing was preempted): FCFS; a request whose adapter is outside a full
   LoRA set is skipped (vLLM ``continue``s, it does not block); admission stops at the first
   request whose prompt does not fit in free KV blocks, at ``max_num_seqs`` running, or when the
   token budget is spent (``engine_schedule.admit_waiting``);
5. adapters of the batch are made resident: GPU slots are a cache of ``max_loras`` over a CPU
   cache of ``max_cpu_loras`` over disk; misses are charged at step start
   (``twin.adapter_cache.load_batch_adapters``);
6. step time = scheduler time + load time + model time (profile estimators, ``engine_cost``); every
   scheduled request advances, those that completed their prompt+generated tokens sample one
   token, those with all output tokens finish and free their blocks (``engine_record.advance_batch``).

Without V1's chunked prefill (V0), 2-4 are reordered: a prefill-only step when any waiting request
is admitted, else a decode step.  Before 1, a step records the time-series samples due (the state
the last step left, as vLLM's gauges show it between steps); before 2 it checks the early stop
(certain starvation, every 10 simulated seconds); between steps, :func:`run_engine` takes the fast
forward (identical decode-only steps in one go).

============================  ====================================================================
``twin.engine_state``         the state object (inputs, mutable state, outputs), its constructor,
                              ``add_request`` (append a request to a live state), ``results``
``twin.engine_queues``        WAITING: global FCFS list and one FIFO per adapter; arrivals
``twin.engine_kv``            KV blocks, recompute preemption
``twin.engine_schedule``      one step's batch: RUNNING loop, LoRA set, WAITING (admission) loop
``twin.adapter_cache``        GPU slots over CPU cache over disk; eviction policies, their registry
``twin.engine_cost``          step time (the profile's estimators)
``twin.engine_record``        advancing the batch, ITL samples, time series, running/waiting areas
``twin.engine_early_stop``    certain starvation (token cap and least-work bound)
``twin.engine_fast_forward``  identical decode-only steps in one go
``twin.engine_invariants``    per-step invariants (``check_invariants``, property tests)
``twin.numba_cache``          keeps Numba's cache of the kernel fresh across these modules
============================  ====================================================================

Skipping blocked requests without scanning them (waiting queues of 10^4 under starvation) uses two
linked lists over the same requests: the global FCFS order, and one FIFO per adapter.  When the
LoRA set is full, the next admissible request is the earliest head among the set's adapters.

**Online use.**  An engine fed live (an HTTP emulator) builds a state with no requests
(``twin.simulate.engine_state`` with empty ``Requests``; a ``duration`` as long as the session,
no early stop), appends each request as it arrives with
``twin.engine_state.add_request(s, now, in_len, out_len, adapter)`` (arrival order; the
per-request arrays grow) and calls :func:`step` until it returns ``DONE`` (nothing left to run
before another request comes in; ``WAITED``: the clock jumped to the next appended arrival).
``s.t`` is the simulated clock; first-token and finish times are in ``results(s)`` (a ``KernelRun``,
fields by name).  ``tests/test_engine.py`` drives a state this way and gets the offline run's numbers
exactly.
"""
from __future__ import annotations

from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.adapter_cache import load_batch_adapters
from twin.engine_cost import step_seconds
from twin.engine_early_stop import starvation_certain
from twin.engine_fast_forward import skip_steady_steps, steady
from twin.engine_invariants import check_invariants
from twin.engine_queues import next_arrival_in, take_arrivals
from twin.engine_record import account_areas, advance_batch, drop_finished, record_timeseries
from twin.engine_schedule import LORA_SET_RUNNING, LORA_SET_SCHEDULED, schedule
from twin.engine_state import results

__all__ = ["DONE", "LORA_SET_RUNNING", "LORA_SET_SCHEDULED", "STEPPED", "STOPPED", "WAITED",
           "results", "run_engine", "step"]

# What one call of step() did
STEPPED = 0
"""A scheduler step ran; the clock moved to its end."""
WAITED = 1
"""Nothing could run: the clock jumped to the next arrival."""
DONE = 2
"""The end: ``duration`` reached, no request left to arrive, or stalled for good."""
STOPPED = 3
"""Early stop: starvation is certain (``s.stopped_at`` = now)."""


@njit(cache=True)
def step(s, check=False):
    """Advance the engine ``s`` by one scheduler step (points 1-6 of the module docstring);
    returns STEPPED, WAITED, DONE or STOPPED.  ``check``: assert the invariants after the step."""
    record_timeseries(s)           # the state the last step left: what vLLM's gauges say until the next one
    take_arrivals(s)
    if s.t >= s.cfg.duration:
        return DONE
    if s.n_running == 0 and s.n_waiting == 0:
        if s.next_arr >= s.n_req:
            return DONE
        s.t = s.arrival[s.next_arr]          # idle: jump to the next arrival
        return WAITED
    if starvation_certain(s):
        s.stopped_at = s.t
        return STOPPED
    s.step += 1
    schedule(s)
    if s.n_batch == 0:
        # Nothing can run.  Only an arrival can change that; if none can come in (all arrived, or
        # the client holds them at its in-flight cap) the engine is stalled for good.
        return WAITED if next_arrival_in(s) else DONE
    load_batch_adapters(s)
    dt = step_seconds(s.lat, s.n_batch, s.n_tokens, s.ctx, s.n_distinct, s.n_running, s.scanned, s.load_ms)
    t_end = s.t + dt
    account_areas(s, t_end)
    advance_batch(s, t_end, dt)
    if s.finished_now > 0:          # RUNNING changes only when a request finished
        drop_finished(s)
    if check:
        check_invariants(s, t_end)
    s.t = t_end
    return STEPPED


@njit(cache=True)
def run_engine(s, check=False, fast_forward=True):
    """Run ``s`` to the end (``duration``, no request left, stalled, or early stop); returns
    :func:`results`.  ``fast_forward``: skip identical decode-only steps in one go (same numbers,
    bit for bit; off only in tests, and with ``check``)."""
    while True:
        outcome = step(s, check)
        if outcome >= DONE:
            break
        if outcome == STEPPED and fast_forward and not check and steady(s):
            skip_steady_steps(s)
    return results(s)
