"""``lora-opt error-model``: the twin's error on held-apart real runs, fitted as conformal bounds.

Every usable end-to-end real run (the fidelity families) is replayed on the twin twice: at its own
load (what ``lora-opt fidelity`` compares) and at an overload (2x its rates, 4x where the twin still
serves 2x), which gives the twin's capacity ``cap_twin`` for the run's configuration.  On the runs
where the real server was saturated (``error_model.capacity_observed``) the ratio
``cap_real / cap_twin`` is a sample of the twin's capacity error.

**Fitted on / reported on.** The bounds are fitted on the *report half* only (the runs no twin
constant was fitted on).  Their coverage is measured on runs they were not fitted on: each report-half
workload (family x A_max) is scored with bounds fitted on the other workloads (leave one workload out),
and the fit half is scored with the bounds of the whole report half.  The Max_pack trade-off (C against
regret and starving picks) is cross-fitted the same way: a workload's pick uses bounds that never saw it.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from lora_opt.calibration import realruns
from lora_opt.calibration.error_model import (POOLED, TWIN_SATURATED, ErrorModel, capacity_observed,
                                              conformal_lower, max_confidence)
from lora_opt.calibration.model_table import FIT_HALF
from lora_opt.calibration.replay import select_runs
from lora_opt.calibration.runs_csv import load_runs
from lora_opt.io import atomic_write_csv, atomic_write_figure, atomic_write_json, atomic_write_text
from lora_opt.parallel import run_scenarios
from lora_opt.tracking import log_command_run, profile_info
from twin.errors import ScenarioError

#: the confidences the report tabulates
CONFIDENCES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.975, 0.99)
RHO = 0.9
#: load factors of the capacity replays, tried in order until the twin saturates
OVERLOAD_FACTORS = (2.0, 4.0)
#: overload replays last at most this long (s): capacity is a rate, the queue only grows
OVERLOAD_S = 900.0
#: a run is light when the real server served at least this fraction without a queue
LIGHT_SERVED = 0.95


def _scenarios(rows, factor: float) -> list[dict]:
    out = []
    for _, r in rows.iterrows():
        s = realruns.run_to_scenario(r)
        if factor != 1.0:
            for a in s["adapters"]:
                a["rate"] *= factor
            s["duration_s"] = min(float(s["duration_s"]), OVERLOAD_S)
        out.append(s)
    return out


def _thr(res: dict) -> tuple[float, float]:
    if res.get("status") != "ok":
        return np.nan, np.nan
    return float(res.get("throughput_tok_s") or 0.0), float(res.get("incoming_token_rate") or np.nan)


def replay_runs(rows, workers: int | None = None, ray_address: str | None = None):
    """The runs with their twin results at 1x and their twin capacity (a DataFrame)."""
    import pandas as pd  # heavy optional dependency: only when tables are built

    base = run_scenarios(_scenarios(rows, 1.0), workers=workers, ray_address=ray_address, desc="twin at 1x")
    thr1, inc1 = map(np.array, zip(*(_thr(r) for r in base)))
    cap, cap_load = thr1.copy(), np.ones(len(rows))
    todo = np.flatnonzero(~(thr1 < TWIN_SATURATED * inc1))        # NaN (not ok) rows too
    for f in OVERLOAD_FACTORS:
        if not todo.size:
            break
        res = run_scenarios(_scenarios(rows.iloc[todo], f), workers=workers, ray_address=ray_address,
                            desc=f"twin at {f:g}x")
        t, i = map(np.array, zip(*(_thr(r) for r in res)))
        cap[todo], cap_load[todo] = t, f
        todo = todo[~(t < TWIN_SATURATED * i)]
    real = rows.reset_index(drop=True)
    rate_sum = np.array([sum(a["rate"] for a in realruns.run_to_scenario(r)["adapters"]) for _, r in real.iterrows()])
    real_inc = rate_sum * (real["total_input_tokens"] + real["total_output_tokens"]) / real["completed"]
    real_thr = (real["input_throughput"] + real["output_throughput"]).to_numpy(float)
    df = pd.DataFrame({
        "model": real["model"], "profile": real["model"].map(realruns.MODEL_PROFILES),
        "experiment": real["experiment"], "workload": [realruns.workload_key(r) for _, r in real.iterrows()],
        "n_served_adapters": real["n_served_adapters"].astype(int), "max_loras": real["max_loras"].astype(int),
        "real_throughput": real_thr, "real_incoming": real_inc.to_numpy(float),
        "real_waiting_mean": real["waiting_mean"].astype(float), "real_ttft_mean": real["mean_ttft_ms"].astype(float),
        "real_ttft_p99": real["p99_ttft_ms"].astype(float),
        "twin_throughput": thr1, "twin_incoming": inc1, "twin_capacity": cap, "twin_capacity_load": cap_load,
        "twin_ttft_p99": [((r.get("ttft_ms") or {}).get("p99") if r.get("status") == "ok" else None) for r in base],
    })
    df["twin_ttft_p99"] = df["twin_ttft_p99"].astype(float)
    df["half"] = ["fit" if FIT_HALF.get(m, "\0") in e else "report" for m, e in zip(df["model"], df["experiment"])]
    df["real_served"] = df["real_throughput"] / df["real_incoming"]
    df["twin_served"] = df["twin_throughput"] / df["twin_incoming"]
    df["capacity_observed"] = capacity_observed(df["real_served"], df["real_waiting_mean"], df["real_ttft_mean"]) \
        & np.isfinite(df["twin_capacity"]) & (df["twin_capacity"] > 0)
    df["capacity_ratio"] = df["real_throughput"] / df["twin_capacity"]
    df["regime"] = _regimes(df)
    return df


def _regimes(df) -> list[str]:
    """light (neither side queues), near saturation (real capacity observed), slot-bound (more adapters
    than A_max), the rest queued but served; ranks mixed would be a fourth (no replayed H100 family has it)."""
    out = []
    for _, r in df.iterrows():
        if r["capacity_observed"]:
            out.append("saturated, slot-bound" if r["n_served_adapters"] > r["max_loras"] else "saturated")
        elif r["real_served"] >= LIGHT_SERVED and r["twin_served"] >= TWIN_SATURATED \
                and r["real_waiting_mean"] < 1.0:
            out.append("light, slot-bound" if r["n_served_adapters"] > r["max_loras"] else "light")
        else:
            out.append("queued, served")
    return out


def fit_models(df) -> dict[str, ErrorModel]:
    """One ErrorModel per profile: its own report-half ratios and the pooled ones of every profile."""
    obs = df[(df["half"] == "report") & df["capacity_observed"]]
    pooled = obs["capacity_ratio"].tolist()
    models = {}
    for prof, g in df.groupby("profile"):
        own = obs[obs["profile"] == prof]["capacity_ratio"].tolist()
        info = profile_info(prof)
        models[prof] = ErrorModel(profile=prof, capacity_ratio={prof: own, POOLED: pooled},
                                  meta={"profile_sha256": info[1] if info else None},
                                  fitted_on=(f"report half of the bundled real runs ({realruns.REAL_RUNS_CSV.name}): "
                                             f"{len(own)} saturated runs of this profile, {len(pooled)} pooled over "
                                             f"{obs['profile'].nunique()} profiles"))
    return models


def _bound(own, pooled, c: float) -> tuple[float | None, str]:
    """What ErrorModel.bound does, on arrays: own samples first, else pooled (None: too few)."""
    for key, s in (("own", own), (POOLED, pooled)):
        q = conformal_lower(s, c) if len(s) else None
        if q is not None:
            return q, key
    return None, ""


def coverage_table(df, confidences=CONFIDENCES):
    """Per C and model: the fraction of capacity-observed runs whose ratio is >= the bound, scored on
    runs the bound was not fitted on (report half: leave one workload out; fit half: whole report half)."""
    import pandas as pd  # heavy optional dependency: only when tables are built

    obs = df[df["capacity_observed"]]
    rep = obs[obs["half"] == "report"]
    rows = []
    for c in confidences:
        for half in ("report", "fit"):
            part = obs[obs["half"] == half]
            hit = []
            for _, r in part.iterrows():
                train = rep[rep["workload"] != r["workload"]] if half == "report" else rep
                q, _ = _bound(train[train["profile"] == r["profile"]]["capacity_ratio"], train["capacity_ratio"], c)
                hit.append(np.nan if q is None else float(r["capacity_ratio"] >= q))
            part = part.assign(hit=hit)
            for model, g in [("all", part), *part.groupby("model")]:
                h = g["hit"].dropna()
                rows.append({"confidence": c, "scored_on": half + " half", "model": model, "runs": int(len(g)),
                             "coverage": float(h.mean()) if len(h) else np.nan, "no_bound": int(g["hit"].isna().sum())})
    return pd.DataFrame(rows)


def _pick(g, accept, by: str = "twin_throughput"):
    ok = g[accept]
    return None if ok.empty else ok.loc[ok[by].idxmax()]


def tradeoff_table(df, confidences=CONFIDENCES, rho: float = RHO):
    """Max_pack picks on the report half per rule: the twin's point estimate, the fixed 1.1x, and the
    conformal bound at each C (cross-fitted: a workload's bound never saw its runs).  Per workload:
    the pick's real throughput against the real Max_pack (regret %), and whether it starves the real run."""
    import pandas as pd  # heavy optional dependency: only when tables are built

    rep = df[df["half"] == "report"]
    obs = rep[rep["capacity_observed"]]
    picks = []
    for wl, g in rep.groupby("workload"):
        if g["n_served_adapters"].nunique() < 2:
            continue
        real = _pick(g, g["real_throughput"] >= rho * g["real_incoming"], "real_throughput")
        train = obs[obs["workload"] != wl]
        prof = g["profile"].iloc[0]
        rules = [("point (twin at 1x)", g["twin_throughput"] >= rho * g["twin_incoming"]),
                 ("fixed 1.1x", g["twin_capacity"] >= rho * 1.1 * g["twin_incoming"])]
        for c in confidences:
            q, _ = _bound(train[train["profile"] == prof]["capacity_ratio"], train["capacity_ratio"], c)
            rules.append((f"C={c:g}", (q * g["twin_capacity"] >= rho * g["twin_incoming"]) if q else g["n_served_adapters"] < 0))
        for rule, accept in rules:
            p = _pick(g, accept)
            row = {"rule": rule, "workload": wl, "model": g["model"].iloc[0],
                   "real_max_pack": None if real is None else int(real["n_served_adapters"]),
                   "pick": None if p is None else int(p["n_served_adapters"])}
            # a pick that starves the real run counts as starving (no regret); a workload every tested
            # count of which starves on the real server has no Max_pack, so no regret either
            row["starves"] = bool(p is not None and p["real_throughput"] < rho * p["real_incoming"])
            row["regret_pct"] = (100.0 * (1.0 - p["real_throughput"] / real["real_throughput"])
                                 if p is not None and real is not None and not row["starves"] else np.nan)
            picks.append(row)
    summary = []
    if not picks:        # no workload tested at two or more served-adapter counts: no Max_pack to pick
        return (pd.DataFrame(columns=["rule", "workload", "model", "real_max_pack", "pick", "starves", "regret_pct"]),
                pd.DataFrame(columns=["rule", "workloads", "with_real_max_pack", "starving_picks", "no_pick",
                                      "mean_regret_pct", "worst_regret_pct"]))
    picks = pd.DataFrame(picks)
    for rule, g in picks.groupby("rule", sort=False):
        has_real = g["real_max_pack"].notna()
        summary.append({"rule": rule, "workloads": int(len(g)), "with_real_max_pack": int(has_real.sum()),
                        "starving_picks": int(g["starves"].sum()),
                        "no_pick": int((g["pick"].isna() & has_real).sum()),
                        "mean_regret_pct": float(g["regret_pct"].mean()), "worst_regret_pct": float(g["regret_pct"].max())})
    return picks, pd.DataFrame(summary)


def regime_table(df):
    """Per half and regime: quantiles of the served-fraction ratio, throughput ratio and p99 TTFT ratio."""
    import pandas as pd  # heavy optional dependency: only when tables are built

    d = df.assign(served_ratio=df["real_served"] / df["twin_served"],
                  throughput_ratio=df["real_throughput"] / df["twin_throughput"],
                  ttft_p99_ratio=df["real_ttft_p99"] / df["twin_ttft_p99"])
    rows = []
    for (half, regime), g in d.groupby(["half", "regime"]):
        for q in ("served_ratio", "throughput_ratio", "ttft_p99_ratio", "capacity_ratio"):
            v = g[q].replace([np.inf, -np.inf], np.nan).dropna()
            if q == "capacity_ratio" and not regime.startswith("saturated"):
                continue                     # capacity not observed there
            if len(v):
                rows.append({"half": half, "regime": regime, "quantity": q, "runs": int(len(v)),
                             **{f"p{int(p * 100):02d}": float(v.quantile(p)) for p in (0.05, 0.5, 0.95)}})
    return pd.DataFrame(rows)


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def _md_table(df, cols: list[str], specs: dict | None = None) -> list[str]:
    specs = specs or {}
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c], specs[c]) if c in specs else str(r[c]) for c in cols) + " |")
    return lines


