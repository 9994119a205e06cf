"""The surrogates' throughput intervals: split-conformal quantiles equal MAPIE's on the same rows, their
coverage holds on rows they were not calibrated on, bad input says what is wrong
(``lora-opt train`` storing them and ``--intervals-only``: tests/test_surrogate.py, on its trained surrogate)."""
import math
import warnings

import numpy as np
import pytest

from lora_opt.surrogates import intervals as iv
from twin.errors import ScenarioError


class _Fixed:
    """A prefit 'regressor' whose predictions are given (MAPIE only calls predict)."""

    def __init__(self, pred):
        self.pred = np.asarray(pred, float)

    def fit(self, X, y):
        return self

    def predict(self, X):
        return self.pred[np.asarray(X, int).ravel()]


@pytest.mark.parametrize("confidence", [0.5, 0.8, 0.9, 0.95])
def test_quantiles_equal_mapie_split_conformal(confidence):
    """The symmetric relative residual |y - yhat| / yhat is MAPIE's absolute score on the ratio y / yhat
    (predicted as 1): MAPIE's interval there is [1 - q, 1 + q] with our q."""
    mapie = pytest.importorskip("mapie.regression")
    rng = np.random.default_rng(7)
    n = 101
    pred = rng.uniform(50, 5000, n)
    y = pred * rng.lognormal(0.0, 0.08, n)
    X = np.arange(n)[:, None]
    m = mapie.SplitConformalRegressor(_Fixed(np.ones(n)), confidence_level=confidence, conformity_score="absolute",
                                      prefit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # "estimator does not appear fitted": it is given
        m.conformalize(X, y / pred)
        _, bounds = m.predict_interval(X)
    q = iv.conformal_quantile(iv.gamma_scores(pred, y), confidence)
    np.testing.assert_allclose(bounds[:, 0, 0], 1 - q, rtol=1e-9)
    np.testing.assert_allclose(bounds[:, 1, 0], 1 + q, rtol=1e-9)


def test_coverage_on_held_apart_rows_is_at_least_nominal_on_average():
    rng = np.random.default_rng(3)
    covered = {c: [] for c in iv.CONFIDENCES}
    for _ in range(40):
        pred = rng.uniform(10, 1000, 400)
        y = pred * rng.lognormal(0.0, 0.1, 400)
        res = iv.conformalize(pred, y, seed=int(rng.integers(1 << 30)))
        for c, v in res["coverage"].items():
            covered[float(c)].append(v)
    for c, vals in covered.items():
        assert np.mean(vals) >= c - 0.02, (c, np.mean(vals))


def test_intervals_and_bad_input():
    pred = np.full(30, 100.0)
    y = np.linspace(80, 120, 30)
    res = iv.conformalize(pred, y)
    assert res["calibration_rows"] == 15 and res["coverage_rows"] == 15 and res["max_confidence"] == pytest.approx(15 / 16)
    assert set(res["quantiles"]) == {"0.5", "0.8", "0.9"}       # 15 rows support no finite 0.95 / 0.99
    lo, hi = iv.interval(np.array([200.0]), res, 0.85)          # between stored Cs: the next higher (0.9)
    q = res["quantiles"]["0.9"]
    assert (lo[0], hi[0]) == (pytest.approx(200 * (1 - q)), pytest.approx(200 * (1 + q)))
    with pytest.raises(ScenarioError, match="go up to 0.9"):
        iv.interval(np.array([1.0]), res, 0.95)
    with pytest.raises(ScenarioError, match="need >= 10"):
        iv.conformalize(pred[:12], y[:12])
    with pytest.raises(ScenarioError, match="differ"):
        iv.conformalize(pred, y[:5])
    assert math.isinf(iv.gamma_scores(np.array([0.0]), np.array([3.0]))[0])
