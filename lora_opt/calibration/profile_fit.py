"""Calibration: fit a twin profile (``twin.profile``) from real vLLM measurements.

``calibrate(runs_csv, model, out, report_dir)`` reads the real-run table
(``data/real_runs/real_runs_vllm_lora.csv``), fits every estimator of a profile from the model's
own *estimator* families, writes the profile YAML (with a ``fit`` provenance section) and, when
asked, a fit report (markdown + PNG plots).

Honesty rules
-------------
Only the estimator families are used for fitting (``ESTIMATOR_PREFIXES``):
``digital_twin_dynamic/estimators/*`` and ``performance_analysis/{memory,compute,loading}_overhead/*``.
The validation families (``digital_twin_modelling/real_results/*``, ``motivation_figure/*``) are
never fitted on; :func:`memory_check` only *checks* the memory model against their start-up status
and KV-cache size.  Every row a fit uses goes through :func:`_family`, which refuses any other prefix.

Models and the family that identifies each parameter
----------------------------------------------------
Memory (``MemorySpec``), vLLM's start-up accounting::

    kv_tokens = floor((util*M - weights - overhead - max_loras*slot(r)) / (16*kv_bytes_per_token))*16
    slot(r)   = lora_elements_per_rank * 2 B * slot_rank_scale * r + slot_fixed_mib

* ``weights_gib`` is computed from the model's dimensions (parameter count x 2 B): the KV data
  only identify the sum ``weights + overhead``, so the split comes from config.json, not a fit.
* ``non_kv_overhead_gib`` (= fitted sum - weights), ``slot_fixed_mib`` and, only when an F-test
  says the data demand it, ``slot_rank_scale``: least squares on the relative KV error of every
  LoRA-enabled start-up in the ``find_available_gpu_memory...`` family (0.8.5) or
  ``performance_analysis/memory_overhead`` (0.5.0), with the ``gpu_oom`` rows of the same family
  as hinge constraints (their KV must fall below ``max_model_len``).
* Not in the schema, recorded in ``fit.memory.max_num_seqs_term``: the profiling peak grows with
  ``max_num_seqs`` above a knee (the sampler's dummy run holds several fp32 ``[max_num_seqs, vocab]``
  tensors).  Fitted as a hinge on the no-LoRA runs of the latency families; the profile's overhead
  is valid at the ``max_num_seqs`` of the memory family (2048 for 0.8.5, 4096 for 0.5.0).

Step time (``LatencySpec``)::

    model_ms = (base + per_seq*n_seqs + per_token*(n_tokens - n_seqs) + per_ctx*ctx/1000) * factor(D)
    factor(D) = 1 + jump + slope*D/(1 + D/n_sat)   (D = distinct adapters in the batch, >= 1)

* 0.8.5 (Llama-3.1, Qwen-2.5): ``base``, ``per_seq``, ``per_ctx`` by linear least squares of the
  mean ITL on the running batch and its context in ``predictor_default_latency/*/output`` and
  ``predictor_latency_overhead/*/initial_points_small`` (no LoRA, lockstep synthetic decodes).
  ``per_token`` from ``predictor_default_latency/*/input`` (output 1): the run duration is
  regressed on the prefill tokens of the simulated chunked-prefill steps plus a per-request
  intercept (the HTTP front end / IPC cost the step model does not contain); only the slope
  is kept.  ``jump``, ``slope``, ``n_sat`` from ``predictor_latency_overhead/*/overhead_small``
  with D = the expected number of distinct adapters in a batch of ``running_mean`` requests drawn
  from the benchmark's balanced, shuffled request list (hypergeometric).
* 0.5.0 (Llama-2-7B): ``factor`` per ``max_lora_rank`` from ``performance_analysis/compute_overhead``
  as the duration ratio to the same group's run without adapter requests (D = the logged
  ``mean_loras_by_batch``); ``base``, ``per_seq``, ``per_ctx`` from the median ITL of the same
  family (decode-dominated datasets, de-LoRA'd with the fitted factor) and of
  ``performance_analysis/loading_overhead``; ``per_token`` is not identifiable from V0's runs and
  comes from the vidur H100 kernel profile of this very model (``data/profiling``).
* Scheduler constants: no estimator family separates ``schedule()`` time from the forward pass
  (both are in every ITL), so they stay 0 and their cost is inside ``base``/``per_seq``.

Loading (``LoadingSpec``): per-load mean times from ``predictor_loading`` (0.8.5: disk and CPU
counts/times) or ``performance_analysis/loading_overhead`` (0.5.0: per-run times, 0.1 s resolution),
fitted against the adapter rank by the smallest of constant / line / per-rank means that an F-test
accepts, and tabulated at the measured ranks.  0.5.0 logs every CPU->GPU activation as 0.0 s, so
Llama-2's CPU->GPU table is Llama-3.1's (same H100, same wrapped-module structure); ``fit`` says so.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import yaml
from scipy import optimize, special, stats

from twin.errors import ScenarioError
from twin.paths import DATA_DIR, REPO_ROOT
from twin.profile import GIB, MIB, EngineDefaults, LoraOverheadSpec, ModelSpec, Profile, profile_from_dict

# ---- constants of the measured setup ------------------------------------------------------------
#: Device memory the papers' H100 reports to vLLM (GiB).
GPU_MEMORY_GIB = 63.43
#: ``--gpu-memory-utilization`` used by every real run (NaN in the CSV = this default).
DEFAULT_UTIL = 0.9
BLOCK_SIZE = 16
#: Significance level for adding a parameter (``slot_rank_scale``, ``n_sat``, a rank slope).
F_TEST_ALPHA = 1e-3
#: Significant digits written to the YAML (deterministic output; 8 digits keep 1e-7 relative).
DIGITS = 8

#: Families allowed for fitting.  Anything else (validation runs) is refused by :func:`_family`.
ESTIMATOR_PREFIXES = (
    "digital_twin_dynamic/estimators/",
    "performance_analysis/memory_overhead/",
    "performance_analysis/compute_overhead/",
    "performance_analysis/loading_overhead/",
)
VALIDATION_PREFIXES = ("digital_twin_modelling/real_results/", "motivation_figure/")

#: Columns the calibration reads (a CSV without them is rejected with their names).
REQUIRED_COLUMNS = (
    "experiment", "model", "status", "enable_lora", "max_loras", "max_lora_rank", "max_num_seqs",
    "max_num_batched_tokens", "gpu_memory_utilization", "gpu_kv_cache_tokens", "gpu_kv_blocks",
    "completed", "num_prompts", "duration_s", "total_input_tokens", "total_output_tokens",
    "mean_itl_ms", "median_itl_ms", "running_mean", "kv_cache_usage_mean", "n_served_adapters",
    "restrict_loras", "mean_loras_by_batch", "adapter_module_ranks", "dataset",
    "adapter_loads_from_disk", "adapter_load_time_from_disk_s", "adapter_loads_from_memory",
    "adapter_load_time_from_memory_s", "lora_loading_time_s", "lora_activating_time_s",
)

RUNS_RELPATH = "data/real_runs/real_runs_vllm_lora.csv"
VIDUR_LLAMA2_7B = DATA_DIR / "profiling" / "h100_meta-llama_Llama-2-7b-hf_mlp.csv"


# ---- the models we can calibrate --------------------------------------------------------------
@dataclass(frozen=True)
class ModelEntry:
    """What calibration needs to know about one model beyond the data."""

    csv_name: str
    """Value of the CSV's ``model`` column."""
    profile_name: str
    spec: ModelSpec
    qkv_bias: bool
    """Qwen2 has q/k/v biases (weights count only)."""
    tied_embeddings: bool
    vllm_version: str
    lora_set_rule: str
    reserve_full_prompt: bool
    defaults: EngineDefaults
    engine: str
    """``v1`` (0.8.5 V1 engine, chunked prefill) or ``v0`` (0.5.0 fork, no chunked prefill)."""
    memory_max_num_seqs: int
    """``max_num_seqs`` of the memory family: the profile's overhead is valid there."""
    notes: tuple[str, ...] = ()


