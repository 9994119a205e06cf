"""The scenario file: the one input of the twin (YAML, JSON accepted).

Every field is a validated dataclass field with a docstring; errors name the field and the
allowed values.  See ``configs/scenarios/example.yaml``.

Code that makes scenarios (lora-opt's policies, dataset, evaluation, calibration, benchmarks)
builds them with :func:`scenario_dict` / :func:`build_scenario` rather than by hand, so every
scenario is assembled, and defaulted (:data:`DEFAULT_RHO`), in one place.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twin.adapter_cache import POLICIES as CACHE_POLICIES
from twin.arrivals import PROCESSES
from twin.bundled_data import TRACES
from twin.errors import ScenarioError
from twin.flags import EngineFlags, check_rank, flag_values, max_lora_rank_for, resolve_flags
from twin.parsing import build_dataclass, check_adapter_id, check_choice, check_positive, read_config_file
from twin.paths import resolve_bundled
from twin.profile import Profile, load_profile

ARRIVAL_PROCESSES = (*PROCESSES, "trace")        # synthetic processes: twin.arrivals
LENGTH_SOURCES = ("sharegpt", "sharegpt-8k", "arxiv", "normal", "mean", "trace")
TRACE_MAPPINGS = ("uniform", "powerlaw", "rates")
ADAPTER_CACHE_POLICIES = tuple(CACHE_POLICIES)     # eviction policies: twin.adapter_cache

#: Sizes a scenario may ask for, checked before anything is allocated (errors name the field, the
#: value and the limit): adapters (groups expanded), expected requests (duration x total rate, x
#: rate_max_factor for nonstationary arrivals), time-series samples (duration / interval; the
#: kernel allocates them up front), nonstationary windows (adapters x duration / window_s).
MAX_ADAPTERS = 1_000_000
MAX_REQUESTS = 50_000_000
MAX_TIMESERIES_SAMPLES = 10_000_000
MAX_WINDOWS = 10_000_000
#: the longest simulated window (s, ~3.2 years) and the largest mean request length (tokens)
MAX_DURATION_S = 1e8
MAX_MEAN_TOKENS = 10_000_000

#: The papers' starvation threshold: a GPU starves when its throughput is below rho x the incoming
#: token rate.  The one default of rho everywhere (scenarios, workloads, grids, criteria).
DEFAULT_RHO = 0.9


@dataclass(frozen=True)
class EngineConfig(EngineFlags):
    """A scenario's ``engine:`` section: the vLLM flags of the instance (``twin.flags.EngineFlags``,
    same names as ``vllm serve``; None = the profile's default, and for ``max_lora_rank`` the
    smallest allowed value that holds every adapter) plus the twin's adapter-cache policy."""

    adapter_cache_policy: str = "lru"
    """GPU/CPU adapter cache eviction: lru (vLLM) or fifo.  Not a vLLM flag: a twin what-if."""

    def validate(self, where: str = "engine", error: type[Exception] = ScenarioError) -> None:
        """The flags' checks (``EngineFlags.validate``), then the cache policy's."""
        super().validate(where, error)
        check_choice(self.adapter_cache_policy, ADAPTER_CACHE_POLICIES, f"{where}.adapter_cache_policy", error)


@dataclass(frozen=True)
class AdapterGroup:
    """``count`` adapters of one rank, each with its own arrival stream of ``rate`` req/s."""

    rank: int
    """LoRA rank of the adapters (1..512)."""
    rate: float | None = None
    """Requests per second per adapter (> 0); for trace arrivals only used by mapping: rates."""
    count: int = 1
    """Number of adapters in the group (>= 1)."""
    id: str | None = None
    """Name of a single adapter (count must be 1); default ``a<index>``."""


