"""Demand drift you can reproduce: a seeded generator of day-long workloads, one ``Workload`` per step.

Three kinds of drift, each a field of :class:`DriftConfig`:

* **the day**: the total request rate follows a cosine between ``trough_fraction x peak_rate`` and
  ``peak_rate``, highest at ``peak_hour`` (evaluated at the middle of each step) -- or, with
  ``rate_shape: trace:<name>[+<name>...]``, the real arrival-rate shape of the bundled one-hour
  request traces (Azure 2023 code/conversation, Mooncake; ``data/README.md``): the traces stitched
  end to end (each one's first request right after the previous one's last), the stitch cut into
  ``steps`` windows of equal length, each step's total rate proportional to its window's request
  count and scaled so the busiest step has ``peak_rate`` (:func:`trace_shape`; no draw: the shape
  is the data's);
* **popularity churn**: adapter ``i`` holds a popularity position ``k`` and gets the share
  ``k^-popularity_alpha / sum_j j^-popularity_alpha`` of the total rate (a power law over positions,
  as the papers' Zipf workloads); each step a random ``churn`` fraction of the adapters swap their
  positions among themselves (a permutation of those positions);
* **arrivals and retirements**: each step ``Poisson(arrivals_per_step)`` new adapters join (at random
  positions, ranks drawn from ``ranks``) and ``Poisson(retirements_per_step)`` leave (chosen at
  random); ids are never reused (``<prefix><n>``, n counting up), so a retired adapter never returns.

Every draw comes from one ``numpy`` generator seeded with ``seed``: the same file gives the same day.
Pure workload generation (no twin run); :func:`write_drift` writes the steps as workload YAML files
(``lora-opt place --workload`` reads each one).

    profile: llama-3.1-8b-h100-64gb
    adapters: 120
    ranks: [{rank: 8, share: 0.5}, {rank: 16, share: 0.3}, {rank: 32, share: 0.2}]
    peak_rate: 30
    trough_fraction: 0.25
    peak_hour: 15
    steps: 24
    step_s: 3600
    popularity_alpha: 1.0
    churn: 0.1
    arrivals_per_step: 3
    retirements_per_step: 2
    seed: 1
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_text
from lora_opt.placement.workload_file import MAX_RATE, Workload, workload_from_dict
from twin.bundled_data import TRACES
from twin.errors import ScenarioError
from twin.flags import check_rank
from twin.parsing import build_dataclass, check_adapter_id, check_finite, read_config_file
from twin.paths import resolve_bundled
from twin.scenario import DEFAULT_RHO, MAX_ADAPTERS
from twin.workload import load_trace

#: the most steps a drift may have (a week of hours)
MAX_STEPS = 168
#: ``rate_shape``'s cosine; the other values are ``TRACE_SHAPE`` + bundled trace names joined by ``+``
DIURNAL = "diurnal"
TRACE_SHAPE = "trace:"


@dataclass(frozen=True)
class RankShare:
    """One LoRA rank of the mix and the share of adapters that have it."""

    rank: int
    """LoRA rank (one vLLM allows: 8, 16, 32, 64, ...)."""
    share: float
    """Share of the adapters with this rank (> 0; the shares are normalised to sum 1)."""


@dataclass(frozen=True)
class DriftConfig:
    """A day (or any horizon) of drifting demand, in ``steps`` workloads of ``step_s`` seconds each."""

    profile: str
    """Bundled profile name or a profile YAML path (as a workload's)."""
    adapters: int
    """Adapters at the start (>= 1)."""
    peak_rate: float
    """Total requests/s at the peak of the day (> 0)."""
    ranks: tuple[RankShare, ...] = (RankShare(8, 0.5), RankShare(16, 0.3), RankShare(32, 0.2))
    """The rank mix new and initial adapters draw from."""
    trough_fraction: float = 0.25
    """Total rate at the trough / at the peak, in (0, 1] (1 = flat day)."""
    peak_hour: float = 15.0
    """Hour of the day (0..24) at which the rate peaks; the trough is 12 h away."""
    start_hour: float = 0.0
    """Hour of the day at which step 0 starts (0..24)."""
    steps: int = 24
    """Workloads generated (1..168)."""
    step_s: float = 3600.0
    """Seconds each step covers (> 0): the day's curve is evaluated at each step's middle."""
    popularity_alpha: float = 1.0
    """Power-law exponent of popularity over positions (>= 0; 0 = every adapter equally popular)."""
    churn: float = 0.1
    """Fraction of adapters whose popularity positions are reshuffled each step, in [0, 1]."""
    arrivals_per_step: float = 2.0
    """Expected new adapters per step (Poisson, >= 0)."""
    retirements_per_step: float = 2.0
    """Expected retired adapters per step (Poisson, >= 0; at least one adapter always stays)."""
    prefix: str = "d-"
    """Adapter ids are ``<prefix><n>``."""
    seed: int = 0
    """Seed of every draw (ranks, churn, arrivals, retirements)."""
    rho: float = DEFAULT_RHO
    """Starvation threshold of every step's workload, in (0, 1]."""
    engine: dict = field(default_factory=dict)
    """Engine flags of every step's workload (a workload's ``engine`` mapping)."""
    evaluation: dict = field(default_factory=dict)
    """Evaluation traffic of every step's workload (a workload's ``evaluation`` mapping; its seed
    is the step's ``seed + step`` unless given)."""
    name: str = "drift"
    """Step workloads are named ``<name>-s<step>``."""
    rate_shape: str = DIURNAL
    """How the total rate moves over the steps: ``diurnal`` (the cosine of ``trough_fraction``,
    ``peak_hour`` and ``start_hour``) or ``trace:<name>[+<name>...]``, bundled one-hour traces
    (azure-code, azure-conv, mooncake-conversation, mooncake-synthetic) stitched end to end and cut
    into ``steps`` equal windows, each step's rate its window's requests scaled so the busiest step
    has ``peak_rate`` (the cosine's fields are then unused)."""

    def validate(self, where: str = "drift") -> None:
        """InputError naming the field and what it allows."""
        if not 1 <= self.adapters <= MAX_ADAPTERS:
            raise InputError(f"{where}.adapters: must be in 1..{MAX_ADAPTERS:,}, got {self.adapters}")
        check_finite(self.peak_rate, f"{where}.peak_rate", 0.0, MAX_RATE, InputError, lo_open=True)
        check_finite(self.trough_fraction, f"{where}.trough_fraction", 0.0, 1.0, InputError, lo_open=True)
        check_finite(self.peak_hour, f"{where}.peak_hour", 0.0, 24.0, InputError)
        check_finite(self.start_hour, f"{where}.start_hour", 0.0, 24.0, InputError)
        if not 1 <= self.steps <= MAX_STEPS:
            raise InputError(f"{where}.steps: must be in 1..{MAX_STEPS}, got {self.steps}")
        check_finite(self.step_s, f"{where}.step_s", 0.0, 86400.0, InputError, lo_open=True)
        check_finite(self.popularity_alpha, f"{where}.popularity_alpha", 0.0, 10.0, InputError)
        check_finite(self.churn, f"{where}.churn", 0.0, 1.0, InputError)
        for name in ("arrivals_per_step", "retirements_per_step"):
            check_finite(getattr(self, name), f"{where}.{name}", 0.0, 10_000.0, InputError)
        if not self.ranks:
            raise InputError(f"{where}.ranks: at least one {{rank, share}} is required")
        for i, r in enumerate(self.ranks):
            check_rank(r.rank, f"{where}.ranks[{i}].rank", InputError)
            check_finite(r.share, f"{where}.ranks[{i}].share", 0.0, 1e6, InputError, lo_open=True)
        check_adapter_id(f"{self.prefix}0", f"{where}.prefix", InputError)
        check_adapter_id(f"{self.name}-s0", f"{where}.name", InputError)
        if "/" in self.name or "\\" in self.name:
            raise InputError(f"{where}.name: {self.name!r:.80} must not contain '/' (it names files)")
        if self.seed < 0:
            raise InputError(f"{where}.seed: must be >= 0, got {self.seed}")
        check_finite(self.rho, f"{where}.rho", 0.0, 1.0, InputError, lo_open=True)
        for name in ("engine", "evaluation"):
            if not isinstance(getattr(self, name), dict):
                raise InputError(f"{where}.{name}: expected a mapping (a workload's {name})")
        if self.rate_shape != DIURNAL:
            trace_shape(self.rate_shape, self.steps, f"{where}.rate_shape")

    def total_rate(self, step: int) -> float:
        """The day's total request rate (req/s) at the middle of ``step`` (or in its trace window)."""
        if self.rate_shape != DIURNAL:
            return self.peak_rate * trace_shape(self.rate_shape, self.steps)[step]
        hour = (self.start_hour + (step + 0.5) * self.step_s / 3600.0) % 24.0
        wave = 0.5 * (1.0 + math.cos(2.0 * math.pi * (hour - self.peak_hour) / 24.0))
        return self.peak_rate * (self.trough_fraction + (1.0 - self.trough_fraction) * wave)


def trace_shape(rate_shape: str, steps: int, where: str = "drift.rate_shape") -> tuple[float, ...]:
    """Each step's share of the busiest step's rate for ``rate_shape`` ``trace:<name>[+<name>...]``:
    the named bundled traces stitched end to end, cut into ``steps`` windows of equal length, the
    request count of each window over the largest count.  InputError (naming ``where``) for an
    unknown value or a window without a request."""
    names = rate_shape[len(TRACE_SHAPE):].split("+") if rate_shape.startswith(TRACE_SHAPE) else []
    if not names or any(n not in TRACES for n in names):
        raise InputError(f"{where}: {rate_shape!r:.120} not allowed; allowed values: {DIURNAL}, "
                         f"{TRACE_SHAPE}<name>[+<name>...] with <name> one of {', '.join(TRACES)}")
    arrivals, span = _stitched(tuple(names), where)
    counts = np.histogram(arrivals, bins=steps, range=(0.0, span))[0]
    if not counts.all():
        k = int(np.flatnonzero(counts == 0)[0])
        raise InputError(f"{where}: window {k} of the {steps} cut from {rate_shape!r} ({span / steps:.0f} s "
                         "each) holds no request; use fewer steps or stitch more traces")
    return tuple(float(c) for c in counts / counts.max())


@functools.lru_cache(maxsize=8)
def _stitched(names: tuple[str, ...], where: str) -> tuple[np.ndarray, float]:
    """The bundled traces' arrival times (s) end to end, and the stitch's span."""
    arrivals, offset = [], 0.0
    for n in names:
        try:
            t = load_trace(n)["t"].to_numpy(float)
        except ScenarioError as exc:
            raise InputError(f"{where}: {exc}") from None
        arrivals.append(t + offset)
        offset += float(t.max())
    return np.concatenate(arrivals), offset


def drift_from_dict(data: Any, where: str = "drift") -> DriftConfig:
    """A validated ``DriftConfig`` from its YAML form; InputError names the field."""
    def ranks(value, w):
        if not isinstance(value, list):
            raise InputError(f"{w}: expected a list of {{rank, share}}, got {value!r:.80}")
        return tuple(build_dataclass(RankShare, v, f"{w}[{i}]", InputError) for i, v in enumerate(value))

    cfg = build_dataclass(DriftConfig, data, where, InputError, ranks=ranks)
    cfg.validate(where)
    # every step must be a valid workload: the first one is built and checked here (the profile,
    # the engine and evaluation mappings), so a bad file fails before any work
    drift_workloads(dataclasses.replace(cfg, steps=1), where)
    return cfg


def load_drift(path: str | Path) -> DriftConfig:
    """Read and validate a drift YAML, or a bundled one by name (``day``: ``configs/drift/day.yaml``)."""
    p = resolve_bundled("drift", path, InputError)
    return drift_from_dict(read_config_file(p, "drift", InputError), p.name)


def drift_workloads(cfg: DriftConfig, where: str = "drift") -> list[Workload]:
    """The ``cfg.steps`` workloads of the drift, in order (deterministic for ``cfg.seed``)."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 26]))
    rank_values = np.array([r.rank for r in cfg.ranks])
    rank_p = np.array([r.share for r in cfg.ranks], float)
    rank_p /= rank_p.sum()
    next_id = cfg.adapters
    # live adapters: id number and LoRA rank, and their popularity positions (a permutation of 1..n)
    ids = list(range(cfg.adapters))
    lora_rank = rng.choice(rank_values, size=cfg.adapters, p=rank_p).tolist()
    position = (rng.permutation(cfg.adapters) + 1).tolist()
    out = []
    for step in range(cfg.steps):
        if step > 0:
            ids, lora_rank, position, next_id = _drift_one_step(cfg, rng, ids, lora_rank, position, next_id,
                                                                rank_values, rank_p)
        weights = np.asarray(position, float) ** -cfg.popularity_alpha
        rates = cfg.total_rate(step) * weights / weights.sum()
        adapters = [{"id": f"{cfg.prefix}{i}", "rank": int(r), "rate": float(q)}
                    for i, r, q in zip(ids, lora_rank, rates)]
        evaluation = {"seed": cfg.seed + step, **cfg.evaluation}
        data = {"profile": cfg.profile, "adapters": adapters, "rho": cfg.rho, "engine": dict(cfg.engine),
                "evaluation": evaluation, "name": f"{cfg.name}-s{step}",
                "meta": {"drift": {"step": step, "start_s": step * cfg.step_s, "step_s": cfg.step_s,
                                   "total_rate": cfg.total_rate(step), "rate_shape": cfg.rate_shape,
                                   "seed": cfg.seed}}}
        out.append(workload_from_dict(data, f"{where} (step {step})"))
    return out


def _drift_one_step(cfg: DriftConfig, rng, ids, lora_rank, position, next_id, rank_values, rank_p):
    """One step of churn, retirements and arrivals; positions stay a permutation of 1..n."""
    n = len(ids)
    k = int(round(cfg.churn * n))
    if k >= 2:                     # reshuffle the positions of k random adapters among themselves
        chosen = rng.choice(n, size=k, replace=False)
        pos = np.asarray(position)
        pos[chosen] = pos[rng.permutation(chosen)]
        position = pos.tolist()
    retire = min(int(rng.poisson(cfg.retirements_per_step)), n - 1)
    if retire:
        gone = set(rng.choice(n, size=retire, replace=False).tolist())
        keep = [j for j in range(n) if j not in gone]
        ids, lora_rank = [ids[j] for j in keep], [lora_rank[j] for j in keep]
        # the survivors keep their popularity order, closed up to 1..n
        order = np.argsort([position[j] for j in keep], kind="stable")
        position = [0] * len(keep)
        for new_pos, j in enumerate(order.tolist(), start=1):
            position[j] = new_pos
    arrive = min(int(rng.poisson(cfg.arrivals_per_step)), MAX_ADAPTERS - len(ids))
    for _ in range(arrive):        # a newcomer takes a random position; those below it move down one
        p = int(rng.integers(1, len(ids) + 2))
        position = [q + 1 if q >= p else q for q in position] + [p]
        ids.append(next_id)
        lora_rank.append(int(rng.choice(rank_values, p=rank_p)))
        next_id += 1
    return ids, lora_rank, position, next_id


def write_drift(workloads: list[Workload], out_dir: str | Path) -> list[Path]:
    """Each step's workload as ``<out_dir>/<name>.yaml`` (readable by ``lora-opt place --workload``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for wl in workloads:
        d = wl.to_dict()
        d["adapters"] = [{k: v for k, v in a.items() if v is not None} for a in d["adapters"]]
        written.append(atomic_write_text(out / f"{wl.name}.yaml", yaml.safe_dump(d, sort_keys=False)))
    return written


__all__ = ["DriftConfig", "RankShare", "drift_from_dict", "drift_workloads", "load_drift", "trace_shape",
           "write_drift"]
