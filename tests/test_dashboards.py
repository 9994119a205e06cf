"""The dashboards of the ``[ui]`` extra over what lora-opt wrote, as the docs run them (docs/concepts/tracking.md):
``mlflow server`` over the tracking store (experiments, runs and registered models found through
MLflow's REST API) and ``optuna-dashboard`` over a search's study (its trials through its HTTP API).
Skipped, saying why, without the extra (full ``mlflow`` and ``optuna-dashboard``)."""
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlflow
import optuna
import pytest

from lora_opt.cli import main
from lora_opt.placement.policies.base import bundled_surrogate_dir
from lora_opt.surrogates import reporting

PROFILE = "llama-3.1-8b-h100-64gb"
TINY = """profile: llama-3.1-8b-h100-64gb
adapters:
  - {count: 10, rank: 8, rate: 0.3, prefix: s-}
  - {count: 6, rank: 16, rate: 0.2, prefix: m-}
evaluation: {duration_s: 120}
"""


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = pytest.mark.skipif(
    not (_installed("mlflow") and _installed("optuna-dashboard")),
    reason="the [ui] extra is not installed (pip install 'lora-opt[ui]': full mlflow for `mlflow server`/"
           "`mlflow ui`, optuna-dashboard); mlflow-skinny alone has no server")


def _script(name: str) -> str:
    """The console script of this interpreter's environment (the docs' command)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cmd: list[str], url: str, log: Path, timeout_s: float = 180.0) -> subprocess.Popen:
    """Start a server (its own process group: MLflow's starts job consumers too) and wait until
    ``url`` answers 200.  MLflow's job runner (GenAI evaluation jobs, 7 processes) is not needed."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{cmd[0]} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    _stop(proc)
    raise AssertionError(f"{cmd[0]} did not answer {url} within {timeout_s:g} s: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and its workers (the process group this test started)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """What a user's directory holds after `lora-opt search` (an MLflow run + an Optuna study) and a
    registered surrogate (as `lora-opt train` registers it)."""
    from test_registry import register_surrogate_dir

    base = tmp_path_factory.mktemp("dashboards")
    uri = f"sqlite:///{base}/mlruns/mlflow.db"
    (base / "mlruns").mkdir()
    (base / "w.yaml").write_text(TINY)
    assert main(["search", "--workload", str(base / "w.yaml"), "--gpus", "2", "--trials", "3", "--workers", "1",
                 "--out", str(base / "search"), "--tracking-uri", uri]) == 0
    register_surrogate_dir(bundled_surrogate_dir(PROFILE), uri)
    yield {"uri": uri, "study_db": f"sqlite:///{base / 'search' / 'study.db'}", "base": base}
    mlflow.set_tracking_uri(None)


def test_mlflow_server_shows_the_experiments_runs_and_models(written):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve([_script("mlflow"), "server", "--backend-store-uri", written["uri"], "--host", "127.0.0.1",
                   "--port", str(port), "--workers", "1"], f"{url}/health", written["base"] / "mlflow-server.log")
    try:
        with httpx.Client(base_url=f"{url}/api/2.0/mlflow", timeout=30.0, trust_env=False) as api:
            exps = api.get("/experiments/search", params={"max_results": 100}).raise_for_status().json()
            by_name = {e["name"]: e["experiment_id"] for e in exps["experiments"]}
            assert {"search", "surrogate"} <= set(by_name)
            runs = api.post("/runs/search", json={"experiment_ids": [by_name["search"]]}).raise_for_status().json()
            (run,) = runs["runs"]
            tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
            assert tags["lora_opt.profile"] == PROFILE and json.loads(tags["lora_opt.seeds"])["sampler"] == 0
            assert {m["key"] for m in run["data"]["metrics"]} >= {"trials", "complete"}
            models = api.get("/registered-models/search").raise_for_status().json()["registered_models"]
            assert {m["name"] for m in models} >= set(reporting.REGISTERED_NAMES.values())
            versions = api.get("/model-versions/search",
                               params={"filter": "name='lora-opt-starvation'"}).raise_for_status().json()
            assert {t["key"]: t["value"] for t in versions["model_versions"][0]["tags"]}["profile"] == PROFILE
            # the UI itself is served (the full mlflow package, not skinny)
            assert "<html" in httpx.get(url, timeout=30.0, trust_env=False).text.lower()
    finally:
        _stop(proc)
    print(f"mlflow server: experiments {sorted(by_name)}, search run {run['info']['run_id']}, "
          f"models {sorted(m['name'] for m in models)}")


def test_optuna_dashboard_serves_the_search_study(written):
    summaries = optuna.get_all_study_summaries(written["study_db"])
    (summary,) = summaries
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve([_script("optuna-dashboard"), written["study_db"], "--host", "127.0.0.1", "--port", str(port)],
                  f"{url}/api/studies", written["base"] / "optuna-dashboard.log")
    try:
        studies = httpx.get(f"{url}/api/studies", timeout=30.0, trust_env=False).raise_for_status().json()["study_summaries"]
        (listed,) = [s for s in studies if s["study_name"] == summary.study_name]
        detail = httpx.get(f"{url}/api/studies/{listed['study_id']}", timeout=30.0, trust_env=False).json()
        assert len(detail["trials"]) == summary.n_trials >= 3
        assert len(detail["directions"]) == 2                 # GPUs and latency
    finally:
        _stop(proc)
    print(f"optuna-dashboard: study {summary.study_name}, {len(detail['trials'])} trials")