@dataclass(frozen=True)
class ArrivalConfig:
    """How requests arrive."""

    process: str = "poisson"
    """poisson | lognormal | nonstationary | trace."""
    cv: float = 2.0
    """lognormal: coefficient of variation of inter-arrival times (> 0; 1 ~ Poisson burstiness)."""
    window_s: float = 300.0
    """nonstationary: every window each adapter re-draws Poisson or log-normal and doubles or
    halves its rate (the papers use 5 minutes)."""
    rate_min_factor: float = 0.25
    """nonstationary: a rate never drops below this factor of its nominal value."""
    rate_max_factor: float = 4.0
    """nonstationary: a rate never exceeds this factor of its nominal value."""
    trace: str | None = None
    """trace: azure-code | azure-conv | mooncake-conversation | mooncake-synthetic | a CSV path."""
    mapping: str = "uniform"
    """trace: how requests are mapped to adapters: uniform | powerlaw | rates."""
    alpha: float = 1.0
    """trace, powerlaw: popularity of the k-th adapter ~ k^-alpha (alpha > 0)."""
    time_scale: float = 1.0
    """trace: multiply inter-arrival times by this (< 1 speeds the trace up), > 0."""
    start_s: float = 0.0
    """trace: skip the first start_s seconds of the trace (after scaling)."""


@dataclass(frozen=True)
class LengthConfig:
    """Request lengths (tokens)."""

    source: str = "sharegpt"
    """sharegpt (fitted to the real runs, ~223/193) | sharegpt-8k | arxiv | normal | mean | trace."""
    mean_in: float | None = None
    """normal/mean: mean prompt tokens."""
    std_in: float = 0.0
    """normal: std of prompt tokens."""
    mean_out: float | None = None
    """normal/mean: mean output tokens."""
    std_out: float = 0.0
    """normal: std of output tokens."""


@dataclass(frozen=True)
class ClientConfig:
    """The client sending the requests (a benchmark harness or a gateway)."""

    max_inflight: int | None = None
    """Cap on requests at the server (running + waiting); None = unbounded. The papers' benchmark
    client never had more than ~25.4k in flight (running + waiting maxima of the real runs)."""
    overflow: str = "drop"
    """What happens to a request arriving at the cap: drop (it fails and is not counted) or wait
    (the client holds it until a slot frees; its TTFT still counts from its arrival)."""


OVERFLOW_POLICIES = ("drop", "wait")


@dataclass(frozen=True)
class Scenario:
    """One vLLM instance, its adapters and their traffic, simulated for ``duration_s``."""

    profile: str
    """A bundled profile name or a path to a profile YAML."""
    adapters: tuple[AdapterGroup, ...]
    """Adapter groups; each adapter gets its own arrival stream."""
    engine: EngineConfig = EngineConfig()
    arrivals: ArrivalConfig = ArrivalConfig()
    lengths: LengthConfig = LengthConfig()
    duration_s: float = 3600.0
    """Simulated seconds (> 0); requests still in flight at the end are not counted."""
    rho: float = DEFAULT_RHO
    """Starvation threshold: starving when throughput < rho x incoming token rate; in (0, 1]."""
    seed: int = 0
    """Seed of every random draw (arrivals, lengths, mapping)."""
    early_stop: bool = False
    """Stop as soon as starvation is certain (recorded as ``stopped_early_s``)."""
    timeseries_interval_s: float = 1.0
    """Sampling interval of the time series (> 0)."""
    client: ClientConfig = ClientConfig()
    """The load generator's limits."""

    # ---- derived ------------------------------------------------------------------------------
    def load_profile(self) -> Profile:
        return load_profile(self.profile)

    def adapter_table(self) -> tuple[list[str], list[int], list[float | None]]:
        """(ids, ranks, rates) of every adapter, groups expanded in order (new lists: the caller's)."""
        ids, ranks, rates = self._adapter_table
        return list(ids), list(ranks), list(rates)

    @functools.cached_property
    def _adapter_table(self) -> tuple[tuple, tuple, tuple]:
        # expanded once per scenario: a fleet's engines (lora_opt bench fleet: 1,000 engines sharing
        # one scenario of 8,000 adapters) ask for it at every start-up, state and flag resolution
        ids, ranks, rates = [], [], []
        for g in self.adapters:
            for _ in range(g.count):
                ids.append(g.id if g.id is not None else f"a{len(ids)}")
                ranks.append(g.rank)
                rates.append(g.rate)
        return tuple(ids), tuple(ranks), tuple(rates)

    def resolved_engine(self, profile: Profile) -> EngineConfig:
        """The engine's flags with every unset one filled in (``twin.flags.resolve_flags``) from the
        profile's defaults and its vLLM release's rules, ``max_lora_rank`` excepted: the smallest vLLM
        value that holds every adapter, not the profile's (vLLM refuses an adapter above it).  An
        engine with every flag set (a placement GPU's, resolved once: ``policies.base.gpu_config``)
        is the resolved one as it is."""
        if None not in flag_values(self.engine).values():
            return self.engine
        _, ranks, _ = self.adapter_table()
        return resolve_flags(self.engine, {**profile.flag_defaults(), "max_lora_rank": max_lora_rank_for(ranks)},
                             profile.flag_rules())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- parsing and validation ------------------------------------------------------------------
