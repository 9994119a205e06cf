"""Workload files: the adapters to place (id, rank, expected rate, optional path), the engine
flags every vLLM instance shares, and how ``lora-opt evaluate`` replays traffic on the twin.

    profile: llama-3.1-8b-h100-64gb
    rho: 0.9
    adapters:
      - {id: support-bot, rank: 16, rate: 0.2, path: /models/support-bot}
      - {count: 600, rank: 8, rate: 0.004, prefix: t8-}      # ids t8-0 .. t8-599
    engine: {max_num_seqs: 2048, max_num_batched_tokens: 2048, gpu_memory_utilization: 0.9}
    evaluation: {arrivals: {process: poisson}, lengths: sharegpt, duration_s: 3600, seed: 0}

Errors name the field and the allowed values, like scenario files; everything wrong in a workload
file or a request log is an ``InputError`` (``lora_opt.errors``), including what the twin finds wrong
in its profile or evaluation traffic.
"""
from __future__ import annotations

import dataclasses
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lora_opt.errors import InputError
from lora_opt.placement.plan import Adapter
from twin.errors import ScenarioError
from twin.flags import PER_INSTANCE_FLAGS, EngineFlags, check_rank, resolve_flags, shared_flags
from twin.parsing import (build_dataclass, check_adapter_id, check_adapter_path, check_finite, check_type,
                          read_config_file)
from twin.paths import resolve_bundled
from twin.profile import Profile, load_profile
from twin.scenario import (DEFAULT_RHO, MAX_ADAPTERS, MAX_DURATION_S, MAX_REQUESTS, ArrivalConfig, LengthConfig,
                           parse_lengths, scenario_dict, scenario_from_dict)
from twin.workload import Requests


@dataclass(frozen=True)
class PlacementEngine(EngineFlags):
    """Flags every instance of a placement shares: ``twin.flags.EngineFlags`` (what each flag means
    and allows is documented there) less ``twin.flags.PER_INSTANCE_FLAGS`` -- ``max_loras``,
    ``max_lora_rank`` and ``max_cpu_loras`` are chosen per GPU, and a workload setting one is
    refused.  The defaults are those the bundled surrogates were trained with; a flag left null
    takes the profile's default (``twin.flags.resolve_flags``)."""

    #: keys of ``EngineFlags`` a workload file may not set (the reference leaves them out)
    REFUSED_KEYS: ClassVar[tuple[str, ...]] = PER_INSTANCE_FLAGS

    max_num_seqs: int = 2048
    """``--max-num-seqs`` (pinned: vLLM's default depends on the GPU)."""
    max_num_batched_tokens: int = 2048
    """``--max-num-batched-tokens`` (chunked-prefill token budget per step)."""
    gpu_memory_utilization: float = 0.9
    """``--gpu-memory-utilization`` in (0, 1]."""


@dataclass(frozen=True)
class EvaluationConfig:
    """How ``lora-opt evaluate`` generates the traffic it replays (same fields as a scenario's)."""

    arrivals: ArrivalConfig = ArrivalConfig()
    """poisson at each adapter's rate (default), lognormal, nonstationary, or a trace."""
    lengths: LengthConfig = LengthConfig()
    """Request lengths; default the ShareGPT model the surrogates were trained on."""
    duration_s: float = 3600.0
    """Replayed seconds (> 0)."""
    seed: int = 0
    """Seed of arrivals, lengths, the trace mapping and fractional routing draws."""


