"""One step's batch: the RUNNING loop (with recompute preemption), the LoRA set, the WAITING
(admission) loop, in vLLM V1 order (running first, then admission into the same step) or V0
order (a prefill-only step when any waiting request is admitted, else a decode step)."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine_kv import blocks_for, preempt_newest
from twin.engine_queues import NONE, dequeue, first_in_set, waiting_in_set

LORA_SET_SCHEDULED = 0
"""vLLM 0.8.5: the LoRA set is the adapters of the requests scheduled so far in the step."""
LORA_SET_RUNNING = 1
"""vLLM 0.33: the LoRA set is the adapters of every running request."""


@njit(cache=True)
def _set_add(s, a):
    """Add adapter ``a`` to this step's LoRA set (stamps ``set_stamp[a] == step`` plus a list)."""
    if s.set_stamp[a] != s.step:
        s.set_stamp[a] = s.step
        s.set_list[s.n_set] = a
        s.n_set += 1


@njit(cache=True)
def _add_to_batch(s, r, num_new):
    s.sched_tok[r] = num_new
    s.n_tokens += num_new
    s.budget -= num_new
    s.batch[s.n_batch] = r
    s.n_batch += 1
    _set_add(s, s.req_adapter[r])


@njit(cache=True)
def schedule_running(s):
    """RUNNING loop in admission order: each request asks for ``prompt + generated - computed``
    tokens (1 for a decode, the rest of the prompt for a prefill chunk), capped by the token
    budget; when its KV blocks cannot be allocated, the most recently admitted running request is
    preempted, until the allocation fits or the victim is the request itself (then the loop stops).
    Returns how many RUNNING entries (in order) it visited."""
    cfg = s.cfg
    bs, max_loras = cfg.block_size, cfg.max_loras
    scheduled_rule = cfg.lora_set_rule == LORA_SET_SCHEDULED
    # The simulator's hottest loop.  Arrays and counters live in locals while it runs: a state
    # field written here would be stored and reloaded every iteration (the compiler cannot tell
    # it apart from the arrays written in between); preempt_newest reads and changes the state,
    # so they are synchronised around it.
    in_len, generated, computed, held = s.in_len, s.generated, s.computed, s.held
    running, req_adapter, set_stamp, set_list = s.running, s.req_adapter, s.set_stamp, s.set_list
    sched_tok, batch = s.sched_tok, s.batch
    step = s.step
    budget, free, ctx, n_tokens, n_batch, n_set = s.budget, s.free_blocks, s.ctx, s.n_tokens, s.n_batch, s.n_set
    n_running = s.n_running
    i = 0
    while i < n_running and budget > 0:
        # unsigned indices: Numba adds a negative-index fix-up to every signed one, in this chain of
        # dependent loads (running -> request -> adapter -> stamp); unsigned, the kernel ran 19 % faster
        r = np.uint32(running[np.uint32(i)])
        a = np.uint32(req_adapter[r])
        if scheduled_rule and n_set >= max_loras and set_stamp[a] != step:
            # 0.8.5 would hand the worker more adapters than slots and crash; keep the request
            # running but unscheduled this step (only reachable when the token budget is shared
            # by more running requests than it can serve).
            i += 1
            continue
        comp = computed[r]
        num_new = min(in_len[r] + generated[r] - comp, budget)
        # held == blocks_for(computed) between steps: a new block only when the tokens outgrow the
        # held ones (spares the division on most decodes)
        tokens = comp + num_new
        need = blocks_for(tokens, bs) - held[r] if tokens > held[r] * bs else 0
        if need > free:
            s.free_blocks = free
            while need > s.free_blocks:
                if preempt_newest(s) == r:
                    s.budget, s.ctx, s.n_tokens, s.n_batch, s.n_set = budget, ctx, n_tokens, n_batch, n_set
                    return i
            free, n_running = s.free_blocks, s.n_running
        free -= need
        held[r] += need
        ctx += comp
        # the request joins the batch and its adapter the LoRA set (_add_to_batch, inlined)
        sched_tok[r] = num_new
        n_tokens += num_new
        budget -= num_new
        batch[np.uint32(n_batch)] = r
        n_batch += 1
        if set_stamp[a] != step:
            set_stamp[a] = step
            set_list[np.uint32(n_set)] = a
            n_set += 1
        i += 1
    s.budget, s.free_blocks, s.ctx, s.n_tokens, s.n_batch, s.n_set = budget, free, ctx, n_tokens, n_batch, n_set
    return i