MODELS: dict[str, ModelEntry] = {
    "llama-3.1-8b-instruct": ModelEntry(
        csv_name="llama-3.1-8b-instruct", profile_name="llama-3.1-8b-h100-64gb",
        spec=ModelSpec(name="meta-llama/Llama-3.1-8B-Instruct", hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, vocab_size=128256, max_model_len=131072),
        qkv_bias=False, tied_embeddings=False, vllm_version="0.8.5", lora_set_rule="scheduled",
        reserve_full_prompt=False,
        defaults=EngineDefaults(max_loras=1, max_lora_rank=16, max_num_seqs=256,
                                max_num_batched_tokens=2048, gpu_memory_utilization=0.9),
        engine="v1", memory_max_num_seqs=2048),
    "qwen-2.5-7b-instruct": ModelEntry(
        csv_name="qwen-2.5-7b-instruct", profile_name="qwen-2.5-7b-h100-64gb",
        spec=ModelSpec(name="Qwen/Qwen2.5-7B-Instruct", hidden_size=3584,
                       intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                       head_dim=128, vocab_size=152064, max_model_len=32768),
        qkv_bias=True, tied_embeddings=False, vllm_version="0.8.5", lora_set_rule="scheduled",
        reserve_full_prompt=False,
        defaults=EngineDefaults(max_loras=1, max_lora_rank=16, max_num_seqs=256,
                                max_num_batched_tokens=2048, gpu_memory_utilization=0.9),
        engine="v1", memory_max_num_seqs=2048),
    "llama-2-7b": ModelEntry(
        csv_name="llama-2-7b", profile_name="llama-2-7b-h100-64gb",
        spec=ModelSpec(name="meta-llama/Llama-2-7b-hf", hidden_size=4096,
                       intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
                       head_dim=128, vocab_size=32000, max_model_len=4096),
        qkv_bias=False, tied_embeddings=False, vllm_version="0.5.0", lora_set_rule="running",
        # V0 without chunked prefill allocates the whole prompt at admission.
        reserve_full_prompt=True,
        # 0.5.0: max_num_seqs 256; no chunked prefill -> max_num_batched_tokens = max(max_model_len, 2048).
        defaults=EngineDefaults(max_loras=1, max_lora_rank=16, max_num_seqs=256,
                                max_num_batched_tokens=4096, gpu_memory_utilization=0.9),
        engine="v0", memory_max_num_seqs=4096,
        notes=("lora_set_rule 'running' is V0's rule: a request is admitted only if its adapter is "
               "in the running set or that set holds fewer than max_loras adapters.",
               "chunked_prefill false: V0 runs prefill-only steps (whole prompts) when it can admit, "
               "decode steps otherwise.")),
}


# ---- small helpers ------------------------------------------------------------------------------
def _sig(x: float, digits: int = DIGITS) -> float:
    """Round to ``digits`` significant digits (keeps inf/0); plain Python float for YAML."""
    x = float(x)
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    y, pred = np.asarray(y, float), np.asarray(pred, float)
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")


def _f_test_p(sse_small: float, sse_big: float, n: int, k_big: int, extra: int = 1) -> float:
    """p-value that the ``extra`` parameters of the bigger nested model reduce the SSE by chance."""
    dof = n - k_big
    if dof <= 0 or sse_big <= 0:
        return 0.0 if sse_small > sse_big else 1.0
    f = max((sse_small - sse_big) / extra, 0.0) / (sse_big / dof)
    return float(stats.f.sf(f, extra, dof))


