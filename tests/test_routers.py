"""Contract tests over every router policy of the fleet twin, and each policy's own rules."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.errors import ScenarioError
from twin.routers import (LORA_AFFINITY_THRESHOLD, QUEUING_THRESHOLD_LORA, ROUTERS, FleetView, RouterSetup,
                          make_router, weighted_pick)

N_ENGINES, N_ADAPTERS = 6, 10


def setup(seed=0):
    routes = {a: [(a % N_ENGINES, 0.6), ((a + 1) % N_ENGINES, 0.4)] for a in range(N_ADAPTERS)}
    return RouterSetup(N_ENGINES, [f"ad-{a}" for a in range(N_ADAPTERS)], seed, routes)


def random_view(rng) -> FleetView:
    sets = lambda: [frozenset(rng.choice(N_ADAPTERS, rng.integers(0, 4), replace=False).tolist())  # noqa: E731
                    for _ in range(N_ENGINES)]
    return FleetView(in_flight=rng.integers(0, 20, N_ENGINES), waiting=rng.integers(0, 200, N_ENGINES),
                     running=rng.integers(0, 20, N_ENGINES), kv_usage=rng.random(N_ENGINES),
                     running_adapters=sets(), waiting_adapters=sets(), max_loras=np.full(N_ENGINES, 4))


def decisions(name, seed, draws):
    """(adapter, candidates, engine) of a router's decisions over a seeded stream of situations.
    ``static`` gets an adapter's placed engines (or a subset: the others down) as candidates."""
    r = make_router(name, setup(seed))
    rng = np.random.default_rng(draws)
    out = []
    for i in range(200):
        a = int(rng.integers(N_ADAPTERS))
        if name == "static":
            placed = np.array(sorted({a % N_ENGINES, (a + 1) % N_ENGINES}))
            cands = placed if rng.random() < 0.7 else placed[:1]
        else:
            cands = np.flatnonzero(rng.random(N_ENGINES) < 0.6)
            if len(cands) == 0:
                r.skip(i)
                continue
        e = r.pick(i, a, cands, random_view(rng) if r.reads_state else None)
        out.append((a, cands.tolist(), e))
    return out


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_policy_picks_a_candidate(name):
    for a, cands, e in decisions(name, 1, 2):
        assert isinstance(e, int) and e in cands


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_policy_is_deterministic_for_a_seed(name):
    assert decisions(name, 5, 3) == decisions(name, 5, 3)


@pytest.mark.parametrize("name", list(ROUTERS))
@settings(max_examples=30, deadline=None)
@given(alive=st.lists(st.booleans(), min_size=N_ENGINES, max_size=N_ENGINES), seed=st.integers(0, 2**32 - 1))
def test_every_policy_never_routes_to_a_down_engine(name, alive, seed):
    """Down engines are never candidates; a policy chooses among the up ones only (static: among
    its adapter's placed engines that are up)."""
    up = np.flatnonzero(alive)
    if len(up) == 0:
        return
    r = make_router(name, setup(seed))
    rng = np.random.default_rng(seed)
    for i in range(30):
        a = int(rng.integers(N_ADAPTERS))
        cands = up
        if name == "static":
            cands = np.intersect1d(up, [a % N_ENGINES, (a + 1) % N_ENGINES])
            if len(cands) == 0:
                r.skip(i)
                continue
        e = r.pick(i, a, cands, random_view(rng) if r.reads_state else None)
        assert alive[e]


def test_unknown_policy_names_the_allowed_ones():
    with pytest.raises(ScenarioError, match="allowed: static, round-robin, least-requests"):
        make_router("fastest", setup())


def test_static_follows_the_weights_with_evaluates_rule():
    r = make_router("static", setup(7))
    picks = [r.pick(i, 0, np.array([0, 1]), None) for i in range(4000)]
    assert abs(np.mean(np.array(picks) == 0) - 0.6) < 0.03
    u = np.random.default_rng(7).random(4000)       # the same stream, evaluate's rule
    assert picks == [int(np.array([0, 1])[weighted_pick(np.cumsum([0.6, 0.4]), x)]) for x in u]


