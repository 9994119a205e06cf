"""Contract tests over every placement policy, and each policy's own rules."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_opt.surrogates.features import gpu_features
from lora_opt.placement.plan import Placement, placement_problems
from lora_opt.placement.policies import POLICIES, PlacementContext, get_policy
from lora_opt.placement.policies.greedy import TESTING_POINTS, Segments
from lora_opt.placement.policies.packing import max_loras_that_start, priority_order, zigzag
from lora_opt.placement.workload_file import load_workload, workload_from_dict
from twin.errors import ScenarioError
from twin.paths import CONFIGS_DIR
from twin.profile import VLLM_LORA_RANKS

PROFILE = "llama-3.1-8b-h100-64gb"
#: greedy-plus's twin verification kept short in tests
FAST: dict = {}


def make_workload(n=120, scale=1.0, seed=0, ranks=(8, 16, 32)):
    rng = np.random.default_rng(seed)
    ads = [{"id": f"a{i}", "rank": int(rng.choice(ranks)), "rate": scale * float(rng.choice([0.05, 0.1, 0.2]))}
           for i in range(n)]
    return workload_from_dict({"profile": PROFILE, "adapters": ads, "evaluation": {"duration_s": 300}})


def policy(name):
    return get_policy(name, **FAST.get(name, {}))


@pytest.fixture(scope="module")
def ctx():
    return PlacementContext.for_workload(make_workload(8))


@pytest.fixture(scope="module", params=list(POLICIES))
def placed(request, ctx):
    wl = make_workload()
    return request.param, wl, policy(request.param).place(wl, 4, ctx)


# ---- contract: every policy ---------------------------------------------------------------------
def test_every_adapter_routed_with_weights_summing_to_one(placed, ctx):
    name, wl, p = placed
    assert placement_problems(p, ctx.profile, include_startup=False) == []
    assert set(p.routes) == {a.id for a in wl.adapters}
    for rs in p.routes.values():
        assert abs(sum(w for _, w in rs) - 1.0) < 1e-9
        if not POLICIES[name].fractional:
            assert len(rs) == 1


def test_engine_flags_are_valid_vllm_values(placed):
    _, _, p = placed
    for i, g in enumerate(p.gpus):
        ads = p.adapters_on(i)
        assert ads, "no empty GPUs in a placement"
        assert g.max_lora_rank in VLLM_LORA_RANKS and g.max_lora_rank >= max(a.rank for a in ads)
        assert g.max_cpu_loras >= max(g.max_loras, len(ads))
        assert 1 <= g.max_loras


def test_verdict_fields_and_pool(placed):
    _, _, p = placed
    m = p.meta
    for key in ("feasible", "gpus_pool", "gpus_needed", "gpus_used", "unplaceable", "predicted_throughput",
                "starvation_margin", "gpus_failing_startup", "policy_wall_ms"):
        assert key in m
    if m["feasible"]:
        assert len(p.gpus) <= m["gpus_pool"] and m["gpus_used"] == len(p.gpus)
    else:
        assert m["unplaceable"] or m["gpus_needed"] > m["gpus_pool"]


def test_deterministic_and_json_round_trip(placed, ctx):
    name, wl, p = placed
    again = policy(name).place(wl, 4, ctx)
    assert again.routes == p.routes and again.gpus == p.gpus
    back = Placement.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back.routes == p.routes and back.gpus == p.gpus


@pytest.mark.parametrize("name", list(POLICIES))
def test_pool_too_small_is_a_result_not_an_exception(name, ctx):
    wl = make_workload(n=300, scale=8.0)       # ~300 req/s: far more than one GPU
    p = policy(name).place(wl, 1, ctx)
    if POLICIES[name].fills_any_pool:          # no capacity model (dLoRA): it always fits the pool
        assert p.meta["feasible"] and len(p.gpus) == 1
    else:
        assert not p.meta["feasible"] and p.meta["gpus_needed"] > 1


def test_unknown_policy_and_bad_pool(ctx):
    with pytest.raises(ScenarioError, match="allowed values: greedy-plus"):
        get_policy("best-fit")
    with pytest.raises(ScenarioError, match="gpus"):
        get_policy("greedy").place(make_workload(8), 0, ctx)


# ---- priority order and segment features ---------------------------------------------------------
def test_zigzag_alternates_high_and_low():
    v = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    assert list(v[zigzag(v)]) == [5.0, 1.0, 4.0, 2.0, 3.0]


def test_priority_order_rank_descending_groups():
    ranks = np.array([8, 32, 16, 32, 8])
    rates = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    o = priority_order(ranks, rates)
    assert list(ranks[o]) == [32, 32, 16, 8, 8]
    assert sorted(o.tolist()) == list(range(5))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([8, 16, 32]), st.floats(0.0, 3.2)), min_size=1, max_size=60),
       st.data())
def test_segment_features_equal_gpu_features(pairs, data):
    ranks = np.array([p[0] for p in pairs])
    rates = np.array([p[1] for p in pairs])
    o = priority_order(ranks, rates)
    seg = Segments(ranks[o], rates[o])
    s = data.draw(st.integers(0, len(pairs) - 1))
    n = data.draw(st.integers(1, len(pairs) - s))
    amax = data.draw(st.integers(1, 384))
    got = seg.rows(s, np.array([n]), np.array([amax]))[0]
    want = gpu_features(ranks[o][s:s + n], rates[o][s:s + n], amax)
    # prefix sums: variances to ~1e-7 absolute (far below any split the surrogates make)
    np.testing.assert_allclose(got, list(want.values()), rtol=1e-9, atol=1e-6)


# ---- policy rules ----------------------------------------------------------------------------------
def test_greedy_a_max_from_testing_points(ctx):
    p = get_policy("greedy").place(make_workload(), 4, ctx)
    for i, g in enumerate(p.gpus):
        assert g.max_loras in TESTING_POINTS or g.max_loras == len(p.adapters_on(i))
        assert g.max_loras <= len(p.adapters_on(i))


def test_greedy_plus_gpus_pass_the_twin_at_the_expected_load(ctx):
    """Every GPU greedy-plus returns was verified on the twin at (1 + margin) x its load."""
    from lora_opt.placement.evaluate import evaluate_placement
    wl = make_workload(n=200, scale=4.0)
    p = policy("greedy-plus").place(wl, 8, ctx)
    assert p.meta["feasible"]
    ev = evaluate_placement(p, wl, workers=1, progress=False, duration_s=300)
    assert ev["gpus_starving"] == 0 and ev["gpus_failing_startup"] == 0


def test_greedy_plus_splits_an_adapter_too_hot_for_one_gpu(ctx):
    wl = workload_from_dict({"profile": PROFILE, "adapters": [
        {"id": "hot", "rank": 16, "rate": 40.0}, {"count": 20, "rank": 8, "rate": 0.1}]})
    p = policy("greedy-plus").place(wl, 8, ctx)
    assert len(p.routes["hot"]) > 1
    assert any("hot" in n for n in p.meta["notes"])


def test_dlora_uses_the_whole_pool_with_a_max_equal_to_adapters(ctx):
    p = get_policy("dlora").place(make_workload(), 4, ctx)
    assert len(p.gpus) == 4
    for i, g in enumerate(p.gpus):
        assert g.max_loras == len(p.adapters_on(i))


def test_loraserve_balances_demand_and_splits_fractionally(ctx):
    wl = make_workload(n=50, scale=6.0)
    p = get_policy("loraserve").place(wl, 6, ctx)
    load = np.zeros(len(p.gpus))
    by_id = {a.id: a for a in wl.adapters}
    for aid, rs in p.routes.items():
        for g, w in rs:
            load[g] += by_id[aid].rate * w
    assert load.max() / load.min() < 1.5          # filled to a common target utilisation
    assert any(len(rs) > 1 for rs in p.routes.values())


def test_startup_failures_are_reported_not_raised(ctx):
    """dLoRA's A_max = adapters per GPU with rank-32 adapters does not fit: a result."""
    wl = make_workload(n=1200, scale=0.1, ranks=(32,))
    p = get_policy("dlora").place(wl, 2, ctx)
    assert p.meta["gpus_failing_startup"] == [0, 1]