def _plots(coverage, summary, out: Path) -> list[str]:
    import matplotlib  # heavy optional dependency: only when plots are drawn
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy optional dependency: only when plots are drawn

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for (half, model), g in coverage.groupby(["scored_on", "model"]):
        if model == "all":
            a.plot(g["confidence"], g["coverage"], "-o", ms=3, label=f"{half} (all models)")
    a.plot([0.5, 1], [0.5, 1], "k--", lw=0.8, label="coverage = C")
    a.set_xlabel("confidence C")
    a.set_ylabel("coverage (runs with ratio >= bound)")
    a.legend(fontsize=7)
    s = summary[summary["rule"].str.startswith("C=")]
    cs = s["rule"].str[2:].astype(float)
    b.plot(cs, s["mean_regret_pct"], "-o", ms=3, label="mean regret % (non-starving picks)")
    b.plot(cs, s["worst_regret_pct"], "-s", ms=3, label="worst regret %")
    b.set_xlabel("confidence C")
    b.set_ylabel("regret % of the real Max_pack's throughput")
    b.legend(fontsize=7, loc="upper left")
    b2 = b.twinx()
    b2.bar(cs, s["starving_picks"], width=0.012, color="C3", alpha=0.5)
    b2.set_ylabel("starving picks (bars, count)", color="C3")
    b2.set_ylim(0, max(3, int(s["starving_picks"].max()) + 1 if len(s) else 0))   # no workload: no picks
    fig.suptitle("Twin capacity error on held-apart H100 runs: coverage and the Max_pack trade-off", fontsize=9)
    fig.tight_layout()
    atomic_write_figure(out / "confidence.png", fig, dpi=80)
    plt.close(fig)
    return ["confidence.png"]


