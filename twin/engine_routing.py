"""The fleet's routing loop, compiled: the router policies that read the engines' state
(``least-requests``, ``power-of-two``, ``lora-affinity``), each engine advanced only as far as the
router reads it, every request appended to its engine -- the per-arrival work of ``twin.fleet``
without a Python call per request.

One owner per rule: the policies' decision rules (:func:`pick_least`, :func:`pick_two`,
:func:`pick_affinity`) live here, and ``twin.routers``' Python policies call these same functions
from their ``pick`` (what the emulator's router and the fleet's Python reference loop use).  Random
draws: a policy takes ``draws`` uniforms per request from its seeded stream, used or not
(``twin.routers.Router.uniforms``), so both paths make the same choices, bit for bit
(``tests/test_fleet.py``).

Lives in a ``twin/engine*.py`` module on purpose: the Numba cache stamp covers exactly those
(``twin.numba_cache``), and the loop calls the kernel's ``step``."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine_fleet import advance_to, finishes_none_before
from twin.engine_state import add_request

#: policy codes of the compiled loop (``twin.routers.Router.kernel``); -1: the policy has none
KERNEL_LEAST_REQUESTS = 0
KERNEL_POWER_OF_TWO = 1
KERNEL_LORA_AFFINITY = 2

#: the endpoint picker's defaults (environment variables of the same names override them there)
QUEUING_THRESHOLD_LORA = 128
LORA_AFFINITY_THRESHOLD = 0.999


@njit(cache=True)
def draw_index(u, n):
    """Index in [0, n) chosen by the uniform ``u`` in [0, 1)."""
    return min(int(u * n), n - 1)


@njit(cache=True)
def pick_least(candidates, load, u):
    """The candidate of least ``load`` (indexed by engine); ties: the ``u``-th of them."""
    lo = load[candidates[0]]
    ties = 0
    for e in candidates:
        if load[e] < lo:
            lo, ties = load[e], 1
        elif load[e] == lo:
            ties += 1
    k = draw_index(u, ties)
    for e in candidates:
        if load[e] == lo:
            if k == 0:
                return e
            k -= 1
    return candidates[0]          # unreachable


@njit(cache=True)
def pick_two(candidates, load, u0, u1):
    """Two distinct candidates drawn by ``u0``, ``u1``; the one of less ``load`` (the first on a tie)."""
    n = candidates.shape[0]
    if n == 1:
        return candidates[0]
    i = draw_index(u0, n)
    j = draw_index(u1, n - 1)
    if j >= i:
        j += 1
    a, b = candidates[i], candidates[j]
    return b if load[b] < load[a] else a


@njit(cache=True)
def _lora_filter(pods, n, affine, n_adapters, max_loras, u, out):
    """LoRA affinity over ``pods[:n]`` into ``out``; returns how many (0: none passed)."""
    n_aff, n_avail = 0, 0
    for k in range(n):
        e = pods[k]
        if affine[e]:
            n_aff += 1
        elif n_adapters[e] < max_loras[e]:
            n_avail += 1
    want_affine = n_aff > 0 and (n_avail == 0 or u < LORA_AFFINITY_THRESHOLD)
    m = 0
    for k in range(n):
        e = pods[k]
        if affine[e] if want_affine else (not affine[e] and n_adapters[e] < max_loras[e]):
            out[m] = e
            m += 1
    return m


@njit(cache=True)
def _least_queue(pods, n, waiting, out):
    lo, hi = waiting[pods[0]], waiting[pods[0]]
    for k in range(n):
        lo, hi = min(lo, waiting[pods[k]]), max(hi, waiting[pods[k]])
    top = lo + (hi - lo) // n
    m = 0
    for k in range(n):
        if waiting[pods[k]] <= top:
            out[m] = pods[k]
            m += 1
    return m


@njit(cache=True)
def _least_kv(pods, n, kv, out):
    lo, hi = kv[pods[0]], kv[pods[0]]
    for k in range(n):
        lo, hi = min(lo, kv[pods[k]]), max(hi, kv[pods[k]])
    top = lo + (hi - lo) / n
    m = 0
    for k in range(n):
        if lo <= kv[pods[k]] <= top:
            out[m] = pods[k]
            m += 1
    return m


@njit(cache=True)
def pick_affinity(candidates, waiting, kv, affine, n_adapters, max_loras, u0, u1):
    """The endpoint picker's default scheduler (``twin.routers.LoraAffinity``) over ``candidates``;
    per engine: ``waiting`` requests, ``kv`` usage, ``affine`` (the adapter is running or waiting
    there), ``n_adapters`` (running + waiting adapters), ``max_loras``.  ``u0`` decides affinity vs
    available, ``u1`` the final pick."""
    n = candidates.shape[0]
    return _pick_affinity(candidates, waiting, kv, affine, n_adapters, max_loras, u0, u1,
                          np.empty(n, np.int64), np.empty(n, np.int64))


@njit(cache=True)
def _pick_affinity(candidates, waiting, kv, affine, n_adapters, max_loras, u0, u1, a, b):
    """:func:`pick_affinity` with its two scratch arrays (``a``, ``b``: at least as long as
    ``candidates``) given: the compiled loop allocates them once, not per request."""
    n = candidates.shape[0]
    m = 0
    for e in candidates:
        if waiting[e] <= QUEUING_THRESHOLD_LORA:
            a[m] = e
            m += 1
    if m > 0:                                     # low queue: affinity, then least queue
        k = _lora_filter(a, m, affine, n_adapters, max_loras, u0, b)
        if k == 0:
            b[:m] = a[:m]
            k = m
        m = _least_queue(b, k, waiting, a)
    else:                                         # least queue on all, then affinity
        q = _least_queue(candidates, n, waiting, b)
        m = _lora_filter(b, q, affine, n_adapters, max_loras, u0, a)
        if m == 0:
            a[:q] = b[:q]
            m = q
    m = _least_kv(a, m, kv, b)
    return b[draw_index(u1, m)]


@njit(cache=True)
def _advance(states, k, h, clock, idle, flight, check):
    """Advance engine ``k`` to ``h`` unless it is there already or idle; refresh its mirrors.
    Returns whether it stepped (its metrics may have changed)."""
    if idle[k] or clock[k] >= h:
        return False
    s = states[k]
    advance_to(s, h, check)
    clock[k] = s.t
    flight[k] = s.n_req - s.n_finished - s.n_dropped
    # nothing left to run and nothing known to arrive: only a new request changes it
    idle[k] = s.t < h
    return True


@njit(cache=True)
def _count_at(states, k, h, clock, idle, flight, quiet, check):
    """``flight[k]`` as of ``h`` (what least-requests and power-of-two read): engine ``k`` is
    advanced only when a request may finish before ``h`` (``quiet``: until when none can, see
    ``twin.engine_fleet.finishes_none_before``; reset when a request is added).  An engine left
    behind ends as it would have: how far an engine is advanced at a time does not change its run.
    The caller tests ``idle``, ``clock`` and ``quiet`` in line first: a call per candidate and
    arrival (its array arguments reference-counted) cost more than all the steps (least-requests
    reads every engine at every arrival; measured at 100 engines: the loop ~2.5x slower)."""
    if _advance(states, k, h, clock, idle, flight, check):
        quiet[k] = finishes_none_before(states[k])


@njit(cache=True)
def _mark(mark, a, k, base, bit):
    """Mark adapter ``a`` of engine ``k`` seen (``bit``) in the scrape whose marks start at ``base``;
    1 when it was not yet seen so in that scrape, else 0."""
    m = mark[a, k]
    if m < base:
        mark[a, k] = base | bit
        return 1
    if m & bit:
        return 0
    mark[a, k] = m | bit
    return 1


@njit(cache=True)
def _scrape(states, k, stamp, mark, n_adapters, waiting, kv):
    """The metrics of engine ``k`` (``twin.engine_fleet.scrape``'s) into the view's arrays: the
    adapters of its running / waiting requests marked with this scrape's ``stamp`` in ``mark[adapter,
    k]`` (``stamp * 4``, bit 1: seen running, bit 2: seen waiting; adapter-major, so the router's read of
    one adapter over every engine at an arrival is contiguous)."""
    s = states[k]
    waiting[k] = s.n_waiting
    kv[k] = (s.cfg.kv_blocks - s.free_blocks) / max(1, s.cfg.kv_blocks)
    n = 0
    base = stamp * 4
    for j in range(s.n_running):
        n += _mark(mark, s.req_adapter[s.running[j]], k, base, 1)
    if s.n_waiting < s.a_wait.shape[0]:          # walk WAITING, or scan the adapters, whichever is shorter
        r = s.ghead
        w = 0
        while r != -1 and w < s.n_waiting:
            n += _mark(mark, s.req_adapter[r], k, base, 2)
            w += 1
            r = s.gnext[r]
    else:
        for a in range(s.a_wait.shape[0]):
            if s.a_wait[a] > 0:
                n += _mark(mark, a, k, base, 2)
    n_adapters[k] = n


@njit(cache=True)
def _assign(states, e, i, requests, serves, a, engine_of, flight, idle):
    """Request ``i`` (adapter ``a``) to engine ``e``: appended, the router's mirrors updated."""
    arrival, _, in_len, out_len = requests
    engine_of[i] = e
    add_request(states[e], arrival[i], in_len[i], out_len[i], serves[e, a])
    flight[e] += 1
    idle[e] = False


