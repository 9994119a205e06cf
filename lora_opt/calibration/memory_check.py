"""Memory check: the fitted memory model against every real run of the model (a check, not a fit).

Validation families included: each run's start-up (ok vs ``gpu_oom``) and logged KV size are
predicted with :meth:`Profile.startup_check` / :meth:`Profile.kv_capacity_tokens`, exactly as the
twin does.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from lora_opt.calibration.model_table import MODELS, model_entry
from lora_opt.calibration.runs_csv import measured_kv_tokens, num, startup_config
from twin.errors import ScenarioError
from twin.flags import EngineFlags
from twin.profile import Profile


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
    util, mnbt, n_loras, ranks = startup_config(rows, profile)
    lora_on = num(rows["enable_lora"]) == 1
    measured = measured_kv_tokens(rows)
    seqs = num(rows["max_num_seqs"])
    actual_ok = (rows["status"] == "ok").to_numpy()
    pred_ok, pred_kv = [], []
    seqs_or_default = np.where(np.isfinite(seqs), seqs, profile.defaults.max_num_seqs)
    for nl, r, u, mb, ms in zip(n_loras, ranks, util, mnbt, seqs_or_default):
        starts, kv, _ = profile.startup_check(EngineFlags(max_loras=int(nl), max_lora_rank=int(r), max_num_seqs=int(ms),
                                                          max_num_batched_tokens=int(mb), gpu_memory_utilization=float(u)))
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


def check_summary(check: dict[str, Any]) -> dict[str, Any]:
    """The part of :func:`memory_check`'s result the profile's ``fit.memory_check`` records."""
    keep = ("n_runs", "accuracy", "confusion", "accuracy_by_family", "kv_ok_runs",
            "kv_ok_runs_at_calibrated_max_num_seqs", "kv_gpu_oom_runs", "kv_by_max_num_seqs_ok_runs",
            "calibrated_max_num_seqs")
    return {k: check[k] for k in keep}

