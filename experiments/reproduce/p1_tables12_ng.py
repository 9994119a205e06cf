"""First paper, Tables 1-2: predicting the optimal served adapters N* and slots G* of a workload from
the 8 order statistics of its adapters' ranks and rates, per model family -- the paper's six (linear
ones: Linear, BayesianRidge, PLS; the random forest; RuleFit and FIGS from ``imodels``, the
``paper`` extra), each as two single-output regressors (one for N*, one for G*) as in the paper
where the family is single-output, and the forest's readable stand-in (one tree, depth 6, >= 10
samples per leaf, as the paper's Tree**).  Inference time: one workload, both outputs, median of
repeated calls (the paper's "time" column).

Ours: a seeded sample of whole workloads labelled by the twin (``configs/grids/workloads.yaml``
with fewer workloads: every (served, A_max) pair of the testing points, Llama-3.1-8B profile,
one simulated hour each, early stop), (N*, G*) = the twin's throughput argmax among non-starving
points (``lora_opt.surrogates.paper_ng.workload_table``); models scored by 5-fold CV over workloads
(leave-one-out below 50).  Then the paper's test: the models trained on all twin workloads predict
the REAL optimum of the bundled real workloads (``digital_twin_modelling/real_results``, Llama-3.1-8B:
only 4 workloads with a whole (served, A_max) sweep).  SMAPE on both scales (the papers' omits the /2).
"""
from __future__ import annotations

import shutil

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.io import atomic_write_text
from lora_opt.smape import smape
from lora_opt.surrogates.dataset import generate, load_dataset
from lora_opt.surrogates.paper_ng import PAPER_STATS, workload_table
from lora_opt.tracking import twin_version
from twin.parsing import read_config_file

NAME = "p1_tables12_ng"
TITLE = "First paper Tables 1-2: N* and G* prediction SMAPE per model family (twin labels and real optima)"
PAPER = "first"
QUICK = True

QUICK_WORKLOADS, FULL_WORKLOADS = 24, 240
RHO = 0.9
REAL_FAMILY = "digital_twin_modelling/real_results/llama-3.1-8b-instruct/"
#: the paper's Table 2 (Llama / Qwen), SMAPE without the /2: N*, G*
PAPER_NG = {"LinearRegression": "38.6-40.6 / -", "RFRegressor": "0.05 / 6.73 (Llama), 1.01 / 7.15 (Qwen)",
            "RuleFitRegressor": "no accuracy advantage; 1.80 / 2.03 ms inference",
            "Tree**": "3.70 / 10.86 (Llama), 1.01 / - (Qwen)"}


def families(seed: int) -> dict:
    from sklearn.cross_decomposition import PLSRegression  # heavy optional dependency: only when fitting
    from sklearn.ensemble import RandomForestRegressor
    from sklearn.linear_model import BayesianRidge, LinearRegression
    from sklearn.multioutput import MultiOutputRegressor
    from sklearn.tree import DecisionTreeRegressor

    fams = {"LinearRegression": lambda: LinearRegression(),
            "BayesianRidge": lambda: MultiOutputRegressor(BayesianRidge()),
            "PLSRegression": lambda: PLSRegression(n_components=2),
            "RFRegressor": lambda: RandomForestRegressor(n_estimators=200, random_state=seed, n_jobs=1)}
    try:
        from imodels import FIGSRegressor, RuleFitRegressor  # the `paper` extra: only these two families
    except ImportError:         # not installed: the table says so
        pass
    else:
        fams["RuleFitRegressor"] = lambda: MultiOutputRegressor(RuleFitRegressor(random_state=seed))
        fams["FIGSRegressor"] = lambda: MultiOutputRegressor(FIGSRegressor(random_state=seed))
    fams["Tree** (depth 6)"] = lambda: DecisionTreeRegressor(max_depth=6, min_samples_leaf=10, random_state=seed)
    return fams


def inference_ms(model, x: np.ndarray, repeats: int = 30) -> float:
    """Median time of one prediction (one workload, both outputs), ms."""
    import time

    model.predict(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.predict(x)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1000.0)


