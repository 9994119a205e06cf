"""The drift generator: seeded, documented day-long workloads (lora_opt.replan.drift)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lora_opt.errors import InputError
from lora_opt.replan.drift import (DriftConfig, drift_from_dict, drift_workloads, load_drift, trace_shape,
                                      write_drift)
from lora_opt.placement.workload_file import load_workload

PROFILE = "llama-3.1-8b-h100-64gb"


def _cfg(**kw) -> DriftConfig:
    base = {"profile": PROFILE, "adapters": 40, "peak_rate": 10.0, "steps": 6, "seed": 3}
    return drift_from_dict({**base, **kw})


def test_the_same_seed_gives_the_same_day_and_another_seed_another():
    a, b = drift_workloads(_cfg()), drift_workloads(_cfg())
    assert [w.adapters for w in a] == [w.adapters for w in b]
    c = drift_workloads(_cfg(seed=4))
    assert [w.adapters for w in a] != [w.adapters for w in c]


def test_the_total_rate_follows_the_day():
    cfg = _cfg(steps=24, trough_fraction=0.2, peak_hour=15, churn=0, arrivals_per_step=0, retirements_per_step=0)
    wls = drift_workloads(cfg)
    totals = np.array([w.total_rate for w in wls])
    assert totals == pytest.approx([cfg.total_rate(k) for k in range(24)])
    assert int(np.argmax(totals)) in (14, 15)            # the steps whose middles straddle 15:00
    assert int(np.argmin(totals)) in (2, 3)
    assert totals.min() == pytest.approx(0.2 * 10.0, rel=0.03)     # half an hour off the trough
    assert totals.max() == pytest.approx(10.0, rel=0.01)


def test_popularity_is_a_power_law_over_positions():
    wl = drift_workloads(_cfg(steps=1, popularity_alpha=1.2))[0]
    rates = np.sort([a.rate for a in wl.adapters])[::-1]
    k = np.arange(1, len(rates) + 1)
    assert rates / rates[0] == pytest.approx(k ** -1.2)


def test_without_churn_arrivals_or_retirements_only_the_level_moves():
    wls = drift_workloads(_cfg(churn=0, arrivals_per_step=0, retirements_per_step=0))
    ids = [a.id for a in wls[0].adapters]
    for w in wls[1:]:
        assert [a.id for a in w.adapters] == ids
        share0 = np.array([a.rate for a in wls[0].adapters]) / wls[0].total_rate
        assert np.array([a.rate for a in w.adapters]) / w.total_rate == pytest.approx(share0)


def test_churn_reshuffles_popularity():
    wls = drift_workloads(_cfg(churn=0.5, arrivals_per_step=0, retirements_per_step=0))
    s0 = [a.rate / wls[0].total_rate for a in wls[0].adapters]
    s1 = [a.rate / wls[1].total_rate for a in wls[1].adapters]
    changed = sum(not np.isclose(x, y) for x, y in zip(s0, s1))
    assert 2 <= changed <= 20                            # at most the reshuffled half moves


def test_arrivals_and_retirements_never_reuse_an_id():
    wls = drift_workloads(_cfg(steps=12, arrivals_per_step=3, retirements_per_step=3))
    seen_gone: set[str] = set()
    prev = {a.id for a in wls[0].adapters}
    for w in wls[1:]:
        now = {a.id for a in w.adapters}
        assert not now & seen_gone                        # a retired adapter never returns
        seen_gone |= prev - now
        prev = now
    assert seen_gone, "some adapters retired"
    assert any(int(a.id[2:]) >= 40 for a in wls[-1].adapters), "some adapters arrived"
    for w in wls:
        assert w.meta["drift"]["step"] == int(w.name.rsplit("-s", 1)[1])
        assert w.evaluation.seed == 3 + w.meta["drift"]["step"]


@pytest.mark.parametrize("field,value,needle", [
    ("steps", 0, "drift.steps"), ("churn", 1.5, "drift.churn"), ("peak_rate", 0, "drift.peak_rate"),
    ("trough_fraction", 0, "drift.trough_fraction"), ("adapters", 0, "drift.adapters"),
    ("ranks", [{"rank": 0, "share": 1}], "drift.ranks[0].rank"), ("ranks", "8", "drift.ranks"),
    ("colour", 1, "unknown field"), ("profile", "no-such-profile", "profile"),
    ("evaluation", {"seed": -1}, "evaluation.seed"),
    ("rate_shape", "weekly", "drift.rate_shape: 'weekly' not allowed; allowed values: diurnal, trace:"),
    ("rate_shape", "trace:azure-conv+nope", "drift.rate_shape: .* azure-code, azure-conv, mooncake-conversation"),
    ("rate_shape", "trace:", "drift.rate_shape"),
])
def test_bad_fields_are_named(field, value, needle):
    base = {"profile": PROFILE, "adapters": 40, "peak_rate": 10.0}
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        drift_from_dict({**base, field: value})


def test_the_bundled_day_loads_and_its_steps_round_trip_as_workload_files(tmp_path):
    cfg = load_drift("day")
    assert cfg.steps == 24
    wls = drift_workloads(dataclasses.replace(cfg, steps=2))
    files = write_drift(wls, tmp_path)
    back = load_workload(files[1])
    assert back.adapters == wls[1].adapters and back.name == wls[1].name and back.evaluation == wls[1].evaluation


def test_a_trace_shape_gives_the_stitched_traces_real_rate():
    """Two one-hour Azure traces stitched and cut in two: each step carries about one trace
    (azure-conv 19,366 requests, azure-code 8,819; data/README.md), in the order stitched."""
    conv_code = trace_shape("trace:azure-conv+azure-code", 2)
    assert conv_code[0] == 1.0 and conv_code[1] == pytest.approx(8819 / 19366, rel=0.05)
    assert trace_shape("trace:azure-code+azure-conv", 2)[::-1] == pytest.approx(conv_code, rel=0.05)
    cfg = _cfg(steps=24, rate_shape="trace:azure-conv+azure-code", peak_rate=50.0)
    wls = drift_workloads(cfg)
    totals = np.array([w.total_rate for w in wls])
    assert totals == pytest.approx(50.0 * np.array(trace_shape(cfg.rate_shape, 24)))
    assert totals.max() == pytest.approx(50.0) and totals.min() > 0
    assert len(set(np.round(totals, 6))) > 12           # a real shape, not a flat or two-level day
    assert wls[3].meta["drift"]["rate_shape"] == cfg.rate_shape
    # the adapters and their draws do not depend on the shape: the same seed, the same adapters
    diurnal = drift_workloads(_cfg(steps=24))
    assert [[a.id for a in w.adapters] for w in wls] == [[a.id for a in w.adapters] for w in diurnal]


def test_a_trace_window_without_requests_is_an_error():
    with pytest.raises(InputError, match="drift.rate_shape: window 20 of the 24 .* holds no request"):
        _cfg(steps=24, rate_shape="trace:azure-code")


def test_the_bundled_traces_day_loads():
    cfg = load_drift("traces")
    assert cfg.steps == 24 and cfg.rate_shape.startswith("trace:")
    assert max(cfg.total_rate(k) for k in range(24)) == pytest.approx(cfg.peak_rate)
