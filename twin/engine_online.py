"""What an online driver of the engine (``lora_opt.emulate``: requests arriving over HTTP) needs
besides ``twin.engine.step`` and ``twin.engine_state.add_request``: the tokens a step produced,
aborting a request (a client that went away), and the gauges vLLM exports.  Nothing here runs in
a batch simulation (``run_engine`` never calls it), so batch results do not depend on it."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine_queues import dequeue


@njit(cache=True)
def step_outputs(s):
    """After a ``STEPPED`` step: (requests that sampled a token at its end, their generated
    counts, the step's batch).  A request sampled a token iff its last token time is the clock."""
    n = s.n_batch
    tok_r = np.empty(n, np.int64)
    tok_gen = np.empty(n, np.int64)
    k = 0
    for j in range(n):
        r = s.batch[j]
        if s.last_t[r] == s.t and s.generated[r] > 0:
            tok_r[k] = r
            tok_gen[k] = s.generated[r]
            k += 1
    return tok_r[:k], tok_gen[:k], s.batch[:n].copy()


@njit(cache=True)
def abort_request(s, r):
    """Remove request ``r`` (let in already: ``r < s.next_arr``) from RUNNING or WAITING, freeing
    its KV blocks, as vLLM aborts a request whose client disconnected.  Returns 1 if it was
    running, 2 if waiting, 0 if it had finished (or was dropped) already.  Call between steps."""
    if s.dropped[r] != 0 or not np.isnan(s.finish_t[r]):
        return 0
    s.dropped[r] = 1
    s.n_dropped += 1                            # an aborted request counts as dropped
    for j in range(s.n_running):
        if s.running[j] == r:
            for k in range(j + 1, s.n_running):     # RUNNING keeps admission order
                s.running[k - 1] = s.running[k]
            s.n_running -= 1
            s.free_blocks += s.held[r]
            s.held[r] = 0
            return 1
    dequeue(s, r)
    return 2


@njit(cache=True)
def gauges(s):
    """(running, waiting, KV blocks used, KV blocks, preemptions, GPU-resident adapters, clock)."""
    return (s.n_running, s.n_waiting, s.cfg.kv_blocks - s.free_blocks, s.cfg.kv_blocks, s.preemptions,
            s.n_gpu, s.t)


@njit(cache=True)
def lora_usage(s):
    """Per adapter: running requests, waiting requests (vLLM's ``vllm:lora_requests_info``)."""
    n = s.a_wait.shape[0]
    running = np.zeros(n, np.int64)
    for j in range(s.n_running):
        running[s.req_adapter[s.running[j]]] += 1
    return running, s.a_wait.copy()


@njit(cache=True)
def first_times(s, rs):
    """(first-token time, running requests at the first token) of requests ``rs``."""
    n = rs.shape[0]
    t = np.empty(n, np.float64)
    run = np.empty(n, np.int64)
    for j in range(n):
        t[j] = s.first_t[rs[j]]
        run[j] = s.first_running[rs[j]]
    return t, run
