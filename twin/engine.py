"""The engine loop: one vLLM instance serving many LoRA adapters, one scheduler step at a time.

This is the whole simulator core.  It is compiled with Numba (``cache=True``) because a simulated
hour is 10^4..10^5 steps over up to thousands of requests; everything in it works on flat arrays.

One iteration of the loop = one vLLM engine step (V1 scheduler, reference §3.1):

1. arrivals with ``arrival <= now`` join the tail of WAITING;
2. RUNNING loop in admission order: each request asks for ``prompt + generated - computed``
   tokens (1 for a decode, the rest of the prompt for a prefill chunk), capped by the step's token
   budget; when its KV blocks cannot be allocated, the most recently admitted running request is
   recompute-preempted to the head of WAITING, until the allocation fits or the victim is the
   request itself (then the loop stops);
3. the LoRA set: adapters of the requests scheduled so far (0.8.5) or of every running request
   (0.33);
4. WAITING loop (only when nothing was preempted): FCFS; a request whose adapter is outside a full
   LoRA set is skipped (vLLM ``continue``s, it does not block); admission stops at the first
   request whose prompt does not fit in free KV blocks, at ``max_num_seqs`` running, or when the
   token budget is spent;
5. adapters of the batch are made resident: GPU slots are a cache of ``max_loras`` over a CPU
   cache of ``max_cpu_loras`` over disk; misses are charged at step start;
6. step time = scheduler time + load time + model time (profile estimators); every scheduled
   request advances, those that completed their prompt+generated tokens sample one token, those
   with all output tokens finish and free their blocks.

Skipping blocked requests without scanning them (waiting queues of 10^4 under starvation) uses two
linked lists over the same requests: the global FCFS order, and one FIFO per adapter.  When the
LoRA set is full, the next admissible request is the earliest head among the set's adapters.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# Adapter-cache eviction policies understood by the kernel (see twin.adapter_cache).
POLICY_LRU = 0
POLICY_FIFO = 1

LORA_SET_SCHEDULED = 0
LORA_SET_RUNNING = 1

_NONE = -1


@njit(cache=True)
def _grow(arr, n):
    """``arr`` with room for index ``n`` (doubling)."""
    if n < arr.shape[0]:
        return arr
    new = np.empty(max(16, arr.shape[0] * 2), dtype=arr.dtype)
    new[: arr.shape[0]] = arr
    return new


@njit(cache=True)
def _push_back(r, prev, nxt, head, tail):
    """Append ``r`` to a doubly linked list; returns the new (head, tail)."""
    prev[r] = tail
    nxt[r] = _NONE
    if tail != _NONE:
        nxt[tail] = r
    else:
        head = r
    return head, r


@njit(cache=True)
def _push_front(r, prev, nxt, head, tail):
    """Prepend ``r`` to a doubly linked list; returns the new (head, tail)."""
    nxt[r] = head
    prev[r] = _NONE
    if head != _NONE:
        prev[head] = r
    else:
        tail = r
    return r, tail


@njit(cache=True)
def _unlink(r, prev, nxt, head, tail):
    """Remove ``r`` from a doubly linked list; returns the new (head, tail)."""
    if prev[r] != _NONE:
        nxt[prev[r]] = nxt[r]
    else:
        head = nxt[r]
    if nxt[r] != _NONE:
        prev[nxt[r]] = prev[r]
    else:
        tail = prev[r]
    return head, tail


@njit(cache=True)
def _set_add(a, step, set_stamp, set_list, n_set):
    """Add adapter ``a`` to this step's LoRA set; returns the new set size."""
    if set_stamp[a] != step:
        set_stamp[a] = step
        set_list[n_set] = a
        n_set += 1
    return n_set