def _parse_adapters(value, where) -> tuple[AdapterGroup, ...]:
    if not isinstance(value, list) or not value:
        raise ScenarioError(f"{where}: at least one adapter group is required "
                            "(a list of {{count, rank, rate}})")
    groups = tuple(build_dataclass(AdapterGroup, g, f"{where}[{i}]") for i, g in enumerate(value))
    for i, g in enumerate(groups):
        w = f"{where}[{i}]"
        if g.count < 1:
            raise ScenarioError(f"{w}.count: must be >= 1, got {g.count}")
        check_rank(g.rank, f"{w}.rank")
        if g.rate is not None and g.rate <= 0:
            raise ScenarioError(f"{w}.rate: must be > 0 requests/s, got {g.rate}")
        if g.id is not None and g.count != 1:
            raise ScenarioError(f"{w}.id: a named adapter must have count 1, got count {g.count}")
        if g.id is not None:
            check_adapter_id(g.id, f"{w}.id")
    return groups


def parse_lengths(value, where: str, error: type[Exception] = ScenarioError) -> LengthConfig:
    """A ``lengths:`` section: a mapping of ``LengthConfig`` fields, or just the source's name; a
    mapping with means but no source is ``normal``."""
    if isinstance(value, str):
        value = {"source": value}
    if isinstance(value, dict) and "source" not in value and ("mean_in" in value or "mean_out" in value):
        value = {"source": "normal", **value}
    return build_dataclass(LengthConfig, value, where, error)


