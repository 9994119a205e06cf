"""The papers' whole dataset grid, labelled once, and what it says about the bundled surrogates.

    lora-opt dataset --grid papers --out outputs/dataset-papers-llama     # ~1.5 h on 2 cores; resumable
    python experiments/papers_grid.py [--dataset DIR] [--train] [--out DIR] [--tracking-uri URI]

``configs/grids/papers.yaml`` is the papers' grid (145,200 points: 3 adapter groups, ranks {8, 16, 32},
10 rates, served adapters and A_max over 8..384, one simulated hour each, Llama-3.1-8B profile).
The bundled surrogates (``configs/surrogates/<profile>/``) were trained on 4,000 points of the
default grid; this script scores them on every labelled papers'-grid point, which they never saw
(out of sample: a different grid, a different sampling):

* starvation head: false-feasible share (the surrogate says "runs" where the twin starves or the
  engine cannot start -- the error that costs a placement its guarantee), false-infeasible share
  (a GPU wasted), ROC AUC of P(starving);
* throughput head: SMAPE (the BRIEF's full scale) on the points that ran the whole hour without
  starving (the rows a regressor is trained on).

``--train`` also trains surrogates on the papers' grid (``lora_opt.surrogates.training``, the
``lora-opt train`` pipeline, on ``--train-rows`` rows drawn from the grid stratified by starvation,
seed 0; all rows by default) and scores both surrogates on every grid row the new one was not
trained on (its own held-out 20 % and, with ``--train-rows``, the rest of the grid).  Outputs
(``--out``, default ``experiments/papers_grid/``): ``results.json``, ``table.md``; one MLflow run
(experiment ``papers-grid``).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from lora_opt.smape import smape
from lora_opt.io import atomic_write_json, atomic_write_text
from lora_opt.placement.policies.base import bundled_surrogate_dir
from lora_opt.surrogates.oracle import Surrogate
from lora_opt.surrogates.training_data import label_rows, load_dataset_dir
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run

OUT = Path(__file__).resolve().parent / "papers_grid"
DATASET = Path("outputs") / "dataset-papers-llama"


def labels(df) -> dict:
    """The twin's labels of the rows a surrogate is judged on (``label_rows``: ran or OOM), the
    throughput head judged on whole-hour non-starving rows only."""
    _, X, thr, starving, measured = label_rows(df)
    starving = starving.astype(bool)
    return {"X": X, "starving": starving, "measured": measured & ~starving, "throughput": thr}


def _training_rows(df, n: int | None):
    """(``n`` rows stratified by the starvation label, seed 0; the other rows) -- all rows and none
    when ``n`` is None or covers the grid."""
    if n is None or n >= len(df):
        return df, df.iloc[0:0]
    from sklearn.model_selection import train_test_split  # heavy optional dependency: only when training

    strata = (df["starving"].astype(bool) | (df["status"] != "ok")).to_numpy()
    keep, rest = train_test_split(np.arange(len(df)), train_size=n, stratify=strata, random_state=0)
    return df.iloc[np.sort(keep)].reset_index(drop=True), df.iloc[np.sort(rest)].reset_index(drop=True)


def score(sur, X, starving, measured, throughput) -> dict:
    """The surrogate's two heads against the twin's labels on these rows."""
    from sklearn.metrics import roc_auc_score  # heavy optional dependency: only when scoring

    thr, feasible, p = sur.predict(X)
    n = len(starving)
    out = {"rows": int(n), "starving_rows": int(starving.sum()),
           "false_feasible_share": float(np.mean(feasible & starving)),
           "false_feasible_rate": float(np.mean(feasible[starving])) if starving.any() else float("nan"),
           "false_infeasible_rate": float(np.mean(~feasible[~starving])) if (~starving).any() else float("nan"),
           "accuracy": float(np.mean(feasible != starving)),
           "auc": float(roc_auc_score(starving, p)) if 0 < starving.sum() < n else float("nan"),
           "throughput_rows": int(measured.sum()),
           "throughput_smape": smape(thr[measured], throughput[measured]) if measured.any() else float("nan")}
    return out


def _table(results: dict) -> str:
    cols = ["rows", "false_feasible_rate", "false_infeasible_rate", "accuracy", "auc", "throughput_rows",
            "throughput_smape"]
    lines = ["| surrogate / rows | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, s in results["scores"].items():
        cells = [f"{s[c]:.4g}" if isinstance(s[c], float) else str(s[c]) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lab = results["labelling"]
    return ("# The papers' grid and the surrogates\n\n"
            f"Dataset: {lab['rows']:,} rows ({lab['dir']}), twin {lab['twin_version']}, labelled in "
            f"{lab['wall_h']:.2f} h of wall time over {lab['runs']} run(s) of `lora-opt dataset` "
            f"({lab['rows_per_s']:.1f} rows/s); {lab['starving_or_oom']:,} starving or OOM, "
            f"{lab['measured']:,} whole-hour non-starving rows.\n\n" + "\n".join(lines) + "\n\n"
            "Rates are shares of the rows' own class (false-feasible: of the starving/OOM rows; false-infeasible: of "
            "the feasible rows); SMAPE full scale, on whole-hour non-starving rows.\n")


def labelling_facts(dataset: Path, df, lab: dict) -> dict:
    """Rows and the labelling's wall time, summed over the runs of ``lora-opt dataset`` that wrote
    it (``summary.json``'s ``runs``: a labelling resumed after a stop is several runs), and the
    points' own simulation time summed (``point_cpu_h``: what one worker would have needed)."""
    summary = json.loads((dataset / "summary.json").read_text()) if (dataset / "summary.json").exists() else {}
    runs = (summary.get("runs") or [summary]) if summary else []
    wall = sum(float(r.get("wall_s", 0.0)) for r in runs)
    return {"dir": str(dataset), "rows": int(len(df)), "twin_version": str(df["twin_version"].iloc[0]),
            "runs": len(runs), "wall_h": wall / 3600.0, "rows_per_s": len(df) / wall if wall else float("nan"),
            "point_cpu_h": float(df["wall_s"].sum()) / 3600.0,
            "starving_or_oom": int(lab["starving"].sum()), "measured": int(lab["measured"].sum())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=str(DATASET), help="the labelled papers' grid (lora-opt dataset --out)")
    ap.add_argument("--profile", default="llama-3.1-8b-h100-64gb", help="bundled surrogate to score")
    ap.add_argument("--train", action="store_true", help="also train surrogates on the grid and compare")
    ap.add_argument("--fast", action="store_true", help="with --train: tiny hyper-parameter grids (a smoke run)")
    ap.add_argument("--train-rows", type=int, default=None,
                    help="with --train: train on this many rows (stratified by starvation, seed 0; default all)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tracking-uri")
    ap.add_argument("--no-track", action="store_true")
    args = ap.parse_args(argv)
    dataset, out = Path(args.dataset), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    df, digest = load_dataset_dir(dataset)
    lab = labels(df)
    bundled = Surrogate.load(bundled_surrogate_dir(args.profile))
    results = {"dataset_hash": digest, "labelling": labelling_facts(dataset, df, lab),
               "scores": {"bundled, every row": score(bundled, lab["X"], lab["starving"], lab["measured"],
                                                      lab["throughput"])}}
    if args.train:
        from lora_opt.surrogates.training import train_surrogates

        train_df, rest = _training_rows(df, args.train_rows)
        trained = train_surrogates(train_df, out / "surrogate", track=False, fast=args.fast)
        data = trained["data"]
        test = data.test
        held = {"X": data.X[test], "starving": data.starving[test].astype(bool),
                "measured": data.measured[test] & (data.starving[test] == 0), "throughput": data.throughput[test]}
        results["scores"]["bundled, held-out 20 % of the training rows"] = score(bundled, **held)
        results["scores"]["trained on the grid, held-out 20 %"] = score(trained["surrogate"], **held)
        if len(rest):
            unseen = labels(rest)
            results["scores"]["bundled, grid rows outside the training rows"] = score(bundled, **unseen)
            results["scores"]["trained on the grid, rows outside its training rows"] = score(trained["surrogate"],
                                                                                            **unseen)
        results["trained"] = {"rows": int(len(train_df)), "train_wall_s": trained["metrics"]["train_wall_s"],
                              "chosen": trained["metrics"]["chosen"]}
    atomic_write_json(out / "results.json", results, indent=2)
    atomic_write_text(out / "table.md", _table(results))
    with tracked_run("papers-grid", run_name=f"papers-grid-{digest}", tracking_uri=args.tracking_uri,
                     profile=args.profile, track=not args.no_track, start_time=t0):
        log_flat_metrics("papers_grid", results)
        log_dir(out)
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
