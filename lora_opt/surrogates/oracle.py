"""The oracle the placement policies consult, and the full surrogate that implements it.

A policy asks one question, many times: for these GPU configurations (rows of ``FEATURES``),
what throughput will each reach, and will it starve?  ``Oracle`` is that interface; two models
implement it: ``Surrogate`` here (the chosen scikit-learn heads, micro- to milliseconds) and
``lora_opt.surrogates.distill.DistilledSurrogate`` (two 32-leaf trees compiled with Numba, tens of
nanoseconds).  A surrogate directory holds both (``ORACLE_FILES``).
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lora_opt.errors import InputError
from lora_opt.surrogates import model_files
from lora_opt.surrogates.features import FEATURES
from lora_opt.surrogates.intervals import interval
from twin.errors import ScenarioError

#: the file of each oracle kind in a surrogate directory (``lora-opt train`` writes both)
ORACLE_FILES = {"full": model_files.MANIFEST_NAME, "distilled": "distilled.json"}


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


class Oracle(ABC):
    """Per-GPU throughput and starvation for rows of ``feature_names`` (FEATURES order by default).

    Implementations carry ``feature_names`` (the columns ``predict`` reads), ``threshold`` (a row
    is feasible when its P(starving) is below it) and ``metadata`` (provenance, JSON-able)."""

    feature_names: tuple
    threshold: float
    metadata: dict

    @abstractmethod
    def predict(self, X) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(throughput tok/s if it runs, feasible = p_starving < threshold, p_starving), one entry
        per row of X (a DataFrame with the feature columns, or an (n, features) / 1-D array)."""


@dataclass
class Surrogate(Oracle):
    """Chosen throughput regressor + starvation classifier + threshold, on FEATURES in order."""

    regressor: Any
    classifier: Any
    threshold: float
    feature_names: tuple = FEATURES
    metadata: dict = field(default_factory=dict)
    #: the heads without scikit-learn's per-call overhead (``LeanHeads``), built on first use
    _lean: Any = field(default=None, init=False, repr=False, compare=False)

    def predict(self, X) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(throughput tok/s if it runs, feasible = p_starving < threshold, p_starving)."""
        A = as_feature_matrix(X, self.feature_names)
        if self._lean is None:
            self._lean = LeanHeads.build(self.regressor, self.classifier, len(self.feature_names))
        thr, p = self._lean.predict(A)
        return np.maximum(thr, 0.0), p < self.threshold, p

    @property
    def intervals(self) -> dict | None:
        """The split-conformal quantiles stored at training (``lora_opt.surrogates.intervals``), or None."""
        iv = self.metadata.get("intervals")
        return iv if isinstance(iv, dict) and iv.get("quantiles") else None

    def throughput_interval(self, X, confidence: float) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) throughput (tok/s) at ``confidence`` around the prediction for rows X: the
        twin's throughput lies inside with probability >= confidence (split conformal, measured
        coverage in the manifest).  InputError for a surrogate trained without intervals."""
        if self.intervals is None:
            raise InputError("this surrogate has no throughput intervals: train it again, or add them with "
                             "lora-opt train --intervals-only --dataset DIR --out SURROGATE_DIR")
        return interval(self.predict(X)[0], self.intervals, confidence)

    def save(self, directory) -> Path:
        """Write ``surrogate.skops`` + ``surrogate.json`` into ``directory`` (see
        ``model_files``: no pickle); return the manifest's path."""
        return model_files.write(directory, {"regressor": self.regressor, "classifier": self.classifier},
                                 {"threshold": float(self.threshold), "feature_names": list(self.feature_names),
                                  "metadata": self.metadata})

    @classmethod
    def load(cls, path) -> Surrogate:
        """From a surrogate directory or its ``surrogate.json``; runs no code from the files and
        refuses (``InputError``) anything but a checked manifest and a trusted skops file."""
        import sklearn  # heavy optional dependency: only to compare versions

        models, m = model_files.read(path)
        try:
            threshold, names = float(m["threshold"]), tuple(str(f) for f in m["feature_names"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path}: the surrogate manifest needs a numeric threshold and a "
                             f"feature_names list ({type(exc).__name__}: {exc})") from None
        metadata = m.get("metadata") if isinstance(m.get("metadata"), dict) else {}
        saved = metadata.get("sklearn_version")
        if saved and saved != sklearn.__version__:
            warnings.warn(f"{path}: saved with scikit-learn {saved}, loaded with {sklearn.__version__}")
        return cls(models["regressor"], models["classifier"], threshold, names, metadata)


#: rows of the probe on which a lean head must equal its scikit-learn head bit for bit
LEAN_PROBE_ROWS = 512


