"""Learned surrogates of the twin: per-GPU throughput and starvation, trained on the twin's dataset.

The greedy placement asks "what throughput will this GPU reach, and will it starve?" thousands of
times; the twin answers in ~0.1-2 s, these models in micro- to milliseconds.

Method
------
* Inputs: the per-GPU ``FEATURES`` of ``lora_opt.surrogates.features`` (adapters served, sum / std of rates,
  max / mean / std of ranks, A_max, incoming token rate), always in that order.
* Two heads per model family (k-nearest neighbours, random forest, support vector machine):
  a throughput **regressor** and a **starvation classifier** (label: ``starving`` or ``status ==
  "oom"`` -- an instance that cannot start serves nobody).  KNN and SVM see ``log1p`` features,
  standardised (rates span four decades); the regressors learn ``log1p(throughput)`` because the
  error that matters (SMAPE) is relative.
* Split: 20 % of the rows are held out (stratified by the starvation label, seeded) and only used to
  report.  On the other 80 %, ``HalvingGridSearchCV`` (5-fold) picks each family's
  hyper-parameters; out-of-fold (OOF) predictions of the tuned model pick the model per head and the
  classifier's threshold.
* Regression rows: ``status == "ok"`` rows that ran the whole duration.  An early-stopped run's
  throughput counts only the tokens completed before the stop (divided by the full duration), so it
  is a truncated number, not the configuration's throughput.

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

The earlier paper's model (``paper_ng_model``) is kept for comparison: per workload (the adapter
groups' ranks and rates), predict the twin's best served adapters N* and slots G* from 8 order
statistics with a random forest, scored by leave-workload-out cross-validation.

Everything heavy (scikit-learn, MLflow, matplotlib) is imported inside functions.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lora_opt import settings  # noqa: F401  (MLflow telemetry off before mlflow is imported)
from lora_opt.surrogates.features import FEATURES
from twin.errors import ScenarioError

#: the largest acceptable false-feasible rate (out-of-fold, training split)
MAX_FALSE_FEASIBLE = 0.01
HOLDOUT_FRACTION = 0.2
LABEL_COLUMNS = ("status", "starving", "throughput_tok_s")
REQUIRED_COLUMNS = (*FEATURES, *LABEL_COLUMNS)
FAMILIES = ("rf", "knn", "svm")
REGISTERED_NAMES = {"regressor": "lora-opt-throughput", "classifier": "lora-opt-starvation"}
#: kernel SVMs scale quadratically in rows: they are tuned and fitted on a seeded, stratified
#: subsample of at most this many training rows (reports still use the full held-out set)
SVM_MAX_ROWS = 10_000
#: below this many workloads the N*/G* model is reported but flagged as not meaningful
PAPER_MIN_WORKLOADS = 30
SURROGATE_FORMAT = "lora-opt-surrogate/1"


# ---- data -----------------------------------------------------------------------------------------
@dataclass
class TrainingData:
    """The dataset as arrays: features, labels, which rows carry a usable throughput, the split."""

    X: np.ndarray                 # (n, len(FEATURES)) float64, FEATURES order
    throughput: np.ndarray        # tok/s (0 for OOM rows)
    starving: np.ndarray          # int 0/1: starving or OOM
    measured: np.ndarray          # bool: ok and ran the whole duration -> a regression target
    train: np.ndarray             # row indices of the training split
    test: np.ndarray              # row indices of the held-out split
    dropped_rows: int = 0         # rows whose twin run failed (status "error")
    dataset_hash: str = ""


def validate_dataset(df) -> None:
    """Raise ``ScenarioError`` for an empty dataset, missing columns or non-finite features."""
    if df is None or len(getattr(df, "columns", ())) == 0:
        raise ScenarioError(f"dataset: no columns; required: {', '.join(REQUIRED_COLUMNS)}")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ScenarioError(f"dataset: missing column(s) {', '.join(missing)} "
                            f"(required: {', '.join(REQUIRED_COLUMNS)})")
    if len(df) == 0:
        raise ScenarioError("dataset: no rows")
    usable = df[df["status"].isin(["ok", "oom"])]
    if len(usable) == 0:
        raise ScenarioError("dataset: no row with status 'ok' or 'oom'")
    bad = [c for c in FEATURES if not np.isfinite(usable[c].to_numpy(np.float64)).all()]
    if bad:
        raise ScenarioError(f"dataset: non-finite values in feature column(s) {', '.join(bad)}")


def frame_hash(df) -> str:
    """Content hash of a dataset frame: sha256 of its CSV (``wall_s`` excluded) in point order.
    For a frame from ``lora_opt.surrogates.dataset.load_dataset(DIR)`` this equals ``dataset_hash(DIR)``, so a
    surrogate run links to the dataset run that made its rows."""
    d = df
    if "point_id" in d.columns:
        keys = ["dataset", "point_id"] if "dataset" in d.columns else ["point_id"]
        d = d.sort_values(keys, kind="stable", ignore_index=True)
    d = d.drop(columns=[c for c in ("wall_s",) if c in d.columns])
    return hashlib.sha256(d.to_csv(index=False).encode()).hexdigest()[:16]


def prepare(df, *, seed: int = 0, holdout: float = HOLDOUT_FRACTION) -> TrainingData:
    """Validate, label and split the dataset (stratified by the starvation label)."""
    from sklearn.model_selection import train_test_split

    validate_dataset(df)
    digest = frame_hash(df)
    usable = df[df["status"].isin(["ok", "oom"])].reset_index(drop=True)
    oom = (usable["status"] == "oom").to_numpy()
    starving = (usable["starving"].astype(bool).to_numpy() | oom).astype(np.int64)
    thr = np.where(oom, 0.0, usable["throughput_tok_s"].to_numpy(np.float64))
    measured = ~oom & np.isfinite(thr)
    if "stopped_early_s" in usable.columns:
        measured &= usable["stopped_early_s"].isna().to_numpy()
    counts = np.bincount(starving, minlength=2)
    if counts.min() < 2 * 5:
        raise ScenarioError(f"dataset: too few rows of one class to train and cross-validate "
                            f"(feasible {counts[0]}, starving/oom {counts[1]}; need >= 10 each)")
    idx = np.arange(len(usable))
    train, test = train_test_split(idx, test_size=holdout, stratify=starving, random_state=seed)
    return TrainingData(X=usable.loc[:, list(FEATURES)].to_numpy(np.float64), throughput=thr,
                        starving=starving, measured=measured, train=np.sort(train), test=np.sort(test),
                        dropped_rows=int(len(df) - len(usable)), dataset_hash=digest)


# ---- metrics --------------------------------------------------------------------------------------
def smape(pred, real) -> float:
    """mean(|p - r| / ((|p| + |r|) / 2)) x 100; a pair of zeros counts as no error."""
    p, r = np.asarray(pred, float), np.asarray(real, float)
    den = (np.abs(p) + np.abs(r)) / 2.0
    err = np.divide(np.abs(p - r), den, out=np.zeros_like(den), where=den > 0)
    return float(err.mean() * 100.0) if err.size else float("nan")


def error_rates(starving, feasible_pred) -> dict:
    """Per-class error rates of a feasibility decision (label 1 = starving or OOM)."""
    from sklearn.metrics import f1_score

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


# ---- model families -------------------------------------------------------------------------------
def _log_scale_steps():
    """log1p then standardise: distances and kernels need comparable, not heavy-tailed, features."""
    from sklearn.preprocessing import FunctionTransformer, StandardScaler

    return [("log", FunctionTransformer(np.log1p)), ("scale", StandardScaler())]


def make_regressor(family: str, seed: int = 0):
    """Untuned throughput regressor: a Pipeline ending in step ``model``, on log1p(throughput)."""
    from sklearn.compose import TransformedTargetRegressor
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.neighbors import KNeighborsRegressor
    from sklearn.pipeline import Pipeline
    from sklearn.svm import SVR

    if family == "rf":
        steps = [("model", RandomForestRegressor(random_state=seed, n_jobs=1))]
    elif family == "knn":
        steps = _log_scale_steps() + [("model", KNeighborsRegressor(n_jobs=1))]
    elif family == "svm":
        steps = _log_scale_steps() + [("model", SVR())]
    else:
        raise ScenarioError(f"surrogate: unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")
    return TransformedTargetRegressor(regressor=Pipeline(steps), func=np.log1p, inverse_func=np.expm1,
                                      check_inverse=False)


def make_classifier(family: str, seed: int = 0):
    """Untuned starvation classifier (class 1 = starving or OOM), with ``predict_proba``."""
    from sklearn.calibration import CalibratedClassifierCV
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.svm import SVC

    if family == "rf":
        return Pipeline([("model", RandomForestClassifier(random_state=seed, n_jobs=1))])
    if family == "knn":
        return Pipeline(_log_scale_steps() + [("model", KNeighborsClassifier(n_jobs=1))])
    if family == "svm":
        # Platt scaling on cross-validated decision values, then one SVC on all rows (what
        # SVC(probability=True) did; scikit-learn 1.9 deprecates that flag for this)
        return CalibratedClassifierCV(Pipeline(_log_scale_steps() + [("model", SVC())]), method="sigmoid",
                                      ensemble=False, cv=5)
    raise ScenarioError(f"surrogate: unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")


_GRIDS = {  # (family, head) -> (full grid, fast grid); keys are the final step's parameters
    ("rf", "regressor"): ({"n_estimators": [100, 200], "max_depth": [None, 16], "min_samples_leaf": [1, 2, 4],
                           "max_features": [1.0, 0.6]},
                          {"n_estimators": [30], "min_samples_leaf": [1, 3]}),
    ("rf", "classifier"): ({"n_estimators": [100, 200], "max_depth": [None, 16], "min_samples_leaf": [1, 2, 4],
                            "max_features": [1.0, 0.6], "class_weight": [None, "balanced"]},
                           {"n_estimators": [30], "min_samples_leaf": [1, 3]}),
    ("knn", "regressor"): ({"n_neighbors": [3, 5, 9, 15], "weights": ["uniform", "distance"], "p": [1, 2]},
                           {"n_neighbors": [3, 7], "weights": ["distance"]}),
    ("knn", "classifier"): ({"n_neighbors": [5, 9, 15, 25], "weights": ["uniform", "distance"], "p": [1, 2]},
                            {"n_neighbors": [5, 9], "weights": ["distance"]}),
    ("svm", "regressor"): ({"C": [1, 10, 100, 1000], "gamma": ["scale", 0.1, 1.0], "epsilon": [0.01, 0.05]},
                           {"C": [10, 100], "epsilon": [0.05]}),
    ("svm", "classifier"): ({"C": [0.1, 1, 10, 100], "gamma": ["scale", 0.1, 1.0],
                             "class_weight": [None, "balanced"]},
                            {"C": [1, 10]}),
}


def param_grid(family: str, head: str, fast: bool = False) -> dict:
    """The search grid of one family and head, keyed for the estimator ``make_*`` returns."""
    full, small = _GRIDS[(family, head)]
    prefix = {"regressor": "regressor__model__",
              "classifier": "estimator__model__" if family == "svm" else "model__"}[head]
    return {prefix + k: v for k, v in (small if fast else full).items()}


def _smape_scorer():
    from sklearn.metrics import make_scorer

    return make_scorer(smape, greater_is_better=False)


def _cv(head: str, folds: int, seed: int):
    from sklearn.model_selection import KFold, StratifiedKFold

    cls = StratifiedKFold if head == "classifier" else KFold
    return cls(n_splits=folds, shuffle=True, random_state=seed)


def _svm_rows(rows: np.ndarray, labels: np.ndarray, seed: int) -> np.ndarray:
    """At most SVM_MAX_ROWS of ``rows``, stratified by ``labels``, seeded."""
    if len(rows) <= SVM_MAX_ROWS:
        return rows
    from sklearn.model_selection import train_test_split

    keep, _ = train_test_split(rows, train_size=SVM_MAX_ROWS, stratify=labels, random_state=seed)
    return np.sort(keep)


HALVING_FACTOR = 3


def _min_resources(n_rows: int, grid: dict, folds: int) -> int:
    """Rows of the first halving iteration: what 'exhaust' would use (the last iteration sees every
    row), but at least 20 per fold, so that e.g. a 25-neighbour KNN can fit on every fold."""
    n_candidates = math.prod(len(v) for v in grid.values())
    iterations = 1 + math.ceil(math.log(max(n_candidates, 1), HALVING_FACTOR))
    exhaust = n_rows // HALVING_FACTOR ** (iterations - 1)
    return int(min(n_rows, max(exhaust, 20 * folds)))


def tune(estimator, grid: dict, X, y, *, head: str, folds: int, seed: int):
    """HalvingGridSearchCV (successive halving over training rows) with ``folds``-fold CV."""
    from sklearn.experimental import enable_halving_search_cv  # noqa: F401
    from sklearn.model_selection import HalvingGridSearchCV

    scoring = _smape_scorer() if head == "regressor" else "roc_auc"
    search = HalvingGridSearchCV(estimator, grid, cv=_cv(head, folds, seed), scoring=scoring, factor=HALVING_FACTOR,
                                 min_resources=_min_resources(len(X), grid, folds), random_state=seed, n_jobs=1,
                                 refit=True, error_score="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)       # tiny halving iterations on small data
        search.fit(X, y)
    return search


def _oof(estimator, X, y, *, head: str, folds: int, seed: int) -> np.ndarray:
    """Out-of-fold predictions (regressor) or P(starving) (classifier) of an untrained clone."""
    from sklearn.base import clone
    from sklearn.model_selection import cross_val_predict

    method = "predict_proba" if head == "classifier" else "predict"
    out = cross_val_predict(clone(estimator), X, y, cv=_cv(head, folds, seed), method=method, n_jobs=1)
    return out[:, 1] if head == "classifier" else out


def fit_regressor_family(family: str, data: TrainingData, *, folds: int, seed: int, fast: bool) -> dict:
    """Tune, score (OOF on train, held-out) and time one family's throughput regressor."""
    rows = data.train[data.measured[data.train]]
    if family == "svm":
        rows = _svm_rows(rows, data.starving[rows], seed)
    X, y = data.X[rows], data.throughput[rows]
    search = tune(make_regressor(family, seed), param_grid(family, "regressor", fast), X, y,
                  head="regressor", folds=folds, seed=seed)
    model = search.best_estimator_
    oof = _oof(model, X, y, head="regressor", folds=folds, seed=seed)
    test = data.test[data.measured[data.test]]
    pred = model.predict(data.X[test])
    feasible_test = test[data.starving[test] == 0]
    return {
        "model": model, "oof_pred": oof, "rows": rows,
        "metrics": {
            "best_params": _short_params(search.best_params_), "train_rows": int(len(rows)),
            "cv_smape": smape(oof, y),
            "test_smape": smape(pred, data.throughput[test]),
            "test_smape_feasible": smape(model.predict(data.X[feasible_test]), data.throughput[feasible_test])
            if len(feasible_test) else float("nan"),
            "test_rows": int(len(test)),
            "latency": measure_latency(model.predict, data.X[data.test], singles=10 if fast else 30),
        },
    }


