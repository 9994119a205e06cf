"""Step time on vLLM 0.8.5's V1 engine (chunked prefill; Llama-3.1, Qwen-2.5): lockstep synthetic runs.

* ``base``, ``per_seq``, ``per_ctx`` by linear least squares of the mean ITL on the running batch
  and its context in ``predictor_default_latency/*/output`` and
  ``predictor_latency_overhead/*/initial_points_small`` (no LoRA, lockstep synthetic decodes).
* ``per_token`` from ``predictor_default_latency/*/input`` (output 1): the run duration is
  regressed on the prefill tokens of the simulated chunked-prefill steps plus a per-request
  intercept (the HTTP front end / IPC cost the step model does not contain); only the slope
  is kept.
* ``jump``, ``slope``, ``n_sat`` from ``predictor_latency_overhead/*/overhead_small`` with D = the
  expected number of distinct adapters in a batch of ``running_mean`` requests drawn from the
  benchmark's balanced, shuffled request list (hypergeometric).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, stats

from lora_opt.calibration.fitting import FitResult, r2_score, relative_linear_fit
from lora_opt.calibration.model_table import ModelEntry
from lora_opt.calibration.runs_csv import family_rows, num, per_request_lengths
from lora_opt.calibration.step_fit import (decode_ctx_per_seq, decode_model, expected_distinct_adapters,
                                           fit_lora_factor, kernel_profile_per_token_ms)


def fit_decode_v1(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """``ITL = base + per_seq*B + per_ctx*B*ctx/1000`` on no-LoRA lockstep decode runs."""
    fams = [f"digital_twin_dynamic/estimators/predictor_default_latency/{entry.csv_name}/output",
            f"digital_twin_dynamic/estimators/predictor_latency_overhead/{entry.csv_name}/initial_points_small/output"]
    rows = pd.concat([family_rows(runs, f) for f in fams])
    rows = rows[(rows["status"] == "ok") & (num(rows["enable_lora"]) == 0)]
    y, b = num(rows["mean_itl_ms"]), num(rows["running_mean"])
    inp, out = per_request_lengths(rows)
    ctx_k = b * decode_ctx_per_seq(inp, out) / 1000.0
    keep = np.isfinite(y) & (y > 0) & np.isfinite(b) & (b > 0) & np.isfinite(ctx_k)
    y, b, ctx_k = y[keep], b[keep], ctx_k[keep]
    design = np.column_stack([np.ones_like(b), b, ctx_k])
    sol = relative_linear_fit(design, y)
    pred = design @ sol
    return FitResult(params={"base_ms": sol[0], "per_seq_ms": sol[1], "per_ctx_ktoken_ms": sol[2]},
                     families=fams, n=int(len(y)), r2=r2_score(y, pred),
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
    rows = family_rows(runs, fam)
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
        params={"per_token_ms": sol.x[0]}, families=[fam], n=int(len(y)), r2=r2_score(y, pred),
        extra={"per_request_overhead_ms": sol.x[1],
               "naive_duration_slope_ms_per_token": slope_only.slope,
               "vidur_cross_check_per_token_ms": kernel_profile_per_token_ms(entry),
               "target": "run duration (ms) of output-1 synthetic runs, simulated chunked-prefill steps"},
        plot={"x": np.array(x_tok), "y": y, "pred": pred})



def fit_lora_v1(runs: pd.DataFrame, entry: ModelEntry, decode: FitResult) -> FitResult:
    """LoRA factor on ``overhead_small`` (max_loras 300, one max_lora_rank): ITL / decode model."""
    fam = f"digital_twin_dynamic/estimators/predictor_latency_overhead/{entry.csv_name}/overhead_small/output"
    rows = family_rows(runs, fam)
    rows = rows[(rows["status"] == "ok") & (num(rows["enable_lora"]) == 1)]
    y, b = num(rows["mean_itl_ms"]), num(rows["running_mean"])
    inp, out = per_request_lengths(rows)
    ctx_k = b * decode_ctx_per_seq(inp, out) / 1000.0
    served = num(rows["n_served_adapters"])
    dist = expected_distinct_adapters(served, b, num(rows["num_prompts"]))
    base = decode_model(decode.params, b, ctx_k)
    ranks = num(rows["max_lora_rank"])
    per_rank: dict[int, dict[str, float]] = {}
    extra: dict[str, Any] = {}
    plot: dict[str, Any] = {}
    for rank in sorted(set(ranks[np.isfinite(ranks)].astype(int))):
        sel = ranks == rank
        params, info = fit_lora_factor(dist[sel], y[sel], base[sel])
        params["ref_max_loras"] = int(np.median(num(rows["max_loras"])[sel]))
        per_rank[rank] = params
        extra[f"rank_{rank}"] = {"r2": info["r2"], "n_points": int(sel.sum()),
                                 "n_sat_test": info["n_sat_test"],
                                 "max_abs_rel_error": info["max_abs_rel_error"],
                                 "max_loras_of_runs": sorted(set(num(rows["max_loras"])[sel].astype(int)))}
        plot[rank] = {"x": dist[sel], "served": served[sel], "y": y[sel] / base[sel],
                      "pred": info["pred"] / base[sel]}
    extra["x_variable"] = ("expected distinct adapters in a batch of running_mean requests "
                           "(hypergeometric over the benchmark's balanced shuffled request list)")
    r2_all = float(np.mean([v["r2"] for k, v in extra.items() if k.startswith("rank_")]))
    return FitResult(params=per_rank, families=[fam], n=int(len(y)), r2=r2_all, extra=extra, plot=plot)


# =================================================================================================
