"""Fit primitives every estimator shares: the result record, rounding for YAML, R^2, the F-test.

A parameter joins a model only if an F-test says the data demand it (:data:`F_TEST_ALPHA`); the
YAML carries :data:`DIGITS` significant digits so that a re-run writes the same bytes.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize, stats

#: Significance level for adding a parameter (``slot_rank_scale``, ``n_sat``, a rank slope).
F_TEST_ALPHA = 1e-3
#: Significant digits written to the YAML (deterministic output; 8 digits keep 1e-7 relative).
DIGITS = 8


def sig(x: float, digits: int = DIGITS) -> float:
    """Round to ``digits`` significant digits (keeps inf/0); plain Python float for YAML."""
    x = float(x)
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def r2_score(y: np.ndarray, pred: np.ndarray) -> float:
    y, pred = np.asarray(y, float), np.asarray(pred, float)
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def f_test_p(sse_small: float, sse_big: float, n: int, k_big: int, extra: int = 1) -> float:
    """p-value that the ``extra`` parameters of the bigger nested model reduce the SSE by chance."""
    dof = n - k_big
    if dof <= 0 or sse_big <= 0:
        return 0.0 if sse_small > sse_big else 1.0
    f = max((sse_small - sse_big) / extra, 0.0) / (sse_big / dof)
    return float(stats.f.sf(f, extra, dof))


def relative_linear_fit(design: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Non-negative linear least squares on relative residuals (rows divided by y, or by ``weights``
    when ``y`` is the part of a measurement left after a known term): the twin's fidelity is judged on
    relative ITL/throughput errors, so a 1 ms miss at 13 ms matters more than at 50 ms."""
    scale = y if weights is None else weights
    sol = optimize.lsq_linear(design / scale[:, None], y / scale, bounds=(0.0, np.inf), method="bvls")
    return sol.x


def clean(obj: Any) -> Any:
    """numpy -> Python, floats rounded to DIGITS significant digits (deterministic YAML)."""
    if isinstance(obj, dict):
        return {(int(k) if isinstance(k, (np.integer,)) else k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return sig(float(obj))
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


@dataclass
class FitResult:
    """One estimator's fit: parameters, goodness of fit and the data for the report's plots."""

    params: dict[str, Any]
    families: list[str]
    n: int
    r2: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    plot: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"families": self.families, "n_points": int(self.n),
                               "params": clean(self.params)}
        if self.r2 is not None:
            out["r2"] = sig(self.r2, 6)
        out.update(clean(self.extra))
        return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