def fit_classifier_family(family: str, data: TrainingData, *, folds: int, seed: int, fast: bool) -> dict:
    """Tune one family's starvation classifier, choose its threshold on OOF probabilities of the
    training split, report held-out errors at that threshold and at 0.5, and time it."""
    rows = data.train
    if family == "svm":
        rows = _svm_rows(rows, data.starving[rows], seed)
    X, y = data.X[rows], data.starving[rows]
    search = tune(make_classifier(family, seed), param_grid(family, "classifier", fast), X, y,
                  head="classifier", folds=folds, seed=seed)
    model = search.best_estimator_
    p_oof = _oof(model, X, y, head="classifier", folds=folds, seed=seed)
    threshold = choose_threshold(p_oof, y)
    p_test = model.predict_proba(data.X[data.test])[:, 1]
    y_test = data.starving[data.test]
    at_t = error_rates(y_test, p_test < threshold)
    at_half = error_rates(y_test, p_test < 0.5)
    return {
        "model": model, "p_oof": p_oof, "rows": rows, "threshold": threshold, "p_test": p_test,
        "metrics": {
            "best_params": _short_params(search.best_params_), "train_rows": int(len(rows)),
            "threshold": threshold,
            "oof": error_rates(y, p_oof < threshold),
            "oof_at_half": error_rates(y, p_oof < 0.5),
            "test": at_t, "test_at_half": at_half,
            "false_infeasible_cost_vs_half": at_t["false_infeasible_rate"] - at_half["false_infeasible_rate"],
            "latency": measure_latency(lambda A: model.predict_proba(A), data.X[data.test],
                                       singles=10 if fast else 30),
        },
    }


