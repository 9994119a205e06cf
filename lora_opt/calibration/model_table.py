"""The (model, GPU, vLLM version) setups calibration knows: ``configs/models.yaml``, validated.

One entry per model column value of the real-run CSV: its dimensions, the vLLM version and engine
generation it ran on, the GPU, the engine's defaults and what the fits need beyond the data.
Adding a setup of a known engine generation (:data:`ENGINE_GENERATIONS`) is a YAML entry plus its
runs in the CSV; ``lora_opt.calibration.generations`` holds the fitting code of each generation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_opt.errors import InputError
from twin.errors import ScenarioError
from twin.parsing import read_config_file
from twin.paths import BUNDLE_ROOT, MODEL_TABLE_PATH
from twin.profile import LORA_RANK_RULES, LORA_SET_RULES, EngineDefaults, ModelSpec


#: engine generations with fitting code: ``v0`` = the vLLM 0.5.0 fork (no chunked prefill),
#: ``v1`` = vLLM 0.8.5's V1 engine (chunked prefill)
ENGINE_GENERATIONS = ("v0", "v1")
#: what a profile's estimators are fitted on (``ModelEntry.fitted_from``)
FITTED_FROM = ("real_runs", "probe")
#: how LoRA's cost enters a step (``ModelEntry.lora_cost``)
LORA_COSTS = ("factor", "per_token", "additive")
#: the end-to-end constants ``lora-opt calibrate-e2e`` can fit (``ModelEntry.e2e_fit``)
E2E_FITTED = ("slot_share", "prefill_share", "frontend")


@dataclass(frozen=True)
class GpuEntry:
    """One GPU the real runs were measured on."""

    key: str
    """Key under ``gpus:`` (models name their GPU by it)."""
    name: str
    """Name in reports, e.g. ``H100``."""
    memory_gib: float
    """Device memory the GPU reports to vLLM (GiB): the profiles' ``memory.gpu_memory_gib``."""
    kernel_profile_file: Path | None = None
    """vidur kernel profile (CSV, relative to the repository) of one model on this GPU: the per-token
    prefill cost where no real run identifies it, a cross-check elsewhere.  None: not measured."""
    kernel_profile_model: str | None = None
    """The model (a key under ``models:``) that kernel profile times."""
    kv_cache_gib: float = 0.0
    """A KV cache of this fixed size (GiB) whatever the model leaves (vLLM's CPU build: the
    ``VLLM_CPU_KVCACHE_SPACE`` the runs were made with): the profiles' ``memory.kv_cache_gib``.
    0 = a GPU: the KV cache is what ``memory_gib`` x utilisation leaves after weights and slots."""


@dataclass(frozen=True)
class CpuToGpuSource:
    """Where a setup whose runs cannot time CPU->GPU adapter loads takes that table from."""

    model: str
    """The model (a key under ``models:``) whose fitted CPU->GPU table is used."""
    reason: str
    """Why that table applies (recorded in the profile's ``fit`` section)."""


