"""The simulator's invariants after one step (``check_invariants``, used by the property tests)."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.adapter_cache import POLICIES
from twin.engine_schedule import LORA_SET_RUNNING

#: the policy under which a batch's adapters all hold GPU slots at the step's end (under FIFO a
#: later load of the same step can evict an adapter the batch uses: loaded longest ago, used now)
_LRU = POLICIES["lru"].code


@njit(cache=True)
def _distinct_adapters(s, reqs, n):
    seen = np.zeros(s.gpu_res.shape[0], np.int64)
    n_distinct = 0
    for j in range(n):
        a = s.req_adapter[reqs[j]]
        if seen[a] == 0:
            seen[a] = 1
            n_distinct += 1
    return n_distinct


@njit(cache=True)
def check_invariants(s, t_end):
    """Raise AssertionError when the step now -> ``t_end`` broke an invariant."""
    if not t_end > s.t:
        raise AssertionError("the clock did not move forward")
    if s.n_waiting + s.n_running + s.n_finished + s.n_dropped != s.next_arr:
        raise AssertionError("an arrived request is neither finished, running, waiting nor dropped")
    if s.free_blocks < 0 or s.free_blocks > s.cfg.kv_blocks:
        raise AssertionError("KV blocks in use exceed the capacity")
    used = 0
    for j in range(s.n_running):
        used += s.held[s.running[j]]
    if used != s.cfg.kv_blocks - s.free_blocks:
        raise AssertionError("KV blocks held by running requests != blocks in use")
    for r in range(s.n_req):
        if s.generated[r] > s.out_len[r]:
            raise AssertionError("a request produced more than its output tokens")
    if s.cfg.lora_set_rule == LORA_SET_RUNNING:
        n_distinct = _distinct_adapters(s, s.running, s.n_running)
    else:
        n_distinct = _distinct_adapters(s, s.batch, s.n_batch)
    if n_distinct > s.cfg.max_loras:
        raise AssertionError("more distinct adapters than max_loras in the LoRA set")
    for j in range(s.n_batch if s.cfg.cache_policy == _LRU else 0):
        if s.gpu_res[s.req_adapter[s.batch[j]]] == 0:
            raise AssertionError("a request ran without its adapter in a GPU slot")
    if s.n_gpu > s.cfg.max_loras or s.gpu_res.sum() != s.n_gpu:
        raise AssertionError("more adapters resident in GPU slots than max_loras")
    if s.n_cpu > s.cfg.max_cpu_loras or s.cpu_res.sum() != s.n_cpu:
        raise AssertionError("more adapters in the CPU cache than max_cpu_loras")
