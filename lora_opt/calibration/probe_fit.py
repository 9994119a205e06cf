"""A profile from ``lora-opt probe`` rows (experiment ``digital_twin_dynamic/estimators/probe/*``).

The probe measures each estimator in isolation (``lora_opt.probe.plan`` says how), so the fits
are direct:

* decode: ``step = base + per_seq*B + per_ctx*ctx/1000`` on LoRA-off pure-decode windows (B streams,
  ctx = the steps' mean total context), non-negative least squares on relative residuals;
* prefill: ``TTFT(P) = c + sum over the chunks of (base + per_seq + per_ctx*ctx/1000) + per_token*(P - chunks)``
  on single requests (chunks of ``max_num_batched_tokens``); ``c`` (HTTP + front end) is reported only;
* LoRA, per ``max_lora_rank``: ``step = decode(B, ctx) * (1 + jump + slope*D/(1 + D/n_sat))`` over D
  distinct adapters (``step_fit.fit_lora_factor``: ``n_sat`` only when an F-test demands it); ``jump``
  is the value at the probed ``max_loras`` (``ref_max_loras``).  ``slope`` too joins only when an F-test
  against ``jump`` alone demands it (p < ``F_TEST_ALPHA``): vLLM's CPU LoRA ops cost per token and rank,
  the same for 1 or 16 distinct adapters, so a CPU server's slope is 0 -- said in the fit
  (``slope_test``), not refused;
* LoRA on prefill, per rank: ``prefill_share`` from lone prompts through an adapter (family
  ``ttft_lora``; :func:`fit_lora_prefill`);
* or, for a model entry with ``lora_cost: per_token`` (vLLM's CPU build), LoRA per token instead of the two
  above: ``token_ms`` per rank from the decode windows and the lone prompts together, one knee in tokens x
  rank when an F-test demands it, beyond which each token pays ``token_ms_above`` (:func:`fit_lora_per_token`;
  ``jump`` and ``prefill_share`` 0);
* loading, per adapter rank: CPU->GPU = the load of a request whose adapter is in the CPU cache, not in a
  slot; disk->CPU = that of one whose adapter is on disk only, minus CPU->GPU; a CPU->GPU copy the probe did
  not resolve above its noise (a CPU server's few-ms copy) is 0, and the profile's notes say so;
* KV tokens per (max_loras, rank): not fitted here, compared with the profile's memory model.

What the probe does not measure is kept from the base profile (``--model``): model dimensions, the
memory model, the LoRA ``slot_share`` (and ``prefill_share`` without ``ttft_lora`` rows), the front-end TTFT
terms, defaults -- or, from a ``configs/models.yaml`` entry of a fixed-KV device (a CPU server), nothing
measured: the front end's TTFT constant is then the prefill fit's (:func:`probe_base`).

Only positive costs reach a profile: ``ok`` rows whose measured cost is not a positive number (rows
from a probe that did not yet mark such windows ``noisy``) and fitted constants <= 0 are refused with
a :class:`ScenarioError` naming the rows (``lora-opt calibrate`` exits 2 and writes nothing).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from lora_opt.calibration.runs_csv import family_rows, load_runs, num
from lora_opt.calibration.fitting import (
    F_TEST_ALPHA,
    FitResult,
    clean,
    f_test_p,
    r2_score,
    relative_linear_fit,
    sha256_of,
    sig,
)
from lora_opt.calibration.generations import GENERATIONS
from lora_opt.calibration.knee_fit import RankPoints, fit_knee, share_fit
from lora_opt.calibration.memory_fit import weights_gib
from lora_opt.calibration.model_table import MODELS
from lora_opt.calibration.step_fit import fit_lora_factor, fit_lora_step_ms
from lora_opt.io import atomic_write_text
from twin.errors import ScenarioError
from twin.profile import Profile, load_profile, profile_from_dict, profile_to_dict

PROBE_PREFIX = "digital_twin_dynamic/estimators/probe/"
log = logging.getLogger(__name__)


def is_probe_table(runs_csv: str | Path) -> bool:
    """Whether the table holds probe rows (then ``calibrate`` fits with this module)."""
    try:
        exp = pd.read_csv(runs_csv, usecols=["experiment"])["experiment"].astype(str)
    except (OSError, ValueError, KeyError):
        return False
    return bool(exp.str.startswith(PROBE_PREFIX).any())


def _ok(runs: pd.DataFrame, family: str) -> pd.DataFrame:
    rows = family_rows(runs, PROBE_PREFIX + family)
    return rows[rows["status"] == "ok"]


#: per family: the measured cost (must be > 0) and the other columns its fit reads (must be numbers)
ROW_COLUMNS = {
    "decode": ("probe_step_ms", ("probe_batch", "probe_ctx_ktokens_mean")),
    "lora": ("probe_step_ms", ("probe_batch", "probe_ctx_ktokens_mean", "probe_distinct_adapters", "max_lora_rank")),
    "prefill": ("probe_ttft_ms", ("probe_prompt_tokens",)),
    "loading": ("probe_load_ms_per_adapter", ("max_lora_rank",)),
    "ttft_lora": ("probe_ttft_ms", ("probe_prompt_tokens", "max_lora_rank")),
}
#: rows named in a refusal (the rest are counted)
NAMED_ROWS = 12


def _names(rows: list[str]) -> str:
    more = len(rows) - NAMED_ROWS
    return ", ".join(rows[:NAMED_ROWS]) + (f" and {more} more" if more > 0 else "")


def family_status(runs: pd.DataFrame, family: str) -> str:
    """The family's rows and their status (``decode_b1_p32 ok, decode_b16_p32 noisy``), for a refusal."""
    rows = family_rows(runs, PROBE_PREFIX + family)
    if rows.empty:
        return f"no {family} rows"
    pairs = zip(rows["run_name"].astype(str), rows["status"].astype(str))
    return f"{family} rows: " + _names([f"{name} {status}" for name, status in pairs])


