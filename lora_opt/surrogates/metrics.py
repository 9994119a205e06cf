"""How good a surrogate is, and the starvation decision rule: per-class error rates, the
classifier's threshold under the false-feasible bound, prediction latency.  (Its SMAPE is
:func:`lora_opt.smape.smape` with ``undefined="zero"``: a pair of zeros counts as no error.)

Why the classifier has its own threshold
----------------------------------------
The two errors of the starvation head do not cost the same.  A false *feasible* (predicted not
starving, actually starving or OOM) puts a configuration into production that starves users; a
false *infeasible* only makes the placement open one more GPU.  So the threshold on
``p_starving`` is not 0.5: it is the largest value whose out-of-fold false-feasible rate on the
training split is <= 1 % (``MAX_FALSE_FEASIBLE``); the held-out set then says what that gives on
unseen rows and what it costs in false-infeasible rate compared with 0.5.  Rates are per class:
false-feasible rate = false feasibles / actually-starving rows, false-infeasible rate = false
infeasibles / actually-feasible rows.
"""
from __future__ import annotations

import math
import time

import numpy as np

#: the largest acceptable false-feasible rate (out-of-fold, training split)
MAX_FALSE_FEASIBLE = 0.01


def error_rates(starving, feasible_pred) -> dict:
    """Per-class error rates of a feasibility decision (label 1 = starving or OOM)."""
    from sklearn.metrics import f1_score  # heavy optional dependency: only when scoring

    y = np.asarray(starving, int)
    pred_starving = (~np.asarray(feasible_pred, bool)).astype(int)
    ff = int(((y == 1) & (pred_starving == 0)).sum())
    fi = int(((y == 0) & (pred_starving == 1)).sum())
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    return {
        "false_feasible_rate": ff / n_pos if n_pos else 0.0,
        "false_infeasible_rate": fi / n_neg if n_neg else 0.0,
        "false_feasible": ff, "false_infeasible": fi, "starving_rows": n_pos, "feasible_rows": n_neg,
        "macro_f1": float(f1_score(y, pred_starving, average="macro", labels=[0, 1], zero_division=0)),
    }


def choose_threshold(p_starving, starving, max_false_feasible: float = MAX_FALSE_FEASIBLE) -> float:
    """The largest threshold t such that calling ``p < t`` feasible misclassifies at most
    ``max_false_feasible`` of the starving rows as feasible (the fewest false infeasibles under
    that bound).  With k = floor(bound x starving rows) misses allowed, t is the (k+1)-th smallest
    p among starving rows: only the k below it can be called feasible (ties make it fewer)."""
    p = np.asarray(p_starving, float)
    y = np.asarray(starving, int)
    pos = np.sort(p[y == 1])
    if pos.size == 0:
        return float(np.nextafter(1.0, 2.0))        # no starving row: everything is feasible
    k = int(math.floor(max_false_feasible * pos.size + 1e-9))
    return float(pos[k]) if k < pos.size else float(np.nextafter(pos[-1], 2.0))


def measure_latency(predict, X_pool: np.ndarray, *, singles: int = 30, batch: int = 10_000,
                    repeats: int = 3) -> dict:
    """Wall time of ``predict`` on one row (median over ``singles`` calls) and per row of a
    ``batch``-row call (best of ``repeats``), in microseconds, after one warm-up call."""
    X_pool = np.ascontiguousarray(X_pool, dtype=np.float64)
    big = np.ascontiguousarray(np.resize(X_pool, (batch, X_pool.shape[1])))
    predict(X_pool[:1])
    one = []
    for i in range(singles):
        row = X_pool[i % len(X_pool)][None, :]
        t = time.perf_counter()
        predict(row)
        one.append(time.perf_counter() - t)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        predict(big)
        best = min(best, time.perf_counter() - t)
    return {"single_us": float(np.median(one) * 1e6), "batch_us_per_row": float(best / batch * 1e6),
            "batch_rows": batch}
