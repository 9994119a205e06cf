"""The fidelity report end to end on a small family, and the real-run -> scenario conversion."""
import json
import subprocess
import sys

import pytest

from lora_opt import realruns
from twin.paths import REPO_ROOT
from twin.scenario import scenario_from_dict


def test_run_to_scenario_reproduces_recorded_rate_counts():
    runs = realruns.load_runs()
    rows = runs[runs["experiment"].str.contains("real_results") & runs["adapter_rate_counts"].notna()]
    for _, row in rows.head(40).iterrows():
        sc = realruns.run_to_scenario(row)
        scenario_from_dict(sc)                      # valid
        counts = {}
        for a in sc["adapters"]:
            counts[a["rate"]] = counts.get(a["rate"], 0) + 1
        recorded = {float(k): int(v) for k, v in (p.split(":") for p in row["adapter_rate_counts"].split(";"))}
        assert counts == recorded


def test_smape():
    assert realruns.smape([110, 90], [100, 100]) == pytest.approx((10 / 105 + 10 / 95) / 2 * 100)


def test_fidelity_cli_small_family(tmp_path):
    out = tmp_path / "fid"
    p = subprocess.run([sys.executable, "-m", "lora_opt.cli", "fidelity", "--family",
                        "loaded_adapters_without_offloading_rate_0.025", "--workers", "1", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_runs"] >= 5
    assert (out / "report.md").exists() and (out / "predicted_vs_real.png").exists()
    assert "SMAPE" in (out / "report.md").read_text()


def test_fidelity_unknown_family_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "lora_opt.cli", "fidelity", "--family", "no-such-family",
                        "--workers", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert p.returncode == 2 and "no usable runs" in p.stderr