def check_row_costs(runs: pd.DataFrame, source: str) -> None:
    """Refuse ``ok`` rows whose measured cost is not a positive number, or whose fit inputs are not
    numbers: fitting them ends in a negative or zero constant, or in a linear-algebra failure."""
    bad = []
    for family, (cost, inputs) in ROW_COLUMNS.items():
        rows = _ok(runs, family)
        for col in (cost, *inputs):
            values = num(rows[col]) if col in rows.columns else np.full(len(rows), np.nan)
            wrong = ~(values > 0) if col == cost else ~np.isfinite(values)
            bad += [f"{name} ({col} {v:g})" for name, v, w in zip(rows["run_name"].astype(str), values, wrong) if w]
    if bad:
        raise ScenarioError(
            f"calibrate --runs {source}: {len(bad)} probe row(s) marked ok hold a cost that is not a positive "
            f"number: {_names(bad)}.  No profile written: rerun lora-opt probe (it marks such measurements "
            "noisy), or set these rows' status to noisy")


#: a fitted cost whose part of what it explains (at the largest measured point) is below this share
#: is 0: the bounded fits stop at 1e-16..1e-10 above a bound of 0, not at 0 itself
COST_RESOLUTION = 1e-6


def check_fitted_costs(fits: dict[str, FitResult | None], runs: pd.DataFrame, source: str) -> None:
    """Refuse a fitted cost that is not positive -- <= 0, or 0 within the fit's precision
    (:data:`COST_RESOLUTION`): the rows it came from do not show the cost the profile needs.  The
    message names each constant and its rows."""
    def names(family: str, rank=None, kinds=None) -> str:
        rows = _ok(runs, family)
        if rank is not None:
            rows = rows[num(rows["max_lora_rank"]) == rank]
        if kinds is not None:
            rows = rows[rows["probe_load_kind"].astype(str).isin(kinds)]
        return _names(rows["run_name"].astype(str).tolist())

    bad = []

    def need(label: str, value: float, share: float, family: str, **which) -> None:
        if not (value > 0 and share > COST_RESOLUTION):
            bad.append(f"{label} = {value:.4g} (from {names(family, **which)})")

    dec, dec_rows = fits["decode"].params, _ok(runs, "decode")
    step_max = float(np.max(num(dec_rows["probe_step_ms"])))
    need("decode base_ms", dec["base_ms"], dec["base_ms"] / step_max, "decode")
    need("decode per_seq_ms", dec["per_seq_ms"], dec["per_seq_ms"] * np.max(num(dec_rows["probe_batch"])) / step_max,
         "decode")
    need("decode per_ctx_ktoken_ms", dec["per_ctx_ktoken_ms"],
         dec["per_ctx_ktoken_ms"] * np.max(num(dec_rows["probe_ctx_ktokens_mean"])) / step_max, "decode")
    pre, pre_rows = fits["prefill"].params["per_token_ms"], _ok(runs, "prefill")
    need("prefill per_token_ms", pre,
         pre * np.max(num(pre_rows["probe_prompt_tokens"])) / np.max(num(pre_rows["probe_ttft_ms"])), "prefill")
    lora_rows = _ok(runs, "lora")
    per_token = fits["lora"].extra.get("form") == "per_token"
    for rank, p in fits["lora"].params.items():
        if per_token:
            need(f"lora r{rank} token_ms", p["token_ms"], p["token_ms"], "lora", rank=rank)
            continue
        d_max = float(np.max(num(lora_rows["probe_distinct_adapters"])[num(lora_rows["max_lora_rank"]) == rank]))
        need(f"lora r{rank} jump", p["jump"], p["jump"], "lora", rank=rank)
        if fits["lora"].extra[f"rank_{rank}"]["slope_test"]["fitted"]:
            need(f"lora r{rank} slope", p["slope"], p["slope"] * d_max, "lora", rank=rank)
    if fits["loading"] is not None:
        for table, kinds in (("cpu_to_gpu_ms", ("cpu",)), ("disk_to_cpu_ms", ("cpu", "disk"))):
            for rank, v in fits["loading"].params[table].items():
                if table == "cpu_to_gpu_ms" and rank in fits["loading"].extra["cpu_to_gpu_unresolved_ranks"]:
                    continue                       # 0 by design (fit_loading): not a failed fit
                need(f"loading {table} r{rank}", v, 1.0, "loading", rank=rank, kinds=kinds)
    if bad:
        raise ScenarioError(
            f"calibrate --runs {source}: the probe rows give costs that are not positive: {'; '.join(bad)}.  "
            "No profile written: the measurement did not resolve these costs -- rerun lora-opt probe with a "
            "longer plan (more batch sizes, prompt lengths, output tokens) or on a quieter machine")


