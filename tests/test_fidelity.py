"""The fidelity report end to end on a small family, and the real-run -> scenario conversion."""
import json
import subprocess
import sys

import pytest

from lora_opt.calibration import realruns
from lora_opt.calibration.runs_csv import load_runs
from lora_opt.smape import smape
from twin.paths import REPO_ROOT
from twin.scenario import scenario_from_dict


def test_run_to_scenario_reproduces_recorded_rate_counts():
    runs = load_runs()
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
    assert smape([110, 90], [100, 100]) == pytest.approx((10 / 105 + 10 / 95) / 2 * 100)


def test_fidelity_cli_small_family(tmp_path):
    out = tmp_path / "fid"
    p = subprocess.run([sys.executable, "-m", "lora_opt.cli", "fidelity", "--family",
                        "loaded_adapters_without_offloading_rate_0.025", "--workers", "1", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_runs"] >= 5
    assert (out / "report.md").exists() and (out / "predicted_vs_real.png").exists()
    report = (out / "report.md").read_text()
    assert "SMAPE" in report and "## Where the error lives" in report and "## Fitted on / reported on" in report
    assert (out / "residuals.png").exists()
    assert "regret" in summary["max_pack"]


def test_fidelity_unknown_family_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "lora_opt.cli", "fidelity", "--family", "no-such-family",
                        "--workers", "1", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert p.returncode == 2 and "no usable runs" in p.stderr


def test_targets_table_gives_both_scales_and_the_comparison():
    from lora_opt.calibration.fidelity import TARGETS, targets_table
    metrics = {"throughput": (4.2, 8.7), "itl_mean": (15.0, 18.7), "ttft_mean": (24.0, 104.0)}
    summary = {"smape": {
        "report half": {},           # overall groups are not in the table
        "m1, report half": {k: {"sharegpt": ours, "peer": peer} for k, (ours, peer) in metrics.items()},
        "m1, fit half": {k: {"sharegpt": 0.0, "peer": 0.0} for k in metrics},
        "m2, report half": {k: {"sharegpt": 1.0, "peer": float("nan")} for k in metrics},
    }}
    lines = targets_table(summary, "sharegpt")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(rows) == 2 * len(TARGETS)
    by = {(r[0], r[1]): r for r in rows}
    # throughput 4.2: above 3 on the full scale, 2.1 <= 3 on the half scale, better than 8.7
    assert by[("m1", "throughput")][2:] == ["4.2", "2.1", "8.7", "<= 3.0", "no", "yes", "yes"]
    assert by[("m1", "itl_mean")][6:] == ["no", "no", "yes"]            # 7.5 > 7 on the half scale too
    assert by[("m1", "ttft_mean")][6:] == ["yes", "yes", "yes"]
    assert by[("m2", "throughput")][4] == "none" and by[("m2", "throughput")][8] == "-"
