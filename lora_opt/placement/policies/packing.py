"""What the packing policies (``greedy``, ``greedy-plus``) and the search (``lora_opt.search.study``)
share: the order adapters are packed in, and the largest A_max that fits in a GPU's memory.

Both the greedy policies and the search cut the *priority order* into contiguous parts, one per
GPU, so every greedy placement is a point of the search's space (the search starts from them).
"""
from __future__ import annotations

import numpy as np

from twin.flags import max_lora_rank_for
from twin.profile import Profile


def zigzag(values: np.ndarray) -> np.ndarray:
    """Indices of ``values`` in zig-zag order: highest, lowest, second highest, second lowest..."""
    order = np.argsort(-values, kind="stable")
    out = np.empty_like(order)
    half = (len(order) + 1) // 2
    out[0::2] = order[:half]
    out[1::2] = order[half:][::-1]
    return out


def priority_order(ranks, rates) -> np.ndarray:
    """Rank-descending groups, zig-zag by rate inside each (the paper's PrioritySorting)."""
    ranks = np.asarray(ranks)
    rates = np.asarray(rates, float)
    parts = []
    for r in sorted(set(ranks.tolist()), reverse=True):
        idx = np.flatnonzero(ranks == r)
        parts.append(idx[zigzag(rates[idx])])
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def max_loras_that_start(profile: Profile, rank: int, util: float, mnbt: int, mml: int, mns: int,
                         limit: int) -> int:
    """Largest A_max <= ``limit`` whose instance starts, by the profile's memory model (0 if none)."""
    lr = max_lora_rank_for([rank])
    lo, hi = 0, limit                         # invariant: lo starts (or 0), hi+1.. unknown
    if profile.startup_check(hi, lr, util, mnbt, mml, mns)[0]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if profile.startup_check(mid, lr, util, mnbt, mml, mns)[0]:
            lo = mid
        else:
            hi = mid
    return lo