def fit_decode(runs: pd.DataFrame) -> FitResult:
    rows = _ok(runs, "decode")
    y, b, ctx_k = num(rows["probe_step_ms"]), num(rows["probe_batch"]), num(rows["probe_ctx_ktokens_mean"])
    if len(y) < 3 or len(set(b)) < 2:
        raise ScenarioError("calibrate: the probe rows hold fewer than 3 ok decode runs over 2 batch sizes "
                            f"({family_status(runs, 'decode')}; noisy and failed rows are not fitted, their "
                            "probe_note says why): run lora-opt probe --launch, or --endpoint on a server without LoRA")
    design = np.column_stack([np.ones_like(b), b, ctx_k])
    sol = relative_linear_fit(design, y)
    pred = design @ sol
    return FitResult(params={"base_ms": sol[0], "per_seq_ms": sol[1], "per_ctx_ktoken_ms": sol[2]},
                     families=[PROBE_PREFIX + "decode"], n=len(y), r2=r2_score(y, pred),
                     extra={"max_abs_rel_error": float(np.max(np.abs(pred / y - 1)))})


def prefill_known(decode: dict, prompt: int, budget: int) -> tuple[float, int]:
    """(the decode-like part of a lone prompt's chunked prefill steps, number of chunks)."""
    chunks = max(1, math.ceil(prompt / budget))
    ctx = sum(min(m * budget, prompt) for m in range(chunks))
    return chunks * (decode["base_ms"] + decode["per_seq_ms"]) + decode["per_ctx_ktoken_ms"] * ctx / 1000.0, chunks


def fit_prefill(runs: pd.DataFrame, decode: FitResult) -> FitResult:
    """``TTFT(P) = c + (the chunks' decode-like part) + per_token*(P - chunks)``, ``c >= 0`` (the front end
    cannot give time back) and ``per_token >= 0``, least squares on relative residuals as the decode fit:
    a 20 ms miss at a 150 ms TTFT matters more than at 1.5 s (and short prompts are what most requests
    are).  Where prefill grows faster than linearly (a CPU's attention over the prompt), the long prompts
    are under-predicted: ``max_abs_rel_error`` says by how much."""
    rows = _ok(runs, "prefill")
    p, y = num(rows["probe_prompt_tokens"]), num(rows["probe_ttft_ms"])
    budget = np.nan_to_num(num(rows["max_num_batched_tokens"]), nan=2048.0).astype(int)
    if len(set(p)) < 2:
        raise ScenarioError("calibrate: the probe rows hold ok prefill runs at fewer than 2 prompt lengths "
                            f"({family_status(runs, 'prefill')})")
    known, x = [], []
    for pi, bi in zip(p.astype(int), budget):
        k, chunks = prefill_known(decode.params, int(pi), int(bi))
        known.append(k)
        x.append(pi - chunks)
    known, x = np.array(known), np.array(x, float)
    design = np.column_stack([np.ones_like(x), x])
    sol = relative_linear_fit(design, y - known, weights=y)
    pred = known + design @ sol
    return FitResult(params={"per_token_ms": float(sol[1])}, families=[PROBE_PREFIX + "prefill"],
                     n=len(y), r2=r2_score(y, pred),
                     extra={"ttft_constant_ms": float(sol[0]), "max_abs_rel_error": float(np.max(np.abs(pred / y - 1))),
                            "target": "TTFT of one request on an idle server vs prompt length (chunked prefill)"})


