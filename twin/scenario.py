"""The scenario file: the one input of the twin (YAML, JSON accepted).

Every field is a validated dataclass field with a docstring; errors name the field and the
allowed values.  See ``configs/scenarios/example.yaml``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from twin.errors import ScenarioError
from twin.profile import VLLM_LORA_RANKS, Profile, load_profile

ARRIVAL_PROCESSES = ("poisson", "lognormal", "nonstationary", "trace")
LENGTH_SOURCES = ("sharegpt", "sharegpt-8k", "arxiv", "normal", "mean", "trace")
TRACE_MAPPINGS = ("uniform", "powerlaw", "rates")
ADAPTER_CACHE_POLICIES = ("lru", "fifo")


@dataclass(frozen=True)
class EngineConfig:
    """vLLM flags of the instance (same names as ``vllm serve``); None = the profile's default."""

    max_loras: int | None = None
    """``--max-loras``: GPU adapter slots (A_max), >= 1."""
    max_lora_rank: int | None = None
    """``--max-lora-rank``: one of vLLM's allowed values 1 8 16 32 64 128 256 320 512; >= every
    adapter's rank. None = the smallest allowed value that holds every adapter."""
    max_cpu_loras: int | None = None
    """``--max-cpu-loras``: CPU adapter cache, >= max_loras (None = max_loras, as vLLM)."""
    max_num_seqs: int | None = None
    """``--max-num-seqs``: cap on running requests."""
    max_num_batched_tokens: int | None = None
    """``--max-num-batched-tokens``: token budget of one step (chunked prefill)."""
    gpu_memory_utilization: float | None = None
    """``--gpu-memory-utilization``: fraction of device memory vLLM may use, in (0, 1]."""
    max_model_len: int | None = None
    """``--max-model-len``: None = the model's context; start-up needs KV for one such request."""
    adapter_cache_policy: str = "lru"
    """GPU/CPU adapter cache eviction: lru (vLLM) or fifo."""


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
    rho: float = 0.9
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
        """(ids, ranks, rates) of every adapter, groups expanded in order."""
        ids, ranks, rates = [], [], []
        for g in self.adapters:
            for _ in range(g.count):
                ids.append(g.id if g.id is not None else f"a{len(ids)}")
                ranks.append(g.rank)
                rates.append(g.rate)
        return ids, ranks, rates

    def resolved_engine(self, profile: Profile) -> dict[str, Any]:
        """Engine flags with the profile's defaults filled in."""
        e, d = self.engine, profile.defaults
        _, ranks, _ = self.adapter_table()
        max_rank = e.max_lora_rank
        if max_rank is None:
            max_rank = next(r for r in VLLM_LORA_RANKS if r >= max(ranks))
        max_loras = e.max_loras if e.max_loras is not None else d.max_loras
        return dict(
            max_loras=max_loras, max_lora_rank=max_rank,
            max_cpu_loras=e.max_cpu_loras if e.max_cpu_loras is not None else max_loras,
            max_num_seqs=e.max_num_seqs if e.max_num_seqs is not None else d.max_num_seqs,
            max_num_batched_tokens=(e.max_num_batched_tokens if e.max_num_batched_tokens is not None
                                    else d.max_num_batched_tokens),
            gpu_memory_utilization=(e.gpu_memory_utilization if e.gpu_memory_utilization is not None
                                    else d.gpu_memory_utilization),
            max_model_len=e.max_model_len if e.max_model_len is not None else profile.model.max_model_len,
            adapter_cache_policy=e.adapter_cache_policy,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- parsing and validation ------------------------------------------------------------------
def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _check_type(value, typ: str, where: str):
    """Coerce/validate a YAML scalar against the annotation string of a dataclass field."""
    allow_none = "None" in typ
    if value is None:
        if allow_none:
            return None
        raise ScenarioError(f"{where}: required, got null")
    base = typ.replace(" | None", "").strip()
    if base == "int":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ScenarioError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScenarioError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ScenarioError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if base == "bool":
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: expected true or false, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise ScenarioError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _build(cls, data: Any, where: str, **nested):
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: expected a mapping with fields {sorted(_fields(cls))}, got {data!r}")
    fields = _fields(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        if name in nested:
            kwargs[name] = nested[name](value, f"{where}.{name}")
        else:
            kwargs[name] = _check_type(value, str(fields[name].type), f"{where}.{name}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ScenarioError(f"{where}: missing required field(s) {missing}")
    return cls(**kwargs)


def _choice(value, allowed, where):
    if value not in allowed:
        raise ScenarioError(f"{where}: {value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")


def _positive(value, where, strict=True):
    if value is not None and (value <= 0 if strict else value < 0):
        raise ScenarioError(f"{where}: must be {'> 0' if strict else '>= 0'}, got {value}")


def check_rank(rank: int, where: str) -> None:
    """A LoRA rank vLLM can serve: 1..the largest ``--max-lora-rank`` value."""
    if not 1 <= rank <= max(VLLM_LORA_RANKS):
        raise ScenarioError(f"{where}: {rank} outside 1..{max(VLLM_LORA_RANKS)} "
                            f"(vLLM's max_lora_rank values: {list(VLLM_LORA_RANKS)})")


def _parse_adapters(value, where) -> tuple[AdapterGroup, ...]:
    if not isinstance(value, list) or not value:
        raise ScenarioError(f"{where}: at least one adapter group is required "
                            "(a list of {{count, rank, rate}})")
    groups = tuple(_build(AdapterGroup, g, f"{where}[{i}]") for i, g in enumerate(value))
    for i, g in enumerate(groups):
        w = f"{where}[{i}]"
        if g.count < 1:
            raise ScenarioError(f"{w}.count: must be >= 1, got {g.count}")
        check_rank(g.rank, f"{w}.rank")
        if g.rate is not None and g.rate <= 0:
            raise ScenarioError(f"{w}.rate: must be > 0 requests/s, got {g.rate}")
        if g.id is not None and g.count != 1:
            raise ScenarioError(f"{w}.id: a named adapter must have count 1, got count {g.count}")
    return groups


def _parse_lengths(value, where) -> LengthConfig:
    if isinstance(value, str):
        value = {"source": value}
    if isinstance(value, dict) and "source" not in value and ("mean_in" in value or "mean_out" in value):
        value = {"source": "normal", **value}
    return _build(LengthConfig, value, where)


def scenario_from_dict(data: Any, where: str = "scenario") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: expected a mapping at the top level")
    sc = _build(Scenario, data, where,
                adapters=_parse_adapters,
                engine=lambda v, w: _build(EngineConfig, v, w),
                arrivals=lambda v, w: _build(ArrivalConfig, v, w),
                client=lambda v, w: _build(ClientConfig, v, w),
                lengths=_parse_lengths)
    validate(sc, where)
    return sc


def validate(sc: Scenario, where: str = "scenario") -> None:
    """Cross-field checks; raises ScenarioError naming the field."""
    e, a, ln = sc.engine, sc.arrivals, sc.lengths
    if not isinstance(sc.adapters, tuple) or not sc.adapters:
        raise ScenarioError(f"{where}.adapters: at least one adapter group is required")
    _positive(sc.duration_s, f"{where}.duration_s")
    _positive(sc.timeseries_interval_s, f"{where}.timeseries_interval_s")
    if not 0 < sc.rho <= 1:
        raise ScenarioError(f"{where}.rho: must be in (0, 1], got {sc.rho}")
    if sc.client.max_inflight is not None and sc.client.max_inflight < 1:
        raise ScenarioError(f"{where}.client.max_inflight: must be >= 1 (or null), got {sc.client.max_inflight}")
    _choice(sc.client.overflow, OVERFLOW_POLICIES, f"{where}.client.overflow")
    if sc.seed < 0:
        raise ScenarioError(f"{where}.seed: must be >= 0, got {sc.seed}")
    if e.max_lora_rank is not None:
        _choice(e.max_lora_rank, VLLM_LORA_RANKS, f"{where}.engine.max_lora_rank")
        too_big = [g.rank for g in sc.adapters if g.rank > e.max_lora_rank]
        if too_big:
            raise ScenarioError(f"{where}.engine.max_lora_rank: {e.max_lora_rank} is below adapter rank "
                                f"{max(too_big)} (vLLM rejects such adapters)")
    for name in ("max_loras", "max_num_seqs", "max_num_batched_tokens", "max_cpu_loras", "max_model_len"):
        v = getattr(e, name)
        if v is not None and v < 1:
            raise ScenarioError(f"{where}.engine.{name}: must be >= 1, got {v}")
    if e.max_cpu_loras is not None and e.max_loras is not None and e.max_cpu_loras < e.max_loras:
        raise ScenarioError(f"{where}.engine.max_cpu_loras: {e.max_cpu_loras} must be >= max_loras "
                            f"{e.max_loras} (vLLM: 'max_cpu_loras must be >= max_loras')")
    if e.gpu_memory_utilization is not None and not 0 < e.gpu_memory_utilization <= 1:
        raise ScenarioError(f"{where}.engine.gpu_memory_utilization: must be in (0, 1], "
                            f"got {e.gpu_memory_utilization}")
    _choice(e.adapter_cache_policy, ADAPTER_CACHE_POLICIES, f"{where}.engine.adapter_cache_policy")
    _choice(a.process, ARRIVAL_PROCESSES, f"{where}.arrivals.process")
    _choice(a.mapping, TRACE_MAPPINGS, f"{where}.arrivals.mapping")
    for name in ("cv", "window_s", "alpha", "time_scale", "rate_min_factor", "rate_max_factor"):
        _positive(getattr(a, name), f"{where}.arrivals.{name}")
    _positive(a.start_s, f"{where}.arrivals.start_s", strict=False)
    if a.rate_min_factor > 1 or a.rate_max_factor < 1:
        raise ScenarioError(f"{where}.arrivals: need rate_min_factor <= 1 <= rate_max_factor")
    if a.process == "trace":
        if not a.trace:
            from twin.workload import TRACES
            raise ScenarioError(f"{where}.arrivals.trace: required for process: trace; one of "
                                f"{', '.join(TRACES)} or a CSV path")
        if a.mapping == "rates" and any(g.rate is None for g in sc.adapters):
            raise ScenarioError(f"{where}.adapters: every group needs a rate for arrivals.mapping: rates")
    else:
        missing = [i for i, g in enumerate(sc.adapters) if g.rate is None]
        if missing:
            raise ScenarioError(f"{where}.adapters[{missing[0]}].rate: required (> 0 requests/s) "
                                f"for arrivals.process: {a.process}")
    _choice(ln.source, LENGTH_SOURCES, f"{where}.lengths.source")
    if ln.source == "normal":
        if ln.mean_in is None or ln.mean_out is None:
            raise ScenarioError(f"{where}.lengths: source normal needs mean_in and mean_out")
    for name in ("mean_in", "mean_out"):
        _positive(getattr(ln, name), f"{where}.lengths.{name}")
    for name in ("std_in", "std_out"):
        _positive(getattr(ln, name), f"{where}.lengths.{name}", strict=False)
    if ln.source == "trace" and a.process != "trace":
        raise ScenarioError(f"{where}.lengths.source: trace needs arrivals.process: trace")


def read_config_file(path: str | Path, what: str = "scenario"):
    """The parsed content of a YAML (or .json) file; ScenarioError if missing or malformed."""
    p = Path(path)
    if not p.exists():
        raise ScenarioError(f"{what} file not found: {p}")
    text = p.read_text()
    try:
        return json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML/JSON file."""
    return scenario_from_dict(read_config_file(path, "scenario"), where=str(Path(path).name))


def replace(sc: Scenario, **changes) -> Scenario:
    """A validated copy with some fields changed (``engine=dict(...)`` merges into the engine)."""
    if isinstance(changes.get("engine"), dict):
        changes["engine"] = dataclasses.replace(sc.engine, **changes["engine"])
    out = dataclasses.replace(sc, **changes)
    validate(out)
    return out
