"""A labelled dataset as the surrogates' training data: validated, labelled and split.

* Inputs: the per-GPU ``FEATURES`` of ``lora_opt.surrogates.features``, always in that order.
* Starvation label: ``starving`` or ``status == "oom"`` (an instance that cannot start serves nobody).
* Regression rows: ``status == "ok"`` rows that ran the whole duration.  An early-stopped run's
  throughput counts only the tokens completed before the stop (divided by the full duration), so it
  is a truncated number, not the configuration's throughput.
* Split: 20 % of the rows are held out (stratified by the starvation label, seeded) and only used to
  report.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lora_opt.surrogates.dataset import load_dataset
from lora_opt.surrogates.features import FEATURES
from twin.errors import ScenarioError

HOLDOUT_FRACTION = 0.2
LABEL_COLUMNS = ("status", "starving", "throughput_tok_s")
REQUIRED_COLUMNS = (*FEATURES, *LABEL_COLUMNS)


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

    def summary(self) -> dict:
        """Row counts: all, dropped, per class, regression rows, per split."""
        return {"rows": int(len(self.X)), "dropped_error_rows": self.dropped_rows,
                "starving_or_oom": int(self.starving.sum()), "feasible": int((self.starving == 0).sum()),
                "regression_rows": int(self.measured.sum()), "train_rows": int(len(self.train)),
                "test_rows": int(len(self.test))}


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


def label_rows(df):
    """The labels a surrogate learns from a dataset's rows that ran or could not start (status ok /
    oom): (those rows, features, throughput -- 0 for an OOM --, starving or OOM as 0/1, measured =
    the engine started and ran the whole window, the rows a throughput regressor learns from)."""
    usable = df[df["status"].isin(["ok", "oom"])].reset_index(drop=True)
    oom = (usable["status"] == "oom").to_numpy()
    starving = (usable["starving"].astype(bool).to_numpy() | oom).astype(np.int64)
    thr = np.where(oom, 0.0, usable["throughput_tok_s"].to_numpy(np.float64))
    measured = ~oom & np.isfinite(thr)
    if "stopped_early_s" in usable.columns:
        measured &= usable["stopped_early_s"].isna().to_numpy()
    return usable, usable.loc[:, list(FEATURES)].to_numpy(np.float64), thr, starving, measured


def prepare(df, *, seed: int = 0, holdout: float = HOLDOUT_FRACTION) -> TrainingData:
    """Validate, label and split the dataset (stratified by the starvation label)."""
    from sklearn.model_selection import train_test_split  # heavy optional dependency: only when training

    validate_dataset(df)
    digest = frame_hash(df)
    usable, X, thr, starving, measured = label_rows(df)
    counts = np.bincount(starving, minlength=2)
    if counts.min() < 2 * 5:
        raise ScenarioError(f"dataset: too few rows of one class to train and cross-validate "
                            f"(feasible {counts[0]}, starving/oom {counts[1]}; need >= 10 each)")
    idx = np.arange(len(usable))
    train, test = train_test_split(idx, test_size=holdout, stratify=starving, random_state=seed)
    return TrainingData(X=X, throughput=thr,
                        starving=starving, measured=measured, train=np.sort(train), test=np.sort(test),
                        dropped_rows=int(len(df) - len(usable)), dataset_hash=digest)


def load_dataset_dir(dataset_dir) -> tuple[Any, str]:
    """(rows of every ``shard-*.parquet`` in point order, the dataset hash); ScenarioError if none."""
    p = Path(dataset_dir)
    if not p.is_dir():
        raise ScenarioError(f"dataset: {dataset_dir} is not a directory")
    df = load_dataset(p)
    return df, frame_hash(df)
