"""Step time (``LatencySpec``): the pieces both engine generations' fits share.

::

    model_ms = (base + per_seq*n_seqs + per_token*(n_tokens - n_seqs) + per_ctx*ctx/1000) * factor(D)
    factor(D) = 1 + jump + slope*D/(1 + D/n_sat)   (D = distinct adapters in the batch, >= 1)

Here: the decode part of the model, the LoRA factor's fit (``n_sat`` only when an F-test demands
it), the expected number of distinct adapters in a batch, and the per-token prefill cost from the
GPU's vidur kernel profile (``GpuEntry.kernel_profile_file``).  Scheduler constants: no estimator
family separates ``schedule()`` time from the forward pass (both are in every ITL), so they stay 0
and their cost is inside ``base``/``per_seq``.

Each engine generation's fits, named by its suffix (the keys of ``generations.GENERATIONS``):

* ``_v1`` -- vLLM 0.8.5's V1 engine (chunked prefill; Llama-3.1, Qwen-2.5), lockstep synthetic runs:
  ``base``, ``per_seq``, ``per_ctx`` by linear least squares of the mean ITL on the running batch
  and its context in ``predictor_default_latency/*/output`` and
  ``predictor_latency_overhead/*/initial_points_small`` (no LoRA, lockstep synthetic decodes);
  ``per_token`` from ``predictor_default_latency/*/input`` (output 1): the run duration is
  regressed on the prefill tokens of the simulated chunked-prefill steps plus a per-request
  intercept (the HTTP front end / IPC cost the step model does not contain); only the slope
  is kept; ``jump``, ``slope``, ``n_sat`` from ``predictor_latency_overhead/*/overhead_small`` with D = the
  expected number of distinct adapters in a batch of ``running_mean`` requests drawn from the
  benchmark's balanced, shuffled request list (hypergeometric).
* ``_v0`` -- the vLLM 0.5.0 fork (V0 engine, no chunked prefill; Llama-2-7B): ``factor`` per
  ``max_lora_rank`` from ``performance_analysis/compute_overhead`` as the duration ratio to the same
  group's run without adapter requests (D = the logged ``mean_loras_by_batch``); ``base``,
  ``per_seq``, ``per_ctx`` from the median ITL of the same family (decode-dominated datasets,
  de-LoRA'd with the fitted factor) and of ``performance_analysis/loading_overhead``; ``per_token``
  is not identifiable from V0's runs and comes from the GPU's vidur kernel profile
  (``GpuEntry.kernel_profile_file``; on the H100, of this very model).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, special, stats

from lora_opt.calibration.fitting import F_TEST_ALPHA, FitResult, f_test_p, r2_score, relative_linear_fit
from lora_opt.calibration.model_table import MODELS, ModelEntry
from lora_opt.calibration.runs_csv import family_rows, measured_kv_tokens, num, per_request_lengths
from twin.paths import bundle_relative
from twin.profile import ModelSpec, lora_extra


def decode_ctx_per_seq(inp: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Mean KV-resident context of a sequence over its decode steps (lockstep waves)."""
    return inp + np.maximum(out - 2.0, 0.0) / 2.0


def decode_model(p: dict[str, float], b: np.ndarray, ctx_k: np.ndarray) -> np.ndarray:
    return p["base_ms"] + p["per_seq_ms"] * b + p["per_ctx_ktoken_ms"] * ctx_k


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


