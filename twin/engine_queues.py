"""WAITING: the global FCFS order and one FIFO per adapter, as doubly linked lists over the same
requests (skipping blocked requests without scanning them: waiting queues of 10^4 under
starvation).  Each waiting request has a key: arrivals get increasing keys at the tail,
preempted requests decreasing ones at the head, so the global order is the order of keys and the
earliest head among a set of adapters is the one with the smallest key."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))

NONE = -1
"""No request (end of a list, empty list)."""


@njit(cache=True)
def _push_back(r, prev, nxt, head, tail):
    """Append ``r`` to a doubly linked list; returns the new (head, tail)."""
    prev[r] = tail
    nxt[r] = NONE
    if tail != NONE:
        nxt[tail] = r
    else:
        head = r
    return head, r


@njit(cache=True)
def _push_front(r, prev, nxt, head, tail):
    """Prepend ``r`` to a doubly linked list; returns the new (head, tail)."""
    nxt[r] = head
    prev[r] = NONE
    if head != NONE:
        prev[head] = r
    else:
        tail = r
    return r, tail


@njit(cache=True)
def _unlink(r, prev, nxt, head, tail):
    """Remove ``r`` from a doubly linked list; returns the new (head, tail)."""
    if prev[r] != NONE:
        nxt[prev[r]] = nxt[r]
    else:
        head = nxt[r]
    if nxt[r] != NONE:
        prev[nxt[r]] = prev[r]
    else:
        tail = prev[r]
    return head, tail


@njit(cache=True)
def enqueue(s, r):
    """``r`` joins the tail of WAITING (an arrival)."""
    a = s.req_adapter[r]
    s.key[r] = s.tail_key
    s.tail_key += 1
    s.ghead, s.gtail = _push_back(r, s.gprev, s.gnext, s.ghead, s.gtail)
    s.ahead[a], s.atail[a] = _push_back(r, s.aprev, s.anext, s.ahead[a], s.atail[a])
    s.n_waiting += 1
    s.a_wait[a] += 1


@njit(cache=True)
def requeue(s, r):
    """``r`` goes back to the head of WAITING (a preemption)."""
    a = s.req_adapter[r]
    s.key[r] = s.head_key
    s.head_key -= 1
    s.ghead, s.gtail = _push_front(r, s.gprev, s.gnext, s.ghead, s.gtail)
    s.ahead[a], s.atail[a] = _push_front(r, s.aprev, s.anext, s.ahead[a], s.atail[a])
    s.n_waiting += 1
    s.a_wait[a] += 1


@njit(cache=True)
def dequeue(s, r):
    """Remove ``r`` from WAITING (it is admitted)."""
    a = s.req_adapter[r]
    s.ghead, s.gtail = _unlink(r, s.gprev, s.gnext, s.ghead, s.gtail)
    s.ahead[a], s.atail[a] = _unlink(r, s.aprev, s.anext, s.ahead[a], s.atail[a])
    s.n_waiting -= 1
    s.a_wait[a] -= 1


@njit(cache=True)
def first_in_set(s):
    """The earliest waiting request whose adapter is in this step's LoRA set (NONE if none)."""
    r = NONE
    best = np.int64(2**62)
    for j in range(s.n_set):
        h = s.ahead[s.set_list[j]]
        if h != NONE and s.key[h] < best:
            best = s.key[h]
            r = h
    return r


@njit(cache=True)
def waiting_in_set(s):
    """Waiting requests whose adapter is in this step's LoRA set."""
    n = 0
    for j in range(s.n_set):
        n += s.a_wait[s.set_list[j]]
    return n


@njit(cache=True)
def take_arrivals(s):
    """Requests with ``arrival <= now`` join the tail of WAITING; beyond the client's in-flight cap
    they fail (drop) or stay at the client until a slot frees."""
    while s.next_arr < s.n_req and s.arrival[s.next_arr] <= s.t:
        if s.n_running + s.n_waiting >= s.cfg.max_inflight:
            if not s.cfg.drop_overflow:
                break
            s.dropped[s.next_arr] = 1
            s.n_dropped += 1
        else:
            enqueue(s, s.next_arr)
        s.next_arr += 1


@njit(cache=True)
def next_arrival_in(s):
    """Jump the clock to the next arrival when one can still come in; False when none can (all
    arrived, or the client holds them at its in-flight cap)."""
    if s.next_arr >= s.n_req or s.arrival[s.next_arr] <= s.t:
        return False
    s.t = s.arrival[s.next_arr]
    return True
