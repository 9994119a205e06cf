"""Step time on the vLLM 0.5.0 fork (V0 engine, no chunked prefill; Llama-2-7B).

* ``factor`` per ``max_lora_rank`` from ``performance_analysis/compute_overhead`` as the duration
  ratio to the same group's run without adapter requests (D = the logged ``mean_loras_by_batch``);
* ``base``, ``per_seq``, ``per_ctx`` from the median ITL of the same family (decode-dominated
  datasets, de-LoRA'd with the fitted factor) and of ``performance_analysis/loading_overhead``;
* ``per_token`` is not identifiable from V0's runs and comes from the GPU's vidur kernel profile
  (``GpuEntry.kernel_profile_file``; on the H100, of this very model).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from lora_opt.calibration.fitting import FitResult, r2_score, relative_linear_fit
from lora_opt.calibration.model_table import MODELS, ModelEntry
from lora_opt.calibration.runs_csv import family_rows, measured_kv_tokens, num, per_request_lengths
from lora_opt.calibration.step_fit import (decode_ctx_per_seq, fit_lora_factor, kernel_layer_slope,
                                           linear_params_per_layer)
from twin.paths import bundle_relative
from twin.profile import lora_extra


def fit_lora_v0(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """Factor per rank = run duration / duration of the same group's run without adapter requests.

    Within a group (dataset, max_loras, max_lora_rank) the workload and KV size are identical, so
    the duration ratio is the mean forward-pass factor; D is the logged ``mean_loras_by_batch``.
    """
    fam = f"performance_analysis/compute_overhead/{entry.csv_name}/"
    rows = family_rows(runs, fam)
    rows = rows[rows["status"] == "ok"].copy()
    rows["group"] = rows["dataset"].astype(str) + "|" + rows["max_loras"].astype(str) + "|" + rows["max_lora_rank"].astype(str)
    x, y, rk, grp = [], [], [], []
    for g, sub in rows.groupby("group", sort=True):
        ref = sub[num(sub["restrict_loras"]) == 0]
        if ref.empty:
            continue
        d0 = float(ref["duration_s"].iloc[0])
        lora = sub[num(sub["restrict_loras"]) > 0]
        x += list(num(lora["mean_loras_by_batch"]))
        y += list(num(lora["duration_s"]) / d0)
        rk += list(num(lora["max_lora_rank"]))
        grp += [g] * len(lora)
    x, y, rk = np.array(x), np.array(y), np.array(rk)
    per_rank, extra, plot = {}, {}, {}
    for rank in sorted(set(rk.astype(int))):
        sel = (rk == rank) & np.isfinite(x) & np.isfinite(y)
        params, info = fit_lora_factor(x[sel], y[sel], np.ones(sel.sum()))
        params["ref_max_loras"] = int(np.median(num(rows["max_loras"])[num(rows["restrict_loras"]) > 0]))
        per_rank[rank] = params
        extra[f"rank_{rank}"] = {"r2": info["r2"], "n_points": int(sel.sum()), "n_sat_test": info["n_sat_test"],
                                 "max_abs_rel_error": info["max_abs_rel_error"]}
        plot[rank] = {"x": x[sel], "served": x[sel], "y": y[sel], "pred": info["pred"]}
    extra["x_variable"] = "logged mean_loras_by_batch"
    extra["target"] = "duration / duration of the group's run without adapter requests"
    r2_all = float(np.mean([v["r2"] for k, v in extra.items() if k.startswith("rank_")]))
    return FitResult(params=per_rank, families=[fam], n=int(len(y)), r2=r2_all, extra=extra, plot=plot)


def _lora_factor(params: dict[str, float], d: np.ndarray) -> np.ndarray:
    """1 + extra at the fitted runs' own slot count (where ``jump`` was measured): ``lora_extra``
    with ``1 + jump`` (the fit's own association, so the factor is bit-identical to its model's)."""
    jump, slope, n_sat = 1.0 + params["jump"], params["slope"], params["n_sat"]
    return np.array([1.0 if v <= 0 else lora_extra(jump, slope, n_sat, v) for v in d])


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
    rows_c = family_rows(runs, fam_c)
    # Only the runs without adapter requests: their median ITL needs no LoRA correction (the
    # duration-ratio factor overstates the decode-only ITL increase of V0's punica kernels).
    rows_c = rows_c[(rows_c["status"] == "ok") & ~rows_c["dataset"].astype(str).str.contains("p25")
                    & (num(rows_c["restrict_loras"]) == 0)]
    b_c = num(rows_c["running_mean"])
    ctx_c = num(rows_c["kv_cache_usage_mean"]) * measured_kv_tokens(rows_c) / 1000.0
    f_c = np.ones(len(rows_c))
    rows_l = family_rows(runs, fam_l)
    rows_l = rows_l[rows_l["status"] == "ok"]
    inp, out = per_request_lengths(rows_l)
    b_l = np.minimum(num(rows_l["max_num_seqs"]), num(rows_l["num_prompts"]))
    ctx_l = b_l * decode_ctx_per_seq(inp, out) / 1000.0
    f_l = _factor_by_rank(lora.params, num(rows_l["max_lora_rank"]), np.ones(len(rows_l)))
    y = np.r_[num(rows_c["median_itl_ms"]) / f_c, num(rows_l["median_itl_ms"]) / f_l]
    b, ctx_k = np.r_[b_c, b_l], np.r_[ctx_c, ctx_l]
    keep = np.isfinite(y) & np.isfinite(b) & np.isfinite(ctx_k) & (y > 0)
    y, b, ctx_k = y[keep], b[keep], ctx_k[keep]
    design = np.column_stack([np.ones_like(b), b, ctx_k])
    sol = relative_linear_fit(design, y)
    pred = design @ sol
    return FitResult(params={"base_ms": sol[0], "per_seq_ms": sol[1], "per_ctx_ktoken_ms": sol[2]},
                     families=[fam_c + " (mean/p75 datasets, no adapter requests)", fam_l], n=int(len(y)), r2=r2_score(y, pred),
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
    """``per_token`` from the GPU's vidur kernel profile (used where no real run identifies it)."""
    path = entry.gpu.kernel_profile_file
    slope, r2 = kernel_layer_slope(path)
    ref = MODELS[entry.gpu.kernel_profile_model].spec
    ratio = linear_params_per_layer(entry.spec) / linear_params_per_layer(ref)
    return FitResult(params={"per_token_ms": slope * ratio * entry.spec.num_layers},
                     families=[bundle_relative(path)], n=0, r2=r2,
                     extra={"target": "per-layer linear-op time vs num_tokens (>= 1024, TP 1) x layers"})
