"""The real-runs CSV (``data/real_runs/...``, ``lora-opt probe``/``ingest`` rows): reading it, validated,
and selecting a measurement family's rows.

:func:`load_runs` is the one reader of a real-runs CSV (calibrate, calibrate-e2e, fidelity, probe's
fit; ``tests/test_one_owner.py`` keeps it the only one): every reader gets the same checks.

Only the *estimator* families may be fitted on (:data:`ESTIMATOR_PREFIXES`); the validation
families (:data:`VALIDATION_PREFIXES`) are only checked against.  Every row a fit uses goes through
:func:`family_rows`, which refuses any other prefix.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from twin.errors import ScenarioError
from twin.paths import REAL_RUNS_CSV
from twin.profile import Profile

#: ``--gpu-memory-utilization`` used by every real run (NaN in the CSV = this default).
DEFAULT_UTIL = 0.9
BLOCK_SIZE = 16

#: Families allowed for fitting.  Anything else (validation runs) is refused by :func:`family_rows`.
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


def load_runs(runs_csv: str | Path = REAL_RUNS_CSV) -> pd.DataFrame:
    """Read and validate a real-run table (default: the bundled one); ScenarioError names what is
    wrong (the ``--runs`` file: missing, not a CSV, or without :data:`REQUIRED_COLUMNS`)."""
    path = Path(runs_csv)
    if not path.exists():
        raise ScenarioError(f"--runs: file not found: {path} "
                            f"(expected the real-run table, e.g. {RUNS_RELPATH})")
    try:
        df = pd.read_csv(path, low_memory=False)
    except Exception as exc:  # pandas raises several types for unreadable files
        raise ScenarioError(f"--runs: cannot read {path} as CSV: {exc}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ScenarioError(f"--runs: {path} lacks column(s) {missing}; "
                            f"required columns: {list(REQUIRED_COLUMNS)}")
    df["experiment"] = df["experiment"].astype(str)
    df["model"] = df["model"].astype(str)
    return df


def family_rows(df: pd.DataFrame, prefix: str) -> pd.DataFrame:
    """Rows whose experiment starts with ``prefix``; only estimator families may be fitted on."""
    if not prefix.startswith(ESTIMATOR_PREFIXES):
        raise AssertionError(f"refusing to fit on non-estimator family {prefix!r}")
    return df[df["experiment"].str.startswith(prefix)]


def num(series: pd.Series) -> np.ndarray:
    """A column as floats (unparseable -> NaN)."""
    return pd.to_numeric(series, errors="coerce").to_numpy(dtype=float)


def measured_kv_tokens(df: pd.DataFrame) -> np.ndarray:
    """Logged KV capacity: ``gpu_kv_cache_tokens`` (0.8.5) or ``gpu_kv_blocks * 16`` (0.5.0)."""
    tok = num(df["gpu_kv_cache_tokens"])
    blk = num(df["gpu_kv_blocks"]) * BLOCK_SIZE
    return np.where(np.isfinite(tok), tok, blk)


def per_request_lengths(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Mean (input, output) tokens per completed request of each run."""
    done = num(rows["completed"])
    return num(rows["total_input_tokens"]) / done, num(rows["total_output_tokens"]) / done


def startup_config(rows: pd.DataFrame, profile: Profile):
    """Per run (gpu_memory_utilization, max_num_batched_tokens, LoRA slots, max_lora_rank) as the
    engine started: missing values are the profile's defaults; ``enable_lora = 0`` means no slots."""
    d = profile.defaults
    util = np.where(np.isfinite(num(rows["gpu_memory_utilization"])), num(rows["gpu_memory_utilization"]),
                    d.gpu_memory_utilization)
    mnbt = np.where(np.isfinite(num(rows["max_num_batched_tokens"])), num(rows["max_num_batched_tokens"]),
                    d.max_num_batched_tokens)
    n_loras = np.where(num(rows["enable_lora"]) == 1, np.nan_to_num(num(rows["max_loras"]), nan=d.max_loras), 0)
    ranks = np.nan_to_num(num(rows["max_lora_rank"]), nan=d.max_lora_rank)
    return util, mnbt, n_loras, ranks