def fit_lora(runs: pd.DataFrame, decode: FitResult) -> FitResult:
    rows = _ok(runs, "lora")
    d = decode.params
    y, b, ctx_k = num(rows["probe_step_ms"]), num(rows["probe_batch"]), num(rows["probe_ctx_ktokens_mean"])
    dist, ranks, loras = num(rows["probe_distinct_adapters"]), num(rows["max_lora_rank"]), num(rows["max_loras"])
    base = d["base_ms"] + d["per_seq_ms"] * b + d["per_ctx_ktoken_ms"] * ctx_k
    per_rank: dict[int, dict[str, float]] = {}
    extra: dict[str, Any] = {}
    for rank in sorted(set(ranks[np.isfinite(ranks)].astype(int))):
        # the distinct-adapter sweeps only: a batch size measured at one adapter count (the per-token
        # form's windows for LoRA's fixed cost a step) tells the factor nothing about adapters
        at = ranks == rank
        swept = [bb for bb in set(b[at]) if len(set(dist[at & (b == bb)])) >= 2]
        sel = at & np.isin(b, swept)
        if len(set(dist[sel])) < 2:
            extra[f"rank_{rank}"] = {"fitted": False, "note": "fewer than 2 distinct-adapter counts"}
            continue
        params, info = fit_lora_factor(dist[sel], y[sel], base[sel])
        slope_test = _slope_test(y[sel], base[sel], info["pred"], params)
        if not slope_test["fitted"]:
            params, info["pred"] = {"jump": slope_test["jump_alone"], "slope": 0.0, "n_sat": math.inf}, \
                base[sel] * (1.0 + slope_test["jump_alone"])
            info["r2"] = r2_score(y[sel], info["pred"])
            info["max_abs_rel_error"] = float(np.max(np.abs(info["pred"] / y[sel] - 1)))
            info["n_sat_test"] = {"fitted": False, "note": "no slope"}
        params["ref_max_loras"] = float(np.median(loras[sel]))
        per_rank[rank] = params
        extra[f"rank_{rank}"] = {"r2": info["r2"], "n_points": int(sel.sum()), "n_sat_test": info["n_sat_test"],
                                 "slope_test": slope_test, "max_abs_rel_error": info["max_abs_rel_error"]}
    if not per_rank:
        raise ScenarioError("calibrate: the probe rows hold no rank with ok LoRA runs at 2+ distinct-adapter counts "
                            f"({family_status(runs, 'lora')})")
    return FitResult(params=per_rank, families=[PROBE_PREFIX + "lora"], n=len(y), extra=extra)


def _slope_test(y: np.ndarray, base: np.ndarray, pred: np.ndarray, params: dict) -> dict:
    """Whether the distinct-adapter term is demanded: the fit with it against ``jump`` alone (relative
    residuals, as the fit's), F-test at ``F_TEST_ALPHA``.  ``jump_alone``: the jump-only fit's value."""
    u = base / y
    jump_alone = float(np.sum(u) / np.sum(u * u) - 1.0)       # argmin of sum((u*(1+j) - 1)^2)
    sse_small = float(np.sum((u * (1.0 + jump_alone) - 1.0) ** 2))
    sse_big = float(np.sum((pred / y - 1.0) ** 2))
    k_big = 3 if math.isfinite(params["n_sat"]) else 2
    p_value = f_test_p(sse_small, sse_big, len(y), k_big, extra=k_big - 1)
    return {"fitted": bool(p_value < F_TEST_ALPHA), "p_value": p_value, "free_slope": float(params["slope"]),
            "jump_alone": jump_alone}


