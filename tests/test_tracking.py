"""MLflow tracking: the store a run goes to (``--tracking-uri``, ``MLFLOW_TRACKING_URI``, else
``./mlruns`` of the current directory), the provenance tags every run carries, and the commands
that fit, evaluate or search logged as runs (``--no-track`` logs nothing)."""
import hashlib
import json
import os
import re
import shutil
import subprocess

import mlflow
import pytest

from lora_opt import tracking
from lora_opt.calibration.profile_fit import calibrate_runs
from lora_opt.cli import main
from lora_opt.tracking import log_flat_metrics, tracked_run
from twin.profile import load_profile

PROFILE = "llama-3.1-8b-h100-64gb"
RUNS_CSV = "data/real_runs/real_runs_vllm_lora.csv"
SMALL = """profile: llama-3.1-8b-h100-64gb
adapters:
  - {count: 12, rank: 8, rate: 0.2}
evaluation: {duration_s: 60, seed: 7}
"""


@pytest.fixture(autouse=True)
def _forget_tracking_uri():
    """mlflow.set_tracking_uri is process-global (and exports MLFLOW_TRACKING_URI): undo it."""
    yield
    mlflow.set_tracking_uri(None)


def test_tracked_run_logs_metrics_and_artifacts(tmp_path):
    uri = os.environ["MLFLOW_TRACKING_URI"]          # the test's own store (conftest)
    art = tmp_path / "a"
    art.mkdir()
    (art / "x.txt").write_text("hi")
    with tracked_run("unit", run_name="r", tracking_uri=uri) as run:
        log_flat_metrics("smape", {"report half": {"throughput": {"sharegpt": 3.5, "peer": None}}})
        mlflow.log_artifacts(str(art))
    got = mlflow.get_run(run.info.run_id)
    assert got.data.metrics == {"smape.report_half.throughput.sharegpt": 3.5}
    assert [f.path for f in mlflow.MlflowClient().list_artifacts(run.info.run_id)] == ["x.txt"]


def test_provenance_tags():
    tags = tracking.provenance_tags(PROFILE, seeds={"sampler": 3})
    assert tags["lora_opt.version"] == tracking.package_version() != ""
    assert tags["lora_opt.twin_version"] == tracking.twin_version()    # what the dataset rows record
    assert tags["lora_opt.profile"] == PROFILE
    assert tags["lora_opt.profile_hash"] == tracking.profile_hash(load_profile(PROFILE))
    assert tags["lora_opt.seeds"] == '{"sampler": 3}'
    if (tracking.SOURCE_ROOT / ".git").exists():       # run from a checkout (CI, developers)
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", tags["lora_opt.git_commit"])
    given = tracking.provenance_tags("p", profile_hash="abc")          # e.g. from a dataset's rows
    assert given["lora_opt.profile"] == "p" and given["lora_opt.profile_hash"] == "abc"
    assert "lora_opt.profile" not in tracking.provenance_tags()