@njit(cache=True)
def _evict(resident, stamp, n_adapters):
    """Index of the resident adapter with the smallest stamp (LRU: last use; FIFO: load time)."""
    best = -1
    best_stamp = np.int64(2**62)
    for a in range(n_adapters):
        if resident[a] and stamp[a] < best_stamp:
            best_stamp = stamp[a]
            best = a
    return best


@njit(cache=True)
def _step_seconds(n_seqs, n_tokens, ctx, n_distinct, n_running, n_scanned, load_ms,
                  base_ms, per_seq_ms, per_token_ms, per_ctx_ktoken_ms, lora_jump, lora_slope,
                  lora_nsat, lora_prefill_share, sched_base_ms, sched_per_running_ms,
                  sched_per_waiting_ms):
    """Step time = scheduler + adapter loads + forward pass (the profile's estimators).
    The LoRA factor multiplies the per-sequence (decode-like) part; prefill tokens beyond one per
    sequence pay ``lora_prefill_share`` of the extra cost."""
    decode = base_ms + per_seq_ms * n_seqs + per_ctx_ktoken_ms * ctx / 1000.0
    prefill = per_token_ms * (n_tokens - n_seqs)
    if n_distinct > 0:
        extra = lora_jump + lora_slope * n_distinct / (1.0 + n_distinct / lora_nsat)
        model = decode * (1.0 + extra) + prefill * (1.0 + lora_prefill_share * extra)
    else:
        model = decode + prefill
    sched = sched_base_ms + sched_per_running_ms * n_running + sched_per_waiting_ms * n_scanned
    return (sched + load_ms + model) / 1000.0


@njit(cache=True)
def _check_invariants(t, t_end, arrived, n_dropped, n_waiting, n_running, n_finished, running, held,
                      generated, out_len, free_blocks, kv_blocks, batch, n_batch, req_adapter,
                      max_loras, lora_set_rule, n_gpu, max_cpu_loras, n_cpu, gpu_res, cpu_res,
                      step):
    """The simulator's invariants after one step (used by the property tests)."""
    if not t_end > t:
        raise AssertionError("the clock did not move forward")
    if n_waiting + n_running + n_finished + n_dropped != arrived:
        raise AssertionError("an arrived request is neither finished, running, waiting nor dropped")
    if free_blocks < 0 or free_blocks > kv_blocks:
        raise AssertionError("KV blocks in use exceed the capacity")
    used = 0
    for j in range(n_running):
        used += held[running[j]]
    if used != kv_blocks - free_blocks:
        raise AssertionError("KV blocks held by running requests != blocks in use")
    for r in range(generated.shape[0]):
        if generated[r] > out_len[r]:
            raise AssertionError("a request produced more than its output tokens")
    seen = np.zeros(gpu_res.shape[0], np.int64)
    n_distinct = 0
    if lora_set_rule == LORA_SET_RUNNING:
        for j in range(n_running):
            a = req_adapter[running[j]]
            if seen[a] == 0:
                seen[a] = 1
                n_distinct += 1
    else:
        for j in range(n_batch):
            a = req_adapter[batch[j]]
            if seen[a] == 0:
                seen[a] = 1
                n_distinct += 1
    if n_distinct > max_loras:
        raise AssertionError("more distinct adapters than max_loras in the LoRA set")
    if n_gpu > max_loras or gpu_res.sum() != n_gpu:
        raise AssertionError("more adapters resident in GPU slots than max_loras")
    if n_cpu > max_cpu_loras or cpu_res.sum() != n_cpu:
        raise AssertionError("more adapters in the CPU cache than max_cpu_loras")