def twin_workloads(ctx: Context) -> pd.DataFrame:
    """Label the reduced workloads grid into the result's folder (resumes) and tabulate (N*, G*)."""
    grid = read_config_file(REPO / "configs" / "grids" / "workloads.yaml", "grid")
    grid["workloads"] = QUICK_WORKLOADS if ctx.quick else FULL_WORKLOADS
    grid["seed"] = ctx.seed
    path = ctx.out / "grid.yaml"
    import yaml  # heavy-ish optional dependency: only to write the grid file

    atomic_write_text(path, yaml.safe_dump(grid, sort_keys=False))
    # the labels are a cache of this twin's (resumed by a rerun): another twin labels afresh
    out = ctx.out / f"dataset-{grid['workloads']}-{twin_version().rsplit('+', 1)[-1]}"
    for stale in ctx.out.glob(f"dataset-{grid['workloads']}*"):
        if stale != out and stale.is_dir():
            shutil.rmtree(stale)
    generate(None, path, out, workers=2, track=False)
    df = load_dataset(out)
    return workload_table(df[df["status"].isin(["ok", "oom"])])


def real_workloads() -> pd.DataFrame:
    """The real optimum of each bundled real workload (rank set x rate set), as workload_table does."""
    runs = pd.read_csv(REPO / "experiments" / "fidelity" / "runs.csv")
    runs = runs[runs["experiment"].str.startswith(REAL_FAMILY)]
    rows = []
    for exp, g in runs.groupby("experiment"):
        ok = g[g["real_throughput"] >= RHO * g["real_incoming"]]
        if not len(ok):
            continue
        best = ok.loc[ok["real_throughput"].idxmax()]
        ranks = np.full(3, float(best["max_lora_rank"]))
        rates = np.array([float(x) for x in str(best["adapter_rates"]).split()])
        rows.append({"experiment": exp, "rank_min": ranks.min(), "rank_max": ranks.max(), "rank_mean": ranks.mean(),
                     "rank_std": ranks.std(), "rate_min": rates.min(), "rate_max": rates.max(),
                     "rate_mean": rates.mean(), "rate_std": rates.std(),
                     "n_star": float(best["n_served_adapters"]), "g_star": float(best["max_loras"])})
    return pd.DataFrame(rows)


def score(wl: pd.DataFrame, real: pd.DataFrame, seed: int) -> list[list]:
    from sklearn.model_selection import KFold, LeaveOneOut, cross_val_predict  # heavy optional dependency

    X, Y = wl.loc[:, list(PAPER_STATS)].to_numpy(float), wl.loc[:, ["n_star", "g_star"]].to_numpy(float)
    Xr, Yr = real.loc[:, list(PAPER_STATS)].to_numpy(float), real.loc[:, ["n_star", "g_star"]].to_numpy(float)
    cv = LeaveOneOut() if len(wl) < 50 else KFold(5, shuffle=True, random_state=seed)
    rows = []
    for name, make in families(seed).items():
        pred = np.asarray(cross_val_predict(make(), X, Y, cv=cv)).reshape(Y.shape)
        model = make().fit(X, Y)
        pr = np.asarray(model.predict(Xr)).reshape(Yr.shape)
        rows.append([name, smape(pred[:, 0], Y[:, 0]), smape(pred[:, 1], Y[:, 1]),
                     smape(pr[:, 0], Yr[:, 0]), smape(pr[:, 1], Yr[:, 1]), inference_ms(model, X[:1]),
                     PAPER_NG.get(name.split(" ")[0], "-")])
    med = np.median(Y, axis=0)
    rows.append(["median (no skill)", smape(np.full(len(Y), med[0]), Y[:, 0]), smape(np.full(len(Y), med[1]), Y[:, 1]),
                 smape(np.full(len(Yr), med[0]), Yr[:, 0]), smape(np.full(len(Yr), med[1]), Yr[:, 1]), 0.0, "-"])
    return rows


def _figure(rows: list[list], ctx: Context) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = np.arange(len(rows))
    for i, (lab, col) in enumerate((("N*, twin CV", 1), ("G*, twin CV", 2), ("N*, real", 3), ("G*, real", 4))):
        ax.bar(x + (i - 1.5) * 0.2, [r[col] / 2 for r in rows], 0.2, label=lab)
    ax.set_xticks(x, [r[0] for r in rows], rotation=20, fontsize=7)
    ax.set(ylabel="SMAPE, papers' scale (%)", title="N*/G* prediction per model family (Llama-3.1-8B)")
    ax.legend(fontsize=7)
    return save_figure(fig, ctx)


#: the paper's Tree** on Llama (papers' scale): N*, G*
PAPER_TREE = (3.70, 10.86)