@dataclass(frozen=True)
class ModelEntry:
    """What calibration needs to know about one (model, GPU, vLLM version) beyond the data."""

    csv_name: str
    """Value of the CSV's ``model`` column (the key under ``models:``, ``lora-opt calibrate --model``)."""
    profile_name: str
    """Name of the fitted profile (``configs/profiles/<profile_name>.yaml``)."""
    gpu: GpuEntry
    """The GPU the runs were measured on."""
    vllm_version: str
    """vLLM version of the runs."""
    engine: str
    """Engine generation (one of :data:`ENGINE_GENERATIONS`): selects the fitting code."""
    spec: ModelSpec
    """Model dimensions, as in its ``config.json``."""
    qkv_bias: bool
    """Whether attention has q/k/v biases (Qwen2; weights count only)."""
    tied_embeddings: bool
    """Whether ``lm_head`` shares the embedding matrix (weights count only)."""
    lora_set_rule: str
    """The scheduler's LoRA set (``twin.profile.LORA_SET_RULES``)."""
    reserve_full_prompt: bool
    """Whether the engine allocates a prompt's whole KV at admission (no chunked prefill)."""
    defaults: EngineDefaults
    """The engine's defaults for this version and GPU."""
    memory_max_num_seqs: int
    """``max_num_seqs`` of the memory family: the profile's overhead is valid there."""
    e2e_fit_half: str | None = None
    """Substring of the experiment names of the end-to-end runs ``lora-opt calibrate-e2e`` fits on
    (the fit half); the other runs are the report half.  None: no end-to-end runs."""
    fitted_from: str = "real_runs"
    """What its profile's estimators are fitted on: ``real_runs`` (the real-run CSV's estimator families:
    ``lora-opt calibrate --runs CSV --model KEY``) or ``probe`` (``lora-opt probe`` rows only: ``lora-opt
    calibrate --runs PROBE/rows.csv --model KEY``)."""
    e2e_fit: tuple[str, ...] = ("slot_share", "prefill_share", "frontend")
    """What ``lora-opt calibrate-e2e`` fits on the fit half (of :data:`E2E_FITTED`); the others keep the
    profile's values (e.g. LoRA shares a probe measured per rank)."""
    lora_cost: str = "factor"
    """How a probe fit prices LoRA (of :data:`LORA_COSTS`): ``factor`` (the papers' form, a GPU's: a step
    with adapters costs ``1 + jump`` times its decode part, prefill tokens ``1 + prefill_share * jump``) or
    ``per_token`` (vLLM's CPU build: every token of a step with an adapter pays ``token_ms`` of its rank,
    dearer for each token beyond a knee in tokens x rank; ``jump`` and ``prefill_share`` 0): the per-token adapter
    gather makes a small batch's LoRA cost small, which a factor fitted at 16 sequences prices ~4x high) or
    ``additive`` (``lora-opt calibrate-e2e`` fits ms per step, slot, distinct adapter and token on the end-to-end
    fit half, no factor: ``lora_opt.calibration.additive_fit``; the estimators' factor stays in the profile's
    fit record)."""
    lora_rank_rule: str = "nearest"
    """How the profile prices a ``max_lora_rank`` it has no LoRA entry for (``twin.profile.LORA_RANK_RULES``:
    ``nearest`` or ``linear`` in the rank through the two nearest fitted ranks); written into the profile by
    ``lora-opt calibrate``.  Chosen by the report half where the fitted ranks do not cover it (issue 36)."""
    cpu_to_gpu_ms_from: CpuToGpuSource | None = None
    """Where the CPU->GPU load table comes from when the runs log no usable activation time."""
    notes: tuple[str, ...] = ()
    """Notes copied into the profile's ``fit`` section."""


def _fields(cls) -> tuple[set[str], set[str]]:
    """(all field names, required field names) of a dataclass."""
    fields = dataclasses.fields(cls)
    return ({f.name for f in fields},
            {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})


