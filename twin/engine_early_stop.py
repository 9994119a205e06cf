"""Early stop of certain starvation: every 10 simulated seconds, an upper bound on the tokens the
run can still complete by ``duration``; when it is below the target (rho x the tokens that count)
the run stops.  Off when ``s.stop.target <= 0``."""
from __future__ import annotations

from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))


@njit(cache=True)
def _least_work_tokens(s, budget_s):
    """Tokens the requests not yet started could at best complete in ``budget_s`` seconds using
    their least work (buckets in decreasing tokens-per-second order, fractional knapsack)."""
    future = 0.0
    for b in range(s.pool_cost.shape[0]):
        if budget_s <= 0.0:
            break
        c = max(s.pool_cost[b], 0.0)
        if c <= budget_s:
            future += s.pool_tokens[b]
            budget_s -= c
        else:
            future += budget_s * s.stop.bucket_ratio[b]
            budget_s = 0.0
    return future


@njit(cache=True)
def starvation_certain(s):
    """Whether the run certainly starves (checked at most every 10 s of simulated time)."""
    st = s.stop
    if not (st.target > 0.0 and s.t >= s.next_stop_check):
        return False
    s.next_stop_check = s.t + 10.0
    left = s.cfg.duration - s.t
    bound = s.completed_tokens + st.token_factor * (st.kv_tokens + st.cap_tok_s * left)
    if st.bucket_cost_s.shape[0] > 0:
        # started requests are credited in full
        bound = min(bound, s.completed_tokens + s.inflight_tokens + _least_work_tokens(s, left))
    return bound < st.target


@njit(cache=True)
def stop_check_due(s):
    """An early-stop check is due now (the fast forward stops there)."""
    return s.stop.target > 0.0 and s.t >= s.next_stop_check