class LeanHeads:
    """A surrogate's two heads computed as scikit-learn computes them, without its per-call checks.

    ``lora-opt train``'s SVM heads (log1p -> StandardScaler -> SVR / SVC with Platt scaling) cost
    ~2 ms per ``predict`` call in scikit-learn's validation and wrappers whatever the batch,
    ~100 x a one-row prediction: placement asks once per GPU, so at 1,000 GPUs that was seconds.
    Here each head is the same arithmetic on the fitted arrays (the ufunc, ``(X - mean_) /
    scale_``, the SVM's own libsvm call, ``expit(-(a T + b))``).  A head is used only if it
    equals scikit-learn's output bit for bit on a probe of ``LEAN_PROBE_ROWS`` rows when built;
    any other model (a forest, another scikit-learn's internals) keeps scikit-learn's path.
    Rows with non-finite features go to scikit-learn too (its error)."""

    def __init__(self, regressor, classifier, reg_plan=None, clf_plan=None):
        self.regressor, self.classifier = regressor, classifier
        #: (steps, SVR, inverse ufunc) or None = scikit-learn's predict
        self.reg_plan = reg_plan
        #: (steps, SVC, sigmoid a, sigmoid b) or None = scikit-learn's predict_proba
        self.clf_plan = clf_plan

    @classmethod
    def build(cls, regressor, classifier, n_features: int) -> LeanHeads:
        plain = cls(regressor, classifier)
        try:
            lean = cls(regressor, classifier, _regressor_plan(regressor), _classifier_plan(classifier))
        except (AttributeError, TypeError, ValueError, IndexError):
            return plain
        if lean.reg_plan is None and lean.clf_plan is None:
            return plain
        X = _probe_rows(n_features)
        try:
            same_thr = np.array_equal(lean._regress(X), regressor.predict(X))
            same_p = np.array_equal(lean._starving(X), classifier.predict_proba(X)[:, 1])
        except Exception:  # noqa: BLE001 -- any failure of the shortcut means: do not use it
            return plain
        return cls(regressor, classifier, lean.reg_plan if same_thr else None, lean.clf_plan if same_p else None)

    def predict(self, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(raw regressor output, P(starving)) for a feature matrix."""
        if not np.isfinite(A).all():
            return self.regressor.predict(A), self.classifier.predict_proba(A)[:, 1]
        A = np.ascontiguousarray(A, dtype=np.float64)
        return self._regress(A), self._starving(A)

    def _regress(self, A):
        if self.reg_plan is None:
            return self.regressor.predict(A)
        steps, svr, inverse = self.reg_plan
        return inverse(svr._dense_predict(_apply_steps(steps, A)))

    def _starving(self, A):
        if self.clf_plan is None:
            return self.classifier.predict_proba(A)[:, 1]
        from scipy.special import expit  # scikit-learn's dependency, as its sigmoid calibration uses

        steps, svc, a, b = self.clf_plan
        T = -svc._dense_decision_function(_apply_steps(steps, A)).ravel()
        return expit(-(a * T + b))


def _apply_steps(steps, X: np.ndarray) -> np.ndarray:
    for kind, *args in steps:
        if kind == "ufunc":
            X = args[0](X)
        else:                                   # StandardScaler.transform: X -= mean_; X /= scale_
            mean, scale = args
            X = X - mean if mean is not None else X.copy()
            if scale is not None:
                X /= scale
    return np.ascontiguousarray(X, dtype=np.float64)


def _pipeline_plan(pipe, final_type):
    """(plain steps, final estimator) for a Pipeline of FunctionTransformer(NumPy ufunc) and
    StandardScaler steps ending in ``final_type``; None for anything else."""
    from sklearn.pipeline import Pipeline  # heavy optional dependency: only with a full surrogate
    from sklearn.preprocessing import FunctionTransformer, StandardScaler

    if type(pipe) is not Pipeline or type(pipe.steps[-1][1]) is not final_type:
        return None
    steps = []
    for _, step in pipe.steps[:-1]:
        if type(step) is FunctionTransformer and isinstance(step.func, np.ufunc) and not step.kw_args \
                and not step.validate:
            steps.append(("ufunc", step.func))
        elif type(step) is StandardScaler:
            steps.append(("scale", step.mean_ if step.with_mean else None, step.scale_ if step.with_std else None))
        else:
            return None
    final = pipe.steps[-1][1]
    if not isinstance(final.kernel, str) or final._sparse:
        return None
    return steps, final


def _regressor_plan(reg):
    from sklearn.compose import TransformedTargetRegressor  # heavy optional dependency: full surrogate only
    from sklearn.preprocessing import FunctionTransformer
    from sklearn.svm import SVR

    if type(reg) is not TransformedTargetRegressor or type(reg.transformer_) is not FunctionTransformer:
        return None
    inverse = reg.transformer_.inverse_func
    plan = _pipeline_plan(reg.regressor_, SVR)
    if plan is None or not isinstance(inverse, np.ufunc) or reg.transformer_.inv_kw_args:
        return None
    return plan[0], plan[1], inverse


def _classifier_plan(clf):
    from sklearn.calibration import CalibratedClassifierCV, _SigmoidCalibration  # heavy optional dependency
    from sklearn.svm import SVC

    if type(clf) is not CalibratedClassifierCV or len(clf.calibrated_classifiers_) != 1:
        return None
    cc = clf.calibrated_classifiers_[0]
    if cc.method != "sigmoid" or len(cc.classes) != 2 or len(cc.calibrators) != 1 \
            or type(cc.calibrators[0]) is not _SigmoidCalibration:
        return None
    plan = _pipeline_plan(cc.estimator, SVC)
    if plan is None or list(plan[1].classes_) != list(cc.classes) or list(clf.classes_) != list(cc.classes):
        return None
    return plan[0], plan[1], cc.calibrators[0].a_, cc.calibrators[0].b_


def _probe_rows(n_features: int) -> np.ndarray:
    """Fixed rows spanning the features' range (counts, rates, ranks up to a few hundred)."""
    rng = np.random.default_rng(20261201)
    X = rng.uniform(0.0, 1.0, (LEAN_PROBE_ROWS, n_features)) * rng.choice([1.0, 10.0, 100.0, 1000.0], (LEAN_PROBE_ROWS, n_features))
    return np.ascontiguousarray(X)
