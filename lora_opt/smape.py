"""SMAPE, the one definition: how far predictions (the twin's, a surrogate's) are from what they
predict (real runs, the twin's labels).  Every stage that scores a prediction imports it from here
(``tests/test_one_owner.py`` keeps it the only one).

SMAPE in percent = mean over pairs of |p - r| / ((|p| + |r|) / 2) x 100 (0 .. 200).  A pair of
zeros has no defined ratio (0 / 0), nor has a pair with a missing value (NaN).  What such a pair
does is the caller's choice, by name (``undefined``), one rule per kind of comparison:

* ``"drop"`` (default): left out of the mean, as is a pair with an infinite value -- real-run
  comparisons (calibration, fidelity, validate, the experiments), where a metric a run did not
  record is no evidence either way.  NaN when no pair is left.
* ``"zero"``: counted as no error (0 in the mean: a pair whose mean magnitude is not > 0 -- two
  zeros, or a NaN); an infinite value makes the result NaN -- the surrogates' scores (training,
  distillation, reports; sklearn's scorer), as they have always been computed.  NaN for no pairs.

On finite inputs without a pair of zeros the two rules give the same float, bit for bit.
"""
from __future__ import annotations

import numpy as np

#: what a pair without a defined ratio (two zeros, a NaN) does: left out, or counted as no error
UNDEFINED_PAIR_RULES = ("drop", "zero")


def smape(pred, real, *, undefined: str = "drop") -> float:
    """SMAPE in percent, mean(|p - r| / ((|p| + |r|) / 2)) x 100.  A pair of zeros or a pair with a
    NaN is left out (``undefined="drop"``, also pairs with an inf) or counts as no error
    (``undefined="zero"``); see the module's docstring."""
    p, r = np.asarray(pred, float), np.asarray(real, float)
    if undefined == "drop":
        ok = np.isfinite(p) & np.isfinite(r) & ((np.abs(p) + np.abs(r)) > 0)
        if not ok.any():
            return float("nan")
        return float(np.mean(np.abs(p[ok] - r[ok]) / ((np.abs(p[ok]) + np.abs(r[ok])) / 2)) * 100)
    if undefined == "zero":
        den = (np.abs(p) + np.abs(r)) / 2.0
        err = np.divide(np.abs(p - r), den, out=np.zeros_like(den), where=den > 0)
        return float(err.mean() * 100.0) if err.size else float("nan")
    raise ValueError(f"smape: undefined={undefined!r}; allowed: {', '.join(UNDEFINED_PAIR_RULES)}")


def smape_half(pred, real, *, undefined: str = "drop") -> float:
    """The variant without the /2 (mean(|p - r| / (|p| + |r|)) x 100): half of :func:`smape`.
    The papers' "SMAPE within 5.1 %" is on this scale (their twin: 4.2 / 5.1 here, 8.3 / 10.1
    with the BRIEF's definition)."""
    return smape(pred, real, undefined=undefined) / 2