def _short_params(params: dict) -> dict:
    return {k.rsplit("__", 1)[-1]: v for k, v in params.items()}


def pick_regressor(results: dict) -> str:
    """Lowest out-of-fold SMAPE (chosen on the training split; the held-out set only reports)."""
    return min(results, key=lambda f: results[f]["metrics"]["cv_smape"])


def pick_classifier(results: dict) -> str:
    """Fewest OOF false infeasibles at the <= 1 % false-feasible threshold; tie -> higher OOF F1."""
    return min(results, key=lambda f: (results[f]["metrics"]["oof"]["false_infeasible_rate"],
                                       -results[f]["metrics"]["oof"]["macro_f1"]))


# ---- the earlier paper's N*/G* model --------------------------------------------------------------
def workload_table(df) -> "Any":
    """One row per workload (profile + group ranks + group rates): the 8 order statistics of its
    adapters and the twin's argmax (N*, G*) of throughput among non-starving, non-OOM rows.
    With the served adapters split evenly over the groups, the statistics over the 3 groups are
    those of the adapters (exactly when 3 divides N)."""
    import pandas as pd

    keys = [c for c in ("profile", "group_ranks", "group_rates") if c in df.columns]
    ok = df[(df["status"] == "ok") & ~df["starving"].astype(bool)]
    rows = []
    for key, g in ok.groupby(keys, sort=True):
        key = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        ranks = np.array([float(x) for x in str(key["group_ranks"]).split(",")])
        rates = np.array([float(x) for x in str(key["group_rates"]).split(",")])
        best = g.loc[g["throughput_tok_s"].idxmax()]
        rows.append({**key, "rank_min": ranks.min(), "rank_max": ranks.max(), "rank_mean": ranks.mean(),
                     "rank_std": ranks.std(), "rate_min": rates.min(), "rate_max": rates.max(),
                     "rate_mean": rates.mean(), "rate_std": rates.std(),
                     "n_star": float(best["n_adapters"]), "g_star": float(best["max_loras"])})
    return pd.DataFrame(rows)


