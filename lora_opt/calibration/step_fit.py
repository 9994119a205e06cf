"""Step time (``LatencySpec``): the pieces both engine generations' fits share.

::

    model_ms = (base + per_seq*n_seqs + per_token*(n_tokens - n_seqs) + per_ctx*ctx/1000) * factor(D)
    factor(D) = 1 + jump + slope*D/(1 + D/n_sat)   (D = distinct adapters in the batch, >= 1)

Here: the decode part of the model, the LoRA factor's fit (``n_sat`` only when an F-test demands
it), the expected number of distinct adapters in a batch, and the per-token prefill cost from the
GPU's vidur kernel profile (``GpuEntry.kernel_profile_file``).  Scheduler constants: no estimator
family separates ``schedule()`` time from the forward pass (both are in every ITL), so they stay 0
and their cost is inside ``base``/``per_seq``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize, special, stats

from lora_opt.calibration.fitting import F_TEST_ALPHA, f_test_p, r2_score
from lora_opt.calibration.model_table import MODELS, ModelEntry
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