# ---- the operator variants of the baselines: A_max capped to what starts -------------------------
def _startable(p, wl, profile, gi):
    return max_loras_that_start(profile, p.gpus[gi].max_lora_rank, wl.resolved_engine(profile), len(p.adapters_on(gi)))


@pytest.mark.parametrize("paper,operator", [("dlora", "dlora-capped"), ("loraserve", "loraserve-capped")])
def test_capped_baselines_start_where_the_papers_ones_oom(paper, operator):
    """On the example workload (model's max_model_len) the paper-faithful baselines fail to start;
    the operator variants start on every GPU with A_max at the startable cap."""
    wl = load_workload(CONFIGS_DIR / "workloads" / "example.yaml")
    ctx = PlacementContext.for_workload(wl)
    faithful, capped = get_policy(paper).place(wl, 4, ctx), get_policy(operator).place(wl, 4, ctx)
    assert faithful.meta["gpus_failing_startup"]
    assert capped.meta["gpus_failing_startup"] == [] and capped.meta["feasible"]
    for gi, g in enumerate(capped.gpus):
        assert g.max_loras == min(len(capped.adapters_on(gi)), _startable(capped, wl, ctx.profile, gi))
        assert g.max_model_len == ctx.profile.model.max_model_len
    if paper == "loraserve":                  # same placement and routing; only A_max differs
        assert capped.routes == faithful.routes


@pytest.mark.parametrize("operator", ["dlora-capped", "loraserve-capped"])
@pytest.mark.parametrize("mml", [None, 8192])
def test_capped_baselines_never_exceed_the_startable_cap(operator, mml):
    """A_max <= the largest that starts under the workload's max_model_len, and <= adapters per GPU;
    a shorter max_model_len leaves room for more (the cap follows the workload, not the model)."""
    rng = np.random.default_rng(3)
    ads = [{"id": f"a{i}", "rank": int(rng.choice([8, 16, 32, 64])), "rate": 0.05} for i in range(900)]
    eng = {"max_model_len": mml} if mml else {}
    wl = workload_from_dict({"profile": PROFILE, "adapters": ads, "engine": eng, "evaluation": {"duration_s": 300}})
    ctx = PlacementContext.for_workload(wl)
    p = get_policy(operator).place(wl, 3, ctx)
    assert p.meta["gpus_failing_startup"] == []
    for gi, g in enumerate(p.gpus):
        assert g.max_model_len == (mml or ctx.profile.model.max_model_len)
        assert 1 <= g.max_loras <= min(len(p.adapters_on(gi)), _startable(p, wl, ctx.profile, gi))
