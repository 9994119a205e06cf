"""The ``max_num_seqs`` term of the memory model (``MemorySpec.overhead_gib_per_1k_seqs``, ``seqs_knee``).

Not in the memory family's data: the profiling peak grows with ``max_num_seqs`` above a knee (the
sampler's dummy run holds several fp32 ``[max_num_seqs, vocab]`` tensors).  Fitted as a hinge on
the no-LoRA runs of the latency families (:func:`fit_max_num_seqs_term`); the profile's overhead is
valid at the ``max_num_seqs`` of the memory family.  Where those families do not exist (vLLM 0.5.0),
:func:`fit_max_num_seqs_term_v0` identifies the term from the one estimator family run at
another ``max_num_seqs``, against the already fitted memory model.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import optimize

from lora_opt.calibration.fitting import FitResult, r2_score
from lora_opt.calibration.model_table import ModelEntry
from lora_opt.calibration.runs_csv import family_rows, measured_kv_tokens, num, startup_config
from twin.profile import GIB, Profile


def fit_max_num_seqs_term(runs: pd.DataFrame, entry: ModelEntry) -> FitResult | None:
    """Non-KV memory vs ``max_num_seqs`` (no LoRA): ``extra = slope * max(0, seqs - knee)``.

    The profiling run's sampler holds ``[max_num_seqs, vocab]`` fp32 tensors; above a knee they,
    not the 2048-token forward pass, set the activation peak (``MemorySpec.overhead_gib_per_1k_seqs``,
    ``seqs_knee``).
    """
    fams = [f"digital_twin_dynamic/estimators/predictor_default_latency/{entry.csv_name}/",
            f"digital_twin_dynamic/estimators/predictor_latency_overhead/{entry.csv_name}/initial_points_small/"]
    rows = pd.concat([family_rows(runs, f) for f in fams])
    rows = rows[num(rows["enable_lora"]) == 0]
    kv = measured_kv_tokens(rows)
    seqs = num(rows["max_num_seqs"])
    ok = np.isfinite(kv) & (kv > 0) & np.isfinite(seqs)
    seqs, gib = seqs[ok], kv[ok] * entry.spec.kv_bytes_per_token / GIB
    if len(np.unique(seqs)) < 4:
        return None

    def hinge(s, kv0, slope_gib_per_kseq, knee):
        return kv0 - slope_gib_per_kseq * np.maximum(s - knee, 0.0) / 1000.0

    p, _ = optimize.curve_fit(hinge, seqs, gib, p0=[gib.max(), 1.0, 150.0],
                              bounds=([0, 0, 0], [100, 100, 4096]))
    pred = hinge(seqs, *p)
    return FitResult(
        params={"slope_gib_per_1k_seqs": p[1], "knee_seqs": p[2]}, families=fams, n=int(len(seqs)),
        r2=r2_score(gib, pred),
        extra={"kv_gib_below_knee_no_lora": p[0],
               "overhead_vs_memory_family_gib": p[1] * max(entry.memory_max_num_seqs - p[2], 0) / 1000.0,
               "note": ("MemorySpec.overhead_gib_per_1k_seqs / seqs_knee: non_kv_overhead_gib holds at "
                        f"max_num_seqs={entry.memory_max_num_seqs}; at max_num_seqs s the overhead "
                        "changes by slope*(max(s, knee) - max(ref, knee))/1000 GiB")},
        plot={"x": seqs, "y": gib, "pred": pred})


def fit_max_num_seqs_term_v0(runs: pd.DataFrame, entry: ModelEntry, profile: Profile) -> FitResult | None:
    """V0 (0.5.0): the same sampler term from the only estimator family run at another
    ``max_num_seqs`` -- ``performance_analysis/loading_overhead`` (50, one LoRA slot) -- against
    ``profile``'s memory model, fitted at the memory family's 4096.  Two ``max_num_seqs`` values
    identify the overhead difference, not the knee: the knee is set at the smaller value (50),
    so below it the overhead is taken as flat (unknown, and no run below it)."""
    fam = f"performance_analysis/loading_overhead/latency/{entry.csv_name}/"
    rows = family_rows(runs, fam)
    rows = rows[rows["status"] == "ok"]
    kv = measured_kv_tokens(rows)
    seqs = num(rows["max_num_seqs"])
    ok = np.isfinite(kv) & (kv > 0) & np.isfinite(seqs) & (seqs < entry.memory_max_num_seqs)
    if not ok.any():
        return None
    rows, kv, seqs = rows[ok], kv[ok], seqs[ok]
    knee = float(seqs.min())
    util, mnbt, n_loras, ranks = startup_config(rows, profile)
    # KV the memory model (no seqs term) predicts for these configurations; the measured surplus
    # is overhead the profiling run does not hold at this max_num_seqs
    pred = np.array([profile.kv_capacity_tokens(int(nl), int(r), float(u), int(mb), enable_lora=nl > 0,
                                                max_num_seqs=entry.memory_max_num_seqs)
                     for nl, r, u, mb in zip(n_loras, ranks, util, mnbt)], float)
    surplus_gib = (kv - pred) * entry.spec.kv_bytes_per_token / GIB
    delta = float(np.mean(surplus_gib))
    slope = max(delta, 0.0) * 1000.0 / (entry.memory_max_num_seqs - knee)
    resid = surplus_gib - delta
    return FitResult(
        params={"slope_gib_per_1k_seqs": slope, "knee_seqs": knee}, families=[fam], n=int(len(kv)),
        r2=None,
        extra={"overhead_vs_memory_family_gib": delta,
               "surplus_gib_per_run_sd": float(np.std(resid)),
               "max_num_seqs_values": sorted({int(x) for x in seqs}),
               "note": ("two max_num_seqs values (this family's and the memory family's "
                        f"{entry.memory_max_num_seqs}): slope = mean KV surplus / difference; knee = the "
                        "smaller value (not identified)")},
        plot={"x": seqs, "y": surplus_gib, "pred": np.full(len(kv), delta),
              "line_x": np.array([0.0, knee, float(entry.memory_max_num_seqs)]),
              "line_y": np.array([delta, delta, 0.0]),
              "label": "measured KV - memory model (fitted at the memory family's max_num_seqs)",
              "ylabel": "KV surplus (GiB)"})
