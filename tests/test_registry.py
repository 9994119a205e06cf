"""Surrogates from the MLflow model registry (``--surrogate models:/NAME@ALIAS`` or ``/VERSION``):
a registered version resolves to the whole surrogate its run logged, loaded through the same
checked files as a directory; the promote (alias) workflow; version tags; clear errors."""
import json
import shutil

import mlflow
import numpy as np
import pytest

from lora_opt.cli import main
from lora_opt.errors import InputError
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.policies.base import bundled_surrogate_dir
from lora_opt.placement.workload_file import load_workload
from lora_opt.surrogates import registry, reporting
from lora_opt.surrogates.features import FEATURES
from lora_opt.surrogates.oracle import Surrogate
from lora_opt.tracking import tracked_run

PROFILE = "llama-3.1-8b-h100-64gb"
STARVATION, THROUGHPUT = reporting.REGISTERED_NAMES["classifier"], reporting.REGISTERED_NAMES["regressor"]
SMALL = """profile: llama-3.1-8b-h100-64gb
adapters:
  - {count: 30, rank: 8, rate: 0.3}
  - {count: 10, rank: 16, rate: 0.1}
"""


def register_surrogate_dir(src, uri: str, profile: str = PROFILE) -> dict:
    """Log and register a surrogate directory's heads as ``lora-opt train`` does (one run, both
    names, the directory under ``surrogate/``, version tags); returns the registered versions."""
    sur = Surrogate.load(src)
    X = np.tile(np.linspace(1.0, 8.0, len(FEATURES)), (3, 1))
    with tracked_run("surrogate", run_name="registered-for-test", tracking_uri=uri, profile=profile):
        models = {"regressor": reporting.log_sklearn_model(sur.regressor, "throughput_model", THROUGHPUT, X,
                                                           sur.regressor.predict(X)),
                  "classifier": reporting.log_sklearn_model(sur.classifier, "starvation_model", STARVATION, X,
                                                            sur.classifier.predict_proba(X))}
        registry.tag_versions(models, {"dataset_hash": sur.metadata["dataset_hash"], "profile": profile}, uri)
        registry.log_surrogate_dir(src)
    return models


@pytest.fixture(autouse=True, scope="module")
def _forget_tracking_uri():
    """mlflow.set_tracking_uri is process-global (and exports MLFLOW_TRACKING_URI): undo it."""
    yield
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def _registry_store(tmp_path_factory):
    """One store for the module (making a store and registering cost seconds): the bundled surrogate
    as version 1 of both names, a copy with a changed model file as version 2; alias ``champion`` -> 1."""
    base = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{base}/registry.db"
    bundled = bundled_surrogate_dir(PROFILE)
    register_surrogate_dir(bundled, uri)
    tampered = base / "tampered"
    shutil.copytree(bundled, tampered)
    blob = bytearray((tampered / "surrogate.skops").read_bytes())
    blob[-1] ^= 1                                  # the manifest's sha256 no longer matches
    (tampered / "surrogate.skops").write_bytes(bytes(blob))
    with tracked_run("surrogate", tracking_uri=uri):
        registry.log_surrogate_dir(tampered)
        run_id = mlflow.active_run().info.run_id
    client = mlflow.MlflowClient(uri)
    for name in (STARVATION, THROUGHPUT):
        client.create_model_version(name, f"runs:/{run_id}/surrogate", run_id=run_id)
    client.set_registered_model_alias(STARVATION, "champion", 1)
    return {"uri": uri, "bundled": bundled, "client": client}


@pytest.fixture
def store(_registry_store, monkeypatch):
    """The module's store, named by MLFLOW_TRACKING_URI (as a user's shell would)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _registry_store["uri"])
    return _registry_store


def test_alias_and_version_resolve_to_the_runs_surrogate(store):
    d = registry.surrogate_dir(f"models:/{STARVATION}@champion")
    assert sorted(p.name for p in d.iterdir()) == sorted(registry.SURROGATE_FILES)
    X = np.array([[16, 2.0, 0.1, 16, 12, 4, 8, 500.0], [64, 9.0, 0.3, 32, 20, 8, 32, 4000.0]])   # FEATURES order
    for got, want in zip(Surrogate.load(d).predict(X), Surrogate.load(store["bundled"]).predict(X)):
        np.testing.assert_array_equal(got, want)
    assert registry.surrogate_dir(f"models:/{THROUGHPUT}/1") == d           # one run, both names
    mv = store["client"].get_model_version(STARVATION, "1")
    assert mv.tags["profile"] == PROFILE and mv.tags["dataset_hash"]
    assert registry.surrogate_dir("some/dir") == "some/dir"                 # not a models:/ URI


def test_registry_surrogate_goes_through_the_same_checks(store):
    d = registry.surrogate_dir(f"models:/{STARVATION}/2")      # the version with the changed file
    with pytest.raises(InputError, match="does not match"):
        Surrogate.load(d)


def test_promote_then_place_with_the_champion(store, tmp_path, capsys):
    (tmp_path / "w.yaml").write_text(SMALL)
    args = ["place", "--workload", str(tmp_path / "w.yaml"), "--gpus", "4", "--policy", "greedy-plus",
            "--verify-s", "0", "--json"]
    assert main([*args, "--out", str(tmp_path / "bundled")]) == 0
    bundled = json.loads(capsys.readouterr().out)
    store["client"].set_registered_model_alias(STARVATION, "champion", 1)       # promote (the docs' recipe)
    assert main([*args, "--out", str(tmp_path / "registry"), "--surrogate", f"models:/{STARVATION}@champion"]) == 0
    from_registry = json.loads(capsys.readouterr().out)
    assert from_registry["gpus"] == bundled["gpus"] and bundled["gpus"]
    ctx = PlacementContext.for_workload(load_workload(str(tmp_path / "w.yaml")), f"models:/{STARVATION}@champion")
    assert ctx.oracle("full").threshold == Surrogate.load(store["bundled"]).threshold


@pytest.mark.parametrize("spec, message", [
    (f"models:/{STARVATION}@nope", r"no such version or alias .*versions \[1, 2\]; @champion -> 1"),
    (f"models:/{STARVATION}/9", r"versions \[1, 2\]"),
    ("models:/not-registered@champion", "no registered model 'not-registered'"),
    ("models:/a/b/c", "expected models:/NAME/VERSION or models:/NAME@ALIAS"),
])
def test_bad_model_uris_are_input_errors(store, spec, message):
    with pytest.raises(InputError, match=message):
        registry.surrogate_dir(spec)


def test_a_version_whose_run_has_no_surrogate_directory(store):
    with tracked_run("surrogate", tracking_uri=store["uri"]):
        run_id = mlflow.active_run().info.run_id
    store["client"].create_registered_model("not-lora-opt-train")
    store["client"].create_model_version("not-lora-opt-train", f"runs:/{run_id}/m", run_id=run_id)
    with pytest.raises(InputError, match="holds no surrogate/ directory"):
        registry.surrogate_dir("models:/not-lora-opt-train/1")
