"""Split-conformal intervals around a surrogate's throughput prediction.

The surrogate answers for the twin in micro-seconds; how far its throughput may be from the twin's is
a distribution, measured here on rows the regressor never saw -- the held-out split's regression rows
(``lora_opt.surrogates.training_data``), halved with a seed: one half **calibrates**, the other
**measures coverage**.  The conformity score is the relative residual ``|y - yhat| / yhat`` (throughputs
span four decades, their error is relative; symmetric -- MAPIE's ``gamma`` score is its signed,
asymmetric variant), and the interval at
confidence C is ``yhat x [1 - q_C, 1 + q_C]`` with ``q_C`` the ``ceil((n + 1) C)``-th smallest of the
n calibration scores -- split conformal prediction, whose coverage is >= C for exchangeable rows.
``tests/test_surrogate_intervals.py`` checks these quantiles against MAPIE's ``SplitConformalRegressor``
(a maintained implementation: its absolute score on the ratio y / yhat) on the same rows; the placement path reads the stored quantiles and
needs neither MAPIE nor a refit.

What the interval covers: the *twin's* throughput for that GPU (the surrogate's error).  The twin's
own error against a real server is the error model's (``lora_opt.calibration.error_model``).
"""
from __future__ import annotations

import math

import numpy as np

from twin.errors import ScenarioError

#: the confidences whose quantiles a surrogate stores (an interval at another C takes the next higher)
CONFIDENCES = (0.5, 0.8, 0.9, 0.95, 0.99)
#: what the stored quantiles score
SCORE = "|y - yhat| / yhat (symmetric relative residual)"
#: the fewest calibration rows (they support C <= 1 - 1/(n + 1): 0.91 at 10)
MIN_CALIBRATION_ROWS = 10


def conformal_quantile(scores: np.ndarray, confidence: float) -> float:
    """The ``ceil((n + 1) C)``-th smallest score (inf when that exceeds n: too few rows for C)."""
    s = np.sort(np.asarray(scores, float))
    k = math.ceil((len(s) + 1) * confidence)
    return float(s[k - 1]) if k <= len(s) else math.inf


def gamma_scores(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    pred = np.asarray(pred, float)
    with np.errstate(divide="ignore", invalid="ignore"):     # a prediction of 0: an infinite relative residual
        return np.where(pred > 0, np.abs(np.asarray(y, float) - pred) / np.where(pred > 0, pred, 1.0), math.inf)


def halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(calibration rows, coverage rows): a seeded permutation of range(n) cut in two."""
    order = np.random.default_rng(np.random.SeedSequence([int(seed), 35])).permutation(n)
    return np.sort(order[: n // 2]), np.sort(order[n // 2:])


def conformalize(pred: np.ndarray, y: np.ndarray, *, seed: int = 0, confidences=CONFIDENCES) -> dict:
    """Quantiles from one half of the held-out rows, coverage on the other (JSON-able, stored in the
    surrogate's manifest as ``metadata["intervals"]``).  ``pred``: the regressor's predictions of
    ``y`` (tok/s) on rows it was not trained on."""
    pred, y = np.asarray(pred, float), np.asarray(y, float)
    if pred.shape != y.shape or pred.ndim != 1:
        raise ScenarioError(f"surrogate intervals: predictions {pred.shape} and targets {y.shape} differ")
    cal, cov = halves(len(y), seed)
    if len(cal) < MIN_CALIBRATION_ROWS:
        raise ScenarioError(f"surrogate intervals: {len(cal)} calibration rows (half of {len(y)} held-out "
                            f"regression rows); need >= {MIN_CALIBRATION_ROWS}: label a larger dataset")
    scores = gamma_scores(pred[cal], y[cal])
    quantiles, coverage = {}, {}
    for c in confidences:
        q = conformal_quantile(scores, c)
        if not math.isfinite(q):        # too few calibration rows for C: not stored (JSON has no inf)
            continue
        quantiles[f"{c:g}"] = q
        inside = (y[cov] >= pred[cov] * (1 - q)) & (y[cov] <= pred[cov] * (1 + q))
        coverage[f"{c:g}"] = float(inside.mean()) if len(cov) else math.nan
    return {"score": SCORE, "method": "split conformal", "seed": int(seed), "calibration_rows": int(len(cal)),
            "coverage_rows": int(len(cov)), "quantiles": quantiles, "coverage": coverage,
            "max_confidence": 1.0 - 1.0 / (len(cal) + 1)}


def quantile_at(intervals: dict, confidence: float) -> float:
    """The stored quantile for ``confidence``: its own, else the next higher stored confidence's
    (conservative); ScenarioError above the highest stored."""
    stored = sorted((float(k), float(v)) for k, v in intervals["quantiles"].items())
    for c, q in stored:
        if c >= confidence - 1e-12:
            return q
    top = f"up to {stored[-1][0]:g}" if stored else "nowhere"
    raise ScenarioError(f"confidence {confidence:g}: the surrogate's intervals go {top} (its "
                        f"{intervals.get('calibration_rows', '?')} calibration rows support no more)")


def interval(pred: np.ndarray, intervals: dict, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) throughput at ``confidence`` around the predictions ``pred`` (tok/s)."""
    q = quantile_at(intervals, confidence)
    pred = np.asarray(pred, float)
    return np.maximum(pred * (1.0 - q), 0.0), pred * (1.0 + q)


def held_out_regression(data) -> tuple[np.ndarray, np.ndarray]:
    """(features, throughput) of the held-out split's regression rows (``TrainingData``)."""
    test = data.test[data.measured[data.test]]
    return data.X[test], data.throughput[test]
