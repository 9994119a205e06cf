"""A profile from ``lora-opt probe`` rows (experiment ``digital_twin_dynamic/estimators/probe/*``).

The probe measures each estimator in isolation (``lora_opt.validate.probe`` says how), so the fits
are direct:

* decode: ``step = base + per_seq*B + per_ctx*ctx/1000`` on LoRA-off pure-decode windows (B streams,
  ctx = the steps' mean total context), non-negative least squares on relative residuals;
* prefill: ``TTFT(P) = c + sum over the chunks of (base + per_seq + per_ctx*ctx/1000) + per_token*(P - chunks)``
  on single requests (chunks of ``max_num_batched_tokens``); ``c`` (HTTP + front end) is reported only;
* LoRA, per ``max_lora_rank``: ``step = decode(B, ctx) * (1 + jump + slope*D/(1 + D/n_sat))`` over D
  distinct adapters (``step_fit.fit_lora_factor``: ``n_sat`` only when an F-test demands it); ``jump``
  is the value at the probed ``max_loras`` (``ref_max_loras``);
* loading, per adapter rank: CPU->GPU = the CPU-resident burst's load per adapter; disk->CPU = the
  disk-only burst's per adapter minus CPU->GPU;
* KV tokens per (max_loras, rank): not fitted here, compared with the profile's memory model.

What the probe does not measure is kept from the base profile (``--model``): model dimensions, the
memory model, the LoRA ``slot_share`` and ``prefill_share``, the front-end TTFT terms, defaults.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from lora_opt.calibration.families import family_rows, load_runs, num
from lora_opt.calibration.fitting import FitResult, clean, r2_score, relative_linear_fit, sha256_of, sig
from lora_opt.calibration.step_fit import fit_lora_factor
from lora_opt.io import atomic_write_text
from twin.errors import ScenarioError
from twin.profile import Profile, load_profile, profile_from_dict, profile_to_dict

PROBE_PREFIX = "digital_twin_dynamic/estimators/probe/"


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


def fit_decode(runs: pd.DataFrame) -> FitResult:
    rows = _ok(runs, "decode")
    y, b, ctx_k = num(rows["probe_step_ms"]), num(rows["probe_batch"]), num(rows["probe_ctx_ktokens_mean"])
    if len(y) < 3 or len(set(b)) < 2:
        raise ScenarioError("calibrate: the probe rows hold fewer than 3 decode runs over 2 batch sizes "
                            "(run lora-opt probe --launch, or --endpoint on a server without LoRA)")
    design = np.column_stack([np.ones_like(b), b, ctx_k])
    sol = relative_linear_fit(design, y)
    pred = design @ sol
    return FitResult(params={"base_ms": sol[0], "per_seq_ms": sol[1], "per_ctx_ktoken_ms": sol[2]},
                     families=[PROBE_PREFIX + "decode"], n=len(y), r2=r2_score(y, pred),
                     extra={"max_abs_rel_error": float(np.max(np.abs(pred / y - 1)))})


def _prefill_known(decode: dict, prompt: int, budget: int) -> tuple[float, int]:
    """(the decode-like part of a lone prompt's chunked prefill steps, number of chunks)."""
    chunks = max(1, math.ceil(prompt / budget))
    ctx = sum(min(m * budget, prompt) for m in range(chunks))
    return chunks * (decode["base_ms"] + decode["per_seq_ms"]) + decode["per_ctx_ktoken_ms"] * ctx / 1000.0, chunks


def fit_prefill(runs: pd.DataFrame, decode: FitResult) -> FitResult:
    rows = _ok(runs, "prefill")
    p, y = num(rows["probe_prompt_tokens"]), num(rows["probe_ttft_ms"])
    budget = np.nan_to_num(num(rows["max_num_batched_tokens"]), nan=2048.0).astype(int)
    if len(set(p)) < 2:
        raise ScenarioError("calibrate: the probe rows hold prefill runs at fewer than 2 prompt lengths")
    known, x = [], []
    for pi, bi in zip(p.astype(int), budget):
        k, chunks = _prefill_known(decode.params, int(pi), int(bi))
        known.append(k)
        x.append(pi - chunks)
    known, x = np.array(known), np.array(x, float)
    design = np.column_stack([np.ones_like(x), x])
    sol, *_ = np.linalg.lstsq(design, y - known, rcond=None)
    pred = known + design @ sol
    return FitResult(params={"per_token_ms": max(float(sol[1]), 0.0)}, families=[PROBE_PREFIX + "prefill"],
                     n=len(y), r2=r2_score(y, pred),
                     extra={"ttft_constant_ms": float(sol[0]),
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
        sel = ranks == rank
        if len(set(dist[sel])) < 2:
            extra[f"rank_{rank}"] = {"fitted": False, "note": "fewer than 2 distinct-adapter counts"}
            continue
        params, info = fit_lora_factor(dist[sel], y[sel], base[sel])
        params["ref_max_loras"] = float(np.median(loras[sel]))
        per_rank[rank] = params
        extra[f"rank_{rank}"] = {"r2": info["r2"], "n_points": int(sel.sum()), "n_sat_test": info["n_sat_test"],
                                 "max_abs_rel_error": info["max_abs_rel_error"]}
    if not per_rank:
        raise ScenarioError("calibrate: the probe rows hold no LoRA runs at 2+ distinct-adapter counts")
    return FitResult(params=per_rank, families=[PROBE_PREFIX + "lora"], n=len(y), extra=extra)


def fit_loading(runs: pd.DataFrame) -> FitResult | None:
    rows = _ok(runs, "loading")
    if rows.empty:
        return None
    kind, ranks, per = rows["probe_load_kind"].astype(str).to_numpy(), num(rows["max_lora_rank"]), \
        num(rows["probe_load_ms_per_adapter"])
    cpu = {int(r): float(np.mean(per[(kind == "cpu") & (ranks == r)])) for r in set(ranks[kind == "cpu"])}
    both = {int(r): float(np.mean(per[(kind == "disk") & (ranks == r)])) for r in set(ranks[kind == "disk"])}
    disk = {r: max(v - cpu[r], 0.0) for r, v in both.items() if r in cpu}
    if not cpu or not disk:
        return None
    return FitResult(params={"cpu_to_gpu_ms": cpu, "disk_to_cpu_ms": disk}, families=[PROBE_PREFIX + "loading"],
                     n=len(rows), extra={"target": "pacer window with a burst of K non-resident adapters minus the "
                                                   "same burst resident, per adapter"})


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


def fit_probe(runs: pd.DataFrame) -> dict[str, FitResult | None]:
    decode = fit_decode(runs)
    return {"decode": decode, "prefill": fit_prefill(runs, decode), "lora": fit_lora(runs, decode),
            "loading": fit_loading(runs)}


def _lora_entry(base: Profile, rank: int, p: dict) -> dict:
    keep = base.latency.lora_for_rank(rank)
    return {"jump": sig(p["jump"]), "slope": sig(p["slope"]), "n_sat": sig(p["n_sat"]),
            "ref_max_loras": sig(p["ref_max_loras"]), "slot_share": keep.slot_share, "prefill_share": keep.prefill_share}


def calibrate_probe(runs_csv: str | Path, base_profile: str, out: str | Path) -> dict[str, Any]:
    """Fit the probe rows of ``runs_csv``; keep what they do not measure from ``base_profile``
    (a bundled name or a YAML); write the profile to ``out``; return it as a dict."""
    runs = load_runs(runs_csv)
    runs = runs[runs["experiment"].str.startswith(PROBE_PREFIX)]
    base = load_profile(base_profile)
    fits = fit_probe(runs)
    prof = profile_to_dict(base)
    lat = prof["latency"]
    for k in ("base_ms", "per_seq_ms", "per_ctx_ktoken_ms"):
        lat[k] = sig(fits["decode"].params[k])
    lat["per_token_ms"] = sig(fits["prefill"].params["per_token_ms"])
    lat["lora"] = {int(r): _lora_entry(base, int(r), p) for r, p in fits["lora"].params.items()}
    if fits["loading"] is not None:
        prof["loading"] = {k: {int(r): sig(v) for r, v in sorted(t.items())} for k, t in fits["loading"].params.items()}
    prof["name"] = Path(out).stem
    prof["fit"] = clean({
        "tool": "lora_opt.calibrate (probe)",
        "command": f"lora-opt calibrate --runs {runs_csv} --model {base_profile} --out {out}",
        "data": {"file": str(runs_csv), "sha256": sha256_of(Path(runs_csv))},
        "kept_from": {"profile": base.name, "what": "model dimensions, memory model, LoRA slot_share and "
                                                    "prefill_share, front-end TTFT terms, defaults"},
        "estimators": {k: (v.summary() if v is not None else {"identified": False}) for k, v in fits.items()},
        "kv_check": kv_check(runs, base)})
    profile_from_dict(prof, str(out))           # schema check before anything is written
    atomic_write_text(out, "# Generated by lora-opt calibrate from lora-opt probe rows; rerun fit.command.\n"
                      + yaml.safe_dump(prof, sort_keys=False, default_flow_style=None, width=110))
    return prof


__all__ = ["calibrate_probe", "fit_probe", "is_probe_table", "PROBE_PREFIX"]