PAPER_STATS = ("rank_min", "rank_max", "rank_mean", "rank_std", "rate_min", "rate_max", "rate_mean", "rate_std")


def paper_ng_model(df, *, seed: int = 0, fast: bool = False) -> dict:
    """SMAPE of an RF predicting (N*, G*) from the 8 order statistics, leave-workload-out CV
    (leave-one-out below 50 workloads, else 5-fold), next to predicting the training median."""
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.model_selection import KFold, LeaveOneOut, cross_val_predict

    if not {"group_ranks", "group_rates"} <= set(df.columns):
        return {"note": "no group_ranks / group_rates columns: workloads unknown, N*/G* model skipped"}
    wl = workload_table(df[df["status"].isin(["ok", "oom"])])
    n_total = int(df.groupby([c for c in ("profile", "group_ranks", "group_rates") if c in df.columns]).ngroups)
    out: dict[str, Any] = {"workloads": n_total, "workloads_with_feasible_config": int(len(wl))}
    if len(wl) < 5:
        out["note"] = f"only {len(wl)} workloads with a non-starving configuration: N*/G* model not fitted"
        return out
    X = wl.loc[:, list(PAPER_STATS)].to_numpy(float)
    Y = wl.loc[:, ["n_star", "g_star"]].to_numpy(float)
    cv = LeaveOneOut() if len(wl) < 50 else KFold(5, shuffle=True, random_state=seed)
    rf = RandomForestRegressor(n_estimators=50 if fast else 200, random_state=seed, n_jobs=1)
    pred = cross_val_predict(rf, X, Y, cv=cv)
    base = np.empty_like(Y)                          # the no-skill reference: median of the other folds
    for tr, te in cv.split(X):
        base[te] = np.median(Y[tr], axis=0)
    out.update({
        "cv": "leave-one-workload-out" if len(wl) < 50 else "5-fold over workloads",
        "smape_n_star": smape(pred[:, 0], Y[:, 0]), "smape_g_star": smape(pred[:, 1], Y[:, 1]),
        "median_baseline_smape_n_star": smape(base[:, 0], Y[:, 0]),
        "median_baseline_smape_g_star": smape(base[:, 1], Y[:, 1]),
        "meaningful": bool(len(wl) >= PAPER_MIN_WORKLOADS),
    })
    if len(wl) < PAPER_MIN_WORKLOADS:
        out["note"] = (f"only {len(wl)} workloads (< {PAPER_MIN_WORKLOADS}): the N*/G* errors are "
                       "anecdotal, compare them with the median baseline")
    return out