def _checked(raw: Any, cls, where: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``raw`` as a mapping with only ``cls``'s fields and all its required ones (``skip``: set by the loader)."""
    if not isinstance(raw, dict):
        raise InputError(f"{where}: expected a mapping, got {type(raw).__name__}")
    names, required = _fields(cls)
    names, required = names - set(skip), required - set(skip)
    unknown = sorted(set(raw) - names)
    missing = sorted(required - set(raw))
    if unknown or missing:
        raise InputError(f"{where}: " + "; ".join(
            ([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing field(s) {missing}"] if missing else []))
            + f"; allowed fields: {sorted(names)}")
    return dict(raw)


def _gpu(key: str, raw: Any, where: str) -> GpuEntry:
    d = _checked(raw, GpuEntry, where, skip=("key",))
    if (d.get("kernel_profile_file") is None) != (d.get("kernel_profile_model") is None):
        raise InputError(f"{where}: kernel_profile_file and kernel_profile_model go together")
    if d.get("kernel_profile_file") is not None:
        d["kernel_profile_file"] = BUNDLE_ROOT / d["kernel_profile_file"]
    if not isinstance(d["memory_gib"], (int, float)) or d["memory_gib"] <= 0:
        raise InputError(f"{where}.memory_gib: expected a positive number of GiB, got {d['memory_gib']!r}")
    if not isinstance(d.get("kv_cache_gib", 0.0), (int, float)) or d.get("kv_cache_gib", 0.0) < 0:
        raise InputError(f"{where}.kv_cache_gib: expected a number of GiB >= 0 (0 = sized from memory), "
                         f"got {d['kv_cache_gib']!r}")
    return GpuEntry(key=key, **d)


def _model(key: str, raw: Any, gpus: dict[str, GpuEntry], where: str) -> ModelEntry:
    d = _checked(raw, ModelEntry, where, skip=("csv_name",))
    if d["gpu"] not in gpus:
        raise InputError(f"{where}.gpu: unknown GPU {d['gpu']!r}; allowed: {sorted(gpus)}")
    if d["engine"] not in ENGINE_GENERATIONS:
        raise InputError(f"{where}.engine: unknown engine generation {d['engine']!r}; allowed: "
                         f"{list(ENGINE_GENERATIONS)}")
    if d["lora_set_rule"] not in LORA_SET_RULES:
        raise InputError(f"{where}.lora_set_rule: {d['lora_set_rule']!r}; allowed: {list(LORA_SET_RULES)}")
    d["gpu"] = gpus[d["gpu"]]
    d["vllm_version"] = str(d["vllm_version"])
    d["spec"] = ModelSpec(**_checked(d["spec"], ModelSpec, f"{where}.spec"))
    d["defaults"] = EngineDefaults(**_checked(d["defaults"], EngineDefaults, f"{where}.defaults"))
    if d.get("cpu_to_gpu_ms_from") is not None:
        d["cpu_to_gpu_ms_from"] = CpuToGpuSource(
            **_checked(d["cpu_to_gpu_ms_from"], CpuToGpuSource, f"{where}.cpu_to_gpu_ms_from"))
    d["notes"] = tuple(str(n) for n in d.get("notes") or ())
    if d.get("fitted_from", "real_runs") not in FITTED_FROM:
        raise InputError(f"{where}.fitted_from: {d['fitted_from']!r}; allowed: {list(FITTED_FROM)}")
    if d.get("lora_cost", "factor") not in LORA_COSTS:
        raise InputError(f"{where}.lora_cost: {d['lora_cost']!r}; allowed: {list(LORA_COSTS)}")
    if d.get("lora_rank_rule", "nearest") not in LORA_RANK_RULES:
        raise InputError(f"{where}.lora_rank_rule: {d['lora_rank_rule']!r}; allowed: {list(LORA_RANK_RULES)}")
    if "e2e_fit" in d:
        fitted = d["e2e_fit"]
        if not isinstance(fitted, list) or not set(fitted) <= set(E2E_FITTED):
            raise InputError(f"{where}.e2e_fit: expected a list of {list(E2E_FITTED)}, got {fitted!r}")
        d["e2e_fit"] = tuple(fitted)
    return ModelEntry(csv_name=key, **d)


def _check_references(models: dict[str, ModelEntry], path: Path) -> None:
    """Cross-entry rules: referenced models exist; a v0 setup has what its fits cannot get from its runs."""
    for key, m in models.items():
        where = f"{path}: models.{key}"
        src = m.cpu_to_gpu_ms_from
        if src is not None and src.model not in models:
            raise InputError(f"{where}.cpu_to_gpu_ms_from.model: unknown model {src.model!r}; allowed: {sorted(models)}")
        if src is not None and models[src.model].engine != "v1":
            # the table is that model's predictor_loading fit, which only V1 runs have
            raise InputError(f"{where}.cpu_to_gpu_ms_from.model: {src.model!r} must be an engine v1 model")
        ref = m.gpu.kernel_profile_model
        if ref is not None and ref not in models:
            raise InputError(f"{path}: gpus.{m.gpu.key}.kernel_profile_model: unknown model {ref!r}")
        if m.engine == "v0":
            # V0 logs CPU->GPU activations as 0.0 s and has no run that identifies the prefill cost
            if src is None:
                raise InputError(f"{where}: engine v0 needs cpu_to_gpu_ms_from (its runs log no activation time)")
            if ref is None:
                raise InputError(f"{where}: engine v0 needs a kernel profile of GPU {m.gpu.key!r} "
                                 "(kernel_profile_file / kernel_profile_model: its prefill cost)")


def load_model_table(path: str | Path = MODEL_TABLE_PATH) -> tuple[dict[str, GpuEntry], dict[str, ModelEntry]]:
    """(GPUs, models) of a model table file; InputError names the file and the field that is wrong."""
    path = Path(path)
    raw = read_config_file(path, "model table", InputError)
    if not isinstance(raw, dict) or set(raw) != {"gpus", "models"}:
        raise InputError(f"model table {path}: expected exactly the sections 'gpus' and 'models'")
    gpus = {str(k): _gpu(str(k), v, f"{path}: gpus.{k}") for k, v in (raw["gpus"] or {}).items()}
    models = {str(k): _model(str(k), v, gpus, f"{path}: models.{k}") for k, v in (raw["models"] or {}).items()}
    _check_references(models, path)
    return gpus, models


GPUS, MODELS = load_model_table()
#: model column -> the fit half's experiment substring (``lora-opt calibrate-e2e``)
FIT_HALF: dict[str, str] = {k: m.e2e_fit_half for k, m in MODELS.items() if m.e2e_fit_half is not None}
#: model column -> bundled profile name
MODEL_PROFILES: dict[str, str] = {k: m.profile_name for k, m in MODELS.items()}


def model_entry(model: str) -> ModelEntry:
    """The entry of CSV model ``model``; ScenarioError names the allowed ones."""
    if model not in MODELS:
        raise ScenarioError(f"calibrate --model: unknown model {model!r}; allowed: {sorted(MODELS)}")
    return MODELS[model]
