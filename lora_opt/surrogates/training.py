"""Train the surrogates of the twin: per-GPU throughput and starvation, on the twin's dataset
(``lora-opt train``).

The greedy placement asks "what throughput will this GPU reach, and will it starve?" thousands of
times; the twin answers in ~0.1-2 s, these models in micro- to milliseconds.

Method
------
* Inputs, labels and the held-out split: ``lora_opt.surrogates.training_data``.
* Two heads per model family (k-nearest neighbours, random forest, support vector machine):
  a throughput **regressor** and a **starvation classifier** (label: ``starving`` or ``status ==
  "oom"`` -- an instance that cannot start serves nobody).  KNN and SVM see ``log1p`` features,
  standardised (rates span four decades); the regressors learn ``log1p(throughput)`` because the
  error that matters (SMAPE) is relative.
* On the 80 % training split, ``HalvingGridSearchCV`` (5-fold) picks each family's
  hyper-parameters; out-of-fold (OOF) predictions of the tuned model pick the model per head and the
  classifier's threshold (``lora_opt.surrogates.metrics.choose_threshold``: at most 1 % false
  feasibles, see there why).
* The chosen heads become the ``Surrogate`` oracle (``lora_opt.surrogates.oracle``); the random
  forests are distilled into rule trees (``lora_opt.surrogates.distill``); the earlier paper's N*/G*
  model is reported beside them (``lora_opt.surrogates.paper_ng``); plots and the MLflow run:
  ``lora_opt.surrogates.reporting``.

scikit-learn, pandas and MLflow are imported inside functions: placement loads this package's
oracles without paying for them.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_text
from lora_opt.surrogates import distill, model_files, registry
from lora_opt.surrogates.intervals import MIN_CALIBRATION_ROWS, conformalize, held_out_regression
from lora_opt.surrogates.features import FEATURES
from lora_opt.smape import smape
from lora_opt.surrogates.metrics import MAX_FALSE_FEASIBLE, choose_threshold, error_rates, measure_latency
from lora_opt.surrogates.oracle import ORACLE_FILES, Surrogate
from lora_opt.surrogates.paper_ng import paper_ng_model
from lora_opt.surrogates.reporting import (log_distilled, log_training_run, plot_confusion, plot_pred_vs_real,
                                           write_json)
from lora_opt.surrogates.training_data import TrainingData, label_rows, load_dataset_dir, prepare
from twin.errors import ScenarioError
from twin.parsing import read_json_file

FAMILIES = ("rf", "knn", "svm")
#: kernel SVMs scale quadratically in rows: they are tuned and fitted on a seeded, stratified
#: subsample of at most this many training rows (reports still use the full held-out set)
SVM_MAX_ROWS = 10_000


# ---- model families -------------------------------------------------------------------------------
def _log_scale_steps():
    """log1p then standardise: distances and kernels need comparable, not heavy-tailed, features."""
    from sklearn.preprocessing import FunctionTransformer, StandardScaler  # heavy optional dependency

    return [("log", FunctionTransformer(np.log1p)), ("scale", StandardScaler())]


def make_regressor(family: str, seed: int = 0):
    """Untuned throughput regressor: a Pipeline ending in step ``model``, on log1p(throughput)."""
    from sklearn.compose import TransformedTargetRegressor  # heavy optional dependency: only when training
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
    from sklearn.calibration import CalibratedClassifierCV  # heavy optional dependency: only when training
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
    from sklearn.metrics import make_scorer  # heavy optional dependency: only when training

    return make_scorer(smape, greater_is_better=False, undefined="zero")


def _cv(head: str, folds: int, seed: int):
    from sklearn.model_selection import KFold, StratifiedKFold  # heavy optional dependency: only when training

    cls = StratifiedKFold if head == "classifier" else KFold
    return cls(n_splits=folds, shuffle=True, random_state=seed)


def _svm_rows(rows: np.ndarray, labels: np.ndarray, seed: int) -> np.ndarray:
    """At most SVM_MAX_ROWS of ``rows``, stratified by ``labels``, seeded."""
    if len(rows) <= SVM_MAX_ROWS:
        return rows
    from sklearn.model_selection import train_test_split  # heavy optional dependency: only when training

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
    from sklearn.experimental import enable_halving_search_cv  # noqa: F401  (heavy; enables the next import)
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
    from sklearn.base import clone  # heavy optional dependency: only when training
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
            "cv_smape": smape(oof, y, undefined="zero"),
            "test_smape": smape(pred, data.throughput[test], undefined="zero"),
            "test_smape_feasible": smape(model.predict(data.X[feasible_test]), data.throughput[feasible_test],
                                         undefined="zero")
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


# ---- training ---------------------------------------------------------------------------------------
def train_surrogates(df, out_dir, *, models=FAMILIES, cv: int = 5, seed: int = 0, tracking_uri: str | None = None,
                     fast: bool = False, track: bool = True, bar: tqdm | None = None) -> dict:
    """Train every family's two heads, choose one per head, save and (``track``) log to MLflow.

    Writes ``out_dir/surrogate.json`` + ``surrogate.skops`` (``Surrogate.save``),
    ``out_dir/metrics.json`` and ``out_dir/plots/*.png``.
    Returns ``{"metrics": dict (JSON-able), "surrogate": Surrogate, "families": {family:
    {"regressor": fitted, "classifier": fitted}}, "data": TrainingData, "oof": {family: P(starving)
    out of fold on the training split}}``.
    """
    import sklearn  # heavy optional dependency: only when training

    models = tuple(models)
    unknown = [m for m in models if m not in FAMILIES]
    if unknown or not models:
        raise ScenarioError(f"surrogate: unknown model family {unknown}; allowed: {', '.join(FAMILIES)}")
    data = prepare(df, seed=seed)
    out_dir = Path(out_dir)
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if bar is None:                          # ``bar``: a progress bar to advance, one step per fit
        bar = tqdm(disable=True)
    regs: dict = {}
    clfs: dict = {}
    for head, fit, fitted in (("throughput", fit_regressor_family, regs), ("starvation", fit_classifier_family, clfs)):
        for f in models:
            bar.set_postfix_str(f"{head} {f}")
            fitted[f] = fit(f, data, folds=cv, seed=seed, fast=fast)
            bar.update()
    bar.set_postfix_str("paper's NG model, plots, MLflow")
    best_reg, best_clf = pick_regressor(regs), pick_classifier(clfs)
    metrics = {
        "dataset": {**data.summary(), "sha256_16": data.dataset_hash},
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
    # split-conformal intervals of the chosen regressor, on held-out rows only (calibrate / cover halves)
    X_held, y_held = held_out_regression(data)
    if len(y_held) >= 2 * MIN_CALIBRATION_ROWS:
        metrics["intervals"] = sur.metadata["intervals"] = conformalize(sur.predict(X_held)[0], y_held, seed=seed)
    test = data.test[data.measured[data.test]]
    plot_pred_vs_real(sur.regressor.predict(data.X[test]), data.throughput[test], data.starving[test],
                      out_dir / "plots" / "throughput_pred_vs_real.png")
    plot_confusion(data.starving[data.test], clfs[best_clf]["p_test"] < sur.threshold, sur.threshold,
                   out_dir / "plots" / "starvation_confusion.png")
    result = {"metrics": metrics, "surrogate": sur, "data": data,
              "families": {f: {"regressor": regs[f]["model"], "classifier": clfs[f]["model"]} for f in models},
              "oof": {f: clfs[f]["p_oof"] for f in models}}
    if track:
        metrics["mlflow"] = log_training_run(result, data, out_dir,
                                             {"models": ",".join(models), "cv": cv, "seed": seed, "fast": fast},
                                             tracking_uri, registry.version_tags(df))
    sur.save(out_dir)
    write_json(out_dir / "metrics.json", metrics)
    return result


def read_datasets(dataset_dir) -> tuple:
    """(rows of one dataset directory or of several concatenated in order -- each tagged with its index in a
    ``dataset`` column --, the directories)."""
    import pandas as pd  # heavy optional dependency: only when training

    dirs = [dataset_dir] if isinstance(dataset_dir, (str, Path)) else list(dataset_dir)
    frames = []
    for k, d in enumerate(dirs):
        part, _ = load_dataset_dir(d)
        frames.append(part.assign(dataset=k) if len(dirs) > 1 else part)
    return (pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]), dirs


def train_cli(dataset_dir, out_dir, tracking_uri: str | None = None, fast: bool = False, *,
              seed: int = 0, track: bool = True, progress: bool = False) -> dict:
    """``lora-opt train``: read the Parquet dataset(s) (one directory or a list, concatenated in
    order), train and choose the surrogates, distill the random forests into one rule tree per
    head, write ``surrogate.json`` + ``surrogate.skops``, ``distilled.json``, ``rules.txt``, ``metrics.json``,
    ``dataset_summary.json`` (the ``summary.json`` of the dataset(s): rows, hash, grid, profile and
    twin version) and plots into ``out_dir``; return the metrics."""
    # progress: one step for reading, one per fit (2 heads x families), NG model + plots + MLflow, distillation
    bar = tqdm(total=2 * len(FAMILIES) + 3, desc="train", unit="step", disable=not progress)
    bar.set_postfix_str("reading the dataset")
    df, dirs = read_datasets(dataset_dir)
    out_dir = Path(out_dir)
    bar.update()
    res = train_surrogates(df, out_dir, tracking_uri=tracking_uri, fast=fast, seed=seed, track=track, bar=bar)
    bar.update()
    bar.set_postfix_str("distilling the random forests")
    rf = res["families"]["rf"]
    dist, report = distill.distill_and_report(rf["regressor"], rf["classifier"], res["data"],
                                              p_teacher_oof=res["oof"]["rf"], seed=seed, fast=fast)
    bar.update()
    bar.close()
    dist.metadata.update({"dataset_hash": res["data"].dataset_hash})
    dist.save(out_dir / ORACLE_FILES["distilled"])
    atomic_write_text(out_dir / "rules.txt", dist.rules())
    metrics = res["metrics"]
    metrics["distilled"] = report
    metrics["dataset"]["dir"] = ", ".join(str(Path(d).resolve()) for d in dirs)
    write_json(out_dir / "metrics.json", metrics)
    # provenance beside the model: which labelled rows (and which twin) it was trained on
    sources = [read_json_file(Path(d) / "summary.json", "dataset summary", InputError, allow_nan=True)
               if (Path(d) / "summary.json").exists()
               else {"out": str(d)} for d in dirs]
    write_json(out_dir / "dataset_summary.json", sources[0] if len(sources) == 1 else sources)
    if track:
        log_distilled(metrics["mlflow"], report, out_dir, (ORACLE_FILES["distilled"], "rules.txt", "metrics.json"))
    return metrics


def add_intervals(surrogate_dir, dataset_dirs, *, seed: int = 0) -> dict:
    """``lora-opt train --intervals-only``: conformalize an already trained surrogate, store the quantiles
    in its manifest and ``metrics.json``; the models themselves are not touched.  ``dataset_dirs``: the
    dataset it was trained on (its hash equals the one the surrogate records: the held-out split
    ``lora-opt train`` made is used) or a **held-apart** dataset of the same profile, labelled on points
    it was not trained on (``configs/grids/heldapart.yaml``: every regression row is used).  The
    intervals (``conformalize``'s dict, with ``rows_from``)."""
    sur = Surrogate.load(surrogate_dir)
    df, dirs = read_datasets(dataset_dirs)
    data = prepare(df, seed=seed)
    path = model_files.manifest_path(surrogate_dir)
    where = Path(path).parent
    summary = where / "dataset_summary.json"
    trained_profile = (read_json_file(summary, "dataset summary", InputError, allow_nan=True).get("profile")
                       if summary.is_file() else None)
    profiles = sorted(set(df["profile"].astype(str))) if "profile" in df.columns else []
    if trained_profile and profiles and profiles != [trained_profile]:
        raise InputError(f"--dataset {', '.join(map(str, dirs))}: labelled for {', '.join(profiles)}; the surrogate in "
                         f"{surrogate_dir} answers for {trained_profile}")
    if sur.metadata.get("dataset_hash") == data.dataset_hash:
        X, y = held_out_regression(data)
        rows_from = f"the held-out split of its training dataset ({data.dataset_hash})"
    else:
        _, X, y, _, measured = label_rows(df)
        X, y = X[measured], y[measured]
        rows_from = f"a held-apart dataset ({data.dataset_hash}: {', '.join(str(Path(d)) for d in dirs)})"
    result = {**conformalize(sur.predict(X)[0], y, seed=seed), "rows_from": rows_from}
    manifest = model_files.read_manifest(path)
    manifest.setdefault("metadata", {})["intervals"] = result
    atomic_write_text(path, json.dumps(manifest, indent=1))
    metrics = where / "metrics.json"
    if metrics.is_file():
        m = read_json_file(metrics, "surrogate metrics", InputError, allow_nan=True)
        m["intervals"] = result
        write_json(metrics, m)
    return result
