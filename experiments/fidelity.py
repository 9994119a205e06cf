"""Twin fidelity against the real vLLM runs, with the published twin side by side (tracked in MLflow).

    python experiments/fidelity.py [--family F] [--workers N] [--tracking-uri URI]

Writes experiments/fidelity/ (report.md, runs.csv, max_pack.csv, summary.json, PNG plots) and logs
the SMAPE table and the report as one MLflow run in the experiment "fidelity".
Same as `lora-opt fidelity --out experiments/fidelity`, plus tracking.
Runs with lora-opt installed (``pip install -e .`` in the checkout): it imports the installed package.
"""
import argparse
from pathlib import Path

from lora_opt.calibration.fidelity import run_fidelity
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run

OUT = Path(__file__).resolve().parent / "fidelity"

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--tracking-uri")
    a = ap.parse_args()
    with tracked_run("fidelity", run_name=a.family or "all", tracking_uri=a.tracking_uri):
        import mlflow
        summary = run_fidelity(family=a.family, out_dir=OUT, workers=a.workers,
                               command="python experiments/fidelity.py" + (f" --family {a.family}" if a.family else ""))
        mlflow.log_params({"family": a.family or "all", "n_runs": summary["n_runs"], "variants": ",".join(summary["variants"])})
        log_flat_metrics("smape", summary["smape"])
        log_flat_metrics("max_pack", summary["max_pack"])
        log_dir(OUT)
    print(f"report -> {OUT / 'report.md'}")