def test_git_commit_only_at_the_top_of_a_checkout(tmp_path):
    """An installed package inside some other repository (a venv in a project) has no commit."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    site = tmp_path / "venv" / "site-packages"
    site.mkdir(parents=True)
    assert tracking.git_commit.__wrapped__(site) is None
    assert tracking.git_commit.__wrapped__(tmp_path / "nowhere") is None


def test_default_store_is_under_the_current_directory(tmp_path, monkeypatch):
    own_store = os.environ["MLFLOW_TRACKING_URI"][len("sqlite:///"):]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    uri = tracking.resolve_tracking_uri()
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlruns/mlflow.db" and (tmp_path / "mlruns").is_dir()
    assert tracking.ui_command(uri) == "mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db"
    # the docs' relative form (docs/concepts/tracking.md) works as --tracking-uri too (artifacts beside the database)
    shutil.copyfile(own_store, tmp_path / "mlruns" / "mlflow.db")        # an empty store (conftest)
    (tmp_path / "note.txt").write_text("x")
    run_id = tracking.log_command_run("unit", artifacts=[tmp_path / "note.txt"], tracking_uri="sqlite:///mlruns/mlflow.db")
    assert (tmp_path / "mlruns" / "artifacts" / "unit" / run_id / "artifacts" / "note.txt").is_file()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    assert tracking.resolve_tracking_uri() == "sqlite:///elsewhere.db"
    assert tracking.resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_untracked_run_logs_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path}/none.db"
    with tracked_run("unit", tracking_uri=uri, track=False) as run:
        tracking.log_params({"a": 1})            # no-ops outside a run, never start one
        log_flat_metrics("m", {"x": 1.0})
    assert run is None and mlflow.active_run() is None
    assert tracking.log_command_run("unit", params={"a": 1}, tracking_uri=uri, track=False) is None
    assert not (tmp_path / "none.db").exists()


def _runs(uri: str, experiment: str):
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def test_library_calls_log_no_run_unless_asked(tmp_path):
    """A command's library function (here ``lora-opt calibrate``'s) logs the command's run only when asked
    (``track=True``, as the CLI asks unless --no-track): a library caller logs none by default."""
    uri = os.environ["MLFLOW_TRACKING_URI"]          # the test's own store (conftest): where a default run would go
    prof, probe_rows = calibrate_runs(RUNS_CSV, "llama-2-7b", tmp_path / "p.yaml")
    assert not probe_rows and prof["fit"]["estimators"] and _runs(uri, "calibrate") == []
    calibrate_runs(RUNS_CSV, "llama-2-7b", tmp_path / "p.yaml", tracking_uri=uri, track=True)
    (run,) = _runs(uri, "calibrate")
    assert run.data.params == {"runs": RUNS_CSV, "model": "llama-2-7b", "out": str(tmp_path / "p.yaml"),
                               "probe_rows": "False"}


def test_commands_are_runs_with_provenance(tmp_path, capsys):
    """calibrate (--tracking-uri), place + evaluate and dataset (MLFLOW_TRACKING_URI): one run each,
    tagged; --no-track logs nothing."""
    uri = os.environ["MLFLOW_TRACKING_URI"]          # the test's own store (conftest)
    (tmp_path / "w.yaml").write_text(SMALL)
    prof = tmp_path / "p.yaml"
    assert main(["calibrate", "--runs", RUNS_CSV, "--model", "llama-2-7b", "--out", str(prof),
                 "--tracking-uri", uri]) == 0
    assert main(["place", "--workload", str(tmp_path / "w.yaml"), "--gpus", "2", "--out", str(tmp_path / "pl"),
                 "--policy", "greedy-fast"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "pl" / "placement.json"), "--workload", str(tmp_path / "w.yaml"),
                 "--workers", "1", "--grace-s", "30", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "greedy-fast"     # stdout stays one JSON object
    assert main(["dataset", "--grid", "tiny", "--out", str(tmp_path / "ds"), "--limit", "2", "--workers", "1"]) == 0
    capsys.readouterr()
    (cal,), (ev,), (dset,) = (_runs(uri, e) for e in ("calibrate", "evaluate", "dataset"))
    for run in (cal, ev, dset):
        assert run.info.status == "FINISHED"
        assert run.data.tags["lora_opt.twin_version"] == tracking.twin_version()
        assert run.data.tags["lora_opt.version"] == tracking.package_version()
    assert cal.data.tags["lora_opt.profile_hash"] == hashlib.sha256(prof.read_bytes()).hexdigest()[:16]
    assert any(k.startswith("step_decode.") for k in cal.data.metrics)
    assert ev.data.tags["lora_opt.profile"] == PROFILE and ev.data.tags["lora_opt.seeds"] == '{"evaluation": 7}'
    assert ev.data.params["policy"] == "greedy-fast" and "throughput_tok_s" in ev.data.metrics
    assert {a.path for a in mlflow.MlflowClient(uri).list_artifacts(ev.info.run_id)} == {"placement.json"}
    assert dset.data.tags["lora_opt.profile_hash"] == tracking.profile_hash(load_profile(PROFILE))
    # --no-track: no new run
    assert main(["calibrate", "--runs", RUNS_CSV, "--model", "llama-2-7b", "--out", str(prof), "--no-track"]) == 0
    assert len(_runs(uri, "calibrate")) == 1