@njit(cache=True)
def _route_by_count(states, kernel, requests, table, u, draws, check):
    """``route_fleet`` for the policies that read the counts in flight (least-requests,
    power-of-two)."""
    arrival, adapter, _, _ = requests
    serves, cand_ptr, cand_idx, _ = table
    n_eng = len(states)
    clock = np.full(n_eng, -np.inf)
    idle = np.zeros(n_eng, np.bool_)
    flight = np.zeros(n_eng, np.int64)
    quiet = np.full(n_eng, -np.inf)                     # flight holds until then (_count_at)
    engine_of = np.full(arrival.shape[0], -1, np.int64)
    for i in range(arrival.shape[0]):
        a = adapter[i]
        cands = cand_idx[cand_ptr[a]:cand_ptr[a + 1]]
        if cands.shape[0] == 0:
            continue
        e = cands[0]
        if cands.shape[0] > 1:                          # else no choice: nothing to read
            t = arrival[i]
            u0 = u[i * draws] if draws > 0 else 0.0
            u1 = u[i * draws + 1] if draws > 1 else 0.0
            if kernel == KERNEL_LEAST_REQUESTS:
                for k in cands:
                    if not (idle[k] or clock[k] >= t or t <= quiet[k]):
                        _count_at(states, k, t, clock, idle, flight, quiet, check)
                e = pick_least(cands, flight, u0)
            else:                                       # only the two drawn are read
                i0 = draw_index(u0, cands.shape[0])
                i1 = draw_index(u1, cands.shape[0] - 1)
                for k in (cands[i0], cands[i1 + (i1 >= i0)]):
                    if not (idle[k] or clock[k] >= t or t <= quiet[k]):
                        _count_at(states, k, t, clock, idle, flight, quiet, check)
                e = pick_two(cands, flight, u0, u1)
        _assign(states, e, i, requests, serves, a, engine_of, flight, idle)
        quiet[e] = -np.inf
    return engine_of


