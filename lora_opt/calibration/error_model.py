"""The twin's error as a measured distribution, and decisions at a stated confidence.

What a packing decision depends on is a GPU's **capacity**: the token rate it serves when saturated.
A GPU starves when its capacity is below rho x its incoming token rate.  The twin predicts a capacity
``cap_twin``; the real server has ``cap_real``.  On held-apart real runs where the real server was
saturated (its capacity observed: served fraction below ``SATURATED_SERVED`` with requests queueing)
the ratio ``R = cap_real / cap_twin`` is measured run by run; ``cap_twin`` comes from the same run
replayed on the twin at an overload (``lora_opt.calibration.error_fit``).

Split-conformal prediction turns those ratios into a distribution-free lower bound: with ``n``
exchangeable calibration ratios sorted ``r_(1) <= ... <= r_(n)`` and ``k = floor((n + 1)(1 - C))``,
a new run's ratio is ``>= r_(k)`` with probability ``>= C`` (Vovk et al.; Angelopoulos & Bates,
"A Gentle Introduction to Conformal Prediction", 2021, sec. 1).  Hence:

- **verification load** ``f_C = 1 / r_(k)``: a GPU the twin serves (throughput >= rho x incoming) at
  ``f_C`` x its load has ``cap_real >= r_(k) x cap_twin >= rho x load`` with probability >= C.  This
  replaces the fixed 1.1x of greedy-plus (that number came from no measured error).
- **margin at C** ``r_(k) x cap_twin / load - 1``: the real capacity's lower bound over the load
  (the same scale as the surrogate's margin; the GPU starves below rho - 1).
- **P(starve)** ``(#{r_i < rho x load / cap_twin} + 1) / (n + 1)``: the conformal p-value, an upper
  estimate of the probability that the real capacity falls below rho x load (never below
  ``1 / (n + 1)``: n runs cannot show a smaller risk).

``k = 0`` means the runs are too few for C: ``C <= 1 - 1 / (n + 1)``.  A profile's own runs are used
where they suffice; above that, the pooled runs of every GPU profile the file holds (the same twin on
other models), and the answer says which.  A profile without an error model file keeps the fixed
margin, and an explicit ``--confidence`` is refused for it (``InputError`` naming the file).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_text
from twin.parsing import read_config_file
from twin.paths import CONFIGS_DIR, bundle_relative

#: where the bundled error models are, one YAML per profile (``configs/error_models/<profile>.yaml``)
ERROR_MODELS_DIR = CONFIGS_DIR / "error_models"
#: the confidence decisions are made at when none is given (chosen from the H100 report half's
#: trade-off table, experiments/error_model/report.md: the smallest C whose cross-fitted Max_pack picks
#: never starved a real run there)
DEFAULT_CONFIDENCE = 0.9
#: a real run's capacity is observed when its served fraction is below this ...
SATURATED_SERVED = 0.95
#: ... and requests queued (mean waiting >= this many, or mean TTFT >= SATURATED_TTFT_MS): light runs
#: serve 96-97 % by the rate estimate's own error (5-minute runs: +-15 %) without any queue
SATURATED_WAITING = 1.0
SATURATED_TTFT_MS = 2000.0
#: the twin serves a load fully at or above this served fraction; below it the twin is saturated and its
#: throughput is its capacity (the fit's capacity replays and place's per-GPU ones use the same line)
TWIN_SATURATED = 0.97
#: the key of the pooled samples in an error model file
POOLED = "pooled"


def check_confidence(confidence, where: str = "--confidence") -> float:
    """``confidence`` as a float in the open interval (0, 1); InputError naming ``where`` otherwise."""
    try:
        c = float(confidence)
    except (TypeError, ValueError):
        raise InputError(f"{where}: expected a number in (0, 1), got {confidence!r}") from None
    if not (math.isfinite(c) and 0.0 < c < 1.0):
        raise InputError(f"{where}: must be in (0, 1) (a probability: 0.9 = right 9 times in 10), got {confidence!r}")
    return c


def conformal_rank(n: int, confidence: float) -> int:
    """``k = floor((n + 1)(1 - C))``: the 1-based rank of the split-conformal lower bound (0: too few)."""
    # the product is rounded first so that (n + 1)(1 - C) = 3 exactly is not floored to 2 by float error
    return int(math.floor(round((n + 1) * (1.0 - confidence), 9)))


def max_confidence(n: int) -> float:
    """The highest C that ``n`` calibration samples support: ``1 - 1 / (n + 1)``."""
    return 1.0 - 1.0 / (n + 1)


def conformal_lower(samples, confidence: float) -> float | None:
    """The split-conformal lower bound at ``confidence`` of a new draw from ``samples``' distribution,
    or None when there are too few samples (``confidence > max_confidence(n)``)."""
    s = np.sort(np.asarray(samples, float))
    k = conformal_rank(len(s), confidence)
    return float(s[k - 1]) if k >= 1 else None


def exceed_probability(samples, threshold: float) -> float:
    """Conformal p-value of a draw below ``threshold``: ``(#{s < threshold} + 1) / (n + 1)`` (capped at 1)."""
    s = np.asarray(samples, float)
    return min(1.0, (float(np.sum(s < threshold)) + 1.0) / (len(s) + 1.0))


def capacity_observed(real_served, real_waiting_mean, real_ttft_mean_ms) -> np.ndarray:
    """Runs whose real capacity is observed: served < SATURATED_SERVED with a queue (mask)."""
    served = np.asarray(real_served, float)
    queued = (np.asarray(real_waiting_mean, float) >= SATURATED_WAITING) | \
             (np.asarray(real_ttft_mean_ms, float) >= SATURATED_TTFT_MS)
    return (served < SATURATED_SERVED) & queued


@dataclass(frozen=True)
class Bound:
    """A capacity-ratio lower bound at one confidence, with where it came from."""

    confidence: float
    ratio: float
    """r_(k): the real capacity is >= ratio x the twin's with probability >= confidence."""
    samples: str
    """Which samples: the profile's own name, or ``pooled``."""
    n: int

    @property
    def verification_load(self) -> float:
        """The load factor the twin must serve a GPU at: 1 / ratio."""
        return 1.0 / self.ratio

    def describe(self) -> str:
        return (f"confidence {self.confidence:g}: real capacity >= {self.ratio:.3f} x the twin's "
                f"({self.samples} runs, n={self.n}), so the twin verifies at {self.verification_load:.3f}x the load")


@dataclass
class ErrorModel:
    """The capacity ratios of one profile (and the pooled GPU runs), read from an error model file."""

    profile: str
    capacity_ratio: dict[str, list[float]]
    """Samples of cap_real / cap_twin by source: the profile's name and ``pooled``."""
    path: str = ""
    fitted_on: str = ""
    meta: dict = field(default_factory=dict)

    def samples(self, key: str) -> np.ndarray:
        return np.sort(np.asarray(self.capacity_ratio.get(key, ()), float))

    def bound(self, confidence: float) -> Bound:
        """The lower bound at ``confidence``: the profile's own runs if they suffice, else the pooled
        runs; InputError (naming --confidence and the file) when neither does."""
        c = check_confidence(confidence)
        for key in (self.profile, POOLED):
            s = self.samples(key)
            q = conformal_lower(s, c) if len(s) else None
            if q is not None and q > 0:
                return Bound(c, q, key, len(s))
        counts = {k: len(v) for k, v in self.capacity_ratio.items()}
        best = max(counts.values(), default=0)
        raise InputError(f"--confidence {c:g}: too few held-apart runs in {self.path or 'the error model'} to bound "
                         f"the twin's error at that confidence (runs: {counts}; n runs support at most "
                         f"1 - 1/(n + 1) = {max_confidence(best):.3f}); lower --confidence, or refit with more "
                         "runs (lora-opt error-model)")

    def p_starve(self, cap_twin: float, load_tok_s: float, rho: float, key: str | None = None) -> float:
        """Conformal estimate of P(real capacity < rho x load) for a GPU the twin gives ``cap_twin``."""
        if load_tok_s <= 0:
            return 0.0
        s = self.samples(key or self.profile)
        if not len(s):
            s = self.samples(POOLED)
        if cap_twin <= 0:
            return 1.0
        return exceed_probability(s, rho * load_tok_s / cap_twin)

    def to_dict(self) -> dict:
        return {"profile": self.profile, "fitted_on": self.fitted_on, "meta": self.meta,
                "capacity_ratio": {k: [round(float(x), 6) for x in sorted(v)] for k, v in self.capacity_ratio.items()}}

    def save(self, path: str | Path) -> Path:
        import yaml  # only when a file is written

        return atomic_write_text(path, "# written by lora-opt error-model: do not edit (refit instead)\n"
                                 + yaml.safe_dump(self.to_dict(), sort_keys=False, width=120))


def error_model_path(profile_name: str) -> Path:
    return ERROR_MODELS_DIR / f"{profile_name}.yaml"


def load_error_model(path: str | Path, profile: str | None = None) -> ErrorModel:
    """An error model file; InputError naming the file and field when it is malformed."""
    data = read_config_file(path, "error model", InputError)
    where = str(path)
    if not isinstance(data, dict) or not isinstance(data.get("capacity_ratio"), dict):
        raise InputError(f"{where}: an error model needs a mapping 'capacity_ratio: {{source: [ratios]}}'")
    ratios: dict[str, list[float]] = {}
    for key, vals in data["capacity_ratio"].items():
        if not isinstance(vals, list) or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                                                 for v in vals):
            raise InputError(f"{where}: capacity_ratio.{key} must be a list of positive finite numbers")
        ratios[str(key)] = [float(v) for v in vals]
    name = str(data.get("profile") or profile or Path(path).stem)
    return ErrorModel(profile=name, capacity_ratio=ratios, path=where, fitted_on=str(data.get("fitted_on", "")),
                      meta=dict(data.get("meta") or {}))


def bundled_error_model(profile_name: str) -> ErrorModel | None:
    """The bundled error model of a profile, or None when the profile has none."""
    path = error_model_path(profile_name)
    if not path.is_file():
        return None
    model = load_error_model(path, profile_name)
    model.path = bundle_relative(path)           # configs/error_models/<profile>.yaml, checkout or wheel
    return model
