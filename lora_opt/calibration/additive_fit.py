"""The additive LoRA form, fitted on the end-to-end fit half (issue 36).

The papers' factor form prices a step with adapters at ``(1 + jump + slope * n)`` times its decode time.
The H100 end-to-end runs do not show that: at 1-3 sequences a step with an adapter costs ~3 ms more than
one without (the factor form: ~5 ms), at 60 sequences and ~50 distinct adapters ~39 ms more (the factor
form: ~24 ms).  The additive form prices the LoRA work as what the kernels do: a fixed cost a step
(``step_ms``) plus a launch over every slot (``slot_ms`` x ``max_loras``), a read of each distinct
adapter's matrices (``adapter_ms`` x adapters in the step), and a cost per decode token (``seq_ms`` +
``token_ms``) and per prefill token (``token_ms``, a share of a decode token's: prefill GEMMs are
compute-bound).

The estimator families cannot identify it (their LoRA runs all have ~200 sequences running and 300
slots).  The fit half can: its runs span 1-740 running requests, 8-192 slots and 8-384 adapters.  This is
a run-level least-squares fit, the same shape as the estimator fits (``lora_opt.calibration.step_fit``):
each run's mean ITL is one step with its mean running requests, their mean context, the prefill tokens
its input throughput puts in a step, and the distinct adapters expected among its running requests
(:func:`expected_distinct`).  The share of a decode token's cost a prefill token pays is chosen by
replaying the fit half (``lora_opt.calibration.e2e_fit``), like the factor form's prefill share.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from scipy import optimize

from lora_opt.calibration import realruns
from lora_opt.calibration.runs_csv import family_rows, num, per_request_lengths
from lora_opt.calibration.step_fit import decode_ctx_per_seq, expected_distinct_adapters

#: the additive form's constants, in the order of the fit's parameter vector
ADDITIVE_KEYS = ("step_ms", "slot_ms", "adapter_ms", "decode_token_ms")


def expected_distinct(rates: list[float], running: float, max_loras: float) -> float:
    """Expected distinct adapters among ``running`` requests whose adapters are independent draws with
    probability proportional to each adapter's request rate (Poisson arrivals, the same lengths for every
    adapter), at most ``max_loras`` (vLLM's LoRA gate)."""
    p = np.asarray(rates, float)
    p = p / p.sum()
    return float(min(max_loras, np.sum(1.0 - (1.0 - p) ** max(running, 0.0))))


def run_features(rows, latency) -> dict[str, np.ndarray]:
    """Per run: mean ITL (``y``), running requests (``seqs``), slots (``slots``), distinct adapters
    (``adapters``), prefill tokens a step (``prefill``) and the step's time without LoRA (``base``, the
    profile's estimators)."""
    seqs = rows["running_mean"].to_numpy(float)
    y = rows["mean_itl_ms"].to_numpy(float)
    slots = rows["max_loras"].to_numpy(float)
    per_req_in = (rows["total_input_tokens"] / rows["completed"]).to_numpy(float)
    per_req_out = (rows["total_output_tokens"] / rows["completed"]).to_numpy(float)
    ctx_k = seqs * (per_req_in + per_req_out / 2.0) / 1000.0
    prefill = rows["input_throughput"].to_numpy(float) * y / 1000.0
    adapters = np.array([expected_distinct([a["rate"] for a in realruns.run_to_scenario(r)["adapters"]], b, a)
                         for (_, r), b, a in zip(rows.iterrows(), seqs, slots)])
    base = (latency.base_ms + latency.per_seq_ms * seqs + latency.per_ctx_ktoken_ms * ctx_k
            + latency.per_token_ms * prefill)
    return {"y": y, "seqs": seqs, "slots": slots, "adapters": adapters, "prefill": prefill, "base": base}


def _predict(p: np.ndarray, f: dict[str, np.ndarray], prefill_share: float) -> np.ndarray:
    step, slot, adapter, tok = p
    return (f["base"] + step + slot * f["slots"] + adapter * f["adapters"]
            + tok * (f["seqs"] + prefill_share * f["prefill"]))


def fit_additive(rows, latency, prefill_share: float) -> tuple[dict[str, float], dict[str, Any]]:
    """The additive constants fitted on ``rows`` (non-negative least squares on relative ITL errors) with
    prefill tokens paying ``prefill_share`` of a decode token's LoRA cost.  (``LoraOverheadSpec`` fields,
    fit record): ``seq_ms`` + ``token_ms`` is a decode token's cost, ``token_ms`` a prefill token's."""
    f = run_features(rows, latency)
    ok = np.isfinite(f["y"]) & (f["y"] > 0) & np.isfinite(f["seqs"])
    g = {k: v[ok] for k, v in f.items()}
    res = optimize.least_squares(lambda p: _predict(p, g, prefill_share) / g["y"] - 1.0, [2.0, 0.02, 0.3, 0.03],
                                 bounds=([0.0] * 4, [100.0, 5.0, 10.0, 5.0]), xtol=1e-12, ftol=1e-12)
    fitted = dict(zip(ADDITIVE_KEYS, (float(x) for x in res.x)))
    pred = _predict(res.x, g, prefill_share)
    tok = fitted["decode_token_ms"]
    params = {"step_ms": fitted["step_ms"], "slot_ms": fitted["slot_ms"], "adapter_ms": fitted["adapter_ms"],
              "seq_ms": tok * (1.0 - prefill_share), "token_ms": tok * prefill_share}
    info = {"n_runs": int(ok.sum()), **fitted, "prefill_token_share": prefill_share,
            "itl_smape_run_level": float(np.mean(np.abs(pred - g["y"]) / ((pred + g["y"]) / 2.0)) * 100.0),
            "target": "mean ITL of each fit-half run as one step at its mean running requests (relative least "
                      "squares, constants >= 0)"}
    return params, info


#: replays of the fit half the Nelder-Mead refinement may spend (each replays every fit-half run)
REPLAY_EVALS = 40


def additive_of(x) -> dict[str, float]:
    """The additive constants of the refinement's vector ``x`` = (step, slot, adapter, decode-token ms, prefill
    token share), clipped to their ranges (``seq_ms`` + ``token_ms`` = a decode token's cost, ``token_ms`` =
    the share of it a prefill token pays)."""
    step, slot, adapter, tok = (max(0.0, float(v)) for v in x[:4])
    share = min(1.0, max(0.0, float(x[4])))
    return {"step_ms": step, "slot_ms": slot, "adapter_ms": adapter, "seq_ms": tok * (1.0 - share),
            "token_ms": tok * share}


def fit_on_replay(rows, latency, loss_of, max_evals: int = REPLAY_EVALS) -> tuple[dict[str, float], dict[str, Any]]:
    """The additive constants: the run-level fit (:func:`fit_additive`, prefill tokens at half a decode token's
    cost) refined by Nelder-Mead on ``loss_of(additive constants)`` -- the fit half replayed on the twin,
    its loss -- for at most ``max_evals`` replays.  (constants, record with the run-level start and the
    refinement's best loss)."""
    start, info = fit_additive(rows, latency, 0.5)
    x0 = np.array([start["step_ms"], start["slot_ms"], start["adapter_ms"], start["seq_ms"] + start["token_ms"], 0.5])
    best = {"loss": np.inf, "x": x0}

    def f(x):
        loss = loss_of(additive_of(x))
        if loss < best["loss"]:
            best.update(loss=loss, x=np.array(x, float))
        return loss

    # the first simplex moves each constant by a third (the share by 0.25), or by a floor where the run-level fit
    # put it at its bound, 0 (Llama-2: no slot or adapter term): a step the replay can tell apart
    floors = (0.5, 0.01, 0.05, 0.005)
    simplex = [x0] + [x0 + np.eye(5)[i] * ((x0[i] / 3.0 if x0[i] > 1e-6 else floors[i]) if i < 4 else 0.25)
                      for i in range(5)]
    optimize.minimize(f, x0, method="Nelder-Mead",
                      options={"maxfev": max_evals, "initial_simplex": np.array(simplex), "xatol": 1e-4, "fatol": 0.01})
    record = {"run_level_start": {k: v for k, v in info.items() if k != "target"},
              "run_level_target": info["target"], "replay_evals": max_evals, "best_loss": float(best["loss"]),
              "method": "Nelder-Mead on the fit half's replay loss, from the run-level fit"}
    return additive_of(best["x"]), record


def fit_estimator_rank(runs, model: str, latency, additive: dict[str, float]) -> tuple[int | None, float | None, dict[str, Any]]:
    """``adapter_ms`` at the rank of the estimator family of LoRA cost (``overhead_small``: 300 slots, ~200
    running, 1-300 adapters, ``max_lora_rank`` 8), the other additive constants as the fit half gave them: the
    cost of reading one adapter's matrices grows with the rank (the fit half's 16 against this family's 8),
    the launches do not.  (rank, adapter_ms, record with the fit's SMAPE and, for comparison, that of the fit
    half's ``adapter_ms`` on the same runs); (None, None, record) when the family has no runs."""
    fam = f"digital_twin_dynamic/estimators/predictor_latency_overhead/{model}/overhead_small/output"
    rows = family_rows(runs, fam)
    rows = rows[(rows["status"] == "ok") & (num(rows["enable_lora"]) == 1)]
    ranks = sorted(set(num(rows["max_lora_rank"]).astype(int).tolist())) if len(rows) else []
    if len(ranks) != 1:
        return None, None, {"family": fam, "n_runs": int(len(rows)), "ranks": ranks}
    y, b = num(rows["mean_itl_ms"]), num(rows["running_mean"])
    inp, out = per_request_lengths(rows)
    dist = expected_distinct_adapters(num(rows["n_served_adapters"]), b, num(rows["num_prompts"]))
    rest = (latency.base_ms + latency.per_seq_ms * b + latency.per_ctx_ktoken_ms * b * decode_ctx_per_seq(inp, out) / 1000
            + additive["step_ms"] + additive["slot_ms"] * num(rows["max_loras"])
            + (additive["seq_ms"] + additive["token_ms"]) * b)
    res = optimize.least_squares(lambda a: (rest + a[0] * dist) / y - 1.0, [additive["adapter_ms"]], bounds=([0.0], [10.0]))
    adapter = float(res.x[0])

    def smape_of(a):
        pred = rest + a * dist
        return float(np.mean(np.abs(pred - y) / ((pred + y) / 2)) * 100)

    return ranks[0], adapter, {"family": fam, "n_runs": int(len(y)), "rank": ranks[0], "adapter_ms": adapter,
                               "itl_smape": smape_of(adapter),
                               "itl_smape_with_fit_half_adapter_ms": smape_of(additive["adapter_ms"]),
                               "target": "mean ITL of each run, the other additive constants fixed"}