def scenario_from_dict(data: Any, where: str = "scenario", *, engine: EngineConfig | None = None) -> Scenario:
    """A validated ``Scenario`` from its YAML form (a mapping); ScenarioError names the field.
    ``engine``: the engine section already typed (:func:`build_scenario`'s flags), instead of the
    mapping's."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: expected a mapping at the top level")
    sc = build_dataclass(Scenario, data, where,
                         adapters=_parse_adapters,
                         engine=lambda v, w: build_dataclass(EngineConfig, v, w),
                         arrivals=lambda v, w: build_dataclass(ArrivalConfig, v, w),
                         client=lambda v, w: build_dataclass(ClientConfig, v, w),
                         lengths=parse_lengths)
    if engine is not None:
        sc = dataclasses.replace(sc, engine=engine)
    validate(sc, where)
    return sc


def validate(sc: Scenario, where: str = "scenario") -> None:
    """Cross-field checks; raises ScenarioError naming the field."""
    e, a, ln = sc.engine, sc.arrivals, sc.lengths
    if not isinstance(sc.adapters, tuple) or not sc.adapters:
        raise ScenarioError(f"{where}.adapters: at least one adapter group is required")
    check_positive(sc.duration_s, f"{where}.duration_s")
    check_positive(sc.timeseries_interval_s, f"{where}.timeseries_interval_s")
    if not 0 < sc.rho <= 1:
        raise ScenarioError(f"{where}.rho: must be in (0, 1], got {sc.rho}")
    if sc.client.max_inflight is not None and sc.client.max_inflight < 1:
        raise ScenarioError(f"{where}.client.max_inflight: must be >= 1 (or null), got {sc.client.max_inflight}")
    check_choice(sc.client.overflow, OVERFLOW_POLICIES, f"{where}.client.overflow")
    if sc.seed < 0:
        raise ScenarioError(f"{where}.seed: must be >= 0, got {sc.seed}")
    e.validate(f"{where}.engine")
    if e.max_lora_rank is not None:
        too_big = [g.rank for g in sc.adapters if g.rank > e.max_lora_rank]
        if too_big:
            raise ScenarioError(f"{where}.engine.max_lora_rank: {e.max_lora_rank} is below adapter rank "
                                f"{max(too_big)} (vLLM rejects such adapters)")
    check_choice(a.process, ARRIVAL_PROCESSES, f"{where}.arrivals.process")
    check_choice(a.mapping, TRACE_MAPPINGS, f"{where}.arrivals.mapping")
    for name in ("cv", "window_s", "alpha", "time_scale", "rate_min_factor", "rate_max_factor"):
        check_positive(getattr(a, name), f"{where}.arrivals.{name}")
    check_positive(a.start_s, f"{where}.arrivals.start_s", strict=False)
    if a.rate_min_factor > 1 or a.rate_max_factor < 1:
        raise ScenarioError(f"{where}.arrivals: need rate_min_factor <= 1 <= rate_max_factor")
    if a.process == "trace":
        if not a.trace:
            raise ScenarioError(f"{where}.arrivals.trace: required for process: trace; one of "
                                f"{', '.join(TRACES)} or a CSV path")
        if a.mapping == "rates" and any(g.rate is None for g in sc.adapters):
            raise ScenarioError(f"{where}.adapters: every group needs a rate for arrivals.mapping: rates")
    else:
        missing = [i for i, g in enumerate(sc.adapters) if g.rate is None]
        if missing:
            raise ScenarioError(f"{where}.adapters[{missing[0]}].rate: required (> 0 requests/s) "
                                f"for arrivals.process: {a.process}")
    check_choice(ln.source, LENGTH_SOURCES, f"{where}.lengths.source")
    if ln.source == "normal":
        if ln.mean_in is None or ln.mean_out is None:
            raise ScenarioError(f"{where}.lengths: source normal needs mean_in and mean_out")
    for name in ("mean_in", "mean_out"):
        check_positive(getattr(ln, name), f"{where}.lengths.{name}")
    for name in ("std_in", "std_out"):
        check_positive(getattr(ln, name), f"{where}.lengths.{name}", strict=False)
    if ln.source == "trace" and a.process != "trace":
        raise ScenarioError(f"{where}.lengths.source: trace needs arrivals.process: trace")
    check_sizes(sc, where)


def _limit(value: float, limit: float, where: str, what: str) -> None:
    if value > limit:
        shown = f"{value:,.0f}" if value < 1e15 else f"{value:.3g}"
        raise ScenarioError(f"{where}: {what} {shown} exceeds the limit of {limit:,.0f}")


def check_sizes(sc: Scenario, where: str = "scenario") -> None:
    """Refuse a scenario whose arrays would not fit (sizes bounded before allocating): see
    :data:`MAX_ADAPTERS`, :data:`MAX_REQUESTS`, :data:`MAX_TIMESERIES_SAMPLES`, :data:`MAX_WINDOWS`."""
    a, ln, T = sc.arrivals, sc.lengths, sc.duration_s
    if T > MAX_DURATION_S:
        raise ScenarioError(f"{where}.duration_s: {T:g} s exceeds the limit of {MAX_DURATION_S:g} s")
    n_adapters = sum(g.count for g in sc.adapters)
    _limit(n_adapters, MAX_ADAPTERS, f"{where}.adapters", "adapters (counts summed)")
    _limit(T / sc.timeseries_interval_s, MAX_TIMESERIES_SAMPLES, f"{where}.timeseries_interval_s",
           f"time-series samples (duration_s {T:g} / interval {sc.timeseries_interval_s:g})")
    if a.process != "trace":
        peak = a.rate_max_factor if a.process == "nonstationary" else 1.0
        expected = T * peak * sum(g.count * g.rate for g in sc.adapters)
        _limit(expected, MAX_REQUESTS, f"{where}.adapters",
               f"expected requests (duration_s x total rate{' x rate_max_factor' if peak != 1.0 else ''})")
        if a.process == "nonstationary":
            _limit(n_adapters * T / a.window_s, MAX_WINDOWS, f"{where}.arrivals.window_s",
                   "rate windows (adapters x duration_s / window_s)")
    for name in ("mean_in", "mean_out", "std_in", "std_out"):
        v = getattr(ln, name)
        if v is not None and v > MAX_MEAN_TOKENS:
            raise ScenarioError(f"{where}.lengths.{name}: {v:g} tokens exceeds the limit of {MAX_MEAN_TOKENS:,}")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML/JSON file, or a bundled scenario by name (``example``)."""
    path = resolve_bundled("scenario", path, ScenarioError)
    return scenario_from_dict(read_config_file(path, "scenario"), where=path.name)