def fit_lora_prefill(runs: pd.DataFrame, decode: FitResult, prefill: FitResult, lora: FitResult) -> FitResult | None:
    """``prefill_share`` per rank from lone prompts through an adapter (family ``ttft_lora``):
    ``TTFT = c + known(P)*(1 + jump) + per_token*(P - chunks)*(1 + prefill_share*jump)`` with ``c``,
    ``per_token`` (the LoRA-off prefill fit) and ``jump`` (the LoRA fit) known; least squares on relative
    residuals, ``prefill_share >= 0`` (above 1 where an adapter costs prefill tokens more than decodes:
    vLLM's CPU LoRA ops gather one copy of the adapter's matrices per token).  With enough prompt
    lengths, a knee (:func:`~lora_opt.calibration.knee_fit.fit_knee`): one share up to ``prefill_knee_tokens`` tokens, ``prefill_share_above``
    beyond, when an F-test demands it (on the CPU build the gather's cost per token steps up where it leaves
    the cache).  Params per rank: those profile fields.  None without such rows."""
    rows = _ok(runs, "ttft_lora")
    if rows.empty:
        return None
    c, per_token = max(prefill.extra["ttft_constant_ms"], 0.0), prefill.params["per_token_ms"]
    p, y, ranks = num(rows["probe_prompt_tokens"]), num(rows["probe_ttft_ms"]), num(rows["max_lora_rank"])
    budget = np.nan_to_num(num(rows["max_num_batched_tokens"]), nan=2048.0).astype(int)
    points: dict[int, RankPoints] = {}
    for rank in sorted(set(ranks[np.isfinite(ranks)].astype(int))):
        if rank not in lora.params or lora.params[rank]["jump"] <= 0:
            continue
        jump = lora.params[rank]["jump"]
        sel = ranks == rank
        known = np.array([prefill_known(decode.params, int(pi), int(bi)) for pi, bi in zip(p[sel], budget[sel])])
        # the knee is in a step's tokens: a prompt within the token budget is one step
        points[rank] = RankPoints(product=np.minimum(p[sel], budget[sel]) * float(rank),
                                   a=per_token * (p[sel] - known[:, 1]) * jump,          # what prefill_share multiplies
                                   b=y[sel] - c - known[:, 0] * (1.0 + jump) - per_token * (p[sel] - known[:, 1]),
                                   y=y[sel])
    knee = fit_knee(points)
    params: dict[int, dict] = {r: {"prefill_share": 1.0} for r in lora.params if r in set(ranks) and r not in points}
    extra: dict[str, Any] = {"knee": None if knee is None else
                             {k: v for k, v in knee.items() if k not in ("sse", "shares")}}
    for rank, q in points.items():
        if knee is None or knee["shares"][rank][0] == knee["shares"][rank][1]:
            share = share_fit(q.a, q.b, q.y)[0]
            params[rank], pred = {"prefill_share": share}, q.y - q.b + q.a * share
        else:
            lo, hi = knee["shares"][rank]
            params[rank] = {"prefill_share": lo, "prefill_knee_tokens": knee["knee_product"] / rank,
                            "prefill_share_above": hi}
            pred = q.y - q.b + q.a * np.where(q.product <= knee["knee_product"], lo, hi)
        extra[f"rank_{rank}"] = {"n_points": len(q.y), "max_abs_rel_error": float(np.max(np.abs(pred / q.y - 1)))}
    if not params:
        return None
    return FitResult(params=dict(sorted(params.items())), families=[PROBE_PREFIX + "ttft_lora"], n=len(y),
                     extra={**extra, "target": "TTFT of one request through an adapter on an idle server"})


def fit_loading(runs: pd.DataFrame) -> FitResult | None:
    rows = _ok(runs, "loading")
    if rows.empty:
        return None
    kind, ranks, per = rows["probe_load_kind"].astype(str).to_numpy(), num(rows["max_lora_rank"]), \
        num(rows["probe_load_ms_per_adapter"])
    cpu = {int(r): float(np.mean(per[(kind == "cpu") & (ranks == r)])) for r in set(ranks[kind == "cpu"])}
    both = {int(r): float(np.mean(per[(kind == "disk") & (ranks == r)])) for r in set(ranks[kind == "disk"])}
    # a disk load resolved, its CPU->slot copy not (within its noise: a few ms on a CPU server): the copy
    # is below what the probe resolves, so 0, said in the profile's notes -- not the whole table lost
    unresolved = sorted(r for r in both if r not in cpu)
    cpu.update({r: 0.0 for r in unresolved})
    disk = {r: v - cpu[r] for r, v in both.items()}
    if not disk:
        return None
    return FitResult(params={"cpu_to_gpu_ms": cpu, "disk_to_cpu_ms": disk}, families=[PROBE_PREFIX + "loading"],
                     n=len(rows), extra={"target": "median TTFT of lone requests that load an adapter (from the CPU "
                                                   "cache into a slot; from disk) minus that of requests that do not",
                                         "cpu_to_gpu_unresolved_ranks": unresolved})


