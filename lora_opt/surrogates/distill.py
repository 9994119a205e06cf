"""Distil the random-forest surrogates into one shallow tree per head: rules a person can apply and
a compiled predictor that answers in tens of nanoseconds.

Method
------
* Teacher: the tuned random forests of ``lora_opt.surrogates.training`` (throughput regressor and starvation
  classifier).  Student: one ``DecisionTreeRegressor`` per head with at most 32 leaves
  (``max_leaf_nodes=32``), i.e. at most 32 IF ... THEN rules per head.
* Fitting points: the training split's features plus ``mixup`` points (convex combinations of two
  random training rows) labelled by the teacher, so the student also learns the teacher between
  the grid's points, where the greedy placement asks its questions.
* Throughput head: fitted to ``log1p`` of the forest's prediction (a leaf then holds a geometric
  mean, the right summary for a relative error such as SMAPE); the exported leaf values are
  converted back to tok/s, so the rules and the compiled predictor give tok/s directly.
* Starvation head: a *regression* tree on the teacher's P(starving) -- soft targets keep the
  forest's confidence, which a classifier on hard labels would throw away, and the threshold needs
  it.  On the training rows the teacher's probabilities are its out-of-fold ones (a forest predicting
  its own training rows is over-confident).  The student's threshold follows the same rule as the
  forest's: the largest one whose out-of-fold false-feasible rate (students cross-fitted on the
  training rows, true labels) is <= 1 %, because a false "feasible" starves users while a false
  "infeasible" only costs a GPU.
* Export: flat arrays per tree (feature, threshold, left, right, value; the JSON format), packed
  into one node table walked by a Numba ``@njit(cache=True)`` loop -- a loop over arrays compiles
  in a fraction of a second, where a tree generated as nested if/else takes tens of seconds.
  Like scikit-learn, a feature value is rounded to float32 before it is compared with the (float64)
  threshold, so the compiled tree returns exactly what ``tree.predict`` returns.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numba import njit

from lora_opt.io import atomic_write_json
from lora_opt.surrogates.features import DEFAULT_TOKENS_PER_REQUEST, FEATURES
from lora_opt.smape import smape
from lora_opt.surrogates.metrics import MAX_FALSE_FEASIBLE, choose_threshold, error_rates
from lora_opt.surrogates.oracle import Oracle, as_feature_matrix
from twin.errors import ScenarioError
from twin.parsing import read_json_file

MAX_LEAVES = 32
DISTILLED_FORMAT = "lora-opt-distilled/1"
TREE_LEAF = -1          # scikit-learn's marker of a leaf in children_left / children_right


# ---- flat trees ----------------------------------------------------------------------------------
@dataclass
class FlatTree:
    """A binary tree as arrays: node i splits on ``X[:, feature[i]] <= threshold[i]`` (left) or
    is a leaf (``left[i] == -1``) answering ``value[i]``."""

    feature: np.ndarray      # int64
    threshold: np.ndarray    # float64
    left: np.ndarray         # int64
    right: np.ndarray        # int64
    value: np.ndarray        # float64, in output units

    @classmethod
    def from_sklearn(cls, tree, value_transform=None) -> "FlatTree":
        """From a fitted DecisionTreeRegressor (value = prediction) or DecisionTreeClassifier
        (value = probability of the positive class, computed as ``predict_proba`` does).
        ``value_transform`` (e.g. ``np.expm1``) maps leaf values to output units."""
        t = tree.tree_
        raw = t.value[:, 0, :]
        if hasattr(tree, "classes_"):
            pos = list(tree.classes_).index(1) if 1 in list(tree.classes_) else len(tree.classes_) - 1
            norm = raw.sum(axis=1)
            norm[norm == 0.0] = 1.0
            value = (raw / norm[:, None])[:, pos]
        else:
            value = raw[:, 0].copy()
        if value_transform is not None:
            value = value_transform(value)
        return cls(t.feature.astype(np.int64), t.threshold.astype(np.float64),
                   t.children_left.astype(np.int64), t.children_right.astype(np.int64),
                   np.ascontiguousarray(value, dtype=np.float64))

    @property
    def n_leaves(self) -> int:
        return int((self.left == TREE_LEAF).sum())

    def depth(self) -> int:
        d = np.zeros(len(self.left), np.int64)
        for i in range(len(self.left)):            # parents precede children in sklearn's order
            if self.left[i] != TREE_LEAF:
                d[self.left[i]] = d[self.right[i]] = d[i] + 1
        return int(d.max())

    def predict(self, X) -> np.ndarray:
        """The compiled walk over rows of X (equal to the scikit-learn tree's ``predict``)."""
        A = np.ascontiguousarray(X, dtype=np.float64)
        out = np.empty((A.shape[0], 1), np.float64)
        forest_predict(*pack_trees([self]), A, out)
        return out[:, 0]

    def to_dict(self) -> dict:
        # floats go through repr: JSON round-trips float64 exactly
        return {k: getattr(self, k).tolist() for k in ("feature", "threshold", "left", "right", "value")}

    @classmethod
    def from_dict(cls, d: dict) -> "FlatTree":
        try:
            t = cls(*(np.asarray(d[k], dt) for k, dt in (("feature", np.int64), ("threshold", np.float64),
                                                         ("left", np.int64), ("right", np.int64),
                                                         ("value", np.float64))))
        except KeyError as exc:
            raise ScenarioError(f"distilled tree: missing array {exc}") from None
        n = len(t.feature)
        if not n or any(len(a) != n for a in (t.threshold, t.left, t.right, t.value)):
            raise ScenarioError("distilled tree: arrays of different lengths")
        inner = t.left != TREE_LEAF
        if (t.left[inner] <= np.arange(n)[inner]).any() or (t.right[inner] >= n).any():
            raise ScenarioError("distilled tree: children must follow their parent")  # the walk ends
        return t


# ---- compiled predictors -------------------------------------------------------------------------
def pack_trees(trees) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Several flat trees as one node table for the compiled loop: ``ints[:, 0:3]`` = feature,
    left, right (children re-based, -1 = leaf), ``floats[:, 0:2]`` = threshold, value, and each
    tree's root.  One table instead of five arrays per tree: a node's fields share a cache line
    and a call from Python passes 3 arrays, not 10 (Numba's dispatch costs ~0.1 us per argument)."""
    ints, floats, roots, base = [], [], [], 0
    for t in trees:
        left = np.where(t.left == TREE_LEAF, TREE_LEAF, t.left + base)
        right = np.where(t.right == TREE_LEAF, TREE_LEAF, t.right + base)
        ints.append(np.stack([t.feature, left, right], axis=1))
        floats.append(np.stack([t.threshold, t.value], axis=1))
        roots.append(base)
        base += len(t.feature)
    return (np.ascontiguousarray(np.concatenate(ints), dtype=np.int64),
            np.ascontiguousarray(np.concatenate(floats), dtype=np.float64), np.asarray(roots, np.int64))


@njit(cache=True)
def forest_predict(ints, floats, roots, X, out):
    """``out[i, t]`` = tree t's value for row i: a loop over the node table (no generated
    if/else, so it compiles in well under a second whatever the depth)."""
    for i in range(X.shape[0]):
        for t in range(roots.shape[0]):
            node = roots[t]
            while ints[node, 1] != -1:
                # scikit-learn compares float32(x) with the float64 threshold: so do we, bit for bit
                if np.float64(np.float32(X[i, ints[node, 0]])) <= floats[node, 0]:
                    node = ints[node, 1]
                else:
                    node = ints[node, 2]
            out[i, t] = floats[node, 1]


# ---- rules -----------------------------------------------------------------------------------------
def _num(x: float) -> str:
    return f"{x:.6g}"


def _leaf_paths(t: FlatTree):
    """(leaf index, [(feature, is_le, threshold), ...]) for every leaf, left to right."""
    stack = [(0, [])]
    while stack:
        node, conds = stack.pop()
        if t.left[node] == TREE_LEAF:
            yield node, conds
            continue
        f, thr = int(t.feature[node]), float(t.threshold[node])
        stack.append((int(t.right[node]), conds + [(f, False, thr)]))
        stack.append((int(t.left[node]), conds + [(f, True, thr)]))


def _condition(conds, feature_names) -> str:
    """Merge a path's tests into one interval per feature: ``lo < name <= hi``."""
    bounds: dict[int, list] = {}
    for f, is_le, thr in conds:
        lo, hi = bounds.setdefault(f, [-math.inf, math.inf])
        bounds[f] = [lo, min(hi, thr)] if is_le else [max(lo, thr), hi]
    parts = []
    for f in sorted(bounds):
        lo, hi = bounds[f]
        name = feature_names[f]
        if lo > -math.inf and hi < math.inf:
            parts.append(f"{_num(lo)} < {name} <= {_num(hi)}")
        elif hi < math.inf:
            parts.append(f"{name} <= {_num(hi)}")
        else:
            parts.append(f"{name} > {_num(lo)}")
    return " AND ".join(parts) if parts else "always"


def rules_text(tree, feature_names=FEATURES, *, value_name: str = "value", unit: str = "",
               threshold: float | None = None) -> str:
    """One ``IF ... THEN ...`` line per leaf of a FlatTree or fitted scikit-learn tree.  With a
    ``threshold`` the value is a P(starving) and the line ends in FEASIBLE (p < threshold) or
    STARVING."""
    t = tree if isinstance(tree, FlatTree) else FlatTree.from_sklearn(tree)
    names = list(feature_names)
    lines = []
    for leaf, conds in _leaf_paths(t):
        v = float(t.value[leaf])
        then = f"{value_name} = {_num(v)}{(' ' + unit) if unit else ''}"
        if threshold is not None:
            then += " -> " + ("FEASIBLE" if v < threshold else "STARVING")
        lines.append(f"IF {_condition(conds, names)} THEN {then}")
    return "\n".join(lines) + "\n"


RULES_HEADER = """\
# lora-opt distilled surrogate: {n_thr} throughput rules and {n_p} starvation rules.
# Compute for one GPU (rates in requests/s per adapter, ranks as served):
#   n_adapters = adapters served; rate_sum / rate_std = sum / std of their rates;
#   rank_max / rank_mean / rank_std = of their ranks; max_loras = vLLM --max-loras (A_max);
#   incoming_token_rate = rate_sum x {tokens:g} tokens per request.
# Find the one line of each section whose conditions all hold.
# Starvation: p_starving < {threshold:.6g} means FEASIBLE (threshold chosen so that at most
# {ff:.0%} of starving configurations are called feasible on the training data).
"""


# ---- the distilled surrogate ---------------------------------------------------------------------
@dataclass
class DistilledSurrogate(Oracle):
    """The ``Oracle`` of ``Surrogate``, from two flat trees and a threshold."""

    throughput_tree: FlatTree
    starvation_tree: FlatTree
    threshold: float
    feature_names: tuple = FEATURES
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        self._packed = pack_trees([self.throughput_tree, self.starvation_tree])

    def predict(self, X) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(throughput tok/s, feasible = p_starving < threshold, p_starving)."""
        A = np.ascontiguousarray(as_feature_matrix(X, self.feature_names))
        if not np.isfinite(A).all():       # NaN would take a different branch than in scikit-learn
            raise ScenarioError("surrogate input: non-finite feature values")
        out = np.empty((A.shape[0], 2), np.float64)
        forest_predict(*self._packed, A, out)
        p = out[:, 1]
        return out[:, 0], p < self.threshold, p

    def rules(self) -> str:
        head = RULES_HEADER.format(n_thr=self.throughput_tree.n_leaves, n_p=self.starvation_tree.n_leaves,
                                   tokens=DEFAULT_TOKENS_PER_REQUEST, threshold=self.threshold,
                                   ff=self.metadata.get("max_false_feasible", MAX_FALSE_FEASIBLE))
        return (head + "\n## throughput (tok/s)\n"
                + rules_text(self.throughput_tree, self.feature_names, value_name="throughput", unit="tok/s")
                + "\n## starvation\n"
                + rules_text(self.starvation_tree, self.feature_names, value_name="p_starving",
                             threshold=self.threshold))

    def to_dict(self) -> dict:
        return {"format": DISTILLED_FORMAT, "feature_names": list(self.feature_names),
                "threshold": float(self.threshold), "throughput_tree": self.throughput_tree.to_dict(),
                "starvation_tree": self.starvation_tree.to_dict(), "metadata": self.metadata}

    def save(self, path) -> Path:
        path = Path(path)
        return atomic_write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path) -> "DistilledSurrogate":
        try:
            d = read_json_file(path, "distilled surrogate", allow_nan=True)
        except ScenarioError as exc:
            raise ScenarioError(f"{path}: cannot read a distilled surrogate ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != DISTILLED_FORMAT:
            raise ScenarioError(f"{path}: not a lora-opt distilled surrogate ({DISTILLED_FORMAT})")
        return cls(FlatTree.from_dict(d["throughput_tree"]), FlatTree.from_dict(d["starvation_tree"]),
                   float(d["threshold"]), tuple(d["feature_names"]), d.get("metadata", {}))


# ---- distillation ----------------------------------------------------------------------------------
def mixup_points(X: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` convex combinations of random pairs of rows of X (inside the data's hull)."""
    rng = np.random.default_rng(seed)
    i, j = rng.integers(0, len(X), n), rng.integers(0, len(X), n)
    lam = rng.random(n)[:, None]
    return lam * X[i] + (1.0 - lam) * X[j]


def _student(seed: int, max_leaf_nodes: int):
    from sklearn.tree import DecisionTreeRegressor  # heavy optional dependency: only when distilling

    return DecisionTreeRegressor(max_leaf_nodes=max_leaf_nodes, random_state=seed)


def distill_throughput(teacher, X_fit: np.ndarray, *, seed: int = 0, max_leaf_nodes: int = MAX_LEAVES):
    """Student tree fitted to log1p(teacher throughput); returns (sklearn tree, FlatTree in tok/s)."""
    target = np.log1p(np.maximum(teacher.predict(X_fit), 0.0))
    tree = _student(seed, max_leaf_nodes).fit(X_fit, target)
    return tree, FlatTree.from_sklearn(tree, value_transform=np.expm1)


def distill_starvation(teacher, X_train: np.ndarray, y_train: np.ndarray, X_extra: np.ndarray, *,
                       p_teacher_train: np.ndarray | None = None, seed: int = 0, folds: int = 5,
                       max_leaf_nodes: int = MAX_LEAVES):
    """Student tree fitted to the teacher's P(starving); its threshold from cross-fitted students.
    Returns (sklearn tree, FlatTree, threshold, out-of-fold error rates at that threshold)."""
    from sklearn.base import clone  # heavy optional dependency: only when distilling
    from sklearn.model_selection import StratifiedKFold

    p_train = (teacher.predict_proba(X_train)[:, 1] if p_teacher_train is None
               else np.asarray(p_teacher_train, float))
    p_extra = teacher.predict_proba(X_extra)[:, 1] if len(X_extra) else np.empty(0)
    student = _student(seed, max_leaf_nodes)
    p_oof = np.empty(len(X_train))
    for tr, te in StratifiedKFold(folds, shuffle=True, random_state=seed).split(X_train, y_train):
        fold = clone(student).fit(np.vstack([X_train[tr], X_extra]), np.concatenate([p_train[tr], p_extra]))
        p_oof[te] = fold.predict(X_train[te])
    threshold = choose_threshold(p_oof, y_train)
    tree = student.fit(np.vstack([X_train, X_extra]), np.concatenate([p_train, p_extra]))
    return tree, FlatTree.from_sklearn(tree), threshold, error_rates(y_train, p_oof < threshold)


def distill(rf_regressor, rf_classifier, X_train: np.ndarray, y_train: np.ndarray, *,
            p_teacher_oof: np.ndarray | None = None, n_extra: int | None = None, seed: int = 0,
            max_leaf_nodes: int = MAX_LEAVES, folds: int = 5) -> DistilledSurrogate:
    """Distil both forests (see the module docstring).  ``p_teacher_oof``: the classifier's
    out-of-fold P(starving) on ``X_train`` (in-sample probabilities are used when absent)."""
    X_train = np.asarray(X_train, np.float64)
    X_extra = mixup_points(X_train, 2 * len(X_train) if n_extra is None else n_extra, seed)
    _, thr_tree = distill_throughput(rf_regressor, np.vstack([X_train, X_extra]), seed=seed,
                                     max_leaf_nodes=max_leaf_nodes)
    _, p_tree, threshold, oof = distill_starvation(rf_classifier, X_train, np.asarray(y_train, int), X_extra,
                                                   p_teacher_train=p_teacher_oof, seed=seed, folds=folds,
                                                   max_leaf_nodes=max_leaf_nodes)
    return DistilledSurrogate(thr_tree, p_tree, threshold, FEATURES,
                              {"max_leaf_nodes": max_leaf_nodes, "extra_points": int(len(X_extra)),
                               "max_false_feasible": MAX_FALSE_FEASIBLE, "oof": oof,
                               "teacher_train_probabilities": "out-of-fold" if p_teacher_oof is not None
                               else "in-sample"})


# ---- accuracy and latency ---------------------------------------------------------------------------
def latency_ns(dist: DistilledSurrogate, X_pool: np.ndarray, *, batch: int = 200_000, singles: int = 2000) -> dict:
    """ns per prediction (both heads) of the compiled loop over ``batch`` rows (best of 5, after
    warm-up), of ``DistilledSurrogate.predict`` on the same batch, and of single-row calls."""
    big = np.ascontiguousarray(np.resize(np.asarray(X_pool, np.float64), (batch, len(dist.feature_names))))
    out = np.empty((batch, 2))
    forest_predict(*dist._packed, big[:10], out[:10])          # warm-up (compiles or loads the cache)
    dist.predict(big[:1])

    def best(fn, repeats):
        t_min = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            t_min = min(t_min, time.perf_counter() - t)
        return t_min

    kernel = best(lambda: forest_predict(*dist._packed, big, out), 5) / batch * 1e9
    api = best(lambda: dist.predict(big), 3) / batch * 1e9
    ints, floats, roots = dist._packed
    row, one = big[:1], out[:1]
    one_kernel = [best(lambda: forest_predict(ints, floats, roots, row, one), 1) for _ in range(singles)]
    one_api = [best(lambda: dist.predict(row), 1) for _ in range(min(singles, 500))]
    return {"batch_ns_per_prediction": kernel, "batch_ns_per_prediction_predict_api": api,
            "single_call_kernel_ns": float(np.median(one_kernel) * 1e9),
            "single_call_predict_api_us": float(np.median(one_api) * 1e6), "batch_rows": batch,
            "note": "a prediction = both heads for one GPU configuration; single calls include "
                    "Python's and Numba's call overhead"}


def accuracy_report(dist: DistilledSurrogate, rf_regressor, rf_classifier, rf_threshold: float, X, throughput,
                    starving, measured) -> dict:
    """Held-out accuracy of the student next to its teacher forests (same rows)."""
    thr_d, feas_d, _ = dist.predict(X)
    thr_rf = rf_regressor.predict(X)
    feas_rf = rf_classifier.predict_proba(X)[:, 1] < rf_threshold
    m = np.asarray(measured, bool)
    rf_s, d_s = smape(thr_rf[m], throughput[m], undefined="zero"), smape(thr_d[m], throughput[m], undefined="zero")
    rf_e, d_e = error_rates(starving, feas_rf), error_rates(starving, feas_d)
    return {
        "throughput": {"rf_smape": rf_s, "distilled_smape": d_s, "smape_increase": d_s - rf_s,
                       "distilled_vs_rf_smape": smape(thr_d, thr_rf, undefined="zero")},
        "starvation": {"rf": rf_e, "distilled": d_e,
                       "macro_f1_change": d_e["macro_f1"] - rf_e["macro_f1"],
                       "false_feasible_rate_change": d_e["false_feasible_rate"] - rf_e["false_feasible_rate"],
                       "false_infeasible_rate_change": d_e["false_infeasible_rate"] - rf_e["false_infeasible_rate"],
                       "decision_agreement": float((feas_d == feas_rf).mean())},
    }


def distill_and_report(rf_regressor, rf_classifier, data, *, p_teacher_oof=None, seed: int = 0,
                       fast: bool = False) -> tuple[DistilledSurrogate, dict]:
    """Distil on ``data``'s training split (a ``training_data.TrainingData``), report on its held-out
    split: accuracy change vs the forests, tree sizes, thresholds, latencies."""
    Xtr, ytr = data.X[data.train], data.starving[data.train]
    t0 = time.perf_counter()
    dist = distill(rf_regressor, rf_classifier, Xtr, ytr, p_teacher_oof=p_teacher_oof, seed=seed)
    fit_s = time.perf_counter() - t0
    p_rf = p_teacher_oof if p_teacher_oof is not None else rf_classifier.predict_proba(Xtr)[:, 1]
    rf_threshold = choose_threshold(p_rf, ytr)
    te = data.test
    report = accuracy_report(dist, rf_regressor, rf_classifier, rf_threshold, data.X[te], data.throughput[te],
                             data.starving[te], data.measured[te])
    report.update({
        "threshold": dist.threshold, "rf_threshold": rf_threshold, "oof": dist.metadata["oof"],
        "leaves": {"throughput": dist.throughput_tree.n_leaves, "starvation": dist.starvation_tree.n_leaves},
        "depth": {"throughput": dist.throughput_tree.depth(), "starvation": dist.starvation_tree.depth()},
        "fit_wall_s": fit_s,
        "latency": latency_ns(dist, data.X[te], batch=50_000 if fast else 200_000,
                              singles=300 if fast else 2000),
    })
    return dist, report