@njit(cache=True)
def _route_affinity(states, requests, table, u, draws, scrape_interval_s, check):
    """``route_fleet`` for lora-affinity: the engines' metrics scraped at each tick."""
    arrival, adapter, _, _ = requests
    serves, cand_ptr, cand_idx, max_loras = table
    n_eng = len(states)
    clock = np.full(n_eng, -np.inf)
    idle = np.zeros(n_eng, np.bool_)
    flight = np.zeros(n_eng, np.int64)
    waiting = np.zeros(n_eng, np.int64)
    kv = np.zeros(n_eng)
    n_adapters = np.zeros(n_eng, np.int64)
    affine = np.zeros(n_eng, np.bool_)
    width = 1
    for k in range(n_eng):
        width = max(width, states[k].a_wait.shape[0])
    mark = np.zeros((width, n_eng), np.int32)            # 4 x scrape number when last seen | running 1 | waiting 2
    serves_by_adapter = np.ascontiguousarray(serves.T)   # adapter-major: one adapter's engines contiguous
    scratch_a = np.empty(n_eng, np.int64)
    scratch_b = np.empty(n_eng, np.int64)
    stamp = np.zeros(n_eng, np.int32)                   # each engine's last real scrape
    seen = np.zeros(n_eng, np.int64)                    # the tick at which the router last read it
    dirty = np.ones(n_eng, np.bool_)          # never scraped yet
    engine_of = np.full(arrival.shape[0], -1, np.int64)
    scrapes = 0
    last_tick = -1.0
    for i in range(arrival.shape[0]):
        a = adapter[i]
        cands = cand_idx[cand_ptr[a]:cand_ptr[a + 1]]
        if cands.shape[0] == 0:
            continue
        t = arrival[i]
        u0 = u[i * draws] if draws > 0 else 0.0
        u1 = u[i * draws + 1] if draws > 1 else 0.0
        tick = math.floor(t / scrape_interval_s) * scrape_interval_s if scrape_interval_s > 0 else t
        if tick > last_tick or scrape_interval_s == 0:
            scrapes += 1
            last_tick = tick
        # the scrape at the tick, taken when the router first reads an engine after it (engines
        # are advanced only to ticks here, so each is still at or before this one); an engine
        # that has not stepped since its last scrape shows the same metrics
        if cands.shape[0] == 1:       # no choice: nothing to read
            e = cands[0]
        else:
            for e in cands:
                if seen[e] != scrapes:
                    seen[e] = scrapes
                    if _advance(states, e, tick, clock, idle, flight, check) or dirty[e]:
                        stamp[e] = scrapes
                        _scrape(states, e, scrapes, mark, n_adapters, waiting, kv)
                        dirty[e] = False
            row = serves_by_adapter[a]
            for e in cands:
                affine[e] = mark[row[e], e] >> 2 == stamp[e]
            e = _pick_affinity(cands, waiting, kv, affine, n_adapters, max_loras, u0, u1, scratch_a, scratch_b)
        _assign(states, e, i, requests, serves, a, engine_of, flight, idle)
    return engine_of, scrapes


@njit(cache=True)
def route_fleet(states, kernel, requests, table, u, draws, scrape_interval_s, check):
    """Route ``requests`` (arrival, adapter, in_len, out_len; sorted by arrival) over the live
    engines ``states`` (a typed list) with policy ``kernel``, appending each to its engine.
    ``table``: (serves: engine x adapter -> table index or -1, cand_ptr / cand_idx: each adapter's
    candidate engines as CSR, max_loras per engine).  Engine indices here are the live ones.
    Returns (engine of each request or -1, scrapes)."""
    if kernel == KERNEL_LORA_AFFINITY:
        return _route_affinity(states, requests, table, u, draws, scrape_interval_s, check)
    return _route_by_count(states, kernel, requests, table, u, draws, check), 0
