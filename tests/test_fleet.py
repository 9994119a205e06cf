"""The fleet twin: static routing equals today's per-GPU evaluation bit for bit; on-demand adapters
are resident whenever a request runs and loads are counted and timed as the profile says."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twin.routers as routers
from lora_opt.placement.evaluate import (Criterion, _gpu_jobs, evaluate_on_fleet, evaluate_placement,
                                         evaluation_from_results, simulate_gpu_jobs, workload_requests)
from lora_opt.placement.instances import FleetOptions, replay_on_fleet
from lora_opt.placement.plan import GPUConfig, Placement
from lora_opt.placement.workload_file import workload_from_dict
from twin.adapter_cache import POLICIES
from twin.errors import ScenarioError
from twin.fleet import FleetEngine, simulate_fleet
from twin.routers import RouterSetup, make_router
from twin.scenario import scenario_from_dict
from twin.workload import Requests

P = "llama-3.1-8b-h100-64gb"


def workload(duration=300):
    return workload_from_dict({"profile": P, "adapters": [{"count": 12, "rank": 8, "rate": 0.3},
                                                          {"count": 12, "rank": 16, "rate": 0.2}],
                               "evaluation": {"duration_s": duration, "seed": 3}})


def two_gpus(wl):
    """Even adapters on GPU 0; odd ones split 1/4 : 3/4 over both."""
    cfg = GPUConfig(16, 16, 24, 2048, 2048, 0.9, 131072)
    routes = {a.id: ([(0, 1.0)] if i % 2 == 0 else [(0, 0.25), (1, 0.75)]) for i, a in enumerate(wl.adapters)}
    return Placement(P, list(wl.adapters), [cfg, cfg], routes, "manual", {"rho": 0.9})


class StaticReadingState(routers.Static):
    """The static router, but the fleet advances every engine to each arrival and scrapes them (as
    for a router reading metrics): the engines' numbers must not change."""

    name = "static-reading-state"
    reads_state = "metrics"


@pytest.fixture(scope="module")
def replayed():
    wl = workload()
    p = two_gpus(wl)
    req = workload_requests(wl, 131072)
    jobs, unrouted, lost = _gpu_jobs(p, wl, req, 300.0, wl.evaluation.seed)
    return wl, p, req, simulate_gpu_jobs(jobs)


def _same(a: dict, b: dict):
    for k in a:
        if k in ("wall_s", "timeseries"):
            continue
        if k == "samples":
            for name, x in a["samples"].items():
                assert np.array_equal(x, b["samples"][name]), name
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("router", ["static", StaticReadingState.name])
def test_static_fleet_equals_the_per_gpu_evaluation_bit_for_bit(replayed, router, monkeypatch):
    monkeypatch.setitem(routers.ROUTERS, StaticReadingState.name, StaticReadingState)
    wl, p, req, per_gpu = replayed
    fleet, unrouted, _ = replay_on_fleet(p, wl, req, 300.0, FleetOptions(router, "static"))
    assert unrouted == 0 and len(fleet) == len(per_gpu)
    for a, b in zip(per_gpu, fleet):
        _same(a, b)
    crit = Criterion(rho=wl.rho)
    assert (evaluation_from_results(p, wl, per_gpu, req, 300.0, 60.0, crit, 0, 0.0)
            == evaluation_from_results(p, wl, fleet, req, 300.0, 60.0, crit, 0, 0.0))


def test_evaluate_with_a_router_and_on_demand_adapters(replayed):
    wl, p, req, _ = replayed
    default = evaluate_placement(p, wl, requests=req, workers=1, progress=False)
    assert "router" not in default                      # today's output unchanged by default
    a = evaluate_on_fleet(p, wl, FleetOptions("lora-affinity", "on-demand"), requests=req)
    b = evaluate_on_fleet(p, wl, FleetOptions("lora-affinity", "on-demand"), requests=req)
    assert a == b and a["router"] == "lora-affinity" and a["adapters"] == "on-demand"
    assert sum(g["arrived"] for g in a["per_gpu"]) == a["requests"] and a["unrouted_requests"] == 0
    # on demand, GPU 1 also serves the even adapters placed only on GPU 0
    assert a["per_gpu"][1]["arrived"] > default["per_gpu"][1]["arrived"]
    with pytest.raises(ScenarioError, match="allowed: static, on-demand"):
        evaluate_on_fleet(p, wl, FleetOptions(adapters="lazy"), requests=req)
    with pytest.raises(ScenarioError, match="allowed: static, round-robin"):
        evaluate_on_fleet(p, wl, FleetOptions(router="fastest"), requests=req)


