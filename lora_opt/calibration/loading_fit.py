"""Loading (``LoadingSpec``): adapter load times vs rank, tabulated at the measured ranks.

Per-load mean times from ``predictor_loading`` (vLLM 0.8.5: disk and CPU counts/times) or
``performance_analysis/loading_overhead`` (0.5.0: per-run times, 0.1 s resolution), fitted against
the adapter rank by the smallest of constant / line / per-rank means that an F-test accepts.
0.5.0 logs every CPU->GPU activation as 0.0 s, so its CPU->GPU table comes from the model its
entry names (``ModelEntry.cpu_to_gpu_ms_from``); ``fit`` says so.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd
from scipy import stats

from lora_opt.calibration.fitting import FitResult, f_test_p, r2_score
from lora_opt.calibration.model_table import ModelEntry
from lora_opt.calibration.runs_csv import family_rows, num


def _rank_table(ranks: np.ndarray, ms: np.ndarray) -> tuple[dict[int, float], dict[str, Any]]:
    """Per-load time vs adapter rank, tabulated at the measured ranks.

    Nested least-squares models, the smallest one not rejected by an F-test (p < 0.05):
    a constant, a line in rank, a free value per rank (the group means; LoadingSpec interpolates
    linearly between the listed ranks, so this is a piecewise-linear fit).
    """
    ranks = ranks.astype(int)
    uniq = sorted(set(ranks))
    n = len(ms)
    models: dict[str, tuple[np.ndarray, int, dict[str, Any]]] = {
        "constant": (np.full(n, ms.mean()), 1, {"mean_ms": float(ms.mean())})}
    if len(uniq) >= 2:
        lin = stats.linregress(ranks, ms)
        models["linear"] = (lin.intercept + lin.slope * ranks, 2,
                            {"intercept_ms": lin.intercept, "slope_ms_per_rank": lin.slope})
    if len(uniq) >= 3:
        means = {r: float(ms[ranks == r].mean()) for r in uniq}
        models["per_rank_mean"] = (np.array([means[r] for r in ranks]), len(uniq), {})
    chosen, tests = "constant", {}
    for richer in ("linear", "per_rank_mean"):
        if richer not in models or n <= models[richer][1]:
            continue
        (p_small, k_small, _), (p_big, k_big, _) = models[chosen], models[richer]
        p_val = f_test_p(float(np.sum((ms - p_small) ** 2)), float(np.sum((ms - p_big) ** 2)), n, k_big,
                          extra=k_big - k_small)
        tests[f"{chosen}_vs_{richer}_p"] = p_val
        if p_val < 0.05:
            chosen = richer
    pred, _, info = models[chosen]
    table = {r: float(pred[ranks == r][0]) for r in uniq}
    return table, {"model": chosen, **info, **tests, "r2": r2_score(ms, pred), "n_points": int(n),
                   "measured_ranks": uniq}


def fit_loading_v1(runs: pd.DataFrame, entry: ModelEntry) -> FitResult:
    """Disk->CPU on every run (disk reads do not depend on the slot); CPU->GPU on runs whose
    adapter rank equals max_lora_rank (the slot padding adds 1-2 ms otherwise; the table has one
    index, the adapter rank)."""
    fam = f"digital_twin_dynamic/estimators/predictor_loading/{entry.csv_name}/"
    rows = family_rows(runs, fam)
    rows = rows[rows["status"] == "ok"]
    rank = num(rows["adapter_module_ranks"])
    slot = num(rows["max_lora_rank"])
    disk = 1000.0 * num(rows["adapter_load_time_from_disk_s"]) / num(rows["adapter_loads_from_disk"])
    cpu = 1000.0 * num(rows["adapter_load_time_from_memory_s"]) / num(rows["adapter_loads_from_memory"])
    disk_tab, disk_info = _rank_table(rank, disk)
    diag = rank == slot
    cpu_tab, cpu_info = _rank_table(rank[diag], cpu[diag])
    off = {f"r{int(a)}_in_slot_{int(s)}": c for a, s, c in zip(rank[~diag], slot[~diag], cpu[~diag])}
    return FitResult(params={"disk_to_cpu_ms": disk_tab, "cpu_to_gpu_ms": cpu_tab}, families=[fam],
                     n=int(len(rows)), extra={"disk_to_cpu": disk_info, "cpu_to_gpu": cpu_info,
                                              "cpu_to_gpu_off_diagonal_ms": off},
                     plot={"rank": rank, "disk": disk, "cpu": cpu, "diag": diag,
                           "disk_tab": disk_tab, "cpu_tab": cpu_tab})


def fit_loading_v0(runs: pd.DataFrame, entry: ModelEntry, fallback: Callable[[], FitResult]) -> FitResult:
    """Disk->CPU from ``lora_loading_time_s`` (one load per run, logged at 0.1 s resolution).

    ``lora_activating_time_s`` is 0.0 in every run (below the 0.1 s resolution), so CPU->GPU is not
    identifiable from this model's data; ``fallback`` supplies it (the fit of the model
    ``entry.cpu_to_gpu_ms_from`` names; documented in ``fit``).
    """
    fam = f"performance_analysis/loading_overhead/latency/{entry.csv_name}/"
    rows = family_rows(runs, fam)
    rows = rows[(rows["status"] == "ok")]
    load = num(rows["lora_loading_time_s"])
    act = num(rows["lora_activating_time_s"])
    rank = num(rows["max_lora_rank"])
    ok = np.isfinite(load)
    disk_tab, disk_info = _rank_table(rank[ok], 1000.0 * load[ok])
    fb = fallback()
    cpu_tab = fb.params["cpu_to_gpu_ms"]
    return FitResult(params={"disk_to_cpu_ms": disk_tab, "cpu_to_gpu_ms": cpu_tab}, families=[fam],
                     n=int(ok.sum()),
                     extra={"disk_to_cpu": disk_info,
                            "cpu_to_gpu": {"identifiable": False,
                                           "max_logged_activating_time_s": float(np.nanmax(act)),
                                           "resolution_s": 0.1,
                                           "chosen": entry.cpu_to_gpu_ms_from.reason,
                                           "source_families": fb.families}},
                     plot={"rank": rank[ok], "disk": 1000.0 * load[ok], "cpu": None, "diag": None,
                           "disk_tab": disk_tab, "cpu_tab": cpu_tab})