def fit_lora_factor(x: np.ndarray, y: np.ndarray, base: np.ndarray) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit ``y = base * (1 + jump + slope*x/(1 + x/n_sat))`` on relative errors.

    ``n_sat`` is kept only if an F-test against the linear model (n_sat = inf) says p < alpha.
    """
    def model(p, sat):
        jump, slope = p[0], p[1]
        n_sat = math.exp(p[2]) if sat else math.inf
        return base * lora_extra(1.0 + jump, slope, n_sat, x)     # the factor 1 + extra

    lin = optimize.least_squares(lambda p: model(p, False) / y - 1.0, [1.0, 0.01],
                                 bounds=([0.0, 0.0], [10.0, 1.0]), xtol=1e-14, ftol=1e-14, gtol=1e-14)
    sat = optimize.least_squares(lambda p: model(p, True) / y - 1.0, [lin.x[0], lin.x[1], math.log(200.0)],
                                 bounds=([0.0, 0.0, 0.0], [10.0, 1.0, math.log(1e6)]),
                                 xtol=1e-14, ftol=1e-14, gtol=1e-14)
    sse_lin, sse_sat = float(np.sum(lin.fun ** 2)), float(np.sum(sat.fun ** 2))
    p_val = f_test_p(sse_lin, sse_sat, len(y), 3)
    use_sat = p_val < F_TEST_ALPHA and sat.x[2] < math.log(1e6) - 1e-6
    if use_sat:
        params = {"jump": sat.x[0], "slope": sat.x[1], "n_sat": math.exp(sat.x[2])}
        pred = model(sat.x, True)
    else:
        params = {"jump": lin.x[0], "slope": lin.x[1], "n_sat": math.inf}
        pred = model(lin.x, False)
    info = {"r2": r2_score(y, pred), "n_sat_test": {"fitted": bool(use_sat), "p_value": p_val,
                                                "free_n_sat": math.exp(sat.x[2])},
            "max_abs_rel_error": float(np.max(np.abs(pred / y - 1))), "pred": pred}
    return params, info


# ---- the GPU's kernel profile (vidur) -----------------------------------------------------------
def kernel_profile_per_token_ms(entry: ModelEntry) -> float | None:
    """Independent per-token prefill cost: the GPU's vidur linear-op times of its profiled model,
    scaled by the ratio of per-layer linear FLOPs and by the layer count (attention kernels
    excluded).  None when the GPU has no kernel profile."""
    path = entry.gpu.kernel_profile_file
    if path is None or not Path(path).exists():
        return None
    slope_per_layer, _ = kernel_layer_slope(path)
    ref = MODELS[entry.gpu.kernel_profile_model].spec
    ratio = (linear_params_per_layer(entry.spec) / linear_params_per_layer(ref))
    return slope_per_layer * ratio * entry.spec.num_layers


def linear_params_per_layer(s: ModelSpec) -> int:
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * s.intermediate_size


def kernel_layer_slope(path: Path) -> tuple[float, float]:
    """(ms per token per layer, R^2): linear fit of one layer's op times for num_tokens >= 1024, TP 1."""
    d = pd.read_csv(path)
    d = d[d["num_tensor_parallel_workers"] == 1]
    ops = ["input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add"]
    # Two residual adds per layer; the file times one.
    layer = sum(d[f"time_stats.{o}.median"] for o in ops) + d["time_stats.add.median"]
    big = d["num_tokens"] >= 1024
    fit = stats.linregress(d.loc[big, "num_tokens"].to_numpy(float), layer[big].to_numpy(float))
    return float(fit.slope), float(fit.rvalue ** 2)


def fit_lora_step_ms(batch: np.ndarray, extra: np.ndarray, y: np.ndarray) -> float:
    """LoRA's fixed ms a step (``step_ms``) from decode windows at several batch sizes: the intercept of
    ``extra = step_ms + token_ms x B`` (non-negative least squares on relative errors); 0 from windows at one
    batch size (not identified: every ms goes on the tokens, as before)."""
    if len(np.unique(batch)) < 2:
        return 0.0
    w = 1.0 / y
    sol, _ = optimize.nnls(np.column_stack([w, w * batch]), w * extra)
    return float(sol[0])


# ---- vLLM 0.8.5 (V1: chunked prefill, lockstep synthetic runs) ------------------------------------
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


# ---- vLLM 0.5.0 (V0: no chunked prefill) --------------------------------------------------------
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


def fit_prefill_v0(entry: ModelEntry) -> FitResult:
    """``per_token`` from the GPU's vidur kernel profile (V0's runs do not identify it)."""
    path = entry.gpu.kernel_profile_file
    slope, r2 = kernel_layer_slope(path)
    ref = MODELS[entry.gpu.kernel_profile_model].spec
    ratio = linear_params_per_layer(entry.spec) / linear_params_per_layer(ref)
    return FitResult(params={"per_token_ms": slope * ratio * entry.spec.num_layers},
                     families=[bundle_relative(path)], n=0, r2=r2,
                     extra={"target": "per-layer linear-op time vs num_tokens (>= 1024, TP 1) x layers"})
