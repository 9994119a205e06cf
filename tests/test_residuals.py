"""Where the twin's error lives (regime tables) and the Max_pack regret, on hand-made runs tables."""
import math

import numpy as np
import pandas as pd
import pytest

from lora_opt.calibration.additive_fit import expected_distinct
from lora_opt.calibration.fidelity import max_pack_table, residual_lines
from lora_opt.calibration.residuals import max_pack_regret, regret_summary, signed_error_table


def _runs(served, real_thr, twin_thr, incoming, half="report", model="m", exp="e", max_loras=8):
    n = len(served)
    return pd.DataFrame({
        "experiment": [exp] * n, "model": [model] * n, "half": [half] * n, "max_loras": [max_loras] * n,
        "max_lora_rank": [16] * n, "n_served_adapters": served,
        "real_throughput": real_thr, "sharegpt_throughput": twin_thr, "real_incoming": incoming,
        "sharegpt_incoming": incoming, "sharegpt_status": ["ok"] * n,
        "real_itl_mean": [10.0] * n, "sharegpt_itl_mean": [11.0] * n,
        "real_ttft_mean": [100.0] * n, "sharegpt_ttft_mean": [50.0] * n,
        "real_running_mean": [2.0, 40.0, 600.0][:n], "real_waiting_mean": [0.0, 0.5, 300.0][:n]})


def test_regret_is_the_real_throughput_lost_at_the_twins_pick():
    # real: 32 served still meets 0.9 x incoming (950 >= 900); the twin thinks 32 starves (800 < 900)
    df = _runs([8, 16, 32], [250.0, 500.0, 950.0], [250.0, 500.0, 800.0], [250.0, 500.0, 1000.0])
    mp = max_pack_regret(max_pack_table(df, "sharegpt"), df, 0.9)
    r = mp.iloc[0]
    assert (r["real_max_pack"], r["twin_max_pack"]) == (32, 16)
    assert r["regret_pct"] == pytest.approx((950 - 500) / 950 * 100)
    assert not r["twin_pick_starves_real"]
    s = regret_summary(mp)["m, report half"]
    assert s["workloads"] == 1 and s["starving_picks"] == 0 and s["no_pick"] == 0


def test_a_pick_that_starves_the_real_server_is_counted():
    # the twin is optimistic: 32 served meets its 0.9 x incoming, the real run does not
    df = _runs([8, 16, 32], [250.0, 500.0, 700.0], [250.0, 500.0, 990.0], [250.0, 500.0, 1000.0])
    mp = max_pack_regret(max_pack_table(df, "sharegpt"), df, 0.9)
    assert mp.iloc[0]["twin_pick_starves_real"]
    assert mp.iloc[0]["regret_pct"] == 0.0            # 700 > 500: no throughput lost, but it starves
    assert regret_summary(mp)["m, report half"]["starving_picks"] == 1


def test_no_twin_pick_is_said_not_averaged():
    df = _runs([8, 16], [250.0, 500.0], [100.0, 100.0], [250.0, 500.0])
    mp = max_pack_regret(max_pack_table(df, "sharegpt"), df, 0.9)
    s = regret_summary(mp)["m, report half"]
    assert s["no_pick"] == 1 and s["workloads"] == 0 and s["mean_regret_pct"] is None


def test_signed_errors_split_by_load_and_running():
    df = _runs([8, 16, 32], [250.0, 500.0, 950.0], [250.0, 500.0, 800.0], [250.0, 500.0, 1000.0])
    t = signed_error_table(df, "sharegpt", ["load"])
    light = t[t["load"] == "light"].iloc[0]
    queued = t[t["load"] == "queued"].iloc[0]
    assert light["runs"] == 2 and queued["runs"] == 1
    assert queued["throughput_median_err"] == pytest.approx((800 - 950) / 950 * 100)
    assert light["itl_mean_median_err"] == pytest.approx(10.0)
    assert light["ttft_mean_median_err"] == pytest.approx(-50.0)
    by_running = signed_error_table(df, "sharegpt", ["running"])
    assert list(by_running["running"]) == ["0-8", "32-128", "512-"]          # by size
    text = "\n".join(residual_lines(df, "sharegpt"))
    assert "## Where the error lives" in text and "| m | report | queued | 1 | -15.8 (17.1)" in text


def test_expected_distinct_adapters():
    # one running request runs one adapter; many requests over 3 equal adapters run all 3; the gate caps
    assert expected_distinct([1.0, 1.0, 1.0], 1, 8) == pytest.approx(1.0)
    assert expected_distinct([1.0, 1.0, 1.0], 200, 8) == pytest.approx(3.0)
    assert expected_distinct([1.0] * 100, 500, 8) == 8
    # an adapter 4x as busy as another is likelier in a small batch: E = sum 1 - (1 - p)^b
    p = np.array([0.8, 0.2])
    assert expected_distinct([4.0, 1.0], 2, 8) == pytest.approx(float(np.sum(1 - (1 - p) ** 2)))
    assert not math.isnan(expected_distinct([0.5], 0, 1))


def test_before_after_table_and_a_bad_before_file(tmp_path):
    import json

    from lora_opt.calibration.fidelity import before_after_lines, read_before
    from twin.errors import ScenarioError

    metrics = ("throughput", "itl_mean", "ttft_mean")
    old = {"variants": ["sharegpt"], "smape": {"m, report half": {k: {"sharegpt": 10.0} for k in metrics}},
           "max_pack": {"n": 1, "regret": {"m, report half": {"mean_regret_pct": 17.7, "worst_regret_pct": 45.1,
                                                               "starving_picks": 0}}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(old))
    summary = {"variants": ["sharegpt"], "before": read_before(path),
               "smape": {"m, report half": {k: {"sharegpt": 5.0} for k in metrics}, "m, fit half": {}},
               "max_pack": {"regret": {"m, report half": {"mean_regret_pct": 0.5, "worst_regret_pct": 2.0,
                                                           "starving_picks": 0}}}}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in before_after_lines(summary)[6:-1]]
    assert ["m", "throughput", "10.0", "5.0", "<= 3.0"] in rows
    assert ["m", "Max_pack worst regret", "45.1", "2.0", "<= 3.0"] in rows
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ScenarioError, match="--before .*bad.json: not a readable fidelity summary.json"):
        read_before(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(ScenarioError, match="not a fidelity summary.json"):
        read_before(tmp_path / "other.json")


def test_no_workload_to_pick_between_is_no_table():
    df = _runs([8], [250.0], [250.0], [250.0])
    mp = max_pack_regret(max_pack_table(df, "sharegpt"), df, 0.9)
    assert mp.empty