def engine(max_loras=2, max_cpu_loras=3, max_lora_rank=16, ranks=(8,) * 6, duration=600.0, preloaded=()):
    sc = scenario_from_dict({
        "profile": P, "duration_s": duration, "seed": 1,
        "engine": {"max_loras": max_loras, "max_cpu_loras": max_cpu_loras, "max_lora_rank": max_lora_rank,
                   "max_num_seqs": 64, "max_num_batched_tokens": 512},
        "adapters": [{"count": 1, "rank": r, "rate": 0.1, "id": f"a{k}"} for k, r in enumerate(ranks)
                     if r <= max_lora_rank]})
    ok = np.array(ranks) <= max_lora_rank              # the table holds the adapters vLLM accepts
    serves = np.full(len(ranks), -1, np.int64)
    serves[ok] = np.arange(ok.sum())
    return FleetEngine(sc, serves, np.array(preloaded, np.int64))


def requests(adapters, gap_s=20.0, in_len=64, out_len=8):
    n = len(adapters)
    return Requests(arrival=np.arange(n) * gap_s, adapter=np.array(adapters, np.int32),
                    in_len=np.full(n, in_len, np.int32), out_len=np.full(n, out_len, np.int32))


def one_router(name, n_engines, n_adapters, seed=0):
    return make_router(name, RouterSetup(n_engines, [f"a{k}" for k in range(n_adapters)], seed))


@settings(max_examples=25, deadline=None)
@given(uses=st.lists(st.integers(0, 5), min_size=1, max_size=25))
def test_on_demand_loads_follow_lru_in_both_tiers(uses):
    """One request at a time on a cold engine: disk loads = misses of an LRU of max_cpu_loras, CPU->GPU
    loads = misses of an LRU of max_loras, over the adapters in request order."""
    fe = engine(duration=20.0 * len(uses) + 20.0)
    res = simulate_fleet([fe], requests(uses), one_router("round-robin", 1, 6), check_invariants=True).engines[0]
    assert res.completed == len(uses)
    assert res.adapter_loads_disk == POLICIES["lru"].simulate(3, uses)[1]
    assert res.adapter_loads_cpu == POLICIES["lru"].simulate(2, uses)[1]


def test_a_load_costs_the_profiles_disk_and_cpu_times():
    fe = engine(preloaded=[0])                         # adapter 0 resident at start-up, adapter 1 on disk
    fr = simulate_fleet([fe], requests([0, 1]), one_router("round-robin", 1, 6))
    res = fr.engines[0]
    loading = fe.scenario.load_profile().loading
    warm, cold = res.samples["ttft_ms"]
    assert (res.adapter_loads_disk, res.adapter_loads_cpu) == (1, 1)
    assert cold - warm == pytest.approx(loading.disk_ms(8) + loading.cpu_ms(8), abs=1e-6)


@pytest.mark.parametrize("router", list(routers.ROUTERS)[1:])
def test_on_demand_fleet_runs_requests_only_where_their_adapter_is_resident(router):
    """Per-step kernel invariants (a batch's adapters hold GPU slots) on every engine; a rank-16
    adapter never reaches the engine whose --max-lora-rank is 8."""
    ranks = (8, 8, 8, 16, 16, 8)
    engines = [engine(max_lora_rank=16, ranks=ranks, duration=120.0), engine(max_lora_rank=8, ranks=ranks, duration=120.0),
               engine(max_loras=1, max_cpu_loras=2, ranks=ranks, duration=120.0)]
    rng = np.random.default_rng(4)
    n = 300
    req = Requests(arrival=np.sort(rng.random(n) * 100), adapter=rng.integers(0, 6, n).astype(np.int32),
                   in_len=rng.integers(16, 400, n).astype(np.int32), out_len=rng.integers(1, 60, n).astype(np.int32))
    fr = simulate_fleet(engines, req, one_router(router, 3, 6, seed=2), scrape_interval_s=0.05, check_invariants=True)
    assert (fr.engine_of >= 0).all()
    assert not np.isin(req.adapter[fr.engine_of == 1], [3, 4]).any()
    assert sum(r.arrived for r in fr.engines) == n
    assert sum(r.completed for r in fr.engines) == n


