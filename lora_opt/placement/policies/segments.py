"""Contiguous segments of adapters in greedy's priority order, described to the surrogates from
prefix sums in O(1) (``lora_opt.placement.policies.greedy`` walks them)."""
from __future__ import annotations

import numpy as np

from lora_opt.surrogates.features import DEFAULT_TOKENS_PER_REQUEST, FEATURES

#: the papers' testing points: adapter counts at which greedy tests a GPU, and its A_max candidates
TESTING_POINTS = (8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384)
#: the largest adapter count (and A_max) per GPU the surrogates were trained on; larger segments
#: are described to them as this many (a random forest's answer for any larger count)
SURROGATE_MAX_ADAPTERS = TESTING_POINTS[-1]


class Segments:
    """Features of contiguous segments [s, s+n) of adapters in priority order, from prefix sums."""

    def __init__(self, ranks, rates, tokens_per_request: float = DEFAULT_TOKENS_PER_REQUEST):
        self.ranks = np.asarray(ranks, float)
        self.rates = np.asarray(rates, float)
        if np.any(np.diff(self.ranks) > 0):
            raise ValueError("Segments: ranks must be non-increasing (priority order)")
        z = np.zeros(1)
        self.q1 = np.concatenate([z, np.cumsum(self.rates)])
        self.q2 = np.concatenate([z, np.cumsum(self.rates ** 2)])
        self.r1 = np.concatenate([z, np.cumsum(self.ranks)])
        self.r2 = np.concatenate([z, np.cumsum(self.ranks ** 2)])
        self.tpr = tokens_per_request

    def rows(self, s: int, n, amax, load=1.0, pad_to: int = 0, n_cap: int = SURROGATE_MAX_ADAPTERS) -> np.ndarray:
        """Feature rows (FEATURES order) for segments [s, s+n) with A_max ``amax`` at ``load``
        x the expected rates (arrays broadcast).  ``pad_to``: segments of fewer adapters are
        described as that many, the extra ones idle (rate 0) at the segment's max rank and A_max
        raised to match -- the surrogates never saw fewer than 8 adapters, and idle adapters add
        no load (so the padded question is the conservative one).  ``n_cap``: the adapter-count
        feature is clipped there (rates and ranks still describe the whole segment)."""
        n = np.asarray(n, np.int64)
        e = s + n
        r_max = self.ranks[s]
        pad = np.maximum(pad_to - n, 0).astype(float)
        nf = n.astype(float) + pad
        qs = self.q1[e] - self.q1[s]
        qm = qs / nf
        qstd = np.sqrt(np.maximum((self.q2[e] - self.q2[s]) / nf - qm * qm, 0.0))
        rm = (self.r1[e] - self.r1[s] + pad * r_max) / nf
        rstd = np.sqrt(np.maximum((self.r2[e] - self.r2[s] + pad * r_max ** 2) / nf - rm * rm, 0.0))
        # prefix-sum variances cancel to ~1e-7 absolute; a lone adapter's spread is exactly 0
        qstd = np.where(nf > 1, qstd, 0.0)
        rstd = np.where(nf > 1, rstd, 0.0)
        load = np.asarray(load, float)
        amax = np.maximum(np.asarray(amax, float), np.minimum(nf, pad_to) if pad_to else 0.0)
        cols = np.broadcast_arrays(np.minimum(nf, n_cap), qs * load, qstd * load, np.full_like(nf, r_max), rm, rstd,
                                   np.minimum(amax, n_cap), qs * load * self.tpr)
        X = np.stack(cols, axis=-1).astype(np.float64)
        return X.reshape(-1, len(FEATURES))
