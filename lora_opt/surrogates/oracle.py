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

    def predict(self, X) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(throughput tok/s if it runs, feasible = p_starving < threshold, p_starving)."""
        A = as_feature_matrix(X, self.feature_names)
        thr = np.maximum(self.regressor.predict(A), 0.0)
        p = self.classifier.predict_proba(A)[:, 1]
        return thr, p < self.threshold, p

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
