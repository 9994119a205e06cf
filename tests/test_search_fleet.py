"""``lora-opt search`` on the fleet twin: ``--router`` / ``--adapters`` replay trials as one fleet,
``--deployment every-gpu`` searches (GPUs, one A_max) with every adapter on every GPU, and several
deployments x routers run one study each, their fronts merged into one."""
import json

import pytest
import yaml

from lora_opt.placement.evaluate import Criterion
from lora_opt.placement.instances import FleetOptions
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.workload_file import workload_from_dict
from lora_opt.search.deployments import every_gpu_placement, hottest, hybrid_placement, study_suffix
from lora_opt.search.study import AMAX_MAX, SearchSetup, Traffic, decode, merge_fronts, run_trial
from twin.errors import ScenarioError
from test_search import P, TINY
from twin.profile import load_profile



@pytest.fixture(scope="module")
def tiny():
    wl = workload_from_dict(TINY)
    return wl, PlacementContext.for_workload(wl)


def test_every_gpu_placement_routes_every_adapter_to_every_identical_gpu(tiny):
    wl, _ = tiny
    p = every_gpu_placement(wl, load_profile(P), 3, 8)
    assert len(p.gpus) == 3 and len(set(p.gpus)) == 1
    assert p.gpus[0].max_loras == 8 and p.gpus[0].max_lora_rank == 16 and p.gpus[0].max_cpu_loras == 24
    assert all(sorted(g for g, _ in rs) == [0, 1, 2] and sum(w for _, w in rs) == pytest.approx(1) for rs in p.routes.values())
    assert every_gpu_placement(wl, load_profile(P), 1, 10_000).gpus[0].max_loras == 24      # clipped to the adapters
    with pytest.raises(ScenarioError, match="gpus and A_max"):
        every_gpu_placement(wl, load_profile(P), 0, 8)


def test_hybrid_placement_puts_the_hot_adapters_everywhere_and_keeps_the_tail(tiny):
    """The hottest adapters routed equally to every GPU (the tail's and the extra ones), the tail where its own
    placement put it; every GPU registers what it is routed and starts; overlap and an empty fleet refused."""
    import dataclasses

    from lora_opt.placement.policies import get_policy
    from lora_opt.placement.plan import placement_problems
    wl, _ = tiny
    prof = load_profile(P)
    hot = hottest(wl, 3)
    assert hot == [a.id for a in sorted(wl.adapters, key=lambda a: -a.rate)[:3]]
    tail_wl = dataclasses.replace(wl, adapters=tuple(a for a in wl.adapters if a.id not in set(hot)))
    tail = get_policy("greedy").place(tail_wl, 4, PlacementContext.for_workload(tail_wl))
    p = hybrid_placement(wl, prof, tail, hot, extra_gpus=1)
    n = len(tail.gpus) + 1
    assert len(p.gpus) == n and [a.id for a in p.adapters] == [a.id for a in wl.adapters]
    assert all(sorted(g for g, _ in p.routes[a]) == list(range(n)) for a in hot)
    assert all(p.routes[a] == tail.routes[a] for a in tail.routes)
    assert p.gpus[-1].max_cpu_loras >= 3 and p.gpus[-1].max_loras <= 3          # the extra GPU: the hot ones only
    assert not placement_problems(p, prof) and all(g.startup_check(prof)[0] for g in p.gpus)
    with pytest.raises(ScenarioError, match="routes hot adapters"):
        hybrid_placement(wl, prof, tail, [next(iter(tail.routes))])
    with pytest.raises(ScenarioError, match="extra_gpus"):
        hybrid_placement(wl, prof, dataclasses.replace(tail, gpus=[], routes={}), hot, 0)


def test_every_gpu_trial_runs_on_the_fleet_twin_and_counts_loads(tiny):
    wl, ctx = tiny
    setup = SearchSetup.build(wl, 3, ctx, Criterion(rho=0.9), fleet=FleetOptions("lora-affinity", "on-demand"),
                              deployment="every-gpu")
    p = decode({"gpus": 2, "amax_0": AMAX_MAX}, setup)
    assert len(p.gpus) == 2 and p.gpus[0].max_loras == min(24, setup.mem_caps[16])
    out = run_trial({"gpus": 2, "amax_0": 4}, setup, Traffic(None, 120, seed=1))
    # the instances start warm (every adapter in the CPU cache, as --lora-modules): A_max 4 < 24 adapters swaps
    assert out["values"][0] == 2.0 and out["metrics"]["adapter_loads_cpu"] > 0 and out["metrics"]["adapter_loads_disk"] == 0
    with pytest.raises(ScenarioError, match="deployment.*allowed values: placement, every-gpu"):
        SearchSetup.build(wl, 3, ctx, deployment="everywhere")


