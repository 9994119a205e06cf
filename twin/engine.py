"""The engine loop: one vLLM instance serving many LoRA adapters, one scheduler step at a time.

This is the simulator core.  It is compiled with Numba (``cache=True``) because a simulated hour
is 10^4..10^5 steps over up to thousands of requests; everything works on flat arrays held by one
state object (``twin.kernel.state.EngineState``), and each concern is a small function of it in
``twin.kernel`` (see that package's docstring for the map) or ``twin.adapter_cache``.

One call of :func:`step` = one vLLM engine step (V1 scheduler, reference §3.1):

1. arrivals with ``arrival <= now`` join the tail of WAITING (``queues.take_arrivals``);
2. RUNNING loop in admission order: each request asks for ``prompt + generated - computed``
   tokens (1 for a decode, the rest of the prompt for a prefill chunk), capped by the step's token
   budget; when its KV blocks cannot be allocated, the most recently admitted running request is
   recompute-preempted to the head of WAITING, until the allocation fits or the victim is the
   request itself (then the loop stops) (``schedule.schedule_running``);
3. the LoRA set: adapters of the requests scheduled so far (0.8.5) or of every running request
   (0.33);
4. WAITING loop (only when nothing was preempted): FCFS; a request whose adapter is outside a full
   LoRA set is skipped (vLLM ``continue``s, it does not block); admission stops at the first
   request whose prompt does not fit in free KV blocks, at ``max_num_seqs`` running, or when the
   token budget is spent (``schedule.admit_waiting``);
5. adapters of the batch are made resident: GPU slots are a cache of ``max_loras`` over a CPU
   cache of ``max_cpu_loras`` over disk; misses are charged at step start
   (``twin.adapter_cache.load_batch_adapters``);
6. step time = scheduler time + load time + model time (profile estimators, ``cost``); every
   scheduled request advances, those that completed their prompt+generated tokens sample one
   token, those with all output tokens finish and free their blocks (``record.advance_batch``).

Without V1's chunked prefill (V0), 2-4 are reordered: a prefill-only step when any waiting request
is admitted, else a decode step.  Between steps :func:`run_engine` takes the early stop and the
fast forward (identical decode-only steps in one go).

Skipping blocked requests without scanning them (waiting queues of 10^4 under starvation) uses two
linked lists over the same requests: the global FCFS order, and one FIFO per adapter.  When the
LoRA set is full, the next admissible request is the earliest head among the set's adapters.

**Online use.**  An engine fed live (an HTTP emulator) builds a state with no requests
(``twin.simulate.engine_state`` with empty ``Requests``; a ``duration`` as long as the session,
no early stop), appends each request as it arrives with
``twin.kernel.state.add_request(s, now, in_len, out_len, adapter)`` (arrival order; the
per-request arrays grow) and calls :func:`step` while it returns ``STEPPED``; ``WAITED`` /
``DONE`` mean nothing runs before the next arrival.  ``s.t`` is the simulated clock; first-token
and finish times are in ``results(s)``.  ``tests/test_engine.py`` drives a state this way and gets
the offline run's numbers exactly.
"""
from __future__ import annotations

from numba import njit

from twin.adapter_cache import load_batch_adapters
from twin.kernel.cost import step_seconds
from twin.kernel.early_stop import starvation_certain
from twin.kernel.fast_forward import skip_steady_steps, steady
from twin.kernel.invariants import check_invariants
from twin.kernel.queues import next_arrival_in, take_arrivals
from twin.kernel.record import account_areas, advance_batch, drop_finished, record_timeseries
from twin.kernel.schedule import LORA_SET_RUNNING, LORA_SET_SCHEDULED, schedule
from twin.kernel.state import results

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
    take_arrivals(s)
    record_timeseries(s)
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