def test_evaluate_cli_router_and_adapters(tmp_path, capsys):
    import json

    from lora_opt.cli import main

    wl = workload(duration=120)
    path = tmp_path / "placement.json"
    two_gpus(wl).save(path)
    rc = main(["evaluate", str(path), "--router", "least-requests", "--adapters", "on-demand", "--json",
               "--duration-s", "120", "--grace-s", "30"])
    ev = json.loads(capsys.readouterr().out)
    assert rc in (0, 3) and ev["router"] == "least-requests" and ev["adapters"] == "on-demand"
    assert ev["adapter_loads_disk"] >= 0 and ev["scrape_interval_s"] == 0.1
    assert main(["evaluate", str(path), "--router", "fastest"]) == 2
    assert "invalid choice: 'fastest' (choose from 'static', 'round-robin'" in capsys.readouterr().err
    assert main(["evaluate", str(path), "--adapters", "lazy"]) == 2
    assert "(choose from 'static', 'on-demand')" in capsys.readouterr().err


def test_the_cli_spells_the_fleets_scrape_default():
    from lora_opt.cli.conventions import SCRAPE_DEFAULT_S
    from twin.fleet import SCRAPE_INTERVAL_S

    assert SCRAPE_DEFAULT_S == SCRAPE_INTERVAL_S == FleetOptions().scrape_interval_s


def test_bench_fleet_reports_the_ratio_to_independent_engines(tmp_path):
    import json

    from lora_opt.bench.fleet import FLEETS, bench_fleet

    lines = bench_fleet(sizes=(1, 2), window_s=30.0, out=str(tmp_path / "fleet.json"), repeats=2)
    report = json.loads((tmp_path / "fleet.json").read_text())
    rows = report["fleet"]
    assert [r["engines"] for r in rows] == [1, 2] and len(lines) == 4
    assert report["repeats"] == 2 and "best of 2" in lines[0] and report["command"] == "lora-opt bench fleet --repeats 2"
    assert all(set(r["fleets"]) == {k for k, *_ in FLEETS} for r in rows)
    assert all(f["ratio"] > 0 and f["completed"] > 0 for r in rows for f in r["fleets"].values())


def _mixed_fleet(on_demand: bool):
    """Three engines (one with --max-lora-rank 8), six adapters of ranks 8/16, 400 requests; static:
    each adapter placed on one or two of the engines that admit its rank."""
    ranks = (8, 8, 8, 16, 16, 8)
    flags = [dict(max_loras=2, max_lora_rank=16), dict(max_loras=2, max_lora_rank=8),
             dict(max_loras=1, max_cpu_loras=2, max_lora_rank=16)]
    placed = [{0, 1}, {1}, {2, 0}, {0}, {0, 2}, {2}]
    engines = []
    for e, f in enumerate(flags):
        fe = engine(ranks=ranks, duration=120.0, **f)
        if not on_demand:
            mine = [a for a in range(6) if e in placed[a] and fe.serves[a] >= 0]
            fe = engine(ranks=tuple(ranks[a] for a in mine), duration=120.0, **f)
            serves = np.full(6, -1, np.int64)
            serves[mine] = np.arange(len(mine))
            fe = FleetEngine(fe.scenario, serves)
        engines.append(fe)
    rng = np.random.default_rng(9)
    n = 400
    req = Requests(arrival=np.sort(rng.random(n) * 90), adapter=rng.integers(0, 6, n).astype(np.int32),
                   in_len=rng.integers(16, 600, n).astype(np.int32), out_len=rng.integers(1, 120, n).astype(np.int32))
    return engines, req


@pytest.mark.parametrize("adapters", ["static", "on-demand"])
@pytest.mark.parametrize("router", list(routers.ROUTERS))
def test_every_fast_path_makes_the_reference_loops_decisions_bit_for_bit(router, adapters):
    """Routing all requests at once (routers reading nothing) or in the compiled loop (the others)
    = ``Router.pick`` at every arrival with every engine advanced to it: same engines, same numbers."""
    engines, req = _mixed_fleet(adapters == "on-demand")
    routes = {a: [(e, 1.0 + e) for e in range(3) if engines[e].serves[a] >= 0] for a in range(6)}
    setup = RouterSetup(3, [f"a{k}" for k in range(6)], 5, routes)
    fast = simulate_fleet(engines, req, make_router(router, setup), scrape_interval_s=0.05)
    ref = simulate_fleet(engines, req, make_router(router, setup), scrape_interval_s=0.05, python_routing=True)
    assert np.array_equal(fast.engine_of, ref.engine_of) and fast.scrapes == ref.scrapes
    assert len(np.unique(fast.engine_of)) > 1                   # the router had choices to make
    for a, b in zip(fast.engines, ref.engines):
        _same(a.__dict__, b.__dict__)