def kv_check(runs: pd.DataFrame, profile: Profile) -> dict:
    """Measured KV tokens of every launch vs the profile's memory model (not fitted: a check)."""
    rows = family_rows(runs, PROBE_PREFIX + "kv")
    rows = rows[(rows["status"] == "ok") & np.isfinite(num(rows["gpu_kv_cache_tokens"]))]
    out = {}
    d = profile.defaults
    for _, r in rows.iterrows():
        lora = int(r["enable_lora"]) == 1
        util = float(r["gpu_memory_utilization"]) if pd.notna(r["gpu_memory_utilization"]) else d.gpu_memory_utilization
        mnbt = int(r["max_num_batched_tokens"]) if pd.notna(r["max_num_batched_tokens"]) else d.max_num_batched_tokens
        pred = profile.kv_capacity_tokens(int(r["max_loras"]) if lora else 0, int(r["max_lora_rank"]) if lora else 16,
                                          util, mnbt, enable_lora=lora,
                                          max_num_seqs=int(r["max_num_seqs"]) if pd.notna(r["max_num_seqs"]) else None)
        out[str(r["run_name"])] = {"measured": float(r["gpu_kv_cache_tokens"]), "profile": float(pred),
                                   "rel_error": float(pred / float(r["gpu_kv_cache_tokens"]) - 1.0)}
    return out


def fit_lora_per_token(runs: pd.DataFrame, decode: FitResult, prefill: FitResult) -> FitResult:
    """``token_ms`` per rank (``lora_cost: per_token``): a step with an adapter costs its LoRA-off time plus
    ``token_ms`` per token it carries, and ``step_ms`` once (:func:`~lora_opt.calibration.step_fit.fit_lora_step_ms`: from windows at several
    batch sizes, else 0).  Points: the LoRA decode windows (B tokens a step: ``step - decode(B, ctx)``) and
    the lone prompts through an adapter (P tokens in its prefill step: ``TTFT - c - known(P) -
    per_token*(P - chunks)``), less ``step_ms``; one knee in tokens x rank for all ranks as :func:`~lora_opt.calibration.knee_fit.fit_knee`
    finds it (the gather leaving the cache), else one ``token_ms`` per rank.  Params per rank: the LoRA
    entry's fields."""
    d, c, per_token = decode.params, max(prefill.extra["ttft_constant_ms"], 0.0), prefill.params["per_token_ms"]
    win, lone = _ok(runs, "lora"), _ok(runs, "ttft_lora")
    b, y_w, r_w = num(win["probe_batch"]), num(win["probe_step_ms"]), num(win["max_lora_rank"])
    base = d["base_ms"] + d["per_seq_ms"] * b + d["per_ctx_ktoken_ms"] * num(win["probe_ctx_ktokens_mean"])
    p, y_p, r_p = num(lone["probe_prompt_tokens"]), num(lone["probe_ttft_ms"]), num(lone["max_lora_rank"])
    budget = np.nan_to_num(num(lone["max_num_batched_tokens"]), nan=2048.0).astype(int)
    points: dict[int, RankPoints] = {}
    fixed: dict[int, float] = {}
    for rank in sorted(set(r_w[np.isfinite(r_w)].astype(int)) | set(r_p[np.isfinite(r_p)].astype(int))):
        sw, sp = r_w == rank, r_p == rank
        known = np.array([prefill_known(d, int(pi), int(bi)) for pi, bi in zip(p[sp], budget[sp])]).reshape(-1, 2)
        fixed[rank] = fit_lora_step_ms(b[sw], y_w[sw] - base[sw], y_w[sw])
        # the knee is in a step's tokens (a prompt beyond the budget is several steps); every token pays
        points[rank] = RankPoints(product=np.concatenate([b[sw], np.minimum(p[sp], budget[sp])]) * float(rank),
                                   a=np.concatenate([b[sw], p[sp]]),
                                   b=np.concatenate([y_w[sw] - base[sw], y_p[sp] - c - known[:, 0]
                                                     - per_token * (p[sp] - known[:, 1])]) - fixed[rank],
                                   y=np.concatenate([y_w[sw], y_p[sp]]))
    if not points:
        raise ScenarioError("calibrate: lora_cost per_token needs ok LoRA decode windows or lone prompts through an "
                            f"adapter ({family_status(runs, 'lora')}; {family_status(runs, 'ttft_lora')})")
    knee = fit_knee(points, "hinge")
    loras = num(win["max_loras"])
    params: dict[int, dict] = {}
    extra: dict[str, Any] = {"knee": None if knee is None else {k: v for k, v in knee.items() if k not in ("sse", "shares")}}
    for rank, q in points.items():
        entry = {"jump": 0.0, "slope": 0.0, "n_sat": math.inf, "prefill_share": 0.0,
                 "ref_max_loras": float(np.median(loras[r_w == rank])) if np.any(r_w == rank) else 1.0}
        if knee is None or knee["shares"][rank][0] == knee["shares"][rank][1]:
            entry["token_ms"] = share_fit(q.a, q.b, q.y)[0]
            pred = q.y - q.b + q.a * entry["token_ms"]
        else:
            lo, hi = knee["shares"][rank]
            entry.update(token_ms=lo, prefill_knee_tokens=knee["knee_product"] / rank, token_ms_above=hi)
            pred = q.y - q.b + q.a * lo + q.beyond(knee["knee_product"], rank) * (hi - lo)
        if fixed[rank] > 0:
            entry["step_ms"] = fixed[rank]
        params[rank] = entry
        extra[f"rank_{rank}"] = {"n_points": len(q.y), "step_ms": fixed[rank],
                                 "window_batches": sorted({int(x) for x in b[r_w == rank]}), "r2": r2_score(q.y, pred),
                                 "max_abs_rel_error": float(np.max(np.abs(pred / q.y - 1)))}
    return FitResult(params=params, families=[PROBE_PREFIX + "lora", PROBE_PREFIX + "ttft_lora"], n=len(y_w) + len(y_p),
                     extra={**extra, "form": "per_token",
                            "target": "LoRA ms per token of a step: decode windows and lone prompts through an adapter"})


