"""The lora-opt command line, end to end (as a user runs it)."""
import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from small_scenarios import small_scenario
from twin.paths import REPO_ROOT, SCENARIOS_DIR
from twin.simulate import RESULT_KEYS


def run(*args, cwd=REPO_ROOT):
    return subprocess.run([sys.executable, "-m", "lora_opt.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_help_lists_commands():
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("simulate", "bench", "calibrate"):
        assert cmd in out.stdout


def test_simulate_bundled_example_summary():
    out = run("simulate", str(SCENARIOS_DIR / "example.yaml"))
    assert out.returncode == 0, out.stderr
    assert "throughput" in out.stdout and "TTFT ms" in out.stdout and "not starving" in out.stdout


def test_simulate_json_and_timeseries(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(small_scenario()))
    ts = tmp_path / "ts.csv"
    out = run("simulate", str(p), "--json", "--timeseries", str(ts))
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert tuple(d) == RESULT_KEYS and d["status"] == "ok"
    df = pd.read_csv(ts)
    assert list(df.columns) == ["time_s", "running", "waiting", "kv_usage", "loaded_adapters"]


def test_simulate_oom_is_reported(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(small_scenario(engine={"max_loras": 384, "max_lora_rank": 32})))
    out = run("simulate", str(p), "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)["status"] == "oom"
    out = run("simulate", str(p))
    assert "OOM at start-up" in out.stdout


def test_bad_scenario_gives_clear_error_not_traceback(tmp_path):
    p = tmp_path / "s.yaml"
    s = small_scenario()
    s["engine"]["max_lora_rank"] = 7
    p.write_text(yaml.safe_dump(s))
    out = run("simulate", str(p))
    assert out.returncode == 2
    assert "max_lora_rank" in out.stderr and "Traceback" not in out.stderr
    out = run("simulate", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "not found" in out.stderr


@pytest.mark.slow       # ~25 s (starts Ray): a benchmark's report format, not a feature
def test_bench_dataset_reports_rates_speedup_and_where_the_time_goes():
    out = run("bench", "dataset", "--grid", "tiny", "--sample", "6")
    assert out.returncode == 0, out.stderr
    assert "rows/s" in out.stdout and "speed-up" in out.stdout and "extrapolated" in out.stdout
    assert "full hour, not starving" in out.stdout and "% of the time" in out.stdout
