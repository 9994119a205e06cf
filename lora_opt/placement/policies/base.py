"""The placement-policy interface: one small base class, every policy a subclass.

A policy turns a workload (adapters with ranks and expected rates) and a GPU pool size into
``GPUAssignment``s: which adapters each GPU serves (with routing weights), and its A_max
(``--max-loras``).  ``PlacementPolicy.place`` does everything the policies share -- per-GPU vLLM
flags, the ``Placement``, the independent checker, the infeasibility verdict -- so a policy only
decides the assignment.  Contract tests (``tests/test_policies.py``) run over ``POLICIES``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lora_opt.placement.plan import GPUConfig, Placement, placement_problems
from lora_opt.placement.workload_file import Workload
from lora_opt.surrogates.distill import DistilledSurrogate
from lora_opt.surrogates.model_files import LEGACY_PICKLE_NAME, refuse_pickle
from lora_opt.surrogates.oracle import ORACLE_FILES, Oracle, Surrogate
from lora_opt.surrogates.registry import surrogate_dir as resolve_surrogate
from twin.errors import ScenarioError
from twin.paths import SURROGATES_DIR
from twin.flags import max_lora_rank_for, resolve_flags
from twin.profile import Profile, load_profile


@dataclass
class GPUAssignment:
    """What a policy decides for one GPU."""

    adapters: list[tuple[int, float]]
    """(index into workload.adapters, routing weight in (0, 1])."""
    max_loras: int
    """A_max (``--max-loras``)."""
    predicted_throughput: float | None = None
    """The oracle's throughput for this GPU (tok/s), when the policy asked one."""
    margin: float | None = None
    """Starvation margin: the capacity headroom over the expected load the oracle predicts
    (fraction); None when the policy has no oracle."""
    verified_load: float | None = None
    """The load factor at which the twin verified this GPU (greedy-plus), None if not verified."""
    config: GPUConfig | None = None
    """The instance's flags when the policy made them (``gpu_config``; greedy-plus: the flags the twin
    verified), so nothing makes them again; None: ``PlacementPolicy.place`` makes them."""


@dataclass
class Assignment:
    """A policy's whole answer."""

    gpus: list[GPUAssignment]
    unplaceable: list[int] = field(default_factory=list)
    """Adapters the policy could not place at all (e.g. one adapter alone starves a GPU)."""
    notes: list[str] = field(default_factory=list)


def bundled_surrogate_dir(profile_name: str) -> Path:
    return SURROGATES_DIR / profile_name


@functools.lru_cache(maxsize=8)
def _load_oracle(path: str, kind: str) -> Oracle:
    loader = {"full": Surrogate.load, "distilled": DistilledSurrogate.load}[kind]
    return loader(path)


@dataclass
class PlacementContext:
    """What policies may consult besides the workload: the profile and the surrogates."""

    profile: Profile
    surrogate_dir: Path | None = None
    """Directory with ``surrogate.json`` (+ ``surrogate.skops``) and ``distilled.json`` (default: the bundled one)."""
    history: Any = None
    """Observed requests (``twin.workload.Requests``, adapter indices = workload order) from which
    the rates were estimated; greedy-plus verifies GPUs on them, bursts included."""
    history_s: float = 0.0
    """Length of the observed window (s)."""

    @classmethod
    def for_workload(cls, wl: Workload, surrogate_dir: str | Path | None = None, history=None,
                     history_s: float = 0.0) -> PlacementContext:
        profile = load_profile(wl.profile)
        d = Path(resolve_surrogate(surrogate_dir)) if surrogate_dir else bundled_surrogate_dir(profile.name)
        if history is not None and not history_s > 0:
            raise ScenarioError("history_s: the observed window must be > 0 s when a history is given")
        return cls(profile=profile, surrogate_dir=d, history=history, history_s=history_s)

    def oracle(self, kind: str) -> Oracle:
        """The full surrogate (``kind='full'``) or its distilled trees (``'distilled'``)."""
        fname = ORACLE_FILES[kind]
        d = self.surrogate_dir
        if d is None or not (d / fname).exists():
            if d is not None:
                refuse_pickle(d / LEGACY_PICKLE_NAME)     # an older lora-opt's pickle: say so, never load it
            bundled = sorted(p.name for p in SURROGATES_DIR.iterdir() if p.is_dir()) if SURROGATES_DIR.exists() else []
            raise ScenarioError(
                f"surrogate: no {fname} for profile {self.profile.name!r} in {d}; bundled surrogates exist "
                f"for {bundled}. Train one (lora-opt dataset ... && lora-opt train ...) and pass --surrogate DIR, "
                "or use a policy without an oracle (dlora, loraserve)")
        return _load_oracle(str(d / fname), kind)


