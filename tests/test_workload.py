"""Arrival processes, length models and trace replay."""
import numpy as np
import pytest

from small_scenarios import small_scenario
from twin.scenario import scenario_from_dict
from twin.workload import (SHAREGPT_MU_IN, SHAREGPT_MU_OUT, SHAREGPT_TARGET_MEANS, TRACES, _sharegpt_draw,
                           generate_requests, load_trace)


def _req(**over):
    return generate_requests(scenario_from_dict(small_scenario(**over)), 131072)


def test_poisson_rate_and_determinism():
    r = _req(adapters=[{"count": 20, "rank": 8, "rate": 1.0}], duration_s=1000)
    assert len(r) == pytest.approx(20_000, rel=0.03)
    assert np.all(np.diff(r.arrival) >= 0) and r.arrival.max() < 1000
    r2 = _req(adapters=[{"count": 20, "rank": 8, "rate": 1.0}], duration_s=1000)
    assert np.array_equal(r.arrival, r2.arrival) and np.array_equal(r.in_len, r2.in_len)
    counts = np.bincount(r.adapter, minlength=20)
    assert counts.min() > 850


@pytest.mark.parametrize("process", ["lognormal", "nonstationary"])
def test_other_processes_have_roughly_the_rate(process):
    r = _req(adapters=[{"count": 10, "rank": 8, "rate": 2.0}], duration_s=2000,
             arrivals={"process": process, "cv": 2.0})
    lo, hi = (0.85, 1.15) if process == "lognormal" else (0.3, 4.0)
    assert lo * 40_000 < len(r) < hi * 40_000


def test_lognormal_is_burstier_than_poisson():
    def cv(process):
        r = _req(adapters=[{"count": 1, "rank": 8, "rate": 5.0}], duration_s=4000,
                 arrivals={"process": process, "cv": 3.0})
        gaps = np.diff(r.arrival)
        return gaps.std() / gaps.mean()
    assert cv("poisson") == pytest.approx(1.0, abs=0.05)
    assert cv("lognormal") > 2.0


def test_sharegpt_model_matches_real_run_means_and_benchmark_rules():
    i, o = _sharegpt_draw(np.random.default_rng(3), 200_000, SHAREGPT_MU_IN, SHAREGPT_MU_OUT)
    assert i.mean() == pytest.approx(SHAREGPT_TARGET_MEANS[0], rel=0.01)
    assert o.mean() == pytest.approx(SHAREGPT_TARGET_MEANS[1], rel=0.01)
    assert i.min() >= 4 and i.max() <= 1024 and o.min() >= 4 and (i + o).max() <= 2048


def test_mean_and_normal_lengths():
    r = _req(lengths="mean")
    assert set(r.in_len) == {223} and set(r.out_len) == {193}
    r = _req(lengths={"mean_in": 100, "std_in": 10, "mean_out": 50, "std_out": 5})
    assert abs(r.in_len.mean() - 100) < 5 and r.out_len.min() >= 1


@pytest.mark.parametrize("name", sorted(TRACES))
def test_bundled_traces_parse(name):
    tr = load_trace(name)
    assert len(tr) > 1000 and tr["t"].min() == 0 and (tr["in_len"] >= 0).all()


def test_trace_replay_mapping_and_scaling():
    over = dict(adapters=[{"count": 50, "rank": 8, "rate": 1}], duration_s=600,
                lengths="trace")
    uni = _req(arrivals={"process": "trace", "trace": "azure-conv"}, **over)
    fast = _req(arrivals={"process": "trace", "trace": "azure-conv", "time_scale": 0.5}, **over)
    assert len(fast) == pytest.approx(2 * len(uni), rel=0.2)
    pl = _req(arrivals={"process": "trace", "trace": "azure-conv", "mapping": "powerlaw", "alpha": 1.5}, **over)
    share = np.sort(np.bincount(pl.adapter, minlength=50))[::-1]
    assert share[0] > 5 * np.median(share)
    flat = np.bincount(uni.adapter, minlength=50)
    assert flat.max() < 3 * flat.mean()


def test_a_scenario_without_any_request_simulates():
    """Adapters too idle to send a request in the window: zero requests, nothing starves."""
    import twin
    from twin.scenario import scenario_from_dict
    sc = scenario_from_dict({"profile": "llama-3.1-8b-h100-64gb", "duration_s": 10,
                             "adapters": [{"count": 2, "rank": 8, "rate": 1e-9}]})
    r = twin.simulate(sc)
    assert r.arrived == 0 and r.completed == 0 and not r.starving
