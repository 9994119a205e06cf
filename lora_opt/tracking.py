"""MLflow tracking with a local store by default (nothing leaves the machine unless asked).

Default store: ``sqlite:///<repo>/mlruns/mlflow.db`` with artifacts under ``<repo>/mlruns/``
(``mlruns/`` is not committed).  ``--tracking-uri`` or ``MLFLOW_TRACKING_URI`` point elsewhere.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lora_opt import settings  # noqa: F401  (MLflow telemetry off before mlflow is imported)
from twin.paths import REPO_ROOT

MLRUNS = REPO_ROOT / "mlruns"


def default_tracking_uri() -> str:
    MLRUNS.mkdir(exist_ok=True)
    return f"sqlite:///{MLRUNS / 'mlflow.db'}"


@contextlib.contextmanager
def tracked_run(experiment: str, run_name: str | None = None, tracking_uri: str | None = None):
    """An MLflow run in ``experiment`` (created with artifacts under mlruns/ when local)."""
    import mlflow

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        # a local SQLite store keeps its artifacts beside the database file
        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri[len("sqlite:///"):]).parent / "artifacts" / experiment).as_uri()
        mlflow.create_experiment(experiment, artifact_location=location)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name) as run:
        yield run


def log_flat_metrics(prefix: str, d: dict) -> None:
    """Log every finite number of a nested dict as ``prefix.key.sub`` metrics."""
    import math

    import mlflow

    flat: dict[str, float] = {}

    def walk(p, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{p}.{k}" if p else str(k), x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            flat[p.replace(" ", "_").replace(",", "")] = float(v)

    walk(prefix, d)
    mlflow.log_metrics(flat)           # one batch: per-metric calls cost ~30 ms each on SQLite


def log_dir(path: str | Path) -> None:
    import mlflow

    mlflow.log_artifacts(str(path))