def fit_probe(runs: pd.DataFrame, source: str = "ROWS", lora_cost: str = "factor") -> dict[str, FitResult | None]:
    """Every estimator's fit (LoRA in the ``lora_cost`` form: ``ModelEntry.lora_cost``); ScenarioError when
    a row or a fitted cost is not positive."""
    check_row_costs(runs, source)
    try:
        decode = fit_decode(runs)
        prefill = fit_prefill(runs, decode)
        if lora_cost == "per_token":
            fits = {"decode": decode, "prefill": prefill, "lora": fit_lora_per_token(runs, decode, prefill),
                    "loading": fit_loading(runs), "lora_prefill_share": None}
        else:
            lora = fit_lora(runs, decode)
            fits = {"decode": decode, "prefill": prefill, "lora": lora, "loading": fit_loading(runs),
                    "lora_prefill_share": fit_lora_prefill(runs, decode, prefill, lora)}
    except np.linalg.LinAlgError as exc:    # degenerate rows (e.g. all at one point) the checks above let by
        raise ScenarioError(f"calibrate --runs {source}: the probe rows do not determine a fit ({exc}); rerun "
                            "lora-opt probe with more batch sizes and prompt lengths") from None
    check_fitted_costs(fits, runs, source)
    return fits


def _lora_entry(base: Profile, rank: int, p: dict, prefill: dict | None) -> dict:
    """A rank's LoRA entry: the fitted factor, the prefill fields fitted (``fit_lora_prefill``) or kept; a
    per-token fit's entry as fitted (``fit_lora_per_token``)."""
    if "token_ms" in p:
        return {k: sig(v) for k, v in p.items()} | {"slot_share": 0.0}
    keep = base.latency.lora_for_rank(rank)
    return {"jump": sig(p["jump"]), "slope": sig(p["slope"]), "n_sat": sig(p["n_sat"]),
            "ref_max_loras": sig(p["ref_max_loras"]), "slot_share": keep.slot_share,
            **({"prefill_share": keep.prefill_share} if prefill is None else {k: sig(v) for k, v in prefill.items()})}


def probe_base(model: str) -> tuple[Profile, str]:
    """The profile a probe fit starts from and what the fit keeps of it: a bundled profile or YAML
    (model dimensions, memory model, LoRA shares, front-end terms, loading where unmeasured), or a
    ``configs/models.yaml`` entry whose device has a fixed KV cache (a CPU server): then nothing measured
    is kept -- dimensions, engine semantics and defaults come from the entry, every cost from the probe."""
    if model not in MODELS:
        return load_profile(model), ("model dimensions, memory model, LoRA slot_share and prefill_share, "
                                     "front-end TTFT terms, defaults")
    entry = MODELS[model]
    if entry.gpu.kv_cache_gib <= 0:
        raise ScenarioError(
            f"calibrate --model {model}: its configs/models.yaml device {entry.gpu.key!r} sizes the KV cache from "
            "GPU memory, a memory model the probe does not fit: give the profile whose memory model to keep "
            f"(--model {entry.profile_name}, or a profile YAML)")
    prof = {
        "name": entry.profile_name, "vllm_version": entry.vllm_version, "lora_set_rule": entry.lora_set_rule,
        "reserve_full_prompt": entry.reserve_full_prompt,
        "chunked_prefill": GENERATIONS[entry.engine].chunked_prefill,
        "model": dataclasses.asdict(entry.spec),
        "memory": {"gpu_memory_gib": entry.gpu.memory_gib, "weights_gib": sig(weights_gib(entry)),
                   "non_kv_overhead_gib": 0.0, "kv_cache_gib": entry.gpu.kv_cache_gib},
        "latency": {"base_ms": 0.0, "per_seq_ms": 0.0, "per_token_ms": 0.0},
        "loading": {"cpu_to_gpu_ms": {16: 0.0}, "disk_to_cpu_ms": {16: 0.0}},
        "defaults": dataclasses.asdict(entry.defaults)}
    return profile_from_dict(prof, f"configs/models.yaml: models.{model}"), "nothing measured (an entry)"


