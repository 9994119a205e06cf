"""``validate --twin-only RUN_DIR``: the twin again on a stored validation run's requests (after a
recalibration), nothing sent.  With the profile unchanged it reproduces the run's own twin files byte for
byte (the requests, routing and admission rebuilt from the run's record are the ones validate used)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lora_opt.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
#: a committed validation run of the real CPU vLLM (experiments/real_validation/cpu_loop.py)
RUN = ROOT / "experiments" / "real_validation" / "cpu" / "validation" / "light-report"


#: the profile that run was validated with: the loop's as calibrate wrote it from the probe rows, before the
#: recalibration (cpu_loop.py keeps it there; configs/profiles/ holds the recalibrated one)
RUN_PROFILE = ROOT / "experiments" / "real_validation" / "cpu" / "recalibrate" / "profile_before.yaml"


@pytest.fixture
def run(tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(RUN, dst)
    for name in ("placement/placement.json", "workload.yaml"):     # the run's own profile, by path
        f = dst / name
        f.write_text(f.read_text().replace('"probe-llama-cpu-vllm032"', f'"{RUN_PROFILE}"')
                     .replace("profile: probe-llama-cpu-vllm032", f"profile: {RUN_PROFILE}"))
    return dst


def _twin_only(run: Path, *extra: str) -> int:
    return cli_main(["validate", str(run / "placement" / "placement.json"), "--workload", str(run / "workload.yaml"),
                     "--twin-only", str(run / "out"), "--workers", "1", *extra])


#: what the twin's time series give: the committed run's values were sampled on the twin's own 5-s grid, with
#: an idle engine's next arrival counted as waiting; since 2026-12-04 the twin's series are read where the
#: server was scraped, as vLLM's gauges read between steps (lora_opt.validate.report.TWIN_SERIES_S)
FROM_SERIES = ("running_mean", "waiting_mean", "kv_usage_mean")


def test_twin_only_reproduces_the_runs_own_twin(run, capsys):
    import json
    for name in ("twin.json", "comparison.json", "twin_timeseries.csv"):
        (run / "out" / name).unlink()
    assert _twin_only(run) == 0
    assert "SMAPE % per metric" in capsys.readouterr().out
    # the same requests, routing and admission: the twin's evaluation byte for byte
    assert (run / "out" / "twin.json").read_bytes() == (RUN / "out" / "twin.json").read_bytes()
    got, want = (json.loads((d / "out" / "comparison.json").read_text()) for d in (run, RUN))
    assert json.dumps(got["real"]) == json.dumps(want["real"])            # NaN (no waiting) is not == NaN
    for m in set(want["smape_per_metric"]) - set(FROM_SERIES):
        assert json.dumps([got["smape_per_metric"][m], got["twin"]["0"][m]]) == \
            json.dumps([want["smape_per_metric"][m], want["twin"]["0"][m]]), m
    # the twin's series at the instants the server was scraped
    scraped = [ln.split(",")[0] for ln in (run / "out" / "timeseries.csv").read_text().splitlines()[1:]]
    assert [ln.split(",")[0] for ln in (run / "out" / "twin_timeseries.csv").read_text().splitlines()[1:]] == scraped
    assert (run / "out" / "real.json").read_bytes() == (RUN / "out" / "real.json").read_bytes()   # never changed


def test_twin_only_refuses_what_it_cannot_rebuild(run, capsys, tmp_path):
    assert _twin_only(run, "--seed", "3") == 2
    assert "--twin-only takes the stored run's requests; drop --seed" in capsys.readouterr().err
    empty = tmp_path / "empty"
    (empty / "out").mkdir(parents=True)
    shutil.copytree(run / "placement", empty / "placement")
    shutil.copy(run / "workload.yaml", empty / "workload.yaml")
    assert _twin_only(empty) == 2
    assert "not a stored validation run (missing real.json, timeseries.csv, requests.csv)" in capsys.readouterr().err


def test_validate_needs_endpoints_or_a_stored_run(run, capsys):
    assert cli_main(["validate", str(run / "placement" / "placement.json")]) == 2
    assert "one of the arguments --endpoints --twin-only is required" in capsys.readouterr().err


def test_speed_match_scales_step_times_and_fits_the_measured_itl(run, tmp_path):
    """lora_opt.validate.speed_match: x1 is the profile itself (the run's own twin numbers, nothing
    written into the run); every millisecond estimator scales, relative factors do not; the fitted factor
    brings the twin's mean ITL to the measured one."""
    import json

    from lora_opt.placement.plan import Placement
    from lora_opt.placement.workload_file import load_workload
    from lora_opt.validate.speed_match import scaled_profile, speed_factor, twin_at_speed
    p, wl = Placement.load(run / "placement" / "placement.json"), load_workload(str(run / "workload.yaml"))
    before = {n: (run / "out" / n).read_bytes() for n in ("twin.json", "comparison.json")}
    stored = json.loads(before["comparison.json"])
    same = twin_at_speed(run / "out", p, wl, 1.0, tmp_path)
    def evaluated(side: dict) -> str:      # the committed run's series-based values predate TWIN_SERIES_S
        return json.dumps({g: {m: v for m, v in d.items() if m not in FROM_SERIES} for g, d in side.items()})
    assert evaluated(same["twin"]) == evaluated(stored["twin"]) and evaluated(same["real"]) == evaluated(stored["real"])
    d1, d2 = scaled_profile(p.profile, 1.0), scaled_profile(p.profile, 2.0)
    assert d2["latency"]["base_ms"] == 2 * d1["latency"]["base_ms"]
    for r, e in d1["latency"]["lora"].items():
        assert d2["latency"]["lora"][r]["jump"] == e["jump"]
        assert d2["latency"]["lora"][r].get("token_ms", 0) == 2 * e.get("token_ms", 0)
    s, comp = speed_factor(run / "out", p, wl)
    twin, real = comp["twin"]["0"]["itl_mean_ms"], comp["real"]["0"]["itl_mean_ms"]
    assert 0.25 < s < 4 and abs(twin - real) / real < 0.01
    assert {n: (run / "out" / n).read_bytes() for n in before} == before       # the run is not rewritten


def test_first_token_order_matches_the_same_requests(run):
    """lora_opt.validate.order: the run's requests matched to the twin's by arrival; the server's and the
    twin's first-token order compared (Kendall's tau), the TTFT per adapter beside it."""
    import csv
    import math

    from lora_opt.placement.plan import Placement
    from lora_opt.placement.workload_file import load_workload
    from lora_opt.validate.order import first_token_order
    from lora_opt.validate.retwin import retwin
    p, wl = Placement.load(run / "placement" / "placement.json"), load_workload(str(run / "workload.yaml"))
    raw = retwin(run / "out", p, wl, write=False)["twin_raw"][0]
    with (run / "out" / "requests.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    got = first_token_order(rows, raw)
    ok = [r for r in rows if r["status"] == "ok"]
    assert got["requests"] == len(ok) and 0.9 < got["kendall_tau"] <= 1.0
    assert set(got["per_adapter"]) == {r["adapter"] for r in ok}
    assert sum(v["requests"] for v in got["per_adapter"].values()) == len(ok)
    assert math.isclose(got["ttft_mean_ms"]["real"], sum(float(r["ttft_ms"]) for r in ok) / len(ok))
    assert first_token_order(rows[:1], raw)["requests"] <= 1              # too few to order: no tau, no error