# ---- the product: Surrogate ------------------------------------------------------------------------
def as_feature_matrix(X, feature_names=FEATURES) -> np.ndarray:
    """(n, len(feature_names)) float64 from a DataFrame (columns by name), a 2-D or a 1-D array."""
    if hasattr(X, "columns"):
        missing = [c for c in feature_names if c not in X.columns]
        if missing:
            raise ScenarioError(f"surrogate input: missing feature column(s) {', '.join(missing)}")
        return X.loc[:, list(feature_names)].to_numpy(np.float64)
    A = np.asarray(X, dtype=np.float64)
    if A.ndim == 1:
        A = A[None, :]
    if A.ndim != 2 or A.shape[1] != len(feature_names):
        raise ScenarioError(f"surrogate input: expected shape (n, {len(feature_names)}) in the order "
                            f"{', '.join(feature_names)}; got {A.shape}")
    return A


@dataclass
class Surrogate:
    """Chosen throughput regressor + starvation classifier + threshold, on FEATURES in order."""

    regressor: Any
    classifier: Any
    threshold: float
    feature_names: tuple = FEATURES
    metadata: dict = field(default_factory=dict)

    def predict(self, X) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(throughput tok/s if it runs, feasible = p_starving < threshold, p_starving)."""
        A = as_feature_matrix(X, self.feature_names)
        thr = np.maximum(self.regressor.predict(A), 0.0)
        p = self.classifier.predict_proba(A)[:, 1]
        return thr, p < self.threshold, p

    def save(self, path) -> Path:
        """joblib (pickle) file: load only files you made (``load`` checks the format tag)."""
        import joblib

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        joblib.dump({"format": SURROGATE_FORMAT, "regressor": self.regressor, "classifier": self.classifier,
                     "threshold": float(self.threshold), "feature_names": list(self.feature_names),
                     "metadata": self.metadata}, path)
        return path

    @classmethod
    def load(cls, path) -> "Surrogate":
        import joblib
        import sklearn

        d = joblib.load(Path(path))
        if not isinstance(d, dict) or d.get("format") != SURROGATE_FORMAT:
            raise ScenarioError(f"{path}: not a lora-opt surrogate ({SURROGATE_FORMAT})")
        saved = d["metadata"].get("sklearn_version")
        if saved and saved != sklearn.__version__:
            warnings.warn(f"{path}: saved with scikit-learn {saved}, loaded with {sklearn.__version__}")
        return cls(d["regressor"], d["classifier"], d["threshold"], tuple(d["feature_names"]), d["metadata"])


# ---- reporting: plots and MLflow -----------------------------------------------------------------
def plot_pred_vs_real(pred, real, starving, path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    s = np.asarray(starving, bool)
    ax.scatter(real[~s], pred[~s], s=10, label="feasible")
    ax.scatter(real[s], pred[s], s=10, marker="x", label="starving (full run)")
    lim = [max(1.0, min(real.min(), pred.min()) * 0.8), max(real.max(), pred.max()) * 1.2]
    ax.plot(lim, lim, "k--", lw=1)
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="twin throughput (tok/s)",
           ylabel="predicted throughput (tok/s)", title=f"held-out, SMAPE {smape(pred, real):.1f} %")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return Path(path)


def plot_confusion(starving, feasible_pred, threshold, path) -> Path:
    from matplotlib.figure import Figure

    y = np.asarray(starving, int)
    ps = (~np.asarray(feasible_pred, bool)).astype(int)
    m = np.array([[((y == a) & (ps == b)).sum() for b in (0, 1)] for a in (0, 1)])
    fig = Figure(figsize=(4.5, 4))
    ax = fig.subplots()
    ax.imshow(m, cmap="Blues")
    for a in (0, 1):
        for b in (0, 1):
            ax.text(b, a, str(m[a, b]), ha="center", va="center", fontsize=14)
    ax.set(xticks=[0, 1], yticks=[0, 1], xticklabels=["feasible", "starving"], yticklabels=["feasible", "starving"],
           xlabel="predicted", ylabel="twin", title=f"held-out, p_starving < {threshold:.3g} = feasible")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return Path(path)


def resolve_tracking_uri(tracking_uri: str | None) -> str:
    import os

    from lora_opt.tracking import default_tracking_uri

    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def _pip_requirements() -> list[str]:
    import scipy
    import skops
    import sklearn

    return [f"scikit-learn=={sklearn.__version__}", f"numpy=={np.__version__}", f"scipy=={scipy.__version__}",
            f"skops=={skops.__version__}"]


def log_sklearn_model(model, name: str, registered_name: str, X_example: np.ndarray, output) -> dict:
    """Log (skops format) and register one fitted estimator in the active run."""
    import mlflow
    import pandas as pd
    import skops.io as sio
    from mlflow.models import infer_signature

    # trust exactly the types our own freshly trained model contains (skops refuses others)
    trusted = sio.get_untrusted_types(data=sio.dumps(model))
    signature = infer_signature(pd.DataFrame(X_example, columns=list(FEATURES)), output)
    info = mlflow.sklearn.log_model(
        model, name=name, signature=signature, pip_requirements=_pip_requirements(),
        skops_trusted_types=trusted or None, registered_model_name=registered_name,
        pyfunc_predict_fn="predict_proba" if hasattr(model, "predict_proba") else "predict")
    return {"model_uri": info.model_uri, "registered_name": registered_name,
            "version": int(info.registered_model_version) if info.registered_model_version else None}


def _log_run(result: dict, data: TrainingData, out_dir: Path, args: dict, tracking_uri: str | None) -> dict:
    """One MLflow run (experiment "surrogate"): params, metrics, plots, the chosen models."""
    import mlflow

    from lora_opt.tracking import tracked_run

    metrics, sur = result["metrics"], result["surrogate"]
    uri = resolve_tracking_uri(tracking_uri)
    with tracked_run("surrogate", run_name=f"surrogate-{data.dataset_hash}", tracking_uri=uri) as run:
        mlflow.set_tag("dataset_hash", data.dataset_hash)
        params = {**args, "dataset_hash": data.dataset_hash, "rows": len(data.X),
                  "chosen_regressor": metrics["chosen"]["regressor"],
                  "chosen_classifier": metrics["chosen"]["classifier"], "threshold": sur.threshold,
                  "max_false_feasible": MAX_FALSE_FEASIBLE}
        for head in ("regressor", "classifier"):
            for fam, m in metrics[head].items():
                params.update({f"{head}.{fam}.{k}": v for k, v in m["best_params"].items()})
        mlflow.log_params({k: str(v) for k, v in params.items()})
        mlflow.log_metrics(flat_metrics("", {k: metrics[k] for k in ("regressor", "classifier", "paper_ng",
                                                                       "dataset", "train_wall_s")}))
        mlflow.log_artifacts(str(out_dir / "plots"), artifact_path="plots")
        X_ex = data.X[data.test[:20]]
        models = {
            "regressor": log_sklearn_model(sur.regressor, "throughput_model", REGISTERED_NAMES["regressor"],
                                           X_ex, sur.regressor.predict(X_ex)),
            "classifier": log_sklearn_model(sur.classifier, "starvation_model", REGISTERED_NAMES["classifier"],
                                            X_ex, sur.classifier.predict_proba(X_ex)),
        }
        return {"run_id": run.info.run_id, "experiment": "surrogate", "tracking_uri": uri, "models": models}


# ---- training ---------------------------------------------------------------------------------------
def flat_metrics(prefix: str, d) -> dict:
    """Every finite number of a nested dict as ``{"prefix.key.sub": value}`` (the names
    ``tracking.log_flat_metrics`` uses), for one batched ``mlflow.log_metrics`` call: one sqlite
    write per metric costs ~30 ms, ~200 of them several seconds."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flat_metrics(f"{prefix}.{k}" if prefix else str(k), v))
    elif isinstance(d, (int, float, np.number)) and not isinstance(d, bool) and math.isfinite(d):
        out[prefix.replace(" ", "_").replace(",", "")] = float(d)
    return out


