"""Advancing the batch at the end of a step, and what is recorded: first-token and finish times,
ITL samples (whole regular steps as (duration, count), irregular gaps listed), running/waiting
areas, and the time series (every ``ts_interval``: the state the last step left, as vLLM's gauges show it)."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))


@njit(cache=True)
def _grow(arr, n):
    """``arr`` with room for index ``n`` (doubling)."""
    if n < arr.shape[0]:
        return arr
    new = np.empty(max(16, arr.shape[0] * 2), dtype=arr.dtype)
    new[: arr.shape[0]] = arr
    return new


@njit(cache=True)
def record_regular(s, dt, count):
    """``count`` requests sampled a token one step (``dt``) after their previous one."""
    if s.n_steps_rec >= s.step_dur.shape[0]:
        s.step_dur = _grow(s.step_dur, s.n_steps_rec)
        s.step_cnt = _grow(s.step_cnt, s.n_steps_rec)
    s.step_dur[s.n_steps_rec] = dt
    s.step_cnt[s.n_steps_rec] = count
    s.n_steps_rec += 1


@njit(cache=True)
def _record_gap(s, gap):
    """An inter-token gap longer than one step (a preemption or an unscheduled step)."""
    if s.n_irr >= s.irr.shape[0]:
        s.irr = _grow(s.irr, s.n_irr)
    s.irr[s.n_irr] = gap
    s.n_irr += 1


@njit(cache=True)
def record_timeseries(s):
    """Samples due at or before now: running, waiting, KV blocks in use, GPU-resident adapters, as the last
    step left them -- before the arrivals since are taken.  vLLM publishes its gauges once a step, so a
    scrape between steps (or in an idle gap) reads that state; taking the next arrival first counted an
    idle engine as one waiting request (a light run's series: waiting 0.19 where none ever waited)."""
    while s.ts_next < s.n_ts and s.ts_next * s.cfg.ts_interval <= s.t:
        k = s.ts_next
        s.ts_running[k] = s.n_running
        s.ts_waiting[k] = s.n_waiting
        s.ts_kv[k] = s.cfg.kv_blocks - s.free_blocks
        s.ts_loaded[k] = s.n_gpu
        s.ts_next += 1


@njit(cache=True)
def account_areas(s, t_end):
    """Running and waiting request-seconds of the step from now to ``t_end`` (within the window)."""
    dt_in = min(t_end, s.cfg.duration) - s.t
    s.running_area += s.n_running * dt_in
    s.waiting_area += s.n_waiting * dt_in


@njit(cache=True)
def _finish(s, r, t_end):
    """``r`` produced its last token at ``t_end``: its blocks are freed."""
    tokens = s.in_len[r] + s.out_len[r]
    s.finish_t[r] = t_end
    s.free_blocks += s.held[r]
    s.held[r] = 0
    if t_end <= s.cfg.duration:
        s.completed_tokens += tokens
    if s.stop.bucket_cost_s.shape[0] > 0:
        s.inflight_tokens -= tokens


@njit(cache=True)
def advance_batch(s, t_end, dt):
    """The step from now to ``t_end`` (``dt`` long) ran: every scheduled request advances, those
    that completed their prompt + generated tokens sample one token, those with all output tokens
    finish.  Sets ``s.finished_now``."""
    # arrays in locals: see engine_schedule.schedule_running
    computed, generated, last_t, batch = s.computed, s.generated, s.last_t, s.batch
    in_len, out_len, sched_tok = s.in_len, s.out_len, s.sched_tok
    first_t, first_running = s.first_t, s.first_running
    t = s.t
    n_running = s.n_running
    regular = 0
    finished = 0
    for j in range(s.n_batch):
        r = np.uint32(batch[j])            # unsigned: see engine_schedule.schedule_running
        c = computed[r] + sched_tok[r]
        computed[r] = c
        sched_tok[r] = 0
        g = generated[r]
        if c != in_len[r] + g:
            continue
        g += 1
        generated[r] = g
        if g == 1:
            first_t[r] = t_end
            first_running[r] = n_running
        elif last_t[r] == t:
            regular += 1
        else:
            _record_gap(s, t_end - last_t[r])
        last_t[r] = t_end
        if g == out_len[r]:
            finished += 1
            _finish(s, r, t_end)
    s.n_finished += finished
    s.finished_now = finished
    if regular > 0:
        record_regular(s, dt, regular)


@njit(cache=True)
def drop_finished(s):
    """Finished requests leave RUNNING, which keeps admission order."""
    running, generated, out_len = s.running, s.generated, s.out_len
    k = 0
    for j in range(s.n_running):
        r = running[j]
        ru = np.uint32(r)                    # unsigned: see engine_schedule.schedule_running
        if generated[ru] < out_len[ru]:
            running[k] = r
            k += 1
    s.n_running = k