@dataclass(frozen=True)
class Workload:
    """Adapters to place, shared engine flags, starvation threshold, evaluation traffic."""

    profile: str
    """A bundled profile name or a path to a profile YAML (hardware + model + vLLM version)."""
    adapters: tuple[Adapter, ...]
    """Every adapter, groups expanded; ids unique."""
    rho: float = DEFAULT_RHO
    """Starvation threshold: a GPU starves when throughput < rho x incoming token rate; in (0, 1]."""
    engine: PlacementEngine = PlacementEngine()
    evaluation: EvaluationConfig = EvaluationConfig()
    name: str = ""
    """Label for reports (default: the file name)."""
    meta: dict = field(default_factory=dict)
    """Free-form provenance (e.g. how rates were estimated); copied into placement.json."""

    @property
    def total_rate(self) -> float:
        return sum(a.rate for a in self.adapters)

    def resolved_engine(self, profile: Profile) -> PlacementEngine:
        """The shared flags with every unset one resolved from the profile's defaults and its vLLM
        release's rules (``twin.flags.resolve_flags``; ``max_model_len`` null: the model's context), as
        each GPU's are (``policies.base.gpu_config``); the per-GPU flags stay unset."""
        return resolve_flags(self.engine, {k: v for k, v in profile.flag_defaults().items()
                                           if k not in PlacementEngine.REFUSED_KEYS}, profile.flag_rules())

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["engine"] = shared_flags(self.engine)      # the keys a workload file may set
        d["adapters"] = [{k: v for k, v in a.items() if v is not None} for a in d["adapters"]]
        return d


_ADAPTER_KEYS = {"id", "rank", "rate", "path"}
#: the largest expected rate of one adapter (requests/s)
MAX_RATE = 1e6
_GROUP_KEYS = {"count", "rank", "rate", "prefix", "path_template"}


