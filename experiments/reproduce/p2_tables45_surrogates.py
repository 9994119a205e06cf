"""Second paper, Tables 4 and 5: the surrogates (KNN / RF / SVM throughput regressor and starvation
classifier) and their distillation into one shallow tree compiled with Numba.

Ours, two ways: (1) the bundled surrogates' own report (``configs/surrogates/<profile>/metrics.json``:
held-out 20 % of the twin-labelled grid, latencies measured at training); (2) the paper's test --
the bundled surrogate (chosen heads) and its distilled tree scored against the real 1-hour vLLM runs
(``digital_twin_modelling/real_results``, Llama-3.1-8B and Qwen-2.5-7B; real starvation = real
throughput < 0.9 x incoming tokens, as the papers define it).  The prediction latency is measured
here, one call per GPU configuration and in a batch.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure
from lora_opt.calibration.realruns import run_to_scenario
from lora_opt.smape import smape
from lora_opt.surrogates.distill import DistilledSurrogate
from lora_opt.surrogates.features import FEATURES, gpu_features
from lora_opt.surrogates.oracle import Surrogate

NAME = "p2_tables45_surrogates"
TITLE = "Second paper Tables 4-5: surrogates and distillation, on held-out twin data and on real runs"
PAPER = "second"
QUICK = True

PROFILES = {"llama-3.1-8b-instruct": "llama-3.1-8b-h100-64gb", "qwen-2.5-7b-instruct": "qwen-2.5-7b-h100-64gb"}
RHO = 0.9
PAPER_TEXT = ("Table 4: RF throughput SMAPE < 8 %, starvation macro-F1 0.93-0.99, 0.25 / 0.16 ms per prediction; "
              "Table 5: small tree <= 32 rules, +6.74 % SMAPE, -0.025 F1, 1.13e-4 ms (Numba)")


def _macro_f1(pred_starving: np.ndarray, starving: np.ndarray) -> float:
    f1 = []
    for cls in (True, False):
        tp = np.sum((pred_starving == cls) & (starving == cls))
        fp = np.sum((pred_starving == cls) & (starving != cls))
        fn = np.sum((pred_starving != cls) & (starving == cls))
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0)
    return float(np.mean(f1))


def real_table() -> pd.DataFrame:
    """Features and real outcomes of the real 1-hour runs the twin was validated on."""
    runs = pd.read_csv(REPO / "experiments" / "fidelity" / "runs.csv")
    runs = runs[runs["model"].isin(list(PROFILES))]
    real = pd.read_csv(REPO / "data" / "real_runs" / "real_runs_vllm_lora.csv", low_memory=False)
    real = real.set_index("source_dir").loc[runs["source_dir"]]
    rows = []
    for (_, r), (_, f) in zip(real.iterrows(), runs.iterrows()):
        sc = run_to_scenario(r.to_dict() | {"source_dir": f["source_dir"]})
        ranks = [a["rank"] for a in sc["adapters"] for _ in range(a["count"])]
        rates = [a["rate"] for a in sc["adapters"] for _ in range(a["count"])]
        feats = gpu_features(ranks, rates, sc["engine"]["max_loras"])
        rows.append({**feats, "source_dir": f["source_dir"], "model": f["model"], "real_throughput": f["real_throughput"],
                     "starving": bool(f["real_throughput"] < RHO * f["real_incoming"])})
    return pd.DataFrame(rows)


def _latency_us(oracle, X: np.ndarray) -> tuple[float, float]:
    """(single call, per row in one batch) in microseconds, best of 3."""
    one = X[:1]
    oracle.predict(one)
    single = min(_timed(lambda: [oracle.predict(one) for _ in range(50)]) / 50 for _ in range(3))
    big = np.repeat(X, max(1, 20000 // len(X)), axis=0)
    batch = min(_timed(lambda: oracle.predict(big)) for _ in range(3)) / len(big)
    return single * 1e6, batch * 1e6


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _on_real(df: pd.DataFrame) -> tuple[list, dict]:
    rows, metrics = [], {}
    for model, prof in PROFILES.items():
        g = df[df["model"] == model]
        X = g.loc[:, list(FEATURES)].to_numpy(float)
        d = REPO / "configs" / "surrogates" / prof
        for label, oracle in (("surrogate", Surrogate.load(d)), ("distilled", DistilledSurrogate.load(d / "distilled.json"))):
            thr, feasible, _ = oracle.predict(X)
            ok = ~g["starving"].to_numpy()
            s = smape(thr[ok], g["real_throughput"].to_numpy()[ok])
            f1 = _macro_f1(~feasible, g["starving"].to_numpy())
            ff = float(np.mean(feasible[~ok])) if (~ok).any() else float("nan")
            single, batch = _latency_us(oracle, X)
            rows.append([model, label, len(g), int((~ok).sum()), s, s / 2, f1, ff, single, batch])
            for k, v in (("smape", s), ("macro_f1", f1), ("false_feasible_rate", ff), ("single_us", single),
                         ("batch_us", batch)):
                metrics[f"real.{model}.{label}.{k}"] = v
    return rows, metrics


def _bundled() -> tuple[list, dict]:
    rows, metrics = [], {}
    for model, prof in PROFILES.items():
        m = json.loads((REPO / "configs" / "surrogates" / prof / "metrics.json").read_text())
        for fam in ("knn", "rf", "svm"):
            reg, cls = m["regressor"][fam], m["classifier"][fam]
            rows.append([model, fam, reg["test_smape"], cls["test"]["macro_f1"], cls["test"]["false_feasible_rate"],
                         reg["latency"]["single_us"] / 1e3, reg["latency"]["batch_us_per_row"] / 1e3])
            metrics[f"heldout.{model}.{fam}.smape"] = reg["test_smape"]
            metrics[f"heldout.{model}.{fam}.macro_f1"] = cls["test"]["macro_f1"]
        dist = m["distilled"]
        rows.append([model, "distilled tree (32 leaves)", dist["throughput"]["distilled_smape"],
                     dist["starvation"]["distilled"]["macro_f1"], dist["starvation"]["distilled"]["false_feasible_rate"],
                     dist["latency"]["single_call_predict_api_us"] / 1e3, dist["latency"]["batch_ns_per_prediction"] / 1e6])
        metrics[f"heldout.{model}.distilled.smape_increase"] = dist["throughput"]["smape_increase"]
        metrics[f"heldout.{model}.distilled.f1_change"] = dist["starvation"]["macro_f1_change"]
    return rows, metrics


def _figure(real_rows: list, ctx: Context) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [f"{r[0].split('-')[0]} {r[1]}" for r in real_rows]
    axes[0].bar(labels, [r[4] for r in real_rows])
    axes[0].axhline(8, ls="--", c="k", lw=1, label="paper: < 8 %")
    axes[0].set(ylabel="throughput SMAPE vs real (%)", title="on real non-starving runs")
    axes[1].bar(labels, [r[6] for r in real_rows])
    axes[1].axhspan(0.93, 0.99, color="grey", alpha=0.3, label="paper: 0.93-0.99")
    axes[1].set(ylabel="starvation macro-F1 vs real", title="on real runs", ylim=(0, 1))
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=7)
        ax.legend(fontsize=7)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    real_rows, m_real = _on_real(real_table())
    b_rows, m_b = _bundled()
    table = "Against the real runs (the paper's test):\n\n" + md_table(
        ["model", "oracle", "runs", "starving runs", "throughput SMAPE", "papers' scale", "starvation macro-F1",
         "false feasible rate", "single call (us)", "batch (us/row)"], real_rows)
    table += "\nHeld-out twin-labelled grid (the bundled metrics.json, measured at training):\n\n" + md_table(
        ["model", "family", "throughput SMAPE", "starvation macro-F1", "false feasible rate", "single call (ms)",
         "batch (ms/row)"], b_rows)
    s = {(r[0], r[1]): r for r in real_rows}
    L, Q = "llama-3.1-8b-instruct", "qwen-2.5-7b-instruct"
    lat = min(r[9] for r in real_rows if r[1] == "distilled") * 1e3
    ours = (f"vs real runs: surrogate SMAPE {s[(L, 'surrogate')][4]:.1f} / {s[(Q, 'surrogate')][4]:.1f} % "
            f"(Llama / Qwen), F1 {s[(L, 'surrogate')][6]:.2f} / {s[(Q, 'surrogate')][6]:.2f}; distilled "
            f"{s[(L, 'distilled')][4]:.1f} / {s[(Q, 'distilled')][4]:.1f} %, F1 {s[(L, 'distilled')][6]:.2f} / "
            f"{s[(Q, 'distilled')][6]:.2f}, {lat:.0f} ns/prediction in a batch; held-out twin grid: RF "
            f"{m_b[f'heldout.{L}.rf.smape']:.1f} / {m_b[f'heldout.{Q}.rf.smape']:.1f} %, F1 "
            f"{m_b[f'heldout.{L}.rf.macro_f1']:.2f} / {m_b[f'heldout.{Q}.rf.macro_f1']:.2f}")
    sur = [r for r in real_rows if r[1] == "surrogate"]
    dist = [r for r in real_rows if r[1] == "distilled"]
    worst_s, worst_f1 = max(r[4] for r in sur), min(r[6] for r in sur)
    f1_drop = float(np.mean([a[6] - b[6] for a, b in zip(sur, dist)]))
    s_rise = float(np.mean([b[4] - a[4] for a, b in zip(sur, dist)]))
    good = worst_s < 8 and worst_f1 >= 0.93
    single_ms = [r[8] / 1e3 for r in sur]
    return Row(
        name=NAME, title=TITLE, paper_value=PAPER_TEXT, ours=ours,
        real=f"{sum(r[2] for r in real_rows) // 2} real 1-hour runs (vLLM 0.8.5) are the test set",
        verdict="reproduced" if good else "partly",
        why=(f"Table 4 {'reproduced' if good else 'not met'} on the real runs (worst SMAPE {worst_s:.1f} %, worst F1 "
             f"{worst_f1:.2f}); distilling adds {s_rise:.1f} % SMAPE and costs {f1_drop:.3f} F1 on average (paper "
             f"+6.74 / -0.025; Llama's tree drops to {dist[0][6]:.2f}); a single sklearn call takes "
             f"{min(single_ms):.0f}-{max(single_ms):.0f} ms here (paper 0.25 ms), which is why placement batches its "
             f"questions ({min(r[9] for r in sur):.0f}-{max(r[9] for r in sur):.0f} us/row)"),
        metrics={**m_real, **m_b}, params={"rho": RHO, "test": "digital_twin_modelling/real_results, both halves"},
        figure=_figure(real_rows, ctx), table_md=table)