def _dataset_summary(data: TrainingData) -> dict:
    return {"rows": int(len(data.X)), "dropped_error_rows": data.dropped_rows,
            "starving_or_oom": int(data.starving.sum()), "feasible": int((data.starving == 0).sum()),
            "regression_rows": int(data.measured.sum()), "train_rows": int(len(data.train)),
            "test_rows": int(len(data.test))}


def train_surrogates(df, out_dir, *, models=FAMILIES, cv: int = 5, seed: int = 0, tracking_uri: str | None = None,
                     fast: bool = False, track: bool = True) -> dict:
    """Train every family's two heads, choose one per head, save and (``track``) log to MLflow.

    Writes ``out_dir/surrogate.joblib``, ``out_dir/metrics.json`` and ``out_dir/plots/*.png``.
    Returns ``{"metrics": dict (JSON-able), "surrogate": Surrogate, "families": {family:
    {"regressor": fitted, "classifier": fitted}}, "data": TrainingData, "oof": {family: P(starving)
    out of fold on the training split}}``.
    """
    import sklearn

    models = tuple(models)
    unknown = [m for m in models if m not in FAMILIES]
    if unknown or not models:
        raise ScenarioError(f"surrogate: unknown model family {unknown}; allowed: {', '.join(FAMILIES)}")
    data = prepare(df, seed=seed)
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    regs = {f: fit_regressor_family(f, data, folds=cv, seed=seed, fast=fast) for f in models}
    clfs = {f: fit_classifier_family(f, data, folds=cv, seed=seed, fast=fast) for f in models}
    best_reg, best_clf = pick_regressor(regs), pick_classifier(clfs)
    metrics = {
        "dataset": {**_dataset_summary(data), "sha256_16": data.dataset_hash},
        "regressor": {f: r["metrics"] for f, r in regs.items()},
        "classifier": {f: c["metrics"] for f, c in clfs.items()},
        "chosen": {"regressor": best_reg, "classifier": best_clf, "threshold": clfs[best_clf]["threshold"],
                   "selection": "regressor: lowest OOF SMAPE; classifier: lowest OOF false-infeasible rate "
                                "at the <= 1 % OOF false-feasible threshold, tie -> OOF macro-F1"},
        "paper_ng": paper_ng_model(df, seed=seed, fast=fast),
        "train_wall_s": time.perf_counter() - t0,
    }
    sur = Surrogate(regs[best_reg]["model"], clfs[best_clf]["model"], clfs[best_clf]["threshold"], FEATURES,
                    {"dataset_hash": data.dataset_hash, "sklearn_version": sklearn.__version__,
                     "regressor": best_reg, "classifier": best_clf, "max_false_feasible": MAX_FALSE_FEASIBLE,
                     "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "metrics": {"regressor": metrics["regressor"][best_reg],
                                 "classifier": metrics["classifier"][best_clf]}})
    test = data.test[data.measured[data.test]]
    plot_pred_vs_real(sur.regressor.predict(data.X[test]), data.throughput[test], data.starving[test],
                      out_dir / "plots" / "throughput_pred_vs_real.png")
    plot_confusion(data.starving[data.test], clfs[best_clf]["p_test"] < sur.threshold, sur.threshold,
                   out_dir / "plots" / "starvation_confusion.png")
    result = {"metrics": metrics, "surrogate": sur, "data": data,
              "families": {f: {"regressor": regs[f]["model"], "classifier": clfs[f]["model"]} for f in models},
              "oof": {f: clfs[f]["p_oof"] for f in models}}
    if track:
        metrics["mlflow"] = _log_run(result, data, out_dir,
                                     {"models": ",".join(models), "cv": cv, "seed": seed, "fast": fast}, tracking_uri)
    sur.save(out_dir / "surrogate.joblib")
    write_json(out_dir / "metrics.json", metrics)
    return result