def _path_template(tmpl: str, where: str) -> str:
    """A group's ``path_template``: ``{id}`` is the only field (``{x}``, ``{0}``, ``{id!r}``, a lone
    brace are errors), and the path it gives is a safe adapter path."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(tmpl) if name is not None]
    except ValueError as exc:
        raise InputError(f"{where}: {tmpl!r:.80} is not a valid template ({exc}); use {{id}} for the adapter id "
                         "and {{{{ }}}} for literal braces") from None
    bad = [n for n, spec, conv in fields if n != "id" or spec or conv]
    if bad or not fields:
        raise InputError(f"{where}: must contain '{{id}}' and no other field, got {tmpl!r:.80}")
    return tmpl


def _parse_adapter_entry(i: int, entry: Any, where: str, budget: int) -> list[Adapter]:
    w = f"{where}[{i}]"
    if not isinstance(entry, dict):
        raise InputError(f"{w}: expected a mapping {{id, rank, rate[, path]}} or a group "
                         f"{{count, rank, rate[, prefix, path_template]}}, got {entry!r:.80}")
    group = "count" in entry
    allowed = _GROUP_KEYS if group else _ADAPTER_KEYS
    unknown = sorted(map(str, set(entry) - allowed))
    if unknown:
        raise InputError(f"{w}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    for req in ("rank", "rate") + (("count",) if group else ("id",)):
        if req not in entry:
            raise InputError(f"{w}.{req}: required")
    rank = check_type(entry["rank"], "int", f"{w}.rank", InputError)
    check_rank(rank, f"{w}.rank", InputError)
    rate = check_type(entry["rate"], "float", f"{w}.rate", InputError)
    check_finite(rate, f"{w}.rate", 0.0, MAX_RATE, InputError)
    if not group:
        aid = check_adapter_id(check_type(entry["id"], "str", f"{w}.id", InputError), f"{w}.id", InputError)
        path = check_type(entry.get("path"), "str | None", f"{w}.path", InputError)
        if path is not None:
            check_adapter_path(path, f"{w}.path", InputError)
        return [Adapter(aid, rank, rate, path)]
    count = check_type(entry["count"], "int", f"{w}.count", InputError)
    if count < 1:
        raise InputError(f"{w}.count: must be >= 1, got {count}")
    if count > budget:
        raise InputError(f"{w}.count: {count:,} adapters exceed the limit of {MAX_ADAPTERS:,} adapters in a "
                         "workload (groups summed)")
    prefix = check_type(entry.get("prefix", f"g{i}-"), "str", f"{w}.prefix", InputError)
    check_adapter_id(f"{prefix}0", f"{w}.prefix", InputError)    # the ids are prefix + a number
    tmpl = check_type(entry.get("path_template"), "str | None", f"{w}.path_template", InputError)
    if tmpl is not None:
        check_adapter_path(_path_template(tmpl, f"{w}.path_template").format(id=f"{prefix}0"),
                           f"{w}.path_template", InputError)
    return [Adapter(f"{prefix}{k}", rank, rate, tmpl.format(id=f"{prefix}{k}") if tmpl else None)
            for k in range(count)]


def _parse_evaluation(value: Any, where: str) -> EvaluationConfig:
    ev = build_dataclass(EvaluationConfig, value, where, InputError,
                         arrivals=lambda v, w: build_dataclass(ArrivalConfig, v, w, InputError),
                         lengths=lambda v, w: parse_lengths(v, w, InputError))
    if not 0 < ev.duration_s <= MAX_DURATION_S:
        raise InputError(f"{where}.duration_s: must be in (0, {MAX_DURATION_S:g}] s, got {ev.duration_s:g}")
    if ev.seed < 0:
        raise InputError(f"{where}.seed: must be >= 0, got {ev.seed}")
    return ev


def workload_from_dict(data: Any, where: str = "workload") -> Workload:
    """A validated ``Workload`` from its YAML form; InputError names the field."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a mapping at the top level")
    allowed = {"profile", "adapters", "rho", "engine", "evaluation", "name", "meta"}
    unknown = sorted(map(str, set(data) - allowed))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    if "profile" not in data:
        raise InputError(f"{where}.profile: required (a bundled profile name or a profile YAML path)")
    profile = check_type(data["profile"], "str", f"{where}.profile", InputError)
    entries = data.get("adapters")
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{where}.adapters: at least one adapter or group is required")
    if len(entries) > MAX_ADAPTERS:
        raise InputError(f"{where}.adapters: {len(entries):,} entries exceed the limit of {MAX_ADAPTERS:,}")
    adapters: list[Adapter] = []
    for i, e in enumerate(entries):
        adapters += _parse_adapter_entry(i, e, f"{where}.adapters", MAX_ADAPTERS - len(adapters))
    seen: set[str] = set()
    for a in adapters:
        if a.id in seen:
            raise InputError(f"{where}.adapters: duplicate adapter id {a.id!r}")
        seen.add(a.id)
    rho = check_type(data.get("rho", DEFAULT_RHO), "float", f"{where}.rho", InputError)
    if not 0 < rho <= 1:
        raise InputError(f"{where}.rho: must be in (0, 1], got {rho}")
    engine = build_dataclass(PlacementEngine, data.get("engine") or {}, f"{where}.engine", InputError)
    per_instance = [k for k in PlacementEngine.REFUSED_KEYS if getattr(engine, k) is not None]
    if per_instance:
        raise InputError(f"{where}.engine.{per_instance[0]}: chosen for each GPU by the placement policy, not "
                         f"set by a workload (the shared flags: {', '.join(shared_flags(engine))})")
    engine.validate(f"{where}.engine", InputError)
    ev = _parse_evaluation(data.get("evaluation") or {}, f"{where}.evaluation")
    expected = ev.duration_s * sum(a.rate for a in adapters)
    if expected > MAX_REQUESTS:
        raise InputError(f"{where}.evaluation.duration_s: expected requests {expected:,.4g} (duration_s "
                         f"{ev.duration_s:g} x total rate) exceed the limit of {MAX_REQUESTS:,}")
    meta = data.get("meta") or {}
    if not isinstance(meta, dict):
        raise InputError(f"{where}.meta: expected a mapping")
    try:                       # free-form, but copied into placement.json: plain finite JSON data only
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}.meta: must be plain JSON data (strings, finite numbers, lists, mappings): "
                         f"{exc}") from None
    name = check_type(data.get("name", ""), "str", f"{where}.name", InputError)
    if name and (check_adapter_id(name, f"{where}.name", InputError) and ("/" in name or "\\" in name)):
        raise InputError(f"{where}.name: {name!r:.80} must not contain '/' (it names output directories)")
    wl = Workload(profile=profile, adapters=tuple(adapters), rho=rho, engine=engine, evaluation=ev,
                  name=name, meta=meta)
    # the profile must exist and the evaluation traffic must make a valid scenario: the twin's
    # verdicts, reported as the workload file's fault
    try:
        load_profile(profile)
        scenario_from_dict(evaluation_scenario(wl, wl.adapters[:1]), where)
    except ScenarioError as exc:
        raise InputError(str(exc)) from None
    return wl


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML/JSON file, or a bundled workload by name (``example``);
    its name defaults to the file's stem."""
    p = resolve_bundled("workload", path, InputError)
    wl = workload_from_dict(read_config_file(p, "workload", InputError), where=p.name)
    if not wl.name:
        wl = dataclasses.replace(wl, name=p.stem)
    return wl