def test_round_robin_cycles_and_consistent_hash_sticks():
    rr = make_router("round-robin", setup())
    assert [rr.pick(i, 0, np.arange(3), None) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    ch = make_router("consistent-hash", setup())
    all_up = np.arange(N_ENGINES)
    first = [ch.pick(i, a, all_up, None) for i, a in enumerate(range(N_ADAPTERS))]
    assert first == [ch.pick(i, a, all_up, None) for i, a in enumerate(range(N_ADAPTERS))]
    # an engine going down moves only its own adapters
    down = first[0]
    rest = np.array([e for e in all_up if e != down])
    again = [ch.pick(i, a, rest, None) for i, a in enumerate(range(N_ADAPTERS))]
    assert all(x == y for x, y in zip(first, again) if x != down)


def test_least_requests_and_power_of_two_prefer_the_less_loaded():
    v = FleetView(np.array([5, 0, 9]), np.zeros(3), np.zeros(3), np.zeros(3), [frozenset()] * 3,
                  [frozenset()] * 3, np.full(3, 4))
    lr = make_router("least-requests", RouterSetup(3, ["a"], 0))
    assert lr.pick(0, 0, np.arange(3), v) == 1
    p2 = make_router("power-of-two", RouterSetup(3, ["a"], 0))
    picks = [p2.pick(i, 0, np.arange(3), v) for i in range(300)]
    assert 2 not in picks or picks.count(2) == 0      # never the busiest of any pair
    assert picks.count(1) > 150                        # the idlest wins every pair it is drawn in


def affinity_view(waiting, kv, running_sets, waiting_sets, max_loras=2):
    n = len(waiting)
    return FleetView(np.zeros(n, np.int64), np.array(waiting), np.zeros(n), np.array(kv, float),
                     [frozenset(s) for s in running_sets], [frozenset(s) for s in waiting_sets], np.full(n, max_loras))


def test_lora_affinity_prefers_an_engine_with_the_adapter_active():
    # engine 1 runs adapter 3; engine 0 has room; engine 2 is full (2 adapters active, max_lora 2)
    v = affinity_view([0, 0, 0], [0.1, 0.1, 0.1], [[], [3], [5, 6]], [[], [], []])
    r = make_router("lora-affinity", RouterSetup(3, [str(a) for a in range(8)], 0))
    picks = [r.pick(i, 3, np.arange(3), v) for i in range(2000)]
    assert picks.count(1) > 1990 and 2 not in picks      # 0.999 affinity, else "available" (engine 0)
    # an adapter active nowhere: an engine with room for another adapter
    assert {r.pick(i, 7, np.arange(3), v) for i in range(50)} <= {0, 1}


def test_lora_affinity_queue_and_kv_filters():
    r = make_router("lora-affinity", RouterSetup(4, [str(a) for a in range(8)], 0))
    # all engines past the queue threshold: least queue first (within (max-min)/n of the minimum)
    q = QUEUING_THRESHOLD_LORA + 1
    v = affinity_view([q + 101, q, q + 1, q + 401], [0.1] * 4, [[3], [], [], []], [[], [], [], []])
    assert {r.pick(i, 3, np.arange(4), v) for i in range(50)} <= {1, 2}
    # below the threshold: affinity, then least KV among the affine engines
    v = affinity_view([0, 0, 0, 0], [0.9, 0.2, 0.1, 0.1], [[3], [3], [], []], [[], [], [], []], max_loras=1)
    assert {r.pick(i, 3, np.arange(4), v) for i in range(50)} == {1}
    assert 0 < LORA_AFFINITY_THRESHOLD < 1


@pytest.mark.parametrize("name", [n for n, r in ROUTERS.items() if not r.reads_state])
def test_routing_all_at_once_equals_picking_one_by_one(name):
    """``route_all`` (the fleet's path for routers that read nothing) = ``pick`` / ``skip`` per request."""
    rng = np.random.default_rng(11)
    adapter = rng.integers(0, N_ADAPTERS, 500)
    candidates = [np.flatnonzero(rng.random(N_ENGINES) < 0.5) for _ in range(N_ADAPTERS)]
    if name == "static":                                  # static: among the placed engines that are up
        candidates = [np.array(sorted({a % N_ENGINES, (a + 1) % N_ENGINES}))[:1 + a % 2] for a in range(N_ADAPTERS)]
    candidates[3] = np.zeros(0, np.int64)                 # nobody serves adapter 3
    one = make_router(name, setup(4))
    expected = []
    for i, a in enumerate(adapter.tolist()):
        if len(candidates[a]) == 0:
            one.skip(i)
            expected.append(-1)
        else:
            expected.append(one.pick(i, a, candidates[a], None))
    assert make_router(name, setup(4)).route_all(adapter, candidates).tolist() == expected


def test_compiled_rules_are_the_python_policies():
    """The fleet's compiled loop and ``pick`` share the rule functions and the draw stream."""
    from twin import engine_routing

    for name, cls in ROUTERS.items():
        assert (cls.kernel >= 0) == (cls.reads_state != ""), name
    r = make_router("power-of-two", setup(3))
    u = r.uniforms(10)
    assert u.shape == (20,) and u[4] == r.uniform(2, 0) and np.array_equal(u, make_router("power-of-two", setup(3)).uniforms(10))
    assert engine_routing.pick_two(np.array([4, 7]), np.array([0, 0, 0, 0, 3, 0, 0, 1]), 0.1, 0.9) == 7
