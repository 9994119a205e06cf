"""What the packing policies (``greedy``, ``greedy-plus``) and the search (``lora_opt.search.study``)
share: the order adapters are packed in, and the largest A_max that fits in a GPU's memory.

Both the greedy policies and the search cut the *priority order* into contiguous parts, one per
GPU, so every greedy placement is a point of the search's space (the search starts from them).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from twin.flags import EngineFlags, max_lora_rank_for
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


def max_loras_that_start(profile: Profile, rank: int, flags: EngineFlags, limit: int) -> int:
    """Largest A_max <= ``limit`` whose instance starts, by the profile's memory model (0 if none):
    ``flags`` are the instance's others, resolved (a workload's shared ones: ``Workload.resolved_engine``),
    its ``--max-lora-rank`` the smallest that holds ``rank``."""
    flags = dataclasses.replace(flags, max_lora_rank=max_lora_rank_for([rank]))

    def starts(max_loras: int) -> bool:
        return profile.startup_check(dataclasses.replace(flags, max_loras=max_loras))[0]

    lo, hi = 0, limit                         # invariant: lo starts (or 0), hi+1.. unknown
    if starts(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if starts(mid):
            lo = mid
        else:
            hi = mid
    return lo