@njit(cache=True)
def run_engine(
    # requests, sorted by arrival
    arrival, in_len, out_len, req_adapter,
    # adapters
    cpu_load_ms, disk_load_ms, gpu_resident0, cpu_resident0, gpu_stamp0, cpu_stamp0,
    # engine configuration
    max_loras, max_cpu_loras, max_num_seqs, max_num_batched_tokens, kv_blocks, block_size,
    lora_set_rule, reserve_full_prompt, chunked_prefill, cache_policy, duration, max_inflight,
    drop_overflow,
    # latency estimators (ms)
    base_ms, per_seq_ms, per_token_ms, per_ctx_ktoken_ms,
    lora_jump, lora_slope, lora_nsat, lora_prefill_share,
    sched_base_ms, sched_per_running_ms, sched_per_waiting_ms,
    # early stop of certain starvation (disabled when stop_target <= 0)
    stop_target, stop_cap_tok_s, stop_token_factor, kv_tokens,
    # ... and its per-request work bound (see twin.simulate.work_buckets; empty = unused)
    req_bucket, req_cost_s, bucket_cost_s, bucket_tokens, bucket_ratio,
    # time series
    ts_interval,
    # verify the invariants at every step (tests); raises AssertionError
    check=False,
    # skip identical decode-only steps in one go (same numbers, bit for bit; off only in tests)
    fast_forward=True,
):
    n_req = arrival.shape[0]
    n_ad = cpu_load_ms.shape[0]

    # per-request state
    computed = np.zeros(n_req, np.int32)      # tokens whose KV is computed
    generated = np.zeros(n_req, np.int32)     # output tokens sampled so far
    held = np.zeros(n_req, np.int32)          # KV blocks held
    first_t = np.full(n_req, np.nan)
    first_running = np.zeros(n_req, np.int32)  # running requests when the first token came out
    dropped = np.zeros(n_req, np.int8)
    n_dropped = 0
    last_t = np.full(n_req, np.nan)
    finish_t = np.full(n_req, np.nan)
    sched_tok = np.zeros(n_req, np.int32)     # tokens scheduled in the current step

    # waiting: global FCFS doubly linked list + one FIFO per adapter, ordered by key
    gnext = np.full(n_req, _NONE, np.int32)
    gprev = np.full(n_req, _NONE, np.int32)
    anext = np.full(n_req, _NONE, np.int32)
    aprev = np.full(n_req, _NONE, np.int32)
    key = np.zeros(n_req, np.int32)
    ahead = np.full(n_ad, _NONE, np.int64)
    a_wait = np.zeros(n_ad, np.int64)          # waiting requests per adapter
    atail = np.full(n_ad, _NONE, np.int64)
    ghead = _NONE
    gtail = _NONE
    n_waiting = 0
    tail_key = np.int64(0)
    head_key = np.int64(-1)

    running = np.empty(n_req, np.int32)       # admission order
    n_running = 0
    batch = np.empty(n_req, np.int32)         # requests scheduled in this step
    # LoRA set of this step, as stamps (set_stamp[a] == step) plus a list
    set_stamp = np.full(n_ad, -1, np.int64)
    set_list = np.empty(n_ad, np.int64)
    batch_stamp = np.full(n_ad, -1, np.int64)

    # adapter residency
    gpu_res = gpu_resident0.copy()
    cpu_res = cpu_resident0.copy()
    gpu_stamp = gpu_stamp0.copy()
    cpu_stamp = cpu_stamp0.copy()
    n_gpu = 0
    n_cpu = 0
    for a in range(n_ad):
        n_gpu += gpu_res[a]
        n_cpu += cpu_res[a]
    clock = np.int64(0)
    for a in range(n_ad):
        clock = max(clock, gpu_stamp[a], cpu_stamp[a])

    free_blocks = kv_blocks
    t = 0.0
    next_arr = 0
    step = np.int64(0)
    preemptions = 0
    loads_cpu = 0
    loads_disk = 0
    completed_tokens = 0
    n_finished = 0
    stopped_at = -1.0
    next_stop_check = 0.0
    # requests ever scheduled, and the tokens of those not finished (the work bound's credit)
    started = np.zeros(n_req, np.int8)
    inflight_tokens = 0
    pool_cost = bucket_cost_s.copy()
    pool_tokens = bucket_tokens.copy()
    n_buckets = bucket_cost_s.shape[0]
    blocks_at = np.zeros(block_size, np.int64)
    running_area = 0.0
    waiting_area = 0.0

    # ITL samples: regular gaps are whole steps (duration, count); irregular ones listed
    step_dur = np.empty(1024, np.float64)
    step_cnt = np.empty(1024, np.int64)
    n_steps_rec = 0
    irr = np.empty(256, np.float64)
    n_irr = 0

    n_ts = int(duration / ts_interval) + 1
    ts_running = np.zeros(n_ts, np.int64)
    ts_waiting = np.zeros(n_ts, np.int64)
    ts_kv = np.zeros(n_ts, np.int64)
    ts_loaded = np.zeros(n_ts, np.int64)
    ts_next = 0

    while True:
        # ---- arrivals -----------------------------------------------------------------
        while next_arr < n_req and arrival[next_arr] <= t:
            if n_running + n_waiting >= max_inflight:
                # the client cannot place the request: it fails (drop) or waits for a free slot
                if drop_overflow:
                    dropped[next_arr] = 1
                    n_dropped += 1
                    next_arr += 1
                    continue
                break
            r = next_arr
            a = req_adapter[r]
            key[r] = tail_key
            tail_key += 1
            ghead, gtail = _push_back(r, gprev, gnext, ghead, gtail)
            ahead[a], atail[a] = _push_back(r, aprev, anext, ahead[a], atail[a])
            n_waiting += 1
            a_wait[a] += 1
            next_arr += 1

        # ---- time series (state at the start of the step) -------------------------------
        while ts_next < n_ts and ts_next * ts_interval <= t:
            ts_running[ts_next] = n_running
            ts_waiting[ts_next] = n_waiting
            ts_kv[ts_next] = kv_blocks - free_blocks
            ts_loaded[ts_next] = n_gpu
            ts_next += 1

        if t >= duration:
            break
        if n_running == 0 and n_waiting == 0:
            if next_arr >= n_req:
                break
            t = arrival[next_arr]          # idle: jump to the next arrival
            continue

        # ---- early stop of certain starvation ---------------------------------------------
        if stop_target > 0.0 and t >= next_stop_check:
            next_stop_check = t + 10.0
            bound = completed_tokens + stop_token_factor * (kv_tokens + stop_cap_tok_s * (duration - t))
            if n_buckets > 0:
                # every request not yet started could at best be finished by T using its least
                # work (buckets in decreasing tokens-per-second order, fractional knapsack); the
                # started ones are credited in full
                budget_s = duration - t
                future = 0.0
                for b in range(n_buckets):
                    if budget_s <= 0.0:
                        break
                    c = max(pool_cost[b], 0.0)
                    if c <= budget_s:
                        future += pool_tokens[b]
                        budget_s -= c
                    else:
                        future += budget_s * bucket_ratio[b]
                        budget_s = 0.0
                bound = min(bound, completed_tokens + inflight_tokens + future)
            if bound < stop_target:
                stopped_at = t
                break

        step += 1
        budget = max_num_batched_tokens
        n_batch = 0
        n_set = 0
        preempted = False
        n_tokens = 0
        ctx = 0

        # V1 (chunked prefill) serves RUNNING first, then admits from WAITING into the same step.
        # V0 runs a prefill-only step when any waiting request is admitted, else a decode step.
        admitted = 0
        scanned = 0
        for phase in range(2):
            if chunked_prefill:
                do_running = phase == 0
                do_waiting = phase == 1
            else:
                do_waiting = phase == 0
                do_running = phase == 1 and n_batch == 0
            if do_running:
                # ---- RUNNING loop ---------------------------------------------------------------
                i = 0
                while i < n_running and budget > 0:
                    r = running[i]
                    a = req_adapter[r]
                    if (lora_set_rule == LORA_SET_SCHEDULED and set_stamp[a] != step
                            and n_set >= max_loras):
                        # 0.8.5 would hand the worker more adapters than slots and crash; keep the
                        # request running but unscheduled this step (only reachable when the token
                        # budget is shared by more running requests than it can serve).
                        i += 1
                        continue
                    num_new = in_len[r] + generated[r] - computed[r]
                    if num_new > budget:
                        num_new = budget
                    need = (computed[r] + num_new + block_size - 1) // block_size - held[r]
                    scheduled = True
                    while need > free_blocks:
                        victim = running[n_running - 1]
                        n_running -= 1
                        free_blocks += held[victim]
                        held[victim] = 0
                        computed[victim] = 0
                        preemptions += 1
                        preempted = True
                        va = req_adapter[victim]
                        key[victim] = head_key
                        head_key -= 1
                        ghead, gtail = _push_front(victim, gprev, gnext, ghead, gtail)
                        ahead[va], atail[va] = _push_front(victim, aprev, anext, ahead[va], atail[va])
                        n_waiting += 1
                        a_wait[va] += 1
                        if victim == r:
                            scheduled = False
                            break
                    if not scheduled:
                        break
                    free_blocks -= need
                    held[r] += need
                    sched_tok[r] = num_new
                    ctx += computed[r]
                    n_tokens += num_new
                    budget -= num_new
                    batch[n_batch] = r
                    n_batch += 1
                    n_set = _set_add(a, step, set_stamp, set_list, n_set)
                    i += 1

            if do_waiting:
                if lora_set_rule == LORA_SET_RUNNING:
                    for j in range(n_running):
                        a = req_adapter[running[j]]
                        n_set = _set_add(a, step, set_stamp, set_list, n_set)

                # ---- WAITING loop ---------------------------------------------------------------
                # vLLM walks the waiting queue in order and skips requests blocked by the LoRA gate; we
                # jump straight to admissible ones but count the entries vLLM would visit (``scanned``),
                # which the scheduler-time estimator charges.  In the gated phase the count is exact when
                # the queue is exhausted and estimated from the in-set share of waiting requests otherwise.
                if not preempted:
                    gated = False
                    w0 = 0
                    ws0 = 0
                    k2 = 0
                    exhausted = False
                    kv_blocked = False
                    while budget > 0 and n_running < max_num_seqs and n_waiting > 0:
                        if n_set < max_loras:
                            r = ghead
                            scanned += 1
                        else:
                            if not gated:
                                gated = True
                                w0 = n_waiting
                                for j in range(n_set):
                                    ws0 += a_wait[set_list[j]]
                            r = _NONE
                            best = np.int64(2**62)
                            for j in range(n_set):
                                h = ahead[set_list[j]]
                                if h != _NONE and key[h] < best:
                                    best = key[h]
                                    r = h
                            if r == _NONE:
                                exhausted = True
                                break
                        a = req_adapter[r]
                        total = in_len[r] + generated[r]
                        if not chunked_prefill and total > budget:
                            break                      # V0 schedules whole prompts only
                        num_new = total if total < budget else budget
                        reserve = total if reserve_full_prompt else num_new
                        need = (reserve + block_size - 1) // block_size
                        if need > free_blocks:
                            kv_blocked = True
                            break
                        if gated:
                            k2 += 1
                        admitted += 1
                        if n_buckets > 0 and not started[r]:
                            started[r] = 1
                            b = req_bucket[r]
                            pool_cost[b] -= req_cost_s[r]
                            pool_tokens[b] -= in_len[r] + out_len[r]
                            inflight_tokens += in_len[r] + out_len[r]
                        # unlink from both waiting lists
                        ghead, gtail = _unlink(r, gprev, gnext, ghead, gtail)
                        ahead[a], atail[a] = _unlink(r, aprev, anext, ahead[a], atail[a])
                        n_waiting -= 1
                        a_wait[a] -= 1
                        alloc = (num_new + block_size - 1) // block_size
                        free_blocks -= alloc
                        held[r] = alloc
                        running[n_running] = r
                        n_running += 1
                        sched_tok[r] = num_new
                        n_tokens += num_new
                        budget -= num_new
                        batch[n_batch] = r
                        n_batch += 1
                        n_set = _set_add(a, step, set_stamp, set_list, n_set)

                    if gated:
                        if exhausted:
                            scanned += w0
                        else:
                            visited = k2 + (1 if kv_blocked else 0)
                            scanned += min(w0, (visited * w0 + max(ws0, 1) - 1) // max(ws0, 1))

        if n_batch == 0:
            # Nothing can run.  Only an arrival can change that; if none can come in (all arrived,
            # or the client holds them at its in-flight cap) the engine is stalled for good.
            if next_arr >= n_req or arrival[next_arr] <= t:
                break
            t = arrival[next_arr]
            continue

        # ---- adapter residency and load time --------------------------------------------
        load_ms = 0.0
        n_distinct = 0
        for j in range(n_batch):
            a = req_adapter[batch[j]]
            if batch_stamp[a] == step:
                continue
            batch_stamp[a] = step
            n_distinct += 1
            clock += 1
            if not cpu_res[a]:
                load_ms += disk_load_ms[a]
                loads_disk += 1
                if n_cpu >= max_cpu_loras:
                    v = _evict(cpu_res, cpu_stamp, n_ad)
                    cpu_res[v] = 0
                    n_cpu -= 1
                    if gpu_res[v]:          # evicting from CPU also deactivates the GPU slot
                        gpu_res[v] = 0
                        n_gpu -= 1
                cpu_res[a] = 1
                n_cpu += 1
                cpu_stamp[a] = clock
            elif cache_policy == POLICY_LRU:
                cpu_stamp[a] = clock
            if not gpu_res[a]:
                load_ms += cpu_load_ms[a]
                loads_cpu += 1
                if n_gpu >= max_loras:
                    v = _evict(gpu_res, gpu_stamp, n_ad)
                    gpu_res[v] = 0
                    n_gpu -= 1
                gpu_res[a] = 1
                n_gpu += 1
                gpu_stamp[a] = clock
            elif cache_policy == POLICY_LRU:
                gpu_stamp[a] = clock

        # ---- step time --------------------------------------------------------------------
        dt = _step_seconds(n_batch, n_tokens, ctx, n_distinct, n_running, scanned, load_ms,
                           base_ms, per_seq_ms, per_token_ms, per_ctx_ktoken_ms, lora_jump,
                           lora_slope, lora_nsat, lora_prefill_share, sched_base_ms,
                           sched_per_running_ms, sched_per_waiting_ms)
        t_end = t + dt
        dt_in = min(t_end, duration) - t
        running_area += n_running * dt_in
        waiting_area += n_waiting * dt_in

        # ---- advance the batch ----------------------------------------------------------
        regular = 0
        finished_now = 0
        for j in range(n_batch):
            r = batch[j]
            computed[r] += sched_tok[r]
            sched_tok[r] = 0
            if computed[r] == in_len[r] + generated[r]:
                generated[r] += 1
                if generated[r] == 1:
                    first_t[r] = t_end
                    first_running[r] = n_running
                elif last_t[r] == t:
                    regular += 1
                else:
                    irr = _grow(irr, n_irr)
                    irr[n_irr] = t_end - last_t[r]
                    n_irr += 1
                last_t[r] = t_end
                if generated[r] == out_len[r]:
                    n_finished += 1
                    finished_now += 1
                    finish_t[r] = t_end
                    free_blocks += held[r]
                    held[r] = 0
                    if t_end <= duration:
                        completed_tokens += in_len[r] + out_len[r]
                    if n_buckets > 0:
                        inflight_tokens -= in_len[r] + out_len[r]
        if regular > 0:
            step_dur = _grow(step_dur, n_steps_rec)
            step_cnt = _grow(step_cnt, n_steps_rec)
            step_dur[n_steps_rec] = dt
            step_cnt[n_steps_rec] = regular
            n_steps_rec += 1
        # drop finished requests from RUNNING, keeping admission order
        k = 0
        for j in range(n_running):
            r = running[j]
            if generated[r] < out_len[r]:
                running[k] = r
                k += 1
        n_running = k
        if check:
            _check_invariants(t, t_end, next_arr, n_dropped, n_waiting, n_running, n_finished, running, held,
                              generated, out_len, free_blocks, kv_blocks, batch, n_batch,
                              req_adapter, max_loras, lora_set_rule, n_gpu, max_cpu_loras, n_cpu,
                              gpu_res, cpu_res, step)
        t = t_end

        # ---- fast forward ---------------------------------------------------------------
        # A step in which every running request decoded one token, nothing was admitted,
        # preempted, loaded or finished repeats identically (one more token each, context +1
        # per request) until an arrival, a finish, a KV block shortage, a time-series sample,
        # an early-stop check or the end.  Those steps are taken here without touching the
        # requests; only the block allocations (periodic in the block size) are counted.
        if (fast_forward and not check and not preempted and load_ms == 0.0 and finished_now == 0
                and admitted == 0 and n_batch == n_running and n_tokens == n_batch):
            min_rem = np.int64(2**62)
            for m in range(block_size):
                blocks_at[m] = 0
            for j in range(n_running):
                r = running[j]
                if generated[r] < 1 or computed[r] != in_len[r] + generated[r] - 1:
                    min_rem = 0          # still prefilling (or a first token is due): no skip
                    break
                rem = out_len[r] - generated[r]
                if rem < min_rem:
                    min_rem = rem
                blocks_at[computed[r] % block_size] += 1
            ctx_ff = ctx + n_batch
            s_ff = 0
            while s_ff < min_rem - 1:
                if t >= duration or (next_arr < n_req and arrival[next_arr] <= t):
                    break
                if ts_next < n_ts and ts_next * ts_interval <= t:
                    break
                if stop_target > 0.0 and t >= next_stop_check:
                    break
                # a request whose computed tokens are a multiple of the block size needs a block
                need = blocks_at[(block_size - s_ff % block_size) % block_size]
                if need > free_blocks:
                    break
                free_blocks -= need
                dt = _step_seconds(n_batch, n_batch, ctx_ff, n_distinct, n_running, scanned, 0.0,
                                   base_ms, per_seq_ms, per_token_ms, per_ctx_ktoken_ms, lora_jump,
                                   lora_slope, lora_nsat, lora_prefill_share, sched_base_ms,
                                   sched_per_running_ms, sched_per_waiting_ms)
                t_end = t + dt
                dt_in = min(t_end, duration) - t
                running_area += n_running * dt_in
                waiting_area += n_waiting * dt_in
                step_dur = _grow(step_dur, n_steps_rec)
                step_cnt = _grow(step_cnt, n_steps_rec)
                step_dur[n_steps_rec] = dt
                step_cnt[n_steps_rec] = n_batch
                n_steps_rec += 1
                step += 1
                ctx_ff += n_batch
                t = t_end
                s_ff += 1
            if s_ff > 0:
                for j in range(n_running):
                    r = running[j]
                    computed[r] += s_ff
                    generated[r] += s_ff
                    held[r] = (computed[r] + block_size - 1) // block_size
                    last_t[r] = t

    counters = np.array([step, preemptions, loads_cpu, loads_disk, ts_next, n_dropped], np.int64)
    areas = np.array([running_area, waiting_area, min(t, duration), stopped_at])
    return (first_t, first_running, finish_t, dropped, step_dur[:n_steps_rec], step_cnt[:n_steps_rec],
            irr[:n_irr], ts_running, ts_waiting, ts_kv, ts_loaded, counters, areas)