def gpu_config(wl: Workload, profile: Profile, ranks, n_adapters: int, max_loras: int) -> GPUConfig:
    """The flags of one GPU: the workload's shared ones, A_max, the smallest vLLM rank that holds
    ``ranks`` and a CPU cache for all ``n_adapters``, every unset flag resolved from the profile
    and its vLLM release's rules (``twin.flags.resolve_flags``, as a scenario's are), every flag set
    (``GPUConfig.from_flags``)."""
    flags = dataclasses.replace(wl.engine, max_loras=int(max_loras), max_lora_rank=max_lora_rank_for(ranks),
                                max_cpu_loras=int(max(max_loras, n_adapters)))
    return GPUConfig.from_flags(resolve_flags(flags, profile.flag_defaults(), profile.flag_rules()))


class PlacementPolicy:
    """Base class: subclasses set ``name``/``summary`` and implement ``assign``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    uses_oracle: ClassVar[bool] = False
    #: policies that may route one adapter to several GPUs
    fractional: ClassVar[bool] = False
    #: policies with no capacity model: every placement fits the pool it is given (dLoRA's)
    fills_any_pool: ClassVar[bool] = False

    def assign(self, wl: Workload, gpus: int, ctx: PlacementContext) -> Assignment:
        """Decide the assignment.  May return more GPUs than ``gpus`` when the pool is too small
        (the placement is then reported infeasible, with the count needed)."""
        raise NotImplementedError

    def place(self, wl: Workload, gpus: int, ctx: PlacementContext | None = None) -> Placement:
        """Assignment -> checked ``Placement`` (``meta`` holds the verdict and predictions)."""
        if not isinstance(gpus, int) or gpus < 1:
            raise ScenarioError(f"gpus: must be an integer >= 1, got {gpus!r}")
        # hundreds of thousands of small objects (routes, GPU lists) and none of them garbage: the
        # cyclic collector's passes cost ~20 % of a 100k-adapter placement (measured); it runs after
        with _collector_paused():
            return self._place(wl, gpus, ctx or PlacementContext.for_workload(wl))

    def _place(self, wl: Workload, gpus: int, ctx: PlacementContext) -> Placement:
        t0 = time.perf_counter()
        asg = self.assign(wl, gpus, ctx)
        wall_ms = (time.perf_counter() - t0) * 1e3
        used = [g for g in asg.gpus if g.adapters]
        configs, routes = [], {}
        for gi, g in enumerate(used):
            configs.append(g.config or gpu_config(wl, ctx.profile, [wl.adapters[i].rank for i, _ in g.adapters],
                                                  len(g.adapters), g.max_loras))
            for i, w in g.adapters:
                routes.setdefault(wl.adapters[i].id, []).append((gi, float(w)))
        needed = len(used)
        feasible = needed <= gpus and not asg.unplaceable
        meta = {
            "workload": wl.name, "rho": wl.rho, "gpus_pool": gpus, "gpus_used": needed if feasible else None,
            "gpus_needed": needed if not asg.unplaceable else None, "feasible": feasible,
            "unplaceable": [wl.adapters[i].id for i in asg.unplaceable],
            "predicted_throughput": [g.predicted_throughput for g in used],
            "starvation_margin": [g.margin for g in used],
            "twin_verified_at_load": [g.verified_load for g in used],
            "incoming_rate_req_s": [sum(wl.adapters[i].rate * w for i, w in g.adapters) for g in used],
            "policy_wall_ms": wall_ms, "notes": asg.notes, "workload_meta": wl.meta,
        }
        p = Placement(profile=wl.profile, adapters=list(wl.adapters), gpus=configs, routes=routes,
                      policy=self.name, meta=meta)
        problems = placement_problems(p, ctx.profile, include_startup=False) if not asg.unplaceable else []
        if problems:   # a policy bug, never a workload property: fail loudly
            raise AssertionError(f"policy {self.name} produced an invalid placement: {problems}")
        meta["gpus_failing_startup"] = startup_failures(p, ctx.profile)
        return p


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block (back as it was after)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def startup_failures(p: Placement, profile: Profile) -> list[int]:
    """GPUs whose vLLM instance would not start (an OOM at start-up is a result, not an error)."""
    return [i for i, g in enumerate(p.gpus) if not g.startup_check(profile)[0]]