@njit(cache=True)
def lora_set_of_running(s, start):
    """0.33 rule: the LoRA set holds the adapters of every running request (those before
    ``start`` in RUNNING were scheduled this step: their adapters are in it already)."""
    running, req_adapter, set_stamp, set_list = s.running, s.req_adapter, s.set_stamp, s.set_list
    step, n_set = s.step, s.n_set
    for j in range(start, s.n_running):
        a = req_adapter[np.uint32(running[j])]
        if set_stamp[a] != step:
            set_stamp[a] = step
            set_list[n_set] = a
            n_set += 1
    s.n_set = n_set


@njit(cache=True)
def _start_work(s, r):
    """The early stop's work bound: ``r`` is started (credited in full until it finishes)."""
    if s.stop.bucket_cost_s.shape[0] > 0 and not s.started[r]:
        s.started[r] = 1
        b = s.stop.req_bucket[r]
        tokens = s.in_len[r] + s.out_len[r]
        s.pool_cost[b] -= s.stop.req_cost_s[r]
        s.pool_tokens[b] -= tokens
        s.inflight_tokens += tokens


@njit(cache=True)
def _admit(s, r, num_new):
    """``r`` leaves WAITING for the tail of RUNNING with the blocks of its first chunk."""
    s.admitted += 1
    _start_work(s, r)
    dequeue(s, r)
    alloc = blocks_for(num_new, s.cfg.block_size)
    s.free_blocks -= alloc
    s.held[r] = alloc
    s.running[s.n_running] = r
    s.n_running += 1
    _add_to_batch(s, r, num_new)


@njit(cache=True)
def _gated_scan(w0, ws0, visited, exhausted):
    """Waiting entries vLLM visits in the gated phase: all of them when the queue is exhausted,
    else estimated from the in-set share (``ws0`` of ``w0``) of the waiting requests."""
    if exhausted:
        return w0
    return min(w0, (visited * w0 + max(ws0, 1) - 1) // max(ws0, 1))


@njit(cache=True)
def admit_waiting(s):
    """WAITING loop, FCFS: a request whose adapter is outside a full LoRA set is skipped (vLLM
    ``continue``s, it does not block); admission stops at the first request whose prompt does not
    fit in free KV blocks, at ``max_num_seqs`` running, or when the token budget is spent.
    We jump straight to admissible requests but count the entries vLLM would visit
    (``s.scanned``), which the scheduler-time estimator charges."""
    cfg = s.cfg
    gated, exhausted, kv_blocked = False, False, False
    w0, ws0, k2 = 0, 0, 0
    while s.budget > 0 and s.n_running < cfg.max_num_seqs and s.n_waiting > 0:
        if s.n_set < cfg.max_loras:
            r = s.ghead
            s.scanned += 1
        else:
            if not gated:
                gated, w0, ws0 = True, s.n_waiting, waiting_in_set(s)
            r = first_in_set(s)
            if r == NONE:
                exhausted = True
                break
        total = s.in_len[r] + s.generated[r]
        if not cfg.chunked_prefill and total > s.budget:
            break                      # V0 schedules whole prompts only
        num_new = total if total < s.budget else s.budget
        reserve = total if cfg.reserve_full_prompt else num_new
        if blocks_for(reserve, cfg.block_size) > s.free_blocks:
            kv_blocked = True
            break
        if gated:
            k2 += 1
        _admit(s, r, num_new)
    if gated:
        s.scanned += _gated_scan(w0, ws0, k2 + (1 if kv_blocked else 0), exhausted)


@njit(cache=True)
def schedule(s):
    """Build this step's batch (``s.batch[:s.n_batch]``, ``s.sched_tok`` per request) and its
    statistics (tokens, context, LoRA set, admitted, scanned, preempted)."""
    s.budget = s.cfg.max_num_batched_tokens
    s.n_batch, s.n_set, s.n_tokens, s.ctx = 0, 0, 0, 0
    s.admitted, s.scanned, s.preempted = 0, 0, False
    visited = 0
    for phase in range(2):
        if s.cfg.chunked_prefill:
            do_running, do_waiting = phase == 0, phase == 1
        else:
            do_running, do_waiting = phase == 1 and s.n_batch == 0, phase == 0
        if do_running:
            visited = schedule_running(s)
        if do_waiting:
            if s.cfg.lora_set_rule == LORA_SET_RUNNING:
                lora_set_of_running(s, visited)
            if not s.preempted:
                admit_waiting(s)