def write_report(df, models, coverage, picks, summary, regimes, out: Path, meta: dict) -> Path:
    obs = df[df["capacity_observed"]]
    lines = ["# The twin's capacity error, as a distribution", "",
             f"Command: `{meta['command']}` ({meta['n_runs']} runs, {meta['wall_s']:.0f} s).", "",
             "**Fitted on:** the report half only (no twin constant was fitted on it), runs whose real capacity "
             "was observed (served < 95 % with a queue). **Reported on:** coverage on runs the bound was not fitted "
             "on -- each report-half workload with bounds fitted on the other workloads; the fit half with the "
             "whole report half's bounds. The Max_pack picks are cross-fitted the same way.", "",
             "Capacity ratio = real throughput / the twin's capacity (its throughput replayed at 2x or 4x the load). "
             "The bound at C is the split-conformal lower quantile; the twin then verifies a GPU at 1 / bound "
             "x its load (lora_opt/calibration/error_model.py).", "",
             "## Bounds per profile (fitted on the whole report half)", "",
             "| profile | own runs | C | bound (own) | verification load | bound (pooled) |", "|---|---|---|---|---|---|"]
    for prof, m in sorted(models.items()):
        own, pooled = m.samples(prof), m.samples(POOLED)
        for c in (0.5, 0.8, 0.9, 0.95, 0.99):
            qo, qp = conformal_lower(own, c), conformal_lower(pooled, c)
            lines.append(f"| {prof} | {len(own)} | {c:g} | {_fmt(qo, '.3f')} | "
                         f"{_fmt(1 / qo if qo else None, '.3f')} | {_fmt(qp, '.3f')} |")
    n_pooled = len(next(iter(models.values())).samples(POOLED)) if models else 0
    lines += ["", f"Own runs support C <= 1 - 1/(n+1); above it the pooled runs (n = {n_pooled}) "
              "are used, and above theirs `--confidence` is refused.", "",
              "## Coverage on runs the bound was not fitted on", ""]
    cov = coverage[coverage["model"] == "all"]
    lines += _md_table(cov, ["confidence", "scored_on", "runs", "coverage", "no_bound"], {"coverage": ".3f"})
    lines += ["", "Per model:", ""]
    lines += _md_table(coverage[coverage["model"] != "all"], ["confidence", "scored_on", "model", "runs", "coverage"],
                       {"coverage": ".3f"})
    lines += ["", "## Max_pack on the report half: confidence against regret and starving picks", "",
              "Per workload (family x A_max, served adapters varying), the rule's pick = the run with the highest "
              "twin throughput among those it accepts; regret = 1 - real throughput of the pick / the real Max_pack's "
              "(over the workloads with a real Max_pack and a non-starving pick); a starving pick serves < 90 % of its load "
              "on the real server; no pick = the rule accepts no tested count where the real server had a Max_pack "
              "(a GPU left unused: not in the regret). The grid of tested counts is coarse (8, 16, 32, 64, 128, 192, "
              "...): one step down costs 15-50 % of a workload's throughput.", ""]
    lines += _md_table(summary, ["rule", "workloads", "with_real_max_pack", "starving_picks", "no_pick",
                                 "mean_regret_pct", "worst_regret_pct"],
                       {"mean_regret_pct": ".2f", "worst_regret_pct": ".2f"})
    lines += ["", "## Residuals by regime (ratios real / twin; quantiles)", ""]
    lines += _md_table(regimes, ["half", "regime", "quantity", "runs", "p05", "p50", "p95"],
                       {"p05": ".3f", "p50": ".3f", "p95": ".3f"})
    lines += ["", "No replayed H100 family mixes ranks in one run: that regime has no held-apart runs here.",
              f"Capacity observed on {len(obs)} of {len(df)} runs.", "", "![coverage and trade-off](confidence.png)", ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def run_error_model(runs_csv: str | Path = realruns.REAL_RUNS_CSV, out_dir: str | Path = "outputs/error_model",
                    models_dir: str | Path | None = None, family: str | None = None, workers: int | None = None,
                    ray_address: str | None = None, command: str = "lora-opt error-model", *,
                    tracking_uri: str | None = None, track: bool = False) -> dict:
    """Replay, fit, score; write runs.csv, coverage.csv, tradeoff.csv, picks.csv, report.md, the plot and
    one error model YAML per profile into ``models_dir`` (default OUT/models); when ``track``, the command's
    MLflow run (experiment ``error_model``: coverage and trade-off numbers) in ``tracking_uri``.  Returns the
    summary."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = select_runs(load_runs(runs_csv), family)
    if len(rows) == 0:
        raise ScenarioError(f"--family {family!r}: no usable runs in {runs_csv}")
    df = replay_runs(rows, workers, ray_address)
    n_obs = int((df["capacity_observed"] & (df["half"] == "report")).sum())
    if n_obs < 2:
        raise ScenarioError(f"{runs_csv}: {n_obs} held-apart (report-half) runs with the real capacity observed; "
                            "an error model needs at least 2 (more for a useful confidence: n runs support "
                            "C <= 1 - 1/(n+1))")
    models = fit_models(df)
    mdir = Path(models_dir) if models_dir else out / "models"
    mdir.mkdir(parents=True, exist_ok=True)
    written = [str(m.save(mdir / f"{prof}.yaml")) for prof, m in sorted(models.items())]
    coverage = coverage_table(df)
    picks, summary = tradeoff_table(df)
    regimes = regime_table(df)
    for name, frame in (("runs.csv", df), ("coverage.csv", coverage), ("picks.csv", picks),
                        ("tradeoff.csv", summary), ("regimes.csv", regimes)):
        atomic_write_csv(out / name, frame, index=False)
    meta = {"command": command, "n_runs": int(len(df)), "wall_s": time.perf_counter() - t0,
            "report_runs_capacity_observed": n_obs, "max_confidence_pooled": max_confidence(n_obs),
            "error_models": written}
    plots = _plots(coverage, summary, out)
    write_report(df, models, coverage, picks, summary, regimes, out, meta)
    result = {**meta, "plots": plots, "tradeoff": summary.to_dict("records"),
              "coverage": coverage[coverage["model"] == "all"].to_dict("records")}
    atomic_write_json(out / "summary.json", result, indent=1, default=float)
    metrics = {"coverage": {f"{r['scored_on']}_C{r['confidence']:g}": r["coverage"] for r in result["coverage"]},
               "tradeoff": {r["rule"]: {k: r[k] for k in ("starving_picks", "no_pick", "mean_regret_pct",
                                                          "worst_regret_pct")} for r in result["tradeoff"]}}
    log_command_run("error_model", family or "all", params={"runs": runs_csv, "family": family, "command": command},
                    metrics=metrics, artifacts=[out_dir], seeds=realruns.RUN_SEEDS, wall_s=result["wall_s"],
                    tracking_uri=tracking_uri, track=track)
    return result