def _verdict(by: dict, n_workloads: int, n_real: int, quick: bool) -> tuple[str, str]:
    """Partly reproduced when the ranking holds (forest below the linear model on N*) and the
    readable tree is within 1.5x of the paper's Tree** on both outputs; else it differs."""
    rf, lin, tree = by["RFRegressor"], by["LinearRegression"], by["Tree** (depth 6)"]
    med = by["median (no skill)"]
    ranking = rf[1] < lin[1]
    tree_close = all(tree[i] / 2 <= 1.5 * p for i, p in zip((1, 2), PAPER_TREE))
    size = (f"{n_workloads} twin-labelled workloads (the paper's grid: 2,200)" + (" in the quick run" if quick else ""))
    real_g = min(r[4] for k, r in by.items() if k != "median (no skill)")
    real_txt = (f"against the {n_real} real optima (the paper's 882-run real test set is not bundled) the errors are "
                f"larger (RF N* {rf[3] / 2:.1f} %, G* {rf[4] / 2:.1f} %)"
                + (f" and no family predicts G* better than the no-skill median ({med[4] / 2:.1f} %)"
                   if real_g >= med[4] else ""))
    head = (f"the ranking {'reproduces' if ranking else 'does not reproduce'} (the forest against the linear model: N* "
            f"{rf[1] / 2:.1f} vs {lin[1] / 2:.1f} %); the readable tree is "
            f"{'at' if tree_close else 'not at'} the paper's level (N* {tree[1] / 2:.1f} vs {PAPER_TREE[0]} %, G* "
            f"{tree[2] / 2:.1f} vs {PAPER_TREE[1]} %); the forest is at N* {rf[1] / 2:.1f} %, G* {rf[2] / 2:.1f} % against "
            f"the paper's 0.05 % / 6.73 % (likely: the twin's throughput surface is flat near its top, so the argmax "
            f"jumps between neighbouring grid points), with {size}; ")
    return ("partly" if ranking and tree_close else "differs"), head + real_txt


def run(ctx: Context) -> Row:
    wl = twin_workloads(ctx)
    real = real_workloads()
    rows = score(wl, real, ctx.seed)
    table = md_table(["family", "N* SMAPE, twin CV", "G* SMAPE, twin CV", "N* SMAPE vs real optimum",
                      "G* SMAPE vs real optimum", "inference ms", "paper (Table 2, papers' scale)"], rows)
    ran = {r[0] for r in rows}
    missing = [f for f in ("RuleFitRegressor", "FIGSRegressor") if f not in ran]
    table += (f"\nFull scale (divide by 2 for the papers' scale). Twin labels: {len(wl)} workloads with a feasible "
              f"configuration; real: {len(real)} workloads."
              + (f" Not run: {', '.join(missing)} (install the `paper` extra: imodels).\n" if missing else "\n"))
    by = {r[0]: r for r in rows}
    rf, lin, tree = by["RFRegressor"], by["LinearRegression"], by["Tree** (depth 6)"]
    rules = "".join(f"; {by[f][0].replace('Regressor', '')} N* {by[f][1] / 2:.1f} %, G* {by[f][2] / 2:.1f} % "
                    f"({by[f][5]:.2f} ms per prediction)" for f in ("RuleFitRegressor", "FIGSRegressor") if f in by)
    metrics = {f"{r[0].split(' ')[0]}.{k}": float(v) for r in rows
               for k, v in zip(("n_cv", "g_cv", "n_real", "g_real", "inference_ms"), r[1:6])}
    metrics["workloads"] = float(len(wl))
    verdict, why = _verdict(by, len(wl), len(real), ctx.quick)
    return Row(
        name=NAME, title=TITLE,
        paper_value="trees: N* 0.05-1.01 %, G* 6.73-7.15 %; linear: N* 38.6-40.6 %; Tree**: N* 3.70 %, G* 10.86 % (Llama)",
        ours=(f"papers' scale, twin CV over {len(wl)} workloads: RF N* {rf[1] / 2:.1f} %, G* {rf[2] / 2:.1f} %; linear "
              f"N* {lin[1] / 2:.1f} %; tree N* {tree[1] / 2:.1f} %, G* {tree[2] / 2:.1f} %{rules}; RF {rf[5]:.2f} ms; "
              f"vs the {len(real)} real "
              f"optima: RF N* {rf[3] / 2:.1f} %, G* {rf[4] / 2:.1f} %"),
        real=f"{len(real)} real Llama-3.1-8B workloads with a whole (served, A_max) sweep",
        verdict=verdict, why=why,
        metrics=metrics, params={"workloads": len(wl), "profile": "llama-3.1-8b-h100-64gb", "rho": RHO},
        figure=_figure(rows, ctx), table_md=table)
