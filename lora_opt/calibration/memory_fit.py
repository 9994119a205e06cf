"""Memory (``MemorySpec``): vLLM's start-up accounting fitted on the memory family's KV sizes.

::

    kv_tokens = floor((util*M - weights - overhead - max_loras*slot(r)) / (16*kv_bytes_per_token))*16
    slot(r)   = lora_elements_per_rank * 2 B * slot_rank_scale * r + slot_fixed_mib

* ``weights_gib`` is computed from the model's dimensions (parameter count x 2 B): the KV data
  only identify the sum ``weights + overhead``, so the split comes from config.json, not a fit.
* ``non_kv_overhead_gib`` (= fitted sum - weights), ``slot_fixed_mib`` and, only when an F-test
  says the data demand it, ``slot_rank_scale``: least squares on the relative KV error of every
  LoRA-enabled start-up of the generation's memory families, with their ``gpu_oom`` rows as hinge
  constraints (their KV must fall below ``max_model_len``).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import optimize

from lora_opt.calibration.fitting import F_TEST_ALPHA, FitResult, f_test_p, r2_score
from lora_opt.calibration.model_table import ModelEntry
from lora_opt.calibration.runs_csv import BLOCK_SIZE, DEFAULT_UTIL, family_rows, measured_kv_tokens, num
from twin.errors import ScenarioError
from twin.profile import GIB, MIB, ModelSpec


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


def per_layer_lora(s: ModelSpec) -> int:
    """Per-rank LoRA elements of one decoder layer (qkv, o, gate_up, down)."""
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return 7 * h + 2 * q + 2 * kv + 3 * s.intermediate_size


def _kv_model_tokens(params: np.ndarray, n_loras: np.ndarray, rank: np.ndarray, entry: ModelEntry,
                     fit_scale: bool) -> np.ndarray:
    """Continuous (un-floored) KV tokens for params = [weights+overhead GiB, slot_fixed MiB, scale]."""
    used, fixed = params[0], params[1]
    scale = params[2] if fit_scale else 1.0
    per_rank = entry.spec.lora_elements_per_rank * entry.spec.dtype_bytes * scale
    avail = DEFAULT_UTIL * entry.gpu.memory_gib * GIB - used * GIB - n_loras * (rank * per_rank + fixed * MIB)
    return avail / entry.spec.kv_bytes_per_token


def fit_memory(runs: pd.DataFrame, entry: ModelEntry, families: list[str]) -> FitResult:
    """Fit ``weights+overhead`` and ``slot_fixed_mib`` (``slot_rank_scale`` if the F-test demands).

    Measurements: every LoRA-enabled start-up of the memory ``families`` at the entry's
    ``memory_max_num_seqs`` with a logged KV size and a status other than ``gpu_oom``; residuals are
    relative (the acceptance check is relative, and a small KV cache is where a relative error
    changes the batch size most).  Constraints: ``gpu_oom`` rows must predict fewer KV tokens than
    ``max_model_len`` (hinge).
    """
    fams = list(families)
    rows = pd.concat([family_rows(runs, f) for f in fams])
    rows = rows[(num(rows["enable_lora"]) == 1) & (num(rows["max_num_seqs"]) == entry.memory_max_num_seqs)]
    kv = measured_kv_tokens(rows)
    is_oom = (rows["status"] == "gpu_oom").to_numpy()
    meas = ~is_oom & np.isfinite(kv) & (kv > 0)
    n_m, r_m, y = num(rows["max_loras"])[meas], num(rows["max_lora_rank"])[meas], kv[meas]
    n_o, r_o = num(rows["max_loras"])[is_oom], num(rows["max_lora_rank"])[is_oom]
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
    lo, hi = np.array([0.0, 0.0, 0.3]), np.array([entry.gpu.memory_gib, 1024.0, 3.0])
    fit1 = optimize.least_squares(lambda p: residuals(np.r_[p, 1.0], False), x0[:2], bounds=(lo[:2], hi[:2]),
                                  x_scale=[1.0, 1.0], xtol=1e-14, ftol=1e-14, gtol=1e-14)
    fit2 = optimize.least_squares(lambda p: residuals(p, True), x0, bounds=(lo, hi),
                                  xtol=1e-14, ftol=1e-14, gtol=1e-14)
    sse1, sse2 = float(np.sum(fit1.fun ** 2)), float(np.sum(fit2.fun ** 2))
    p_scale = f_test_p(sse1, sse2, len(fit1.fun), 3)
    use_scale = p_scale < F_TEST_ALPHA
    params = (fit2.x if use_scale else np.r_[fit1.x, 1.0]).copy()
    if params[1] < 1e-9:  # optimiser noise at the zero bound of slot_fixed_mib
        params[1] = 0.0
    pred = _kv_model_tokens(params, n_m, r_m, entry, True)
    rel = (pred - y) / y
    w = weights_gib(entry)
    code_scale_no_embed = (entry.spec.num_layers * per_layer_lora(entry.spec)) / entry.spec.lora_elements_per_rank
    res = FitResult(
        params={"weights_gib": w, "non_kv_overhead_gib": params[0] - w,
                "slot_fixed_mib": params[1], "slot_rank_scale": params[2]},
        families=fams, n=int(len(y) + len(n_o)), r2=r2_score(y, pred),
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

