import shutil
import sys
from pathlib import Path

import pytest

import lora_opt.settings  # noqa: F401  (no telemetry, Ray on loopback)

PROFILE = "llama-3.1-8b-h100-64gb"


def small_scenario(**over):
    """A scenario small enough for per-step invariant checks."""
    sc = {
        "profile": PROFILE,
        "engine": {"max_loras": 4, "max_lora_rank": 16, "max_num_seqs": 64, "max_num_batched_tokens": 512},
        "adapters": [{"count": 6, "rank": 8, "rate": 0.5}, {"count": 4, "rank": 16, "rate": 1.0}],
        "duration_s": 60,
        "seed": 1,
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(sc.get(k), dict):
            sc[k] = {**sc[k], **v}
        else:
            sc[k] = v
    return sc


#: an empty MLflow store with its schema made, copied into each test's own store
_MLFLOW_TEMPLATE: list[Path] = []


@pytest.fixture(autouse=True)
def _hermetic(tmp_path_factory, monkeypatch):
    """Each test tracks to its own MLflow store.  Once a test has imported mlflow, later tests start
    from a copy of an empty store: making one runs MLflow's schema migrations (seconds each time)."""
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"      # beside tmp_path: tests list tmp_path
    if "mlflow" in sys.modules:
        if not _MLFLOW_TEMPLATE:
            import mlflow  # already imported by an earlier test: no import cost here

            template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
            mlflow.MlflowClient(f"sqlite:///{template}").search_experiments()     # makes the schema
            _MLFLOW_TEMPLATE.append(template)
        shutil.copyfile(_MLFLOW_TEMPLATE[0], db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    yield


@pytest.fixture
def small():
    return small_scenario