def test_a_hybrid_trial_puts_its_hot_adapters_everywhere_and_splits_the_tail(tiny):
    from lora_opt.search.space import HYBRID_SEED_HOT, seed_params
    wl, ctx = tiny
    setup = SearchSetup.build(wl, 3, ctx, Criterion(rho=0.9), fleet=FleetOptions("lora-affinity"), deployment="hybrid")
    params = {"hot": 3, "gpus": 2, "share_0": 0.5, "amax_0": 8, "share_1": 0.5, "amax_1": 8}
    p = decode(params, setup)
    hot = hottest(wl, 3)
    assert len(p.gpus) == 2 and all(sorted(g for g, _ in p.routes[a]) == [0, 1] for a in hot)
    tail = [a.id for a in wl.adapters if a.id not in hot]
    assert all(len(p.routes[a]) == 1 for a in tail) and len(p.routes) == len(wl.adapters)
    assert sorted(sum(1 for a in tail if p.routes[a][0][0] == g) for g in (0, 1)) == [10, 11]   # 21 tail adapters
    out = run_trial(params, setup, Traffic(None, 120, seed=1))
    assert out["values"][0] == 2.0 and out["metrics"]["ttft_p99_ms"] > 0
    # a greedy placement seeds the study as its split of the tail of the HYBRID_SEED_HOT hottest
    seed = seed_params(decode({"gpus": 2, "share_0": 0.5, "amax_0": 8, "share_1": 0.5, "amax_1": 8},
                              SearchSetup.build(wl, 3, ctx)), setup)
    assert seed["hot"] == HYBRID_SEED_HOT and seed["gpus"] == 2
    with pytest.raises(ScenarioError, match="deployment hybrid: needs at least 2 adapters"):
        SearchSetup.build(workload_from_dict({**TINY, "adapters": [TINY["adapters"][0] | {"count": 1}]}), 3,
                          ctx, deployment="hybrid")


def test_default_study_names_are_unchanged_and_fleet_ones_say_what_they_replay():
    assert study_suffix("placement", "static", "static") == ""
    assert study_suffix("every-gpu", "lora-affinity", "on-demand") == "-every-gpu-lora-affinity-on-demand"


def test_merged_front_keeps_the_non_dominated_rows_of_every_study():
    rows = [{"gpus": 1, "p99_ttft": 90.0, "deployment": "placement"}, {"gpus": 2, "p99_ttft": 95.0, "deployment": "placement"},
            {"gpus": 2, "p99_ttft": 60.0, "deployment": "every-gpu"}, {"gpus": 3, "p99_ttft": 70.0, "deployment": "every-gpu"}]
    assert [(r["gpus"], r["deployment"]) for r in merge_fronts(rows, "p99_ttft")] == [(1, "placement"), (2, "every-gpu")]


def test_search_cli_across_deployments_and_routers(tmp_path, capsys):
    from lora_opt.cli import main
    wfile = tmp_path / "w.yaml"
    wfile.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "o"
    rc = main(["search", "--workload", str(wfile), "--gpus", "3", "--trials", "3", "--workers", "1", "--out", str(out),
               "--deployment", "placement", "every-gpu", "hybrid", "--router", "lora-affinity", "--adapters", "on-demand",
               "--json", "--no-track"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and [(s["deployment"], s["router"], s["adapters"]) for s in res["studies"]] == [
        ("placement", "lora-affinity", "on-demand"), ("every-gpu", "lora-affinity", "on-demand"),
        ("hybrid", "lora-affinity", "on-demand")]
    assert res["trials"] == 9 and res["front"]
    assert all(r["router"] == "lora-affinity" and r["deployment"] in ("placement", "every-gpu", "hybrid")
               for r in res["front"])
    front = [(r["gpus"], r["p99_ttft"]) for r in res["front"]]
    assert front == sorted(front) and all(b[1] < a[1] for a, b in zip(front, front[1:]))     # non-dominated
    for d in ("placement-lora-affinity", "every-gpu-lora-affinity"):
        assert (out / d / "pareto_front.png").exists() and list((out / d).glob("placement-*gpus-trial*.json"))
    assert main(["search", "--workload", str(wfile), "--gpus", "3", "--router", "nearest"]) == 2
    assert "invalid choice: 'nearest'" in capsys.readouterr().err