def replace(sc: Scenario, **changes) -> Scenario:
    """A validated copy with some fields changed (``engine=dict(...)`` merges into the engine)."""
    if isinstance(changes.get("engine"), dict):
        changes["engine"] = dataclasses.replace(sc.engine, **changes["engine"])
    out = dataclasses.replace(sc, **changes)
    validate(out)
    return out


# ---- building scenarios in code --------------------------------------------------------------
def _section(value) -> dict:
    """A scenario section as its YAML mapping: a dataclass (``EngineConfig``, ``GPUConfig`` or any
    ``EngineFlags``, ``ArrivalConfig``, ...) by its fields, a mapping copied."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return dict(value)


def _adapter_entry(group) -> dict:
    if isinstance(group, AdapterGroup):
        return {k: v for k, v in dataclasses.asdict(group).items() if v is not None}
    return dict(group)


def scenario_dict(profile: str, adapters: Iterable[Mapping | AdapterGroup], *, engine=None, arrivals=None,
                  lengths=None, duration_s: float | None = None, rho: float | None = None,
                  seed: int | None = None, early_stop: bool | None = None, client=None) -> dict:
    """A scenario in its YAML form (what :func:`scenario_from_dict` reads; plain data, so it can
    travel to Ray workers and subprocesses), unvalidated.

    ``adapters``: adapter groups, each a mapping ``{count, rank, rate[, id]}`` or an ``AdapterGroup``.
    ``engine``: a mapping of ``EngineConfig`` fields or an engine-flags dataclass (a placement's
    ``GPUConfig``).  ``arrivals`` / ``client``: a mapping or the dataclass.  ``lengths``: a mapping,
    a ``LengthConfig`` or a source name.  A section or field left None is left out, so the
    scenario's default applies (``Scenario`` documents them; rho's is :data:`DEFAULT_RHO`)."""
    out: dict[str, Any] = {"profile": profile, "adapters": [_adapter_entry(g) for g in adapters]}
    sections = {"engine": engine, "arrivals": arrivals, "client": client,
                "lengths": {"source": lengths} if isinstance(lengths, str) else lengths}
    out.update({k: _section(v) for k, v in sections.items() if v is not None})
    scalars = {"duration_s": duration_s, "rho": rho, "seed": seed, "early_stop": early_stop}
    out.update({k: v for k, v in scalars.items() if v is not None})
    return out


def build_scenario(profile: str, adapters: Iterable[Mapping | AdapterGroup], *, engine=None, arrivals=None,
                   lengths=None, duration_s: float | None = None, rho: float | None = None,
                   seed: int | None = None, early_stop: bool | None = None, client=None,
                   where: str = "scenario") -> Scenario:
    """The validated ``Scenario`` of :func:`scenario_dict` (same arguments); errors name ``where``.
    An engine given as flags (``twin.flags.EngineFlags``, e.g. a placement GPU's resolved
    ``GPUConfig``) is taken as it is, not through its YAML form."""
    flags = engine_config(engine) if isinstance(engine, EngineFlags) else None
    d = scenario_dict(profile, adapters, engine=None if flags is not None else engine, arrivals=arrivals,
                      lengths=lengths, duration_s=duration_s, rho=rho, seed=seed, early_stop=early_stop, client=client)
    return scenario_from_dict(d, where, engine=flags)


def engine_config(flags: EngineFlags) -> EngineConfig:
    """A scenario's engine section with these flags (itself when it is one; the adapter cache's
    default policy otherwise)."""
    return flags if isinstance(flags, EngineConfig) else EngineConfig(**flag_values(flags))