#: scenario rates must be > 0; an adapter expected to be idle gets this (no requests in practice)
IDLE_RATE = 1e-12


def scenario_adapters(adapters, rate_scale: float = 1.0) -> list[dict]:
    """Adapters (anything with ``id``, ``rank``, ``rate``: a workload's or a placement's) as a
    scenario's adapter groups, one a group so each keeps its id; rates times ``rate_scale``, at
    least ``IDLE_RATE``.  The one conversion (evaluation and greedy-plus verification build their
    scenarios from it; ``tests/test_one_owner.py`` finds a second copy)."""
    return [{"count": 1, "rank": a.rank, "rate": max(a.rate * rate_scale, IDLE_RATE), "id": a.id}
            for a in adapters]


def evaluation_scenario(wl: Workload, adapters, engine=None, duration_s: float | None = None) -> dict:
    """Scenario dict serving ``adapters`` with the workload's evaluation traffic (one adapter a
    group, so each keeps its id).  ``engine``: a mapping of engine flags or a ``GPUConfig``;
    ``duration_s``: default the evaluation's."""
    ev = wl.evaluation
    return scenario_dict(
        wl.profile, scenario_adapters(adapters),
        engine=engine or {}, arrivals=ev.arrivals, lengths=ev.lengths,
        duration_s=ev.duration_s if duration_s is None else duration_s, rho=wl.rho, seed=ev.seed)


def _rates_from_requests(wl: Workload, adapter, span: float) -> tuple[Adapter, ...]:
    """The workload's adapters with rate = their requests in ``adapter`` (indices) / ``span`` s."""
    counts = np.bincount(adapter, minlength=len(wl.adapters))
    return tuple(dataclasses.replace(a, rate=float(c) / span) for a, c in zip(wl.adapters, counts))


