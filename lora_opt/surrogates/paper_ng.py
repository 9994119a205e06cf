"""The earlier paper's model, kept for comparison: per workload (the adapter groups' ranks and
rates), predict the twin's best served adapters N* and slots G* from 8 order statistics with a
random forest, scored by leave-workload-out cross-validation."""
from __future__ import annotations

from typing import Any

import numpy as np

from lora_opt.smape import smape

#: below this many workloads the N*/G* model is reported but flagged as not meaningful
PAPER_MIN_WORKLOADS = 30
PAPER_STATS = ("rank_min", "rank_max", "rank_mean", "rank_std", "rate_min", "rate_max", "rate_mean", "rate_std")


def workload_table(df) -> Any:
    """One row per workload (profile + group ranks + group rates): the 8 order statistics of its
    adapters and the twin's argmax (N*, G*) of throughput among non-starving, non-OOM rows.
    With the served adapters split evenly over the groups, the statistics over the 3 groups are
    those of the adapters (exactly when 3 divides N)."""
    import pandas as pd  # heavy optional dependency: only when training

    keys = [c for c in ("profile", "group_ranks", "group_rates") if c in df.columns]
    ok = df[(df["status"] == "ok") & ~df["starving"].astype(bool)]
    rows = []
    for key, g in ok.groupby(keys, sort=True):
        key = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        ranks = np.array([float(x) for x in str(key["group_ranks"]).split(",")])
        rates = np.array([float(x) for x in str(key["group_rates"]).split(",")])
        best = g.loc[g["throughput_tok_s"].idxmax()]
        rows.append({**key, "rank_min": ranks.min(), "rank_max": ranks.max(), "rank_mean": ranks.mean(),
                     "rank_std": ranks.std(), "rate_min": rates.min(), "rate_max": rates.max(),
                     "rate_mean": rates.mean(), "rate_std": rates.std(),
                     "n_star": float(best["n_adapters"]), "g_star": float(best["max_loras"])})
    return pd.DataFrame(rows)


def paper_ng_model(df, *, seed: int = 0, fast: bool = False) -> dict:
    """SMAPE of an RF predicting (N*, G*) from the 8 order statistics, leave-workload-out CV
    (leave-one-out below 50 workloads, else 5-fold), next to predicting the training median."""
    from sklearn.ensemble import RandomForestRegressor  # heavy optional dependency: only when training
    from sklearn.model_selection import KFold, LeaveOneOut, cross_val_predict

    if not {"group_ranks", "group_rates"} <= set(df.columns):
        return {"note": "no group_ranks / group_rates columns: workloads unknown, N*/G* model skipped"}
    wl = workload_table(df[df["status"].isin(["ok", "oom"])])
    n_total = int(df.groupby([c for c in ("profile", "group_ranks", "group_rates") if c in df.columns]).ngroups)
    out: dict[str, Any] = {"workloads": n_total, "workloads_with_feasible_config": int(len(wl))}
    if len(wl) < 5:
        out["note"] = f"only {len(wl)} workloads with a non-starving configuration: N*/G* model not fitted"
        return out
    X = wl.loc[:, list(PAPER_STATS)].to_numpy(float)
    Y = wl.loc[:, ["n_star", "g_star"]].to_numpy(float)
    cv = LeaveOneOut() if len(wl) < 50 else KFold(5, shuffle=True, random_state=seed)
    rf = RandomForestRegressor(n_estimators=50 if fast else 200, random_state=seed, n_jobs=1)
    pred = cross_val_predict(rf, X, Y, cv=cv)
    base = np.empty_like(Y)                          # the no-skill reference: median of the other folds
    for tr, te in cv.split(X):
        base[te] = np.median(Y[tr], axis=0)
    out.update({
        "cv": "leave-one-workload-out" if len(wl) < 50 else "5-fold over workloads",
        "smape_n_star": smape(pred[:, 0], Y[:, 0], undefined="zero"),
        "smape_g_star": smape(pred[:, 1], Y[:, 1], undefined="zero"),
        "median_baseline_smape_n_star": smape(base[:, 0], Y[:, 0], undefined="zero"),
        "median_baseline_smape_g_star": smape(base[:, 1], Y[:, 1], undefined="zero"),
        "meaningful": bool(len(wl) >= PAPER_MIN_WORKLOADS),
    })
    if len(wl) < PAPER_MIN_WORKLOADS:
        out["note"] = (f"only {len(wl)} workloads (< {PAPER_MIN_WORKLOADS}): the N*/G* errors are "
                       "anecdotal, compare them with the median baseline")
    return out
