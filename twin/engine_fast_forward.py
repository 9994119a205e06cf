"""Fast forward: a step in which every running request decoded one token, and nothing was
admitted, preempted, loaded or finished, repeats identically (one more token each, context + 1
per request) until an arrival (or the fleet driver's ``horizon``), a finish, a KV block shortage, a time-series sample, an early-stop
check or the end.  Those steps are taken here without touching the requests -- the same numbers,
bit for bit, as stepping; only the block allocations (periodic in the block size) are counted."""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine_cost import step_seconds
from twin.engine_early_stop import stop_check_due
from twin.engine_record import account_areas, record_regular


@njit(cache=True)
def steady(s):
    """The last step was decode-only for every running request with nothing else happening."""
    return (not s.preempted and s.load_ms == 0.0 and s.finished_now == 0 and s.admitted == 0
            and s.n_batch == s.n_running and s.n_tokens == s.n_batch)


@njit(cache=True)
def _decode_horizon(s):
    """Steps until the first running request finishes (0: one is still prefilling or due its first
    token); fills ``s.blocks_at[m]``: running requests with ``computed % block_size == m``."""
    bs = s.cfg.block_size
    running, generated, computed, in_len, out_len, blocks_at = (s.running, s.generated, s.computed, s.in_len,
                                                                s.out_len, s.blocks_at)
    blocks_at[:] = 0
    horizon = np.int64(2**62)
    for j in range(s.n_running):
        r = np.uint32(running[j])            # unsigned: see engine_schedule.schedule_running
        g, c = generated[r], computed[r]
        if g < 1 or c != in_len[r] + g - 1:
            return 0
        horizon = min(horizon, out_len[r] - g)
        blocks_at[c % bs] += 1
    return horizon


@njit(cache=True)
def _must_stop(s):
    """Something other than decoding happens now: the end, an arrival (one known, or one a fleet's
    router may still send: ``s.horizon``), a sample or a stop check."""
    if s.t >= s.cfg.duration or s.t >= s.horizon or (s.next_arr < s.n_req and s.arrival[s.next_arr] <= s.t):
        return True
    if s.ts_next < s.n_ts and s.ts_next * s.cfg.ts_interval <= s.t:
        return True
    return stop_check_due(s)


@njit(cache=True)
def _catch_up(s, n):
    """The running requests decoded ``n`` more tokens, the last at now."""
    bs = s.cfg.block_size
    running, computed, generated, held, last_t = s.running, s.computed, s.generated, s.held, s.last_t
    t = s.t
    for j in range(s.n_running):
        r = np.uint32(running[j])            # unsigned: see engine_schedule.schedule_running
        c = computed[r] + n
        computed[r] = c
        generated[r] += n
        held[r] = (c + bs - 1) // bs
        last_t[r] = t


@njit(cache=True)
def settle(s):
    """Catch the running requests up on a fast forward left pending (none: a no-op); before
    anything reads their progress (a step, the results)."""
    if s.ff_done > 0:
        _catch_up(s, s.ff_done)
        s.ff_done = 0


@njit(cache=True)
def skip_steady_steps(s):
    """Take the repeats of a steady step (see the module docstring) in one go.

    Stopped by a fleet's ``horizon`` (the clock past it), the run stays pending: ``s.ff_done`` steps
    taken, the requests not caught up, ``s.blocks_at`` and the run's length ``s.ff_until`` kept; the
    next call resumes it without a pass over RUNNING.  A router that reads every engine at every
    arrival advances each one about a step at a time, so two passes per step (horizon, catch-up)
    would otherwise cost more than the steps.  Catching up ``a + b`` steps once at the end gives
    what catching up ``a`` then ``b`` gives, and a resumed run's horizon and block counts are the
    first pass's shifted by ``a``: the same numbers, bit for bit."""
    if _must_stop(s):          # nothing to skip: spare the pass over RUNNING
        settle(s)
        return
    bs = s.cfg.block_size
    n_batch = s.n_batch
    done = s.ff_done
    if done == 0:
        s.ff_until = _decode_horizon(s)
    horizon = s.ff_until
    ctx = s.ctx + n_batch
    n = done
    while n < horizon - 1 and not _must_stop(s):
        # a request whose computed tokens are a multiple of the block size needs a block
        need = s.blocks_at[(bs - n % bs) % bs]
        if need > s.free_blocks:
            break
        s.free_blocks -= need
        dt = step_seconds(s.lat, n_batch, n_batch, ctx, s.n_distinct, s.n_running, s.scanned, 0.0)
        t_end = s.t + dt
        account_areas(s, t_end)
        record_regular(s, dt, n_batch)
        s.step += 1
        ctx += n_batch
        s.t = t_end
        n += 1
    if n > done:
        s.ctx = ctx - n_batch        # the last step's context: a fleet's driver may resume from here
    s.ff_done = n
    if s.t < s.horizon:              # stopped for another reason than the horizon: no resume
        settle(s)
