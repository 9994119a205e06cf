"""Per-GPU features of a set of adapters served by one vLLM instance (the surrogates' inputs).

The papers' features: A (adapters served), sum and std of their rates, max / mean / std of their
ranks, and A_max (``max_loras``).  We add the incoming token rate (sum of rates x mean tokens per
request), which makes throughput nearly linear in the inputs below saturation.
"""
from __future__ import annotations

import numpy as np

FEATURES = ("n_adapters", "rate_sum", "rate_std", "rank_max", "rank_mean", "rank_std", "max_loras",
            "incoming_token_rate")

#: mean prompt + output tokens of the default ``sharegpt`` length model (223 + 193)
DEFAULT_TOKENS_PER_REQUEST = 416.0


def gpu_features(ranks, rates, max_loras: int, tokens_per_request: float = DEFAULT_TOKENS_PER_REQUEST) -> dict:
    """Feature dict of one GPU serving adapters with these ranks and rates (req/s)."""
    ranks = np.asarray(ranks, float)
    rates = np.asarray(rates, float)
    return {
        "n_adapters": float(len(ranks)),
        "rate_sum": float(rates.sum()),
        "rate_std": float(rates.std()),
        "rank_max": float(ranks.max()),
        "rank_mean": float(ranks.mean()),
        "rank_std": float(ranks.std()),
        "max_loras": float(max_loras),
        "incoming_token_rate": float(rates.sum() * tokens_per_request),
    }


def feature_matrix(rows) -> np.ndarray:
    """(n, len(FEATURES)) float64 matrix from a DataFrame or a list of feature dicts."""
    if hasattr(rows, "loc"):
        return rows.loc[:, list(FEATURES)].to_numpy(np.float64)
    return np.array([[r[f] for f in FEATURES] for r in rows], np.float64)
