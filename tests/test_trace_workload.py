"""Trace splits: rates estimated on the first window, the rest replayed, load scaling."""
import numpy as np
import pytest

from lora_opt.placement.trace_split import trace_split
from twin.errors import ScenarioError

P = "llama-3.1-8b-h100-64gb"


@pytest.mark.parametrize("scaling", ["compress", "superpose"])
def test_split_scales_the_load_and_estimates_rates_on_the_first_window(scaling):
    sp = trace_split("azure-conv", profile=P, n_adapters=64, ranks=(8, 16), target_rate=10.0, seed=1,
                     scaling=scaling)
    total = len(sp.history) + len(sp.replay)
    assert abs(total / (sp.history_s + sp.duration_s) - 10.0) < 0.3
    counts = np.bincount(sp.history.adapter, minlength=64)
    np.testing.assert_allclose([a.rate for a in sp.workload.adapters], counts / sp.history_s)
    assert sp.replay.arrival.min() >= 0 and sp.replay.arrival.max() < sp.duration_s
    assert {a.rank for a in sp.workload.adapters} <= {8, 16}


def test_split_is_deterministic_and_seeded():
    a = trace_split("azure-code", profile=P, n_adapters=32, ranks=(8, 16, 32), target_rate=4.0, seed=3)
    b = trace_split("azure-code", profile=P, n_adapters=32, ranks=(8, 16, 32), target_rate=4.0, seed=3)
    c = trace_split("azure-code", profile=P, n_adapters=32, ranks=(8, 16, 32), target_rate=4.0, seed=4)
    assert np.array_equal(a.replay.arrival, b.replay.arrival) and np.array_equal(a.replay.adapter, b.replay.adapter)
    assert not np.array_equal(a.replay.adapter, c.replay.adapter)


def test_bad_arguments():
    with pytest.raises(ScenarioError, match="estimate_fraction"):
        trace_split("azure-conv", profile=P, n_adapters=8, ranks=(8,), target_rate=1.0, estimate_fraction=1.0)
    with pytest.raises(ScenarioError, match="scaling"):
        trace_split("azure-conv", profile=P, n_adapters=8, ranks=(8,), target_rate=1.0, scaling="stretch")