def _block_size(runs: pd.DataFrame, base: Profile) -> int:
    """The launches' KV block size (the kv rows' tokens per block, as the server reported both), else the
    base profile's."""
    rows = family_rows(runs, PROBE_PREFIX + "kv")
    if {"gpu_kv_cache_tokens", "gpu_kv_blocks"} <= set(rows.columns):
        tokens, blocks = num(rows["gpu_kv_cache_tokens"]), num(rows["gpu_kv_blocks"])
        ok = np.isfinite(tokens) & np.isfinite(blocks) & (blocks > 0)
        sizes = set((tokens[ok] / blocks[ok]).round().astype(int))
        if len(sizes) == 1:
            return int(sizes.pop())
    return base.memory.block_size


def calibrate_probe(runs_csv: str | Path, base_profile: str, out: str | Path) -> dict[str, Any]:
    """Fit the probe rows of ``runs_csv``; keep what they do not measure from ``base_profile``
    (a bundled name, a YAML, or a configs/models.yaml entry of a fixed-KV device: see
    :func:`probe_base`); write the profile to ``out``; return it as a dict."""
    runs = load_runs(runs_csv)
    runs = runs[runs["experiment"].str.startswith(PROBE_PREFIX)]
    base, kept = probe_base(base_profile)
    from_entry = base_profile in MODELS         # probe_base built it from the entry: nothing measured kept
    fits = fit_probe(runs, str(runs_csv), MODELS[base_profile].lora_cost if from_entry else "factor")
    prof = profile_to_dict(base)
    lat = prof["latency"]
    for k in ("base_ms", "per_seq_ms", "per_ctx_ktoken_ms"):
        lat[k] = sig(fits["decode"].params[k])
    lat["per_token_ms"] = sig(fits["prefill"].params["per_token_ms"])
    shares = fits["lora_prefill_share"].params if fits["lora_prefill_share"] is not None else {}
    lat["lora"] = {int(r): _lora_entry(base, int(r), p, shares.get(int(r))) for r, p in fits["lora"].params.items()}
    notes = []
    if from_entry:
        # nothing to keep: the front end's part of TTFT is the prefill fit's constant (HTTP, tokenizer,
        # IPC, first chunk), when positive
        lat["ttft_frontend_ms"] = sig(max(fits["prefill"].extra["ttft_constant_ms"], 0.0))
        prof["memory"]["block_size"] = _block_size(runs, base)
    if fits["loading"] is not None:
        prof["loading"] = {k: {int(r): sig(v) for r, v in sorted(t.items())} for k, t in fits["loading"].params.items()}
        if fits["loading"].extra["cpu_to_gpu_unresolved_ranks"]:
            notes.append("CPU->GPU LOAD NOT RESOLVED at ranks "
                         f"{fits['loading'].extra['cpu_to_gpu_unresolved_ranks']}: within the probe's noise, 0 ms here")
    elif from_entry:
        notes.append("LOADING NOT IDENTIFIED: no ok loading rows; adapter loads cost 0 ms in this profile")
    else:
        notes.append(f"LOADING NOT IDENTIFIED: no ok loading rows; the loading table is {base.name}'s")
    prof["name"] = Path(out).stem
    prof["fit"] = clean({
        "tool": "lora_opt.calibrate (probe)",
        "command": f"lora-opt calibrate --runs {runs_csv} --model {base_profile} --out {out}",
        "data": {"file": str(runs_csv), "sha256": sha256_of(Path(runs_csv))},
        "kept_from": {"profile": base.name, "what": kept},
        "estimators": {k: (v.summary() if v is not None else {"identified": False}) for k, v in fits.items()},
        "kv_check": kv_check(runs, profile_from_dict(prof, str(out))),
        "notes": notes})
    profile_from_dict(prof, str(out))           # schema check before anything is written
    atomic_write_text(out, "# Generated by lora-opt calibrate from lora-opt probe rows; rerun fit.command.\n"
                      + yaml.safe_dump(prof, sort_keys=False, default_flow_style=None, width=110))
    for note in notes:
        log.warning(note)
    return prof


__all__ = ["PROBE_PREFIX", "calibrate_probe", "fit_probe", "is_probe_table"]
