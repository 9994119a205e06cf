"""The LoRA cost's knee in a step's tokens x ``--max-lora-rank`` (vLLM's CPU build: where the per-token
adapter gather leaves the cache), fitted on a probe's points: one share or one ms per token on each side
(``lora_opt.calibration.probe_fit`` calls it for the factor form's ``prefill_share`` and the per-token form)."""
from __future__ import annotations

import dataclasses

import numpy as np

from lora_opt.calibration.fitting import f_test_p


def share_fit(a: np.ndarray, b: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The share minimising the relative SSE of ``y - b + a*share`` against ``y`` (>= 0), and that SSE."""
    w = 1.0 / y ** 2
    share = max(float(np.sum(w * a * b) / np.sum(w * a * a)), 0.0) if np.any(a > 0) else 1.0
    return share, float(np.sum(((a * share - b) / y) ** 2))


def hinge_fit(a: np.ndarray, e: np.ndarray, b: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """``lo`` per token and ``hi`` per token beyond the knee (``e``: tokens beyond it) minimising the relative
    SSE of ``y - b + lo*a + (hi - lo)*e`` against ``y`` (both >= 0: a bound hit refits the other alone),
    and that SSE."""
    w = 1.0 / y
    X = np.column_stack([a - e, e]) * w[:, None]
    lo, hi = np.linalg.lstsq(X, b * w, rcond=None)[0]
    if lo < 0 or hi < 0:
        col = 1 if lo < 0 else 0
        v = max(float(np.sum(X[:, col] * b * w) / np.sum(X[:, col] ** 2)), 0.0)
        lo, hi = (0.0, v) if lo < 0 else (v, 0.0)
    return float(lo), float(hi), float(np.sum((((a - e) * lo + e * hi - b) / y) ** 2))


#: a knee joins the LoRA prefill fit only when an F-test against one share per rank gives p below this, and
KNEE_ALPHA = 0.01
#: the share beyond it differs from the share up to it by at least this fraction (at some rank)
KNEE_MIN_STEP = 0.2


@dataclasses.dataclass
class RankPoints:
    """One rank's lone prompts: the step's tokens x ``--max-lora-rank`` (the adapter gather's working set),
    what ``prefill_share`` multiplies (``a``), the rest of the TTFT it leaves to explain (``b``), the TTFT."""

    product: np.ndarray
    a: np.ndarray
    b: np.ndarray
    y: np.ndarray

    def beyond(self, knee_product: float, rank: int) -> np.ndarray:
        """The point's tokens beyond the knee in each of its steps (``product / rank`` tokens a step; a
        prompt beyond the budget is several steps), summed over its steps -- ``a`` counts its tokens."""
        step = self.product / rank
        return np.maximum(step - knee_product / rank, 0.0) * self.a / step


def fit_knee(points: dict[int, RankPoints], form: str = "step") -> dict | None:
    """One knee for every rank, in tokens x ``--max-lora-rank`` (the working set that leaves the cache; it
    sits at the same product for every rank), each rank's points fitted with one share (``form`` "step":
    ``prefill_share``'s; a share up to the knee and another beyond, per point) or one LoRA ms per token
    (``form`` "hinge": ``token_ms`` for each token up to it and ``token_ms_above`` for each beyond,
    :func:`twin.profile.lora_token_cost`) on each side (a rank with < 2 points on a side keeps one); the
    best knee by relative SSE, kept only when an F-test against one share per rank demands it
    (``KNEE_ALPHA``, ``KNEE_MIN_STEP``).  "step": the knee is the middle of the products around the step
    (no measured point lies between them); "hinge": a measured product or the middle of two."""
    singles = {r: share_fit(q.a, q.b, q.y) for r, q in points.items()}
    sse_one = sum(e for _, e in singles.values())
    products = np.unique(np.concatenate([q.product for q in points.values()]))
    mids = (products[:-1] + products[1:]) / 2
    knees = zip(products[:-1], products[1:], mids) if form == "step" else \
        ((k, k, k) for k in np.unique(np.concatenate([products[1:-1], mids])))
    best = None
    for lo, hi, knee in knees:
        shares, sse, split = {}, 0.0, 0
        for r, q in points.items():
            below = q.product <= knee
            if below.sum() >= 2 and (~below).sum() >= 2:
                if form == "step":
                    (s_lo, e_lo), (s_hi, e_hi) = share_fit(q.a[below], q.b[below], q.y[below]), \
                        share_fit(q.a[~below], q.b[~below], q.y[~below])
                    shares[r], err = (s_lo, s_hi), e_lo + e_hi
                else:
                    s_lo, s_hi, err = hinge_fit(q.a, q.beyond(knee, r), q.b, q.y)
                    shares[r] = (s_lo, s_hi)
                sse, split = sse + err, split + 1
            else:
                shares[r], sse = (singles[r][0], singles[r][0]), sse + singles[r][1]
        if split and (best is None or sse < best["sse"]):
            best = {"knee_product": float(knee), "between": [float(lo), float(hi)], "shares": shares,
                    "sse": sse, "split_ranks": split, "form": form}
    if best is None:
        return None
    n = sum(len(q.y) for q in points.values())
    best["p_value"] = f_test_p(sse_one, best["sse"], n, len(points) + 1 + best["split_ranks"],
                               extra=1 + best["split_ranks"])
    # parameters chosen from several splits: a strict test, and a step worth modelling
    step = max(abs(hi / max(lo, 1e-12) - 1.0) for lo, hi in best["shares"].values())
    return best if best["p_value"] < KNEE_ALPHA and step >= KNEE_MIN_STEP else None