def write_json(path, obj) -> None:
    Path(path).write_text(json.dumps(_jsonable(obj), indent=2, allow_nan=True))


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def load_dataset_dir(dataset_dir) -> tuple[Any, str]:
    """(rows of every ``shard-*.parquet`` in point order, the dataset hash); ScenarioError if none."""
    from lora_opt.surrogates.dataset import load_dataset

    p = Path(dataset_dir)
    if not p.is_dir():
        raise ScenarioError(f"dataset: {dataset_dir} is not a directory")
    df = load_dataset(p)
    return df, frame_hash(df)


def train_cli(dataset_dir, out_dir, tracking_uri: str | None = None, fast: bool = False, *,
              seed: int = 0, track: bool = True) -> dict:
    """``lora-opt train``: read the Parquet dataset(s) (one directory or a list, concatenated in
    order), train and choose the surrogates, distill the random forests into one rule tree per
    head, write ``surrogate.joblib``, ``distilled.json``, ``rules.txt``, ``metrics.json``,
    ``dataset_summary.json`` (the ``summary.json`` of the dataset(s): rows, hash, grid, profile and
    twin version) and plots into ``out_dir``; return the metrics."""
    import pandas as pd

    from lora_opt.surrogates import distill

    dirs = [dataset_dir] if isinstance(dataset_dir, (str, Path)) else list(dataset_dir)
    frames = []
    for k, d in enumerate(dirs):
        part, _ = load_dataset_dir(d)
        frames.append(part.assign(dataset=k) if len(dirs) > 1 else part)
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    out_dir = Path(out_dir)
    res = train_surrogates(df, out_dir, tracking_uri=tracking_uri, fast=fast, seed=seed, track=track)
    rf = res["families"]["rf"]
    dist, report = distill.distill_and_report(rf["regressor"], rf["classifier"], res["data"],
                                              p_teacher_oof=res["oof"]["rf"], seed=seed, fast=fast)
    dist.metadata.update({"dataset_hash": res["data"].dataset_hash})
    dist.save(out_dir / "distilled.json")
    (out_dir / "rules.txt").write_text(dist.rules())
    metrics = res["metrics"]
    metrics["distilled"] = report
    metrics["dataset"]["dir"] = ", ".join(str(Path(d).resolve()) for d in dirs)
    write_json(out_dir / "metrics.json", metrics)
    # provenance beside the model: which labelled rows (and which twin) it was trained on
    sources = [json.loads((Path(d) / "summary.json").read_text()) if (Path(d) / "summary.json").exists()
               else {"out": str(d)} for d in dirs]
    write_json(out_dir / "dataset_summary.json", sources[0] if len(sources) == 1 else sources)
    if track:
        _log_distilled(metrics["mlflow"], report, out_dir)
    return metrics


def _log_distilled(run: dict, report: dict, out_dir: Path) -> None:
    """Add the distillation's metrics and files to the surrogate run."""
    import mlflow

    mlflow.set_tracking_uri(run["tracking_uri"])
    with mlflow.start_run(run_id=run["run_id"]):
        mlflow.log_metrics(flat_metrics("distilled", report))
        for name in ("distilled.json", "rules.txt", "metrics.json"):
            mlflow.log_artifact(str(out_dir / name))
