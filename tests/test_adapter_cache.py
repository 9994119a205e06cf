"""Contract tests run over every adapter-cache policy."""
import numpy as np
import pytest

import twin
from small_scenarios import small_scenario
from twin.adapter_cache import POLICIES, AdapterCachePolicy
from twin.scenario import ADAPTER_CACHE_POLICIES, scenario_from_dict
from twin.workload import generate_requests


def test_every_policy_is_registered_and_selectable():
    assert set(POLICIES) == set(ADAPTER_CACHE_POLICIES)
    assert len({p.code for p in POLICIES.values()}) == len(POLICIES)
    for p in POLICIES.values():
        assert isinstance(p, AdapterCachePolicy)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_reference_respects_capacity_and_hits_do_not_load(name):
    pol = POLICIES[name]
    rng = np.random.default_rng(0)
    uses = rng.integers(0, 9, 300).tolist()
    for cap in (1, 3, 8, 9):
        resident, loads = pol.simulate(cap, uses)
        assert len(resident) <= cap
        assert uses[-1] in resident
        assert loads >= len(set(uses)) - 0 and loads <= len(uses)
    resident, loads = pol.simulate(3, [1, 1, 1, 2, 2, 1])
    assert loads == 2


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_engine_matches_reference_policy(name):
    """Serving one request at a time (max_num_seqs 1) in arrival order, the engine's GPU loads
    equal the reference policy's loads for the same adapter sequence."""
    n_ad, slots = 7, 3
    sc = scenario_from_dict(small_scenario(
        engine={"max_loras": slots, "max_cpu_loras": n_ad, "max_num_seqs": 1,
                "adapter_cache_policy": name},
        adapters=[{"count": n_ad, "rank": 8, "rate": 0.02}], duration_s=600,
        lengths={"source": "mean", "mean_in": 20, "mean_out": 3}))
    req = generate_requests(sc, 131072)
    res = twin.simulate(sc, requests=req, check_invariants=True)
    assert res.completed == res.arrived                  # light load: everything is served in order
    warm = list(range(n_ad))                             # start-up: --lora-modules loaded in order
    _, loads_warm = POLICIES[name].simulate(slots, warm)
    _, loads = POLICIES[name].simulate(slots, warm + req.adapter.tolist())
    assert res.adapter_loads_cpu == loads - loads_warm
    assert res.adapter_loads_disk == 0


def test_lru_and_fifo_differ_on_a_hot_adapter():
    seq = [0, 1, 2, 0, 3, 0, 4, 0, 5, 0]
    assert POLICIES["lru"].simulate(2, seq)[1] < POLICIES["fifo"].simulate(2, seq)[1]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_kernel_invariants_with_disk_and_cpu_loads(name):
    """Contract of a registered policy: the engine runs with it and keeps its invariants at every
    step (check_invariants) when the CPU cache is smaller than the adapter set (disk loads) and the
    GPU slots smaller than the CPU cache (CPU loads)."""
    sc = scenario_from_dict(small_scenario(
        engine={"max_loras": 2, "max_cpu_loras": 4, "adapter_cache_policy": name},
        adapters=[{"count": 9, "rank": 8, "rate": 0.4}], duration_s=120))
    res = twin.simulate(sc, check_invariants=True)
    assert res.status == "ok" and res.completed > 0
    assert res.adapter_loads_disk > 0 and res.adapter_loads_cpu > res.adapter_loads_disk


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_kernel_dispatch_reaches_the_policys_victim_function(name):
    from twin.adapter_cache import _insert
    pol = POLICIES[name]
    rng = np.random.default_rng(1)
    for _ in range(20):
        resident = (rng.random(12) < 0.6).astype(np.int64)
        resident[rng.integers(12)] = 1
        loaded = rng.permutation(12).astype(np.int64)
        used = loaded + rng.integers(0, 50, 12)
        expected = pol.victim(resident, loaded, used)
        assert resident[expected]
        n = int(resident.sum())
        _, evicted = _insert(resident, loaded, used, n, n, int(np.flatnonzero(resident == 0)[0]) if n < 12 else 0,
                             99, pol.code)
        assert evicted == expected
