import shutil
import sys
from pathlib import Path

import pytest
from small_scenarios import PROFILE, small_scenario  # noqa: F401  (the `small` fixture; PROFILE for tests)

import lora_opt.no_network_env  # noqa: F401  (no telemetry, Ray on loopback)

#: failing tests' reports made with the garbage collector off (the module says why)
pytest_plugins = ["gc_quiet_reports"]

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