def _family(df: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Rows whose experiment starts with ``prefix``; only estimator families may be fitted on."""
    if not prefix.startswith(ESTIMATOR_PREFIXES):
        raise AssertionError(f"refusing to fit on non-estimator family {prefix!r}")
    return df[df["experiment"].str.startswith(prefix)]


def _num(series: pd.Series) -> np.ndarray:
    return pd.to_numeric(series, errors="coerce").to_numpy(dtype=float)


def _measured_kv_tokens(df: pd.DataFrame) -> np.ndarray:
    """Logged KV capacity: ``gpu_kv_cache_tokens`` (0.8.5) or ``gpu_kv_blocks * 16`` (0.5.0)."""
    tok = _num(df["gpu_kv_cache_tokens"])
    blk = _num(df["gpu_kv_blocks"]) * BLOCK_SIZE
    return np.where(np.isfinite(tok), tok, blk)


def weights_gib(entry: ModelEntry) -> float:
    """bf16 weight bytes from config.json dimensions (embeddings, attention, MLP, norms)."""
    s = entry.spec
    h, inter, q, kv = s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if entry.qkv_bias:
        per_layer += q + 2 * kv
    embeddings = s.vocab_size * h * (1 if entry.tied_embeddings else 2)
    params = s.num_layers * per_layer + embeddings + h
    return params * s.dtype_bytes / GIB


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- input --------------------------------------------------------------------------------------
def load_runs(runs_csv: str | Path) -> pd.DataFrame:
    """Read and validate the real-run table; ScenarioError names what is wrong."""
    path = Path(runs_csv)
    if not path.exists():
        raise ScenarioError(f"calibrate --runs: file not found: {path} "
                            f"(expected the real-run table, e.g. {RUNS_RELPATH})")
    try:
        df = pd.read_csv(path, low_memory=False)
    except Exception as exc:  # pandas raises several types for unreadable files
        raise ScenarioError(f"calibrate --runs: cannot read {path} as CSV: {exc}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ScenarioError(f"calibrate --runs: {path} lacks column(s) {missing}; "
                            f"required columns: {list(REQUIRED_COLUMNS)}")
    df["experiment"] = df["experiment"].astype(str)
    df["model"] = df["model"].astype(str)
    return df


def model_entry(model: str) -> ModelEntry:
    if model not in MODELS:
        raise ScenarioError(f"calibrate --model: unknown model {model!r}; allowed: {sorted(MODELS)}")
    return MODELS[model]


# =================================================================================================
# Memory
# =================================================================================================
@dataclass
class FitResult:
    """One estimator's fit: parameters, goodness of fit and the data for the report's plots."""

    params: dict[str, Any]
    families: list[str]
    n: int
    r2: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    plot: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"families": self.families, "n_points": int(self.n),
                               "params": _clean(self.params)}
        if self.r2 is not None:
            out["r2"] = _sig(self.r2, 6)
        out.update(_clean(self.extra))
        return out


def _clean(obj: Any) -> Any:
    """numpy -> Python, floats rounded to DIGITS significant digits (deterministic YAML)."""
    if isinstance(obj, dict):
        return {(int(k) if isinstance(k, (np.integer,)) else k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return _sig(float(obj))
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def _memory_family(entry: ModelEntry) -> str:
    if entry.engine == "v1":
        return ("digital_twin_dynamic/estimators/find_available_gpu_memory_depending_on_loaded_adapters/"
                f"{entry.csv_name}")
    return f"performance_analysis/memory_overhead/{entry.csv_name}/"


def _kv_model_tokens(params: np.ndarray, n_loras: np.ndarray, rank: np.ndarray, entry: ModelEntry,
                     fit_scale: bool) -> np.ndarray:
    """Continuous (un-floored) KV tokens for params = [weights+overhead GiB, slot_fixed MiB, scale]."""
    used, fixed = params[0], params[1]
    scale = params[2] if fit_scale else 1.0
    per_rank = entry.spec.lora_elements_per_rank * entry.spec.dtype_bytes * scale
    avail = DEFAULT_UTIL * GPU_MEMORY_GIB * GIB - used * GIB - n_loras * (rank * per_rank + fixed * MIB)
    return avail / entry.spec.kv_bytes_per_token


def fit_memory(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """Fit ``weights+overhead`` and ``slot_fixed_mib`` (``slot_rank_scale`` if the F-test demands).

    Measurements: every LoRA-enabled start-up of the memory family at its ``max_num_seqs`` with a
    logged KV size and a status other than ``gpu_oom``; residuals are relative (the acceptance check
    is relative, and a small KV cache is where a relative error changes the batch size most).
    Constraints: ``gpu_oom`` rows must predict fewer KV tokens than ``max_model_len`` (hinge).
    The ``predictor_loading`` family (max_loras 1, same max_num_seqs) adds small-n points for 0.8.5.
    """
    fams = [_memory_family(entry)]
    if entry.engine == "v1":
        fams.append(f"digital_twin_dynamic/estimators/predictor_loading/{entry.csv_name}/")
    rows = pd.concat([_family(runs, f) for f in fams])
    rows = rows[(_num(rows["enable_lora"]) == 1) & (_num(rows["max_num_seqs"]) == entry.memory_max_num_seqs)]
    kv = _measured_kv_tokens(rows)
    is_oom = (rows["status"] == "gpu_oom").to_numpy()
    meas = ~is_oom & np.isfinite(kv) & (kv > 0)
    n_m, r_m, y = _num(rows["max_loras"])[meas], _num(rows["max_lora_rank"])[meas], kv[meas]
    n_o, r_o = _num(rows["max_loras"])[is_oom], _num(rows["max_lora_rank"])[is_oom]
    mml = entry.spec.max_model_len
    if len(y) < 3:
        raise ScenarioError(f"calibrate: model {entry.csv_name!r} has {len(y)} KV measurements in "
                            f"{fams}; need at least 3")

    def residuals(p: np.ndarray, fit_scale: bool) -> np.ndarray:
        rel = (_kv_model_tokens(p, n_m, r_m, entry, fit_scale) - y) / y
        # A start-up that failed must predict a KV cache smaller than one max_model_len request.
        hinge = np.maximum(_kv_model_tokens(p, n_o, r_o, entry, fit_scale) - (mml - BLOCK_SIZE), 0.0) / mml
        return np.concatenate([rel, hinge])

    x0 = np.array([weights_gib(entry) + 4.0, 4.0, 1.0])
    lo, hi = np.array([0.0, 0.0, 0.3]), np.array([GPU_MEMORY_GIB, 1024.0, 3.0])
    fit1 = optimize.least_squares(lambda p: residuals(np.r_[p, 1.0], False), x0[:2], bounds=(lo[:2], hi[:2]),
                                  x_scale=[1.0, 1.0], xtol=1e-14, ftol=1e-14, gtol=1e-14)
    fit2 = optimize.least_squares(lambda p: residuals(p, True), x0, bounds=(lo, hi),
                                  xtol=1e-14, ftol=1e-14, gtol=1e-14)
    sse1, sse2 = float(np.sum(fit1.fun ** 2)), float(np.sum(fit2.fun ** 2))
    p_scale = _f_test_p(sse1, sse2, len(fit1.fun), 3)
    use_scale = p_scale < F_TEST_ALPHA
    params = (fit2.x if use_scale else np.r_[fit1.x, 1.0]).copy()
    if params[1] < 1e-9:  # optimiser noise at the zero bound of slot_fixed_mib
        params[1] = 0.0
    pred = _kv_model_tokens(params, n_m, r_m, entry, True)
    rel = (pred - y) / y
    w = weights_gib(entry)
    code_scale_no_embed = (entry.spec.num_layers * _per_layer_lora(entry.spec)) / entry.spec.lora_elements_per_rank
    res = FitResult(
        params={"weights_gib": w, "non_kv_overhead_gib": params[0] - w,
                "slot_fixed_mib": params[1], "slot_rank_scale": params[2]},
        families=fams, n=int(len(y) + len(n_o)), r2=_r2(y, pred),
        extra={"n_kv_points": int(len(y)), "n_oom_constraints": int(len(n_o)),
               "max_num_seqs_of_fit": entry.memory_max_num_seqs,
               "max_abs_rel_kv_error": float(np.max(np.abs(rel))),
               "rms_rel_kv_error": float(np.sqrt(np.mean(rel ** 2))),
               "oom_constraints_violated": int(np.sum(residuals(params, True)[len(y):] > 0)),
               "slot_rank_scale_test": {"fitted": bool(use_scale), "p_value": float(p_scale),
                                        "free_value": float(fit2.x[2]),
                                        "code_value_without_embedding_lora": float(code_scale_no_embed)},
               "weights_note": "weights_gib from config.json parameter count x 2 B (KV data identify "
                               "only weights + overhead)"},
        plot={"n": n_m, "r": r_m, "y": y, "pred": pred, "n_oom": n_o, "r_oom": r_o,
              "pred_oom": _kv_model_tokens(params, n_o, r_o, entry, True), "mml": mml})
    return res


def _per_layer_lora(s: ModelSpec) -> int:
    """Per-rank LoRA elements of one decoder layer (qkv, o, gate_up, down)."""
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return 7 * h + 2 * q + 2 * kv + 3 * s.intermediate_size


def fit_max_num_seqs_term(runs: pd.DataFrame, entry: ModelEntry) -> FitResult | None:
    """Non-KV memory vs ``max_num_seqs`` (no LoRA): ``extra = slope * max(0, seqs - knee)``.

    The profiling run's sampler holds ``[max_num_seqs, vocab]`` fp32 tensors; above a knee they,
    not the 2048-token forward pass, set the activation peak (``MemorySpec.overhead_gib_per_1k_seqs``,
    ``seqs_knee``).
    """
    fams = [f"digital_twin_dynamic/estimators/predictor_default_latency/{entry.csv_name}/",
            f"digital_twin_dynamic/estimators/predictor_latency_overhead/{entry.csv_name}/initial_points_small/"]
    rows = pd.concat([_family(runs, f) for f in fams])
    rows = rows[_num(rows["enable_lora"]) == 0]
    kv = _measured_kv_tokens(rows)
    seqs = _num(rows["max_num_seqs"])
    ok = np.isfinite(kv) & (kv > 0) & np.isfinite(seqs)
    seqs, gib = seqs[ok], kv[ok] * entry.spec.kv_bytes_per_token / GIB
    if len(np.unique(seqs)) < 4:
        return None

    def hinge(s, kv0, slope_gib_per_kseq, knee):
        return kv0 - slope_gib_per_kseq * np.maximum(s - knee, 0.0) / 1000.0

    p, _ = optimize.curve_fit(hinge, seqs, gib, p0=[gib.max(), 1.0, 150.0],
                              bounds=([0, 0, 0], [100, 100, 4096]))
    pred = hinge(seqs, *p)
    return FitResult(
        params={"slope_gib_per_1k_seqs": p[1], "knee_seqs": p[2]}, families=fams, n=int(len(seqs)),
        r2=_r2(gib, pred),
        extra={"kv_gib_below_knee_no_lora": p[0],
               "overhead_vs_memory_family_gib": p[1] * max(entry.memory_max_num_seqs - p[2], 0) / 1000.0,
               "note": ("MemorySpec.overhead_gib_per_1k_seqs / seqs_knee: non_kv_overhead_gib holds at "
                        f"max_num_seqs={entry.memory_max_num_seqs}; at max_num_seqs s the overhead "
                        "changes by slope*(max(s, knee) - max(ref, knee))/1000 GiB")},
        plot={"x": seqs, "y": gib, "pred": pred})


def _startup_config(rows: pd.DataFrame, profile: Profile):
    """Per run (gpu_memory_utilization, max_num_batched_tokens, LoRA slots, max_lora_rank) as the
    engine started: missing values are the profile's defaults; ``enable_lora = 0`` means no slots."""
    d = profile.defaults
    util = np.where(np.isfinite(_num(rows["gpu_memory_utilization"])), _num(rows["gpu_memory_utilization"]),
                    d.gpu_memory_utilization)
    mnbt = np.where(np.isfinite(_num(rows["max_num_batched_tokens"])), _num(rows["max_num_batched_tokens"]),
                    d.max_num_batched_tokens)
    n_loras = np.where(_num(rows["enable_lora"]) == 1, np.nan_to_num(_num(rows["max_loras"]), nan=d.max_loras), 0)
    ranks = np.nan_to_num(_num(rows["max_lora_rank"]), nan=d.max_lora_rank)
    return util, mnbt, n_loras, ranks


def fit_max_num_seqs_term_v0(runs: pd.DataFrame, entry: ModelEntry, profile: Profile) -> FitResult | None:
    """V0 (0.5.0): the same sampler term from the only estimator family run at another
    ``max_num_seqs`` -- ``performance_analysis/loading_overhead`` (50, one LoRA slot) -- against
    ``profile``'s memory model, fitted at the memory family's 4096.  Two ``max_num_seqs`` values
    identify the overhead difference, not the knee: the knee is set at the smaller value (50),
    so below it the overhead is taken as flat (unknown, and no run below it)."""
    fam = f"performance_analysis/loading_overhead/latency/{entry.csv_name}/"
    rows = _family(runs, fam)
    rows = rows[rows["status"] == "ok"]
    kv = _measured_kv_tokens(rows)
    seqs = _num(rows["max_num_seqs"])
    ok = np.isfinite(kv) & (kv > 0) & np.isfinite(seqs) & (seqs < entry.memory_max_num_seqs)
    if not ok.any():
        return None
    rows, kv, seqs = rows[ok], kv[ok], seqs[ok]
    knee = float(seqs.min())
    util, mnbt, n_loras, ranks = _startup_config(rows, profile)
    # KV the memory model (no seqs term) predicts for these configurations; the measured surplus
    # is overhead the profiling run does not hold at this max_num_seqs
    pred = np.array([profile.kv_capacity_tokens(int(nl), int(r), float(u), int(mb), enable_lora=nl > 0,
                                                max_num_seqs=entry.memory_max_num_seqs)
                     for nl, r, u, mb in zip(n_loras, ranks, util, mnbt)], float)
    surplus_gib = (kv - pred) * entry.spec.kv_bytes_per_token / GIB
    delta = float(np.mean(surplus_gib))
    slope = max(delta, 0.0) * 1000.0 / (entry.memory_max_num_seqs - knee)
    resid = surplus_gib - delta
    return FitResult(
        params={"slope_gib_per_1k_seqs": slope, "knee_seqs": knee}, families=[fam], n=int(len(kv)),
        r2=None,
        extra={"overhead_vs_memory_family_gib": delta,
               "surplus_gib_per_run_sd": float(np.std(resid)),
               "max_num_seqs_values": sorted({int(x) for x in seqs}),
               "note": ("two max_num_seqs values (this family's and the memory family's "
                        f"{entry.memory_max_num_seqs}): slope = mean KV surplus / difference; knee = the "
                        "smaller value (not identified)")},
        plot={"x": seqs, "y": surplus_gib, "pred": np.full(len(kv), delta),
              "line_x": np.array([0.0, knee, float(entry.memory_max_num_seqs)]),
              "line_y": np.array([delta, delta, 0.0]),
              "label": "measured KV - memory model (fitted at the memory family's max_num_seqs)",
              "ylabel": "KV surplus (GiB)"})


# =================================================================================================
# Step time, 0.8.5 (V1: chunked prefill, lockstep synthetic runs)
# =================================================================================================
def _per_request_lengths(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    done = _num(rows["completed"])
    return _num(rows["total_input_tokens"]) / done, _num(rows["total_output_tokens"]) / done


def _relative_linear_fit(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative linear least squares on relative residuals (rows divided by y): the twin's
    fidelity is judged on relative ITL/throughput errors, so a 1 ms miss at 13 ms matters more
    than at 50 ms."""
    sol = optimize.lsq_linear(design / y[:, None], np.ones_like(y), bounds=(0.0, np.inf), method="bvls")
    return sol.x


def _decode_ctx_per_seq(inp: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Mean KV-resident context of a sequence over its decode steps (lockstep waves)."""
    return inp + np.maximum(out - 2.0, 0.0) / 2.0


def fit_decode_v1(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """``ITL = base + per_seq*B + per_ctx*B*ctx/1000`` on no-LoRA lockstep decode runs."""
    fams = [f"digital_twin_dynamic/estimators/predictor_default_latency/{entry.csv_name}/output",
            f"digital_twin_dynamic/estimators/predictor_latency_overhead/{entry.csv_name}/initial_points_small/output"]
    rows = pd.concat([_family(runs, f) for f in fams])
    rows = rows[(rows["status"] == "ok") & (_num(rows["enable_lora"]) == 0)]
    y, b = _num(rows["mean_itl_ms"]), _num(rows["running_mean"])
    inp, out = _per_request_lengths(rows)
    ctx_k = b * _decode_ctx_per_seq(inp, out) / 1000.0
    keep = np.isfinite(y) & (y > 0) & np.isfinite(b) & (b > 0) & np.isfinite(ctx_k)
    y, b, ctx_k = y[keep], b[keep], ctx_k[keep]
    design = np.column_stack([np.ones_like(b), b, ctx_k])
    sol = _relative_linear_fit(design, y)
    pred = design @ sol
    return FitResult(params={"base_ms": sol[0], "per_seq_ms": sol[1], "per_ctx_ktoken_ms": sol[2]},
                     families=fams, n=int(len(y)), r2=_r2(y, pred),
                     extra={"target": "mean_itl_ms vs running_mean and context (B*(in+(out-2)/2)); "
                                      "non-negative least squares on relative residuals",
                            "max_abs_rel_error": float(np.max(np.abs(pred / y - 1)))},
                     plot={"b": b, "ctx_k": ctx_k, "y": y, "pred": pred})


def _chunked_prefill_steps(n_req: int, prompt: float, budget: int, max_seqs: int) -> dict[str, float]:
    """Sums over the steps of FCFS chunked prefill of ``n_req`` equal prompts (output 1 token).

    Every step takes up to ``budget`` tokens, continuing the partial prompt first; a request whose
    prompt completes finishes in that step (its single output token comes from the prefill).
    """
    plen = max(int(round(prompt)), 1)
    sum_seqs = sum_extra = sum_ctx = 0.0
    steps = 0
    nxt, done_tokens_of_partial = 0, 0  # next request index; tokens already computed of request nxt
    while nxt < n_req:
        budget_left, seqs = budget, 0
        while budget_left > 0 and nxt < n_req and seqs < max_seqs:
            take = min(plen - done_tokens_of_partial, budget_left)
            sum_ctx += done_tokens_of_partial
            sum_extra += take - 1
            seqs += 1
            budget_left -= take
            done_tokens_of_partial += take
            if done_tokens_of_partial == plen:
                nxt, done_tokens_of_partial = nxt + 1, 0
        sum_seqs += seqs
        steps += 1
    return {"steps": steps, "seqs": sum_seqs, "extra_tokens": sum_extra, "ctx": sum_ctx}


def fit_prefill_v1(runs: pd.DataFrame, entry: ModelEntry, decode: FitResult) -> FitResult:
    """``per_token`` from the duration of output-1 runs (front-end-bound: see module docstring).

    duration = sum_steps(base + per_seq*n + per_ctx*ctx/1000) + per_token*sum(n_tokens - n) + c_req*N
    with base/per_seq/per_ctx from the decode fit; c_req (per request, not a step cost) is the
    HTTP/IPC overhead that made ``running_mean < 1``; only per_token enters the profile.
    """
    fam = f"digital_twin_dynamic/estimators/predictor_default_latency/{entry.csv_name}/input"
    rows = _family(runs, fam)
    rows = rows[rows["status"] == "ok"]
    budget = entry.defaults.max_num_batched_tokens
    d = decode.params
    known, x_tok, x_req, y = [], [], [], []
    for _, r in rows.iterrows():
        n_req = int(r["completed"])
        sums = _chunked_prefill_steps(n_req, r["total_input_tokens"] / n_req, budget,
                                      int(r["max_num_seqs"]))
        known.append(sums["steps"] * d["base_ms"] + sums["seqs"] * d["per_seq_ms"]
                     + sums["ctx"] * d["per_ctx_ktoken_ms"] / 1000.0)
        x_tok.append(sums["extra_tokens"])
        x_req.append(n_req)
        y.append(float(r["duration_s"]) * 1000.0)
    known, y = np.array(known), np.array(y)
    design = np.column_stack([x_tok, x_req]).astype(float)
    sol = optimize.lsq_linear(design, y - known, bounds=(0.0, np.inf), method="bvls")
    pred = known + design @ sol.x
    slope_only = stats.linregress(np.array(x_tok), y)  # naive slope, reported for comparison
    return FitResult(
        params={"per_token_ms": sol.x[0]}, families=[fam], n=int(len(y)), r2=_r2(y, pred),
        extra={"per_request_overhead_ms": sol.x[1],
               "naive_duration_slope_ms_per_token": slope_only.slope,
               "vidur_cross_check_per_token_ms": _vidur_per_token_ms(entry),
               "target": "run duration (ms) of output-1 synthetic runs, simulated chunked-prefill steps"},
        plot={"x": np.array(x_tok), "y": y, "pred": pred})


def _vidur_per_token_ms(entry: ModelEntry) -> float | None:
    """Independent per-token prefill cost: vidur's H100 Llama-2-7B linear-op times, scaled by the
    ratio of per-layer linear FLOPs and by the layer count (attention kernels excluded)."""
    if not VIDUR_LLAMA2_7B.exists():
        return None
    slope_per_layer, _ = _vidur_layer_slope()
    ref = MODELS["llama-2-7b"].spec
    ratio = (_linear_params_per_layer(entry.spec) / _linear_params_per_layer(ref))
    return slope_per_layer * ratio * entry.spec.num_layers


def _linear_params_per_layer(s: ModelSpec) -> int:
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * s.intermediate_size


def _vidur_layer_slope() -> tuple[float, float]:
    """(ms per token per layer, R^2): linear fit of one layer's op times for num_tokens >= 1024, TP 1."""
    d = pd.read_csv(VIDUR_LLAMA2_7B)
    d = d[d["num_tensor_parallel_workers"] == 1]
    ops = ["input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]
    # Two residual adds per layer; the file times one.
    layer = sum(d[f"time_stats.{o}.median"] for o in ops) + d["time_stats.add.median"]
    big = d["num_tokens"] >= 1024
    fit = stats.linregress(d.loc[big, "num_tokens"].to_numpy(float), layer[big].to_numpy(float))
    return float(fit.slope), float(fit.rvalue ** 2)


def expected_distinct_adapters(n_adapters: np.ndarray, batch: np.ndarray, n_requests: np.ndarray) -> np.ndarray:
    """E[distinct adapters] in ``batch`` requests drawn without replacement from ``n_requests``
    requests spread evenly over ``n_adapters`` (the benchmark assigns round-robin, then shuffles)."""
    n_adapters, batch, total = (np.asarray(a, float) for a in (n_adapters, batch, n_requests))
    per = total / n_adapters
    batch = np.minimum(batch, total)
    rest = total - per - batch  # requests of other adapters left outside the batch
    # P(an adapter has none of its `per` requests in the batch) = C(N-per, B) / C(N, B); zero when
    # the other adapters' requests cannot fill the batch.
    safe_rest = np.maximum(rest, 0.0)
    log_p0 = (special.gammaln(total - per + 1) - special.gammaln(safe_rest + 1)
              - special.gammaln(total + 1) + special.gammaln(total - batch + 1))
    p0 = np.where(rest >= 0, np.exp(log_p0), 0.0)
    return n_adapters * (1.0 - p0)


def _fit_lora_factor(x: np.ndarray, y: np.ndarray, base: np.ndarray) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit ``y = base * (1 + jump + slope*x/(1 + x/n_sat))`` on relative errors.

    ``n_sat`` is kept only if an F-test against the linear model (n_sat = inf) says p < alpha.
    """
    def model(p, sat):
        jump, slope = p[0], p[1]
        n_sat = math.exp(p[2]) if sat else math.inf
        return base * (1.0 + jump + slope * x / (1.0 + x / n_sat))

    lin = optimize.least_squares(lambda p: model(p, False) / y - 1.0, [1.0, 0.01],
                                 bounds=([0.0, 0.0], [10.0, 1.0]), xtol=1e-14, ftol=1e-14, gtol=1e-14)
    sat = optimize.least_squares(lambda p: model(p, True) / y - 1.0, [lin.x[0], lin.x[1], math.log(200.0)],
                                 bounds=([0.0, 0.0, 0.0], [10.0, 1.0, math.log(1e6)]),
                                 xtol=1e-14, ftol=1e-14, gtol=1e-14)
    sse_lin, sse_sat = float(np.sum(lin.fun ** 2)), float(np.sum(sat.fun ** 2))
    p_val = _f_test_p(sse_lin, sse_sat, len(y), 3)
    use_sat = p_val < F_TEST_ALPHA and sat.x[2] < math.log(1e6) - 1e-6
    if use_sat:
        params = {"jump": sat.x[0], "slope": sat.x[1], "n_sat": math.exp(sat.x[2])}
        pred = model(sat.x, True)
    else:
        params = {"jump": lin.x[0], "slope": lin.x[1], "n_sat": math.inf}
        pred = model(lin.x, False)
    info = {"r2": _r2(y, pred), "n_sat_test": {"fitted": bool(use_sat), "p_value": p_val,
                                                "free_n_sat": math.exp(sat.x[2])},
            "max_abs_rel_error": float(np.max(np.abs(pred / y - 1))), "pred": pred}
    return params, info


def decode_model(p: dict[str, float], b: np.ndarray, ctx_k: np.ndarray) -> np.ndarray:
    return p["base_ms"] + p["per_seq_ms"] * b + p["per_ctx_ktoken_ms"] * ctx_k


def fit_lora_v1(runs: pd.DataFrame, entry: ModelEntry, decode: FitResult) -> FitResult:
    """LoRA factor on ``overhead_small`` (max_loras 300, one max_lora_rank): ITL / decode model."""
    fam = f"digital_twin_dynamic/estimators/predictor_latency_overhead/{entry.csv_name}/overhead_small/output"
    rows = _family(runs, fam)
    rows = rows[(rows["status"] == "ok") & (_num(rows["enable_lora"]) == 1)]
    y, b = _num(rows["mean_itl_ms"]), _num(rows["running_mean"])
    inp, out = _per_request_lengths(rows)
    ctx_k = b * _decode_ctx_per_seq(inp, out) / 1000.0
    served = _num(rows["n_served_adapters"])
    dist = expected_distinct_adapters(served, b, _num(rows["num_prompts"]))
    base = decode_model(decode.params, b, ctx_k)
    ranks = _num(rows["max_lora_rank"])
    per_rank: dict[int, dict[str, float]] = {}
    extra: dict[str, Any] = {}
    plot: dict[str, Any] = {}
    for rank in sorted(set(ranks[np.isfinite(ranks)].astype(int))):
        sel = ranks == rank
        params, info = _fit_lora_factor(dist[sel], y[sel], base[sel])
        params["ref_max_loras"] = int(np.median(_num(rows["max_loras"])[sel]))
        per_rank[rank] = params
        extra[f"rank_{rank}"] = {"r2": info["r2"], "n_points": int(sel.sum()),
                                 "n_sat_test": info["n_sat_test"],
                                 "max_abs_rel_error": info["max_abs_rel_error"],
                                 "max_loras_of_runs": sorted(set(_num(rows["max_loras"])[sel].astype(int)))}
        plot[rank] = {"x": dist[sel], "served": served[sel], "y": y[sel] / base[sel],
                      "pred": info["pred"] / base[sel]}
    extra["x_variable"] = ("expected distinct adapters in a batch of running_mean requests "
                           "(hypergeometric over the benchmark's balanced shuffled request list)")
    r2_all = float(np.mean([v["r2"] for k, v in extra.items() if k.startswith("rank_")]))
    return FitResult(params=per_rank, families=[fam], n=int(len(y)), r2=r2_all, extra=extra, plot=plot)


# =================================================================================================
# Step time, 0.5.0 (V0 fork, Llama-2-7B)
# =================================================================================================
def fit_lora_v0(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """Factor per rank = run duration / duration of the same group's run without adapter requests.

    Within a group (dataset, max_loras, max_lora_rank) the workload and KV size are identical, so
    the duration ratio is the mean forward-pass factor; D is the logged ``mean_loras_by_batch``.
    """
    fam = f"performance_analysis/compute_overhead/{entry.csv_name}/"
    rows = _family(runs, fam)
    rows = rows[rows["status"] == "ok"].copy()
    rows["group"] = rows["dataset"].astype(str) + "|" + rows["max_loras"].astype(str) + "|" + rows["max_lora_rank"].astype(str)
    x, y, rk, grp = [], [], [], []
    for g, sub in rows.groupby("group", sort=True):
        ref = sub[_num(sub["restrict_loras"]) == 0]
        if ref.empty:
            continue
        d0 = float(ref["duration_s"].iloc[0])
        lora = sub[_num(sub["restrict_loras"]) > 0]
        x += list(_num(lora["mean_loras_by_batch"]))
        y += list(_num(lora["duration_s"]) / d0)
        rk += list(_num(lora["max_lora_rank"]))
        grp += [g] * len(lora)
    x, y, rk = np.array(x), np.array(y), np.array(rk)
    per_rank, extra, plot = {}, {}, {}
    for rank in sorted(set(rk.astype(int))):
        sel = (rk == rank) & np.isfinite(x) & np.isfinite(y)
        params, info = _fit_lora_factor(x[sel], y[sel], np.ones(sel.sum()))
        params["ref_max_loras"] = int(np.median(_num(rows["max_loras"])[_num(rows["restrict_loras"]) > 0]))
        per_rank[rank] = params
        extra[f"rank_{rank}"] = {"r2": info["r2"], "n_points": int(sel.sum()), "n_sat_test": info["n_sat_test"],
                                 "max_abs_rel_error": info["max_abs_rel_error"]}
        plot[rank] = {"x": x[sel], "served": x[sel], "y": y[sel], "pred": info["pred"]}
    extra["x_variable"] = "logged mean_loras_by_batch"
    extra["target"] = "duration / duration of the group's run without adapter requests"
    r2_all = float(np.mean([v["r2"] for k, v in extra.items() if k.startswith("rank_")]))
    return FitResult(params=per_rank, families=[fam], n=int(len(y)), r2=r2_all, extra=extra, plot=plot)


def _lora_factor(params: dict[str, float], d: np.ndarray) -> np.ndarray:
    """1 + extra at the fitted runs' own slot count (where ``jump`` was measured)."""
    spec = LoraOverheadSpec(params["jump"], params["slope"], params["n_sat"])
    return np.array([1.0 if v <= 0 else 1.0 + spec.jump + spec.slope * v / (1.0 + v / spec.n_sat)
                     for v in d])


def fit_decode_v0(runs: pd.DataFrame, entry: ModelEntry, lora: FitResult) -> FitResult:
    """``median ITL / factor = base + per_seq*B + per_ctx*ctx/1000`` for V0.

    Median ITL (V0 stalls decodes for whole-prompt prefill steps, which inflate the mean) from:
    * ``compute_overhead`` runs without adapter requests and with long outputs (mean/p75 datasets;
      the p25 dataset's 27-token outputs make its ITLs prefill-dominated), B = running_mean,
      ctx = kv_cache_usage_mean x KV size (KV-saturated, preempting runs: the measured context);
    * ``loading_overhead`` (max_num_seqs 50, 100 prompts, lockstep waves), B = 50,
      ctx = B x (in + (out-2)/2), one adapter (factor(1) of its rank).
    """
    fam_c = f"performance_analysis/compute_overhead/{entry.csv_name}/"
    fam_l = f"performance_analysis/loading_overhead/latency/{entry.csv_name}/"
    rows_c = _family(runs, fam_c)
    # Only the runs without adapter requests: their median ITL needs no LoRA correction (the
    # duration-ratio factor overstates the decode-only ITL increase of V0's punica kernels).
    rows_c = rows_c[(rows_c["status"] == "ok") & ~rows_c["dataset"].astype(str).str.contains("p25")
                    & (_num(rows_c["restrict_loras"]) == 0)]
    b_c = _num(rows_c["running_mean"])
    ctx_c = _num(rows_c["kv_cache_usage_mean"]) * _measured_kv_tokens(rows_c) / 1000.0
    f_c = np.ones(len(rows_c))
    rows_l = _family(runs, fam_l)
    rows_l = rows_l[rows_l["status"] == "ok"]
    inp, out = _per_request_lengths(rows_l)
    b_l = np.minimum(_num(rows_l["max_num_seqs"]), _num(rows_l["num_prompts"]))
    ctx_l = b_l * _decode_ctx_per_seq(inp, out) / 1000.0
    f_l = _factor_by_rank(lora.params, _num(rows_l["max_lora_rank"]), np.ones(len(rows_l)))
    y = np.r_[_num(rows_c["median_itl_ms"]) / f_c, _num(rows_l["median_itl_ms"]) / f_l]
    b, ctx_k = np.r_[b_c, b_l], np.r_[ctx_c, ctx_l]
    keep = np.isfinite(y) & np.isfinite(b) & np.isfinite(ctx_k) & (y > 0)
    y, b, ctx_k = y[keep], b[keep], ctx_k[keep]
    design = np.column_stack([np.ones_like(b), b, ctx_k])
    sol = _relative_linear_fit(design, y)
    pred = design @ sol
    return FitResult(params={"base_ms": sol[0], "per_seq_ms": sol[1], "per_ctx_ktoken_ms": sol[2]},
                     families=[fam_c + " (mean/p75 datasets, no adapter requests)", fam_l], n=int(len(y)), r2=_r2(y, pred),
                     extra={"target": "median_itl_ms / lora factor; non-negative least squares on "
                                      "relative residuals",
                            "max_abs_rel_error": float(np.max(np.abs(pred / y - 1)))},
                     plot={"b": b, "ctx_k": ctx_k, "y": y, "pred": pred})


def _factor_by_rank(per_rank: dict[int, dict[str, float]], ranks: np.ndarray, d: np.ndarray) -> np.ndarray:
    out = np.ones(len(d))
    known = sorted(per_rank)
    for i, (r, v) in enumerate(zip(ranks, d)):
        if not np.isfinite(r) or not np.isfinite(v) or v <= 0:
            continue
        best = min(known, key=lambda k: (abs(k - r), k))
        out[i] = _lora_factor(per_rank[best], np.array([v]))[0]
    return out


def fit_prefill_vidur(entry: ModelEntry) -> FitResult:
    """``per_token`` from vidur's H100 kernel profile (used where no real run identifies it)."""
    slope, r2 = _vidur_layer_slope()
    ref = MODELS["llama-2-7b"].spec
    ratio = _linear_params_per_layer(entry.spec) / _linear_params_per_layer(ref)
    return FitResult(params={"per_token_ms": slope * ratio * entry.spec.num_layers},
                     families=[str(VIDUR_LLAMA2_7B.relative_to(REPO_ROOT))], n=0, r2=r2,
                     extra={"target": "per-layer linear-op time vs num_tokens (>= 1024, TP 1) x layers"})


# =================================================================================================
# Loading
# =================================================================================================
def _rank_table(ranks: np.ndarray, ms: np.ndarray) -> tuple[dict[int, float], dict[str, Any]]:
    """Per-load time vs adapter rank, tabulated at the measured ranks.

    Nested least-squares models, the smallest one not rejected by an F-test (p < 0.05):
    a constant, a line in rank, a free value per rank (the group means; LoadingSpec interpolates
    linearly between the listed ranks, so this is a piecewise-linear fit).
    """
    ranks = ranks.astype(int)
    uniq = sorted(set(ranks))
    n = len(ms)
    models: dict[str, tuple[np.ndarray, int, dict[str, Any]]] = {
        "constant": (np.full(n, ms.mean()), 1, {"mean_ms": float(ms.mean())})}
    if len(uniq) >= 2:
        lin = stats.linregress(ranks, ms)
        models["linear"] = (lin.intercept + lin.slope * ranks, 2,
                            {"intercept_ms": lin.intercept, "slope_ms_per_rank": lin.slope})
    if len(uniq) >= 3:
        means = {r: float(ms[ranks == r].mean()) for r in uniq}
        models["per_rank_mean"] = (np.array([means[r] for r in ranks]), len(uniq), {})
    chosen, tests = "constant", {}
    for richer in ("linear", "per_rank_mean"):
        if richer not in models or n <= models[richer][1]:
            continue
        (p_small, k_small, _), (p_big, k_big, _) = models[chosen], models[richer]
        p_val = _f_test_p(float(np.sum((ms - p_small) ** 2)), float(np.sum((ms - p_big) ** 2)), n, k_big,
                          extra=k_big - k_small)
        tests[f"{chosen}_vs_{richer}_p"] = p_val
        if p_val < 0.05:
            chosen = richer
    pred, _, info = models[chosen]
    table = {r: float(pred[ranks == r][0]) for r in uniq}
    return table, {"model": chosen, **info, **tests, "r2": _r2(ms, pred), "n_points": int(n),
                   "measured_ranks": uniq}


def fit_loading_v1(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """Disk->CPU on every run (disk reads do not depend on the slot); CPU->GPU on runs whose
    adapter rank equals max_lora_rank (the slot padding adds 1-2 ms otherwise; the table has one
    index, the adapter rank)."""
    fam = f"digital_twin_dynamic/estimators/predictor_loading/{entry.csv_name}/"
    rows = _family(runs, fam)
    rows = rows[rows["status"] == "ok"]
    rank = _num(rows["adapter_module_ranks"])
    slot = _num(rows["max_lora_rank"])
    disk = 1000.0 * _num(rows["adapter_load_time_from_disk_s"]) / _num(rows["adapter_loads_from_disk"])
    cpu = 1000.0 * _num(rows["adapter_load_time_from_memory_s"]) / _num(rows["adapter_loads_from_memory"])
    disk_tab, disk_info = _rank_table(rank, disk)
    diag = rank == slot
    cpu_tab, cpu_info = _rank_table(rank[diag], cpu[diag])
    off = {f"r{int(a)}_in_slot_{int(s)}": c for a, s, c in zip(rank[~diag], slot[~diag], cpu[~diag])}
    return FitResult(params={"disk_to_cpu_ms": disk_tab, "cpu_to_gpu_ms": cpu_tab}, families=[fam],
                     n=int(len(rows)), extra={"disk_to_cpu": disk_info, "cpu_to_gpu": cpu_info,
                                              "cpu_to_gpu_off_diagonal_ms": off},
                     plot={"rank": rank, "disk": disk, "cpu": cpu, "diag": diag,
                           "disk_tab": disk_tab, "cpu_tab": cpu_tab})


def fit_loading_v0(runs: pd.DataFrame, entry: ModelEntry, fallback: Callable[[], FitResult]) -> FitResult:
    """Disk->CPU from ``lora_loading_time_s`` (one load per run, logged at 0.1 s resolution).

    ``lora_activating_time_s`` is 0.0 in every run (below the 0.1 s resolution), so CPU->GPU is not
    identifiable from this model's data; ``fallback`` supplies it (documented in ``fit``).
    """
    fam = f"performance_analysis/loading_overhead/latency/{entry.csv_name}/"
    rows = _family(runs, fam)
    rows = rows[(rows["status"] == "ok")]
    load = _num(rows["lora_loading_time_s"])
    act = _num(rows["lora_activating_time_s"])
    rank = _num(rows["max_lora_rank"])
    ok = np.isfinite(load)
    disk_tab, disk_info = _rank_table(rank[ok], 1000.0 * load[ok])
    fb = fallback()
    cpu_tab = fb.params["cpu_to_gpu_ms"]
    return FitResult(params={"disk_to_cpu_ms": disk_tab, "cpu_to_gpu_ms": cpu_tab}, families=[fam],
                     n=int(ok.sum()),
                     extra={"disk_to_cpu": disk_info,
                            "cpu_to_gpu": {"identifiable": False,
                                           "max_logged_activating_time_s": float(np.nanmax(act)),
                                           "resolution_s": 0.1,
                                           "chosen": "same-H100 CPU->GPU times of Llama-3.1-8B (same module "
                                                     "structure: qkv/o/gate_up/down x 32 layers + embed + lm_head), "
                                                     "from its predictor_loading family",
                                           "source_families": fb.families}},
                     plot={"rank": rank[ok], "disk": 1000.0 * load[ok], "cpu": None, "diag": None,
                           "disk_tab": disk_tab, "cpu_tab": cpu_tab})


# =================================================================================================
# Memory check (all real runs of the model, validation families included: a check, not a fit)
# =================================================================================================
def _csv_model_of(profile: Profile) -> str:
    name = profile.fit.get("model") if isinstance(profile.fit, dict) else None
    if name in MODELS:
        return name
    for key, entry in MODELS.items():
        if entry.spec.name == profile.model.name and entry.vllm_version == profile.vllm_version:
            return key
    raise ScenarioError(f"memory_check: cannot tell which CSV model profile {profile.name!r} describes; "
                        f"known models: {sorted(MODELS)}")


def memory_check(runs_df: pd.DataFrame, profile: Profile, model: str | None = None) -> dict[str, Any]:
    """Predict start-up (ok vs gpu_oom) and KV size for every real run of the profile's model.

    Uses :meth:`Profile.startup_check` / :meth:`Profile.kv_capacity_tokens` exactly as the twin does;
    NaN ``max_num_batched_tokens`` / ``gpu_memory_utilization`` mean the profile's defaults; runs
    with ``enable_lora = 0`` have no slots.  Returns accuracy, confusion counts, the misclassified
    runs, and KV errors overall, per family and at the calibration's ``max_num_seqs``.
    """
    model = model or _csv_model_of(profile)
    entry = model_entry(model)
    rows = runs_df[(runs_df["model"] == model) & runs_df["status"].isin(["ok", "gpu_oom"])]
    if rows.empty:
        raise ScenarioError(f"memory_check: no ok/gpu_oom runs of model {model!r}")
    util, mnbt, n_loras, ranks = _startup_config(rows, profile)
    lora_on = _num(rows["enable_lora"]) == 1
    measured = _measured_kv_tokens(rows)
    seqs = _num(rows["max_num_seqs"])
    actual_ok = (rows["status"] == "ok").to_numpy()
    pred_ok, pred_kv = [], []
    seqs_or_default = np.where(np.isfinite(seqs), seqs, profile.defaults.max_num_seqs)
    for nl, r, u, mb, ms in zip(n_loras, ranks, util, mnbt, seqs_or_default):
        starts, kv, _ = profile.startup_check(int(nl), int(r), float(u), int(mb), max_num_seqs=int(ms))
        pred_ok.append(starts)
        pred_kv.append(profile.kv_capacity_tokens(int(nl), int(r), float(u), int(mb), enable_lora=int(nl) > 0,
                                                  max_num_seqs=int(ms)))
    pred_ok, pred_kv = np.array(pred_ok), np.array(pred_kv, float)
    fam = rows["experiment"].str.split("/").str[:3].str.join("/").to_numpy()
    wrong = pred_ok != actual_ok
    has_kv = np.isfinite(measured) & (measured > 0)
    rel = np.where(has_kv, (pred_kv - measured) / np.where(has_kv, measured, 1.0), np.nan)

    def kv_stats(mask: np.ndarray) -> dict[str, Any]:
        m = mask & has_kv
        if not m.any():
            return {"n": 0}
        return {"n": int(m.sum()), "max_abs_rel_error": float(np.nanmax(np.abs(rel[m]))),
                "mean_abs_rel_error": float(np.nanmean(np.abs(rel[m]))),
                "within_2pct": float(np.mean(np.abs(rel[m]) <= 0.02))}

    at_cal = seqs == entry.memory_max_num_seqs
    # Largest errors, one row per distinct configuration (repeated runs log the same KV size).
    worst, seen = [], set()
    for i in np.argsort(-np.nan_to_num(np.abs(rel), nan=-1), kind="stable"):
        key = (fam[i], n_loras[i], ranks[i], seqs[i], measured[i])
        if not np.isfinite(rel[i]) or key in seen:
            continue
        seen.add(key)
        worst.append(i)
        if len(worst) == 8:
            break
    out = {
        "model": model, "n_runs": int(len(rows)),
        "accuracy": float(np.mean(~wrong)),
        "confusion": {"ok_pred_ok": int(np.sum(actual_ok & pred_ok)), "ok_pred_oom": int(np.sum(actual_ok & ~pred_ok)),
                      "oom_pred_ok": int(np.sum(~actual_ok & pred_ok)), "oom_pred_oom": int(np.sum(~actual_ok & ~pred_ok))},
        "misclassified": [{"experiment": e, "max_loras": int(nl), "max_lora_rank": int(r), "status": s,
                           "predicted_kv": int(k), "measured_kv": (None if not np.isfinite(m) else int(m))}
                          for e, nl, r, s, k, m in zip(rows["experiment"][wrong], n_loras[wrong], ranks[wrong],
                                                       rows["status"][wrong], pred_kv[wrong], measured[wrong])],
        "accuracy_by_family": {f: float(np.mean(~wrong[fam == f])) for f in sorted(set(fam))},
        "kv_ok_runs": kv_stats(actual_ok),
        "kv_ok_runs_at_calibrated_max_num_seqs": kv_stats(actual_ok & at_cal & lora_on),
        "kv_gpu_oom_runs": kv_stats(~actual_ok),
        "kv_by_family_ok_runs": {f: kv_stats(actual_ok & (fam == f)) for f in sorted(set(fam))},
        "kv_by_max_num_seqs_ok_runs": {int(s): kv_stats(actual_ok & (seqs == s))
                                       for s in sorted(set(seqs[np.isfinite(seqs)]))},
        "worst_kv": [{"experiment": rows["experiment"].iloc[i], "max_loras": int(n_loras[i]),
                      "max_lora_rank": int(ranks[i]), "max_num_seqs": float(seqs[i]), "status": rows["status"].iloc[i],
                      "measured": int(measured[i]), "predicted": int(pred_kv[i]), "rel_error": float(rel[i])}
                     for i in worst if np.isfinite(rel[i])],
        "calibrated_max_num_seqs": entry.memory_max_num_seqs,
    }
    return out


# =================================================================================================
# Assembling the profile
# =================================================================================================
def _fit_all(runs: pd.DataFrame, entry: ModelEntry) -> dict[str, FitResult | None]:
    fits: dict[str, FitResult | None] = {"memory": fit_memory(runs, entry),
                                         "max_num_seqs_term": fit_max_num_seqs_term(runs, entry)}
    if entry.engine == "v1":
        fits["decode"] = fit_decode_v1(runs, entry)
        fits["prefill"] = fit_prefill_v1(runs, entry, fits["decode"])
        fits["lora"] = fit_lora_v1(runs, entry, fits["decode"])
        fits["loading"] = fit_loading_v1(runs, entry)
    else:
        fits["lora"] = fit_lora_v0(runs, entry)
        fits["decode"] = fit_decode_v0(runs, entry, fits["lora"])
        fits["prefill"] = fit_prefill_vidur(entry)
        fits["loading"] = fit_loading_v0(
            runs, entry, lambda: fit_loading_v1(runs, MODELS["llama-3.1-8b-instruct"]))
    return fits


def _rel_data_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _profile_dict(entry: ModelEntry, fits: dict[str, FitResult | None], data_path: Path,
                  out: Path) -> dict[str, Any]:
    mem, dec, pre, lora, load = (fits[k] for k in ("memory", "decode", "prefill", "lora", "loading"))
    seqs_term = fits["max_num_seqs_term"]
    model = dataclasses.asdict(entry.spec)
    memory = {"gpu_memory_gib": GPU_MEMORY_GIB,
              "weights_gib": _sig(mem.params["weights_gib"]),
              "non_kv_overhead_gib": _sig(mem.params["non_kv_overhead_gib"]),
              "overhead_gib_per_1k_batched_tokens": 0.0,
              "overhead_ref_max_num_seqs": entry.memory_max_num_seqs,
              "overhead_gib_per_1k_seqs": _sig(seqs_term.params["slope_gib_per_1k_seqs"]) if seqs_term else 0.0,
              "seqs_knee": _sig(seqs_term.params["knee_seqs"]) if seqs_term else 0.0,
              "slot_fixed_mib": _sig(mem.params["slot_fixed_mib"]),
              "slot_rank_scale": _sig(mem.params["slot_rank_scale"]),
              "block_size": BLOCK_SIZE}
    latency = {"base_ms": _sig(dec.params["base_ms"]), "per_seq_ms": _sig(dec.params["per_seq_ms"]),
               "per_token_ms": _sig(pre.params["per_token_ms"]),
               "per_ctx_ktoken_ms": _sig(dec.params["per_ctx_ktoken_ms"]),
               "lora": {int(r): {k: _sig(v) for k, v in p.items()} for r, p in lora.params.items()},
               "sched_base_ms": 0.0, "sched_per_running_ms": 0.0, "sched_per_waiting_ms": 0.0}
    loading = {"cpu_to_gpu_ms": {int(r): _sig(v) for r, v in load.params["cpu_to_gpu_ms"].items()},
               "disk_to_cpu_ms": {int(r): _sig(v) for r, v in load.params["disk_to_cpu_ms"].items()}}
    data_rel = _rel_data_path(data_path)
    fit = {
        "tool": "lora_opt.calibrate",
        "model": entry.csv_name,
        "command": (f"lora-opt calibrate --runs {data_rel} --model {entry.csv_name} "
                    f"--out {_rel_data_path(out)}"),
        "data": {"file": data_rel, "sha256": sha256_of(data_path)},
        "setup": {"gpu_memory_gib": GPU_MEMORY_GIB, "gpu_memory_utilization": DEFAULT_UTIL,
                  "vllm_version": entry.vllm_version, "engine": entry.engine},
        "estimators": {
            "memory": mem.summary(),
            "max_num_seqs_term": (fits["max_num_seqs_term"].summary() if fits["max_num_seqs_term"]
                                  else {"identified": False,
                                        "note": "fewer than 4 distinct max_num_seqs values without LoRA"}),
            "step_decode": dec.summary(),
            "step_prefill_per_token": pre.summary(),
            "lora_overhead": lora.summary(),
            "loading": load.summary(),
            "scheduler": {"identified": False,
                          "note": "no estimator family separates schedule() CPU time from the forward "
                                  "pass; its cost is inside base_ms/per_seq_ms; constants left 0"},
        },
        "notes": list(entry.notes),
    }
    return {"name": entry.profile_name, "vllm_version": entry.vllm_version,
            "lora_set_rule": entry.lora_set_rule, "reserve_full_prompt": entry.reserve_full_prompt,
            "chunked_prefill": entry.engine == "v1",
            "model": model, "memory": memory, "latency": latency, "loading": loading,
            "defaults": dataclasses.asdict(entry.defaults), "fit": _clean(fit)}


def _header(entry: ModelEntry, data_rel: str) -> str:
    return (f"# Generated by lora_opt.calibration.profile_fit from {data_rel} (model {entry.csv_name}).\n"
            "# Do not edit by hand: rerun the command in fit.command.\n")


def calibrate(runs_csv: str | Path, model: str, out: str | Path,
              report_dir: str | Path | None = None) -> dict[str, Any]:
    """Fit a profile for ``model`` from ``runs_csv``; write it to ``out`` (and a report).

    Returns the profile as a dict (the YAML's content, loadable by ``profile_from_dict``).
    Raises ScenarioError on an unknown model, a missing/unreadable CSV or missing columns.
    """
    entry = model_entry(model)
    runs = load_runs(runs_csv)
    if not (runs["model"] == entry.csv_name).any():
        raise ScenarioError(f"calibrate: {runs_csv} has no runs of model {model!r}; models present: "
                            f"{sorted(set(runs['model']))}")
    fits = _fit_all(runs, entry)
    out = Path(out)
    data_path = Path(runs_csv)
    prof = _profile_dict(entry, fits, data_path, out)
    prof = _carry_e2e(prof, out)
    profile = profile_from_dict(prof, str(out))  # schema check before anything is written
    if fits["max_num_seqs_term"] is None and entry.engine == "v0":
        term = fit_max_num_seqs_term_v0(runs, entry, profile)
        if term is not None:
            fits["max_num_seqs_term"] = term
            prof["memory"]["overhead_gib_per_1k_seqs"] = _sig(term.params["slope_gib_per_1k_seqs"])
            prof["memory"]["seqs_knee"] = _sig(term.params["knee_seqs"])
            prof["fit"]["estimators"]["max_num_seqs_term"] = _clean(term.summary())
            profile = profile_from_dict(prof, str(out))
    check = memory_check(runs, profile, entry.csv_name)
    prof["fit"]["memory_check"] = _clean(_check_summary(check))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as fh:
        fh.write(_header(entry, _rel_data_path(data_path)))
        yaml.safe_dump(prof, fh, sort_keys=False, default_flow_style=None, width=110)
    if report_dir is not None:
        from lora_opt.calibration import report as calibrate_report  # matplotlib only when a report is asked for

        calibrate_report.write_report(Path(report_dir), entry, prof, fits, check)
    return prof


E2E_LATENCY_KEYS = ("ttft_frontend_ms", "ttft_frontend_per_running_ms", "sched_base_ms")   # V0: step overhead
E2E_LORA_KEYS = ("slot_share", "prefill_share")


def _carry_e2e(prof: dict[str, Any], out: Path) -> dict[str, Any]:
    """Keep the end-to-end constants (``lora-opt calibrate-e2e``, fitted on half of the
    end-to-end runs) of the profile being overwritten: they are not estimator fits."""
    if not out.exists():
        return prof
    old = yaml.safe_load(out.read_text()) or {}
    e2e = (old.get("fit") or {}).get("e2e")
    if not e2e:
        return prof
    from lora_opt.calibration.e2e_fit import _with_params

    p = e2e["params"]
    prof = _with_params(prof, p["slot_share"], p["prefill_share"],
                        (p["ttft_frontend_ms"], p["ttft_frontend_per_running_ms"]), p.get("step_overhead_ms", 0.0))
    prof["fit"]["e2e"] = e2e
    return prof


def _check_summary(check: dict[str, Any]) -> dict[str, Any]:
    keep = ("n_runs", "accuracy", "confusion", "accuracy_by_family", "kv_ok_runs",
            "kv_ok_runs_at_calibrated_max_num_seqs", "kv_gpu_oom_runs", "kv_by_max_num_seqs_ok_runs",
            "calibrated_max_num_seqs")
    return {k: check[k] for k in keep}


__all__ = ["calibrate", "memory_check", "load_runs", "MODELS", "ESTIMATOR_PREFIXES",
           "expected_distinct_adapters", "weights_gib"]