def load_request_log(wl: Workload, path: str | Path):
    """A log of served requests -> (workload with each adapter's rate = its requests / the log's
    span, the log as ``Requests`` in workload adapter order, the span in s).

    CSV columns: ``timestamp_s`` (seconds, any origin) or ``timestamp`` (date-time), ``adapter``
    (an id of the workload), ``input_tokens``, ``output_tokens``.  greedy-plus verifies GPUs on
    these requests (bursts included) instead of Poisson traffic."""
    import pandas as pd  # heavy optional dependency: only reading a request log needs it

    p = Path(path)
    if not p.exists():
        raise InputError(f"request log not found: {p}")
    if not p.is_file():
        raise InputError(f"request log {p}: not a file")
    try:
        df = pd.read_csv(p, dtype={"adapter": str}, keep_default_na=False, nrows=MAX_LOG_REQUESTS + 1,
                         encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise InputError(f"request log {p}: cannot be read as CSV: {str(exc)[:200]}") from None
    if len(df) > MAX_LOG_REQUESTS:
        raise InputError(f"request log {p}: more than {MAX_LOG_REQUESTS:,} requests (the limit)")
    tcol = "timestamp_s" if "timestamp_s" in df.columns else ("timestamp" if "timestamp" in df.columns else None)
    missing = [c for c in ("adapter", "input_tokens", "output_tokens") if c not in df.columns]
    if tcol is None or missing:
        raise InputError(f"request log {p}: needs columns timestamp_s (or timestamp), adapter, input_tokens, "
                         f"output_tokens; missing {missing + ([] if tcol else ['timestamp_s'])}")
    if len(df) == 0:
        raise InputError(f"request log {p}: no requests")
    t = _log_times(df[tcol], tcol, p)
    index = {a.id: k for k, a in enumerate(wl.adapters)}
    ids = df["adapter"].astype(str)
    unknown = sorted(set(ids) - set(index))
    if unknown:
        raise InputError(f"request log {p}: adapter(s) not in the workload: {', '.join(repr(u)[1:-1][:60] for u in unknown[:5])}"
                         f"{' ...' if len(unknown) > 5 else ''}")
    max_len = wl.resolved_engine(load_profile(wl.profile)).max_model_len
    ins, outs = (_log_tokens(df[c], c, p, max_len) for c in ("input_tokens", "output_tokens"))
    span = float(t.max()) if t.max() > 0 else 1.0
    adapter = ids.map(index).to_numpy(np.int64)
    order = np.argsort(t, kind="stable")
    adapters = _rates_from_requests(wl, adapter, span)
    req = Requests(arrival=np.ascontiguousarray(t[order]), adapter=adapter[order].astype(np.int32),
                   in_len=ins[order].astype(np.int32), out_len=outs[order].astype(np.int32))
    meta = {**wl.meta, "rates_from_log": str(p), "log_requests": int(len(df)), "log_span_s": span}
    return dataclasses.replace(wl, adapters=adapters, meta=meta), req, span


#: the most requests a request log may hold (~1 GB read), and the longest span it may cover (s, ~3.2 years)
MAX_LOG_REQUESTS = 10_000_000
MAX_LOG_SPAN_S = 1e8


def _log_times(col, tcol: str, p: Path) -> np.ndarray:
    """Seconds from the log's first request; every value finite, the span bounded."""
    import pandas as pd  # heavy optional dependency: only reading a request log needs it

    if tcol == "timestamp":
        t = pd.to_datetime(col, errors="coerce", utc=True)
    else:
        t = pd.to_numeric(col, errors="coerce")
        t = t.where(np.isfinite(t.to_numpy(float, na_value=np.nan)))
    if t.isna().any():
        row = int(np.flatnonzero(t.isna().to_numpy())[0])
        raise InputError(f"request log {p} line {row + 2}: bad {tcol} value {str(col.iloc[row])[:60]!r} "
                         f"({'a date-time' if tcol == 'timestamp' else 'a finite number of seconds'} expected)")
    t = ((t - t.min()).dt.total_seconds() if tcol == "timestamp" else t - t.min()).to_numpy(float)
    if not np.isfinite(t).all() or t.max() > MAX_LOG_SPAN_S:
        row = int(np.argmax(np.where(np.isfinite(t), t, np.inf)))
        raise InputError(f"request log {p} line {row + 2}: {tcol} spans {t.max():g} s from the first request; "
                         f"at most {MAX_LOG_SPAN_S:g} s")
    return t


def _log_tokens(col, name: str, p: Path, max_len: int) -> np.ndarray:
    """A token column as int64: whole numbers in 1..max_model_len (no 32-bit wrap-around)."""
    import pandas as pd  # heavy optional dependency: only reading a request log needs it

    x = pd.to_numeric(col, errors="coerce").to_numpy(float, na_value=np.nan)
    bad = ~np.isfinite(x) | (x < 1) | (x > max_len) | (x != np.floor(x))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InputError(f"request log {p} line {row + 2}: {name} must be an integer in 1..{max_len:,} "
                         f"(max_model_len), got {str(col.iloc[row])[:40]!r}")
    return x.astype(np.int64)


def split_request_log(wl: Workload, req, span: float):
    """(workload with rates from the first half of the log, first-half requests, second-half
    requests shifted to start at 0, the split time): estimate on one half, judge on the other."""
    half = span / 2.0
    first = req.arrival < half
    adapters = _rates_from_requests(wl, req.adapter[first], half)
    pick = (lambda m, shift: Requests(arrival=np.ascontiguousarray(req.arrival[m] - shift), adapter=req.adapter[m],
                                      in_len=req.in_len[m], out_len=req.out_len[m]))
    return dataclasses.replace(wl, adapters=adapters), pick(first, 0.0), pick(~first, half), half
