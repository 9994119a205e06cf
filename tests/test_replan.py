"""``lora-opt replan``: the fewest moves for new demand, and a transition that never starves an
instance it loads (lora_opt.replan.replan, lora_opt.replan.replan_steps)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from lora_opt.cli import main
from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.replan.replan import GPUJudge, ReplanCosts, StateJudge, replan
from lora_opt.placement.workload_file import workload_from_dict

PROFILE = "llama-3.1-8b-h100-64gb"
GROUPS = [{"count": 30, "rank": 8, "rate": 0.2, "prefix": "a8-"},
          {"count": 20, "rank": 16, "rate": 0.25, "prefix": "a16-"},
          {"count": 10, "rank": 32, "rate": 0.2, "prefix": "a32-"}]


def _workload(scale: float = 1.0, groups=GROUPS, name: str = "w"):
    return workload_from_dict({"profile": PROFILE, "name": name,
                               "adapters": [{**g, "rate": g["rate"] * scale} for g in groups]})


@pytest.fixture(scope="module")
def placed():
    wl = _workload()
    policy = get_policy("greedy-plus")
    ctx = PlacementContext.for_workload(wl)
    return wl, policy, ctx, policy.place(wl, 16, ctx)


def _steps(plan, action):
    return [s for s in plan["steps"] if s["action"] == action]


def _check_transition(plan):
    """Every state after the first is ok; an instance the plan adds traffic to never starves."""
    assert plan["transition_ok"]
    for s in plan["states"][1:]:
        for inst in s["instances"]:
            assert inst["ok"] or inst["relieved_only"] or inst["within_target"], (s["label"], inst)


def test_an_unchanged_workload_proposes_no_move(placed):
    wl, policy, ctx, p = placed
    r = replan(p, wl, policy, ctx)
    assert r.chosen.name == "incremental"
    assert (r.chosen.moves, r.chosen.restarts, len(r.chosen.instances)) == (0, 0, len(p.gpus))
    assert r.plan["steps"] == [] and r.plan["starving_at_start"] == []
    assert r.placement.gpus == p.gpus and r.placement.routes == p.routes
    _check_transition(r.plan)


def test_a_doubled_rate_adds_gpus_and_moves_only_what_must_move(placed):
    wl, policy, ctx, p = placed
    wl2 = _workload(2.0)
    r = replan(p, wl2, policy, ctx)
    c = r.chosen
    assert len(c.instances) > len(p.gpus) and c.restarts == 0
    assert r.plan["starving_at_start"], "the doubled demand overloads the running instances"
    kept = [it for it in c.instances if it.origin is not None]
    assert len(kept) == len(p.gpus) and all(it.cfg == p.gpus[it.origin] for it in kept)    # no restart
    judge = GPUJudge(wl2, policy, ctx)
    before = p.by_gpu()
    moved = 0
    for it in kept:
        had = [k for k, _ in before[it.origin]]
        stayed = [i for i, _ in it.adapters]
        assert stayed == [k for k in had if k in set(stayed)], "kept adapters keep their place"
        shed = [k for k in had if k not in set(stayed)]
        moved += len(shed)
        assert judge.ok(it.adapters, it.cfg)
        if shed:           # minimal: the coldest adapter shed could not have stayed
            coldest = min(shed, key=lambda k: wl2.adapters[k].rate)
            assert not judge.ok(it.adapters + [(coldest, 1.0)], it.cfg)
    assert 0 < moved < len(wl2.adapters)
    assert c.loads == moved and c.unloads == moved
    assert r.chosen.moves <= next(x for x in r.candidates if x.name == "from-scratch").moves
    _check_transition(r.plan)


def test_pinned_adapters_stay_where_they_run_while_others_relieve_their_gpu(placed):
    """operate's held adapters (their load failed): the doubled demand sheds the hottest first; pinned, the
    hottest of each overloaded GPU stays and colder ones move instead; no from-scratch candidate."""
    wl, policy, ctx, p = placed
    wl2 = _workload(2.0)
    free = replan(p, wl2, policy, ctx)
    moved = sorted((a.id for a in wl2.adapters if _holders(free.placement, a.id) != _holders(p, a.id)),
                   key=lambda aid: -next(a.rate for a in wl2.adapters if a.id == aid))
    assert moved
    pinned = frozenset(moved[:3])
    r = replan(p, wl2, policy, ctx, pinned=pinned, restarts=False)
    assert {c.name for c in r.candidates} == {"incremental"}
    for aid in pinned:                                          # where they ran (kept instances keep their index)
        assert _holders(r.placement, aid) == _holders(p, aid)
    assert not {s["adapter"] for s in _steps(r.plan, "load")} & pinned
    assert r.plan["starving_at_start"] and len(r.placement.gpus) > len(p.gpus)


def test_loads_come_before_the_switch_and_unloads_after(placed):
    wl, policy, ctx, p = placed
    r = replan(p, _workload(1.6), policy, ctx)
    steps = r.plan["steps"]
    for route in _steps(r.plan, "route"):
        for aid, dests in route["weights"].items():
            for dest, _, _ in dests:
                ready = [s["step"] for s in steps if s.get("instance") == dest and
                         (s["action"] == "load" and s["adapter"] == aid or
                          s["action"] == "launch" and aid in s["lora_modules"])]
                assert ready and max(ready) < route["step"] or dest in _holders(p, aid)
            for s in steps:
                if s["action"] == "unload" and s["adapter"] == aid:
                    assert s["step"] > route["step"]
    for s in _steps(r.plan, "load") + _steps(r.plan, "unload"):
        assert s["request"]["method"] == "POST" and s["request"]["json"]["lora_name"] == s["adapter"]
        assert s["request"]["url"].endswith(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))
    _check_transition(r.plan)


def _holders(p: Placement, aid: str) -> set[str]:
    return {f"gpu{g}" for g, _ in p.routes.get(aid, [])}


def test_lower_demand_gives_gpus_back_and_drains_before_stopping(placed):
    _, policy, ctx, _ = placed
    p = policy.place(_workload(2.5), 16, ctx)
    assert len(p.gpus) >= 2
    r = replan(p, _workload(0.5), policy, ctx)
    assert len(r.chosen.instances) < len(p.gpus)
    stops = _steps(r.plan, "stop")
    assert stops
    for stop in stops:
        drain = [s["step"] for s in _steps(r.plan, "drain") if s["instance"] == stop["instance"]]
        assert drain and drain[0] < stop["step"]
        assert all(s["step"] < drain[0] for s in _steps(r.plan, "route"))
    _check_transition(r.plan)
    # no consolidation: the same demand keeps every instance
    r2 = replan(p, _workload(0.5), policy, ctx, consolidate=False, scratch=False)
    assert len(r2.chosen.instances) == len(p.gpus) and r2.chosen.moves == 0


def test_arrivals_and_retirements_are_loaded_and_unloaded(placed):
    wl, policy, ctx, p = placed
    groups = [dict(GROUPS[0], count=25), GROUPS[1], GROUPS[2], {"count": 4, "rank": 16, "rate": 0.2, "prefix": "new-"}]
    wl2 = _workload(groups=groups)
    r = replan(p, wl2, policy, ctx, scratch=False)
    unloaded = {s["adapter"] for s in _steps(r.plan, "unload") if s.get("why") == "retired"}
    assert unloaded == {f"a8-{k}" for k in range(25, 30)} - {a for a in unloaded if False}
    routed = {aid for s in _steps(r.plan, "route") for aid in s["adapters"]}
    assert {f"new-{k}" for k in range(4)} <= routed
    assert sorted(r.placement.routes) == sorted(a.id for a in wl2.adapters)
    _check_transition(r.plan)


def test_costs_weigh_moves_against_gpus(placed):
    wl, policy, ctx, p = placed
    costs = ReplanCosts(move_cost=0.5)
    assert costs.key(3, 0, 4, 1) == (5.0, 1, 4)
    assert ReplanCosts().key(3, 1, 40, 1) < ReplanCosts().key(4, 0, 0, 0)      # lexicographic: GPUs first
    assert ReplanCosts().key(3, 1, 40, 1) < ReplanCosts().key(3, 0, 0, 2)      # then launches (vLLM starts)
    with pytest.raises(InputError, match="move_cost"):
        ReplanCosts(move_cost=-1)
    with pytest.raises(InputError, match="profile"):
        replan(p, dataclasses.replace(wl, profile="other"), policy, ctx)


def test_the_cli_writes_the_plan_and_the_new_placement(placed, tmp_path, capsys):
    wl, policy, ctx, p = placed
    p.save(tmp_path / "placement.json")
    (tmp_path / "new.json").write_text(json.dumps(_workload(2.0, name="w2").to_dict()))
    code = main(["replan", str(tmp_path / "placement.json"), "--workload", str(tmp_path / "new.json"),
                 "--out", str(tmp_path / "out"), "--no-scratch"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "incremental" in out and "intermediate states judged" in out
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    new = Placement.load(tmp_path / "out")
    assert plan["chosen"] == "incremental" and plan["transition_ok"]
    assert len(new.meta["instances"]) == len(new.gpus) > len(p.gpus)
    # a second replan from the new placement with the same demand: nothing to do
    code = main(["replan", str(tmp_path / "out"), "--workload", str(tmp_path / "new.json"),
                 "--out", str(tmp_path / "again"), "--json", "--no-scratch"])
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["steps"] == [] and again["candidates"][0]["moves"] == 0


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert main(["replan", str(tmp_path / "missing.json"), "--workload", "example"]) == 2
    assert "placement" in capsys.readouterr().err
    assert main(["replan", "x", "--workload", "example", "--move-cost", "-1"]) == 2
    assert "--move-cost" in capsys.readouterr().err


def test_a_restart_keeps_the_adapters_its_old_flags_could_not_serve(placed):
    """Flags too small for the demand (``--max-loras`` 1): the no-restart candidate must move
    adapters away; ``incremental-restart`` restarts the instance with the policy's flags and moves
    none -- the new instance is launched with them beside the old one, which is drained and stopped."""
    wl, policy, ctx, p = placed
    small = dataclasses.replace(p, gpus=[dataclasses.replace(g, max_loras=1, max_cpu_loras=g.max_cpu_loras)
                                         for g in p.gpus], meta=dict(p.meta))
    judge = GPUJudge(wl, policy, ctx)
    assert not all(judge.ok([(k, w) for k, w in on], g) for on, g in zip(small.by_gpu(), small.gpus))
    r = replan(small, wl, policy, ctx)
    inc, rs = (next(c for c in r.candidates if c.name == n) for n in ("incremental", "incremental-restart"))
    assert inc.restarts == 0 and inc.moves > 0
    assert rs.moves == 0 and rs.restarts >= 1 and len(rs.instances) == len(p.gpus)
    before = {f"gpu{g}": {small.adapters[k].id for k, _ in on} for g, on in enumerate(small.by_gpu())}
    assert rs.restart_kept == sum(len(before[it.replaces]) for it in rs.instances if it.replaces)
    assert r.chosen is rs
    launches = _steps(r.plan, "launch")
    assert len(launches) == rs.restarts and all(s["replaces"] for s in launches)
    assert not _steps(r.plan, "load") and not _steps(r.plan, "unload")
    for s in launches:
        assert set(s["lora_modules"]) == before[s["replaces"]] and s["flags"]["max_loras"] > 1
        drain = [d["step"] for d in _steps(r.plan, "drain") if d["instance"] == s["replaces"]]
        stop = [d["step"] for d in _steps(r.plan, "stop") if d["instance"] == s["replaces"]]
        assert s["step"] < drain[0] < stop[0]
    assert {c["name"] for c in r.plan["candidates"]} == {"incremental", "incremental-restart", "from-scratch"}
    _check_transition(r.plan)
    # without restarts the candidate is not offered
    r2 = replan(small, wl, policy, ctx, restarts=False, scratch=False)
    assert [c.name for c in r2.candidates] == ["incremental"]


def _log(path, p: Placement, scale: float, span_s: float = 600.0, extra: str | None = None):
    """A request log: every adapter of ``p`` at ``scale`` x its rate, evenly spread over ``span_s``."""
    rows = ["timestamp_s,adapter,input_tokens,output_tokens"]
    for a in p.adapters:
        n = max(1, round(a.rate * scale * span_s))
        rows += [f"{span_s * (k + 1) / n:.6f},{a.id},200,200" for k in range(n)]
    if extra:
        rows.append(f"1.0,{extra},200,200")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_cli_estimates_the_new_demand_from_a_request_log(placed, tmp_path, capsys):
    wl, policy, ctx, p = placed
    p.save(tmp_path / "placement.json")
    log = _log(tmp_path / "log.csv", p, 2.0)
    code = main(["replan", str(tmp_path / "placement.json"), "--history", str(log), "--out", str(tmp_path / "out"),
                 "--json", "--no-scratch"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["transition_ok"]
    new = Placement.load(tmp_path / "out")
    assert len(new.gpus) > len(p.gpus) and new.meta["workload"] == "w-history"
    assert new.meta["workload_meta"]["rates_from_log"] == str(log)
    rates = {a.id: a.rate for a in new.adapters}
    assert all(rates[a.id] == pytest.approx(2 * a.rate, rel=0.05) for a in p.adapters)
    assert plan["starving_at_start"]


def test_history_errors_name_the_flag(placed, tmp_path, capsys):
    _, _, _, p = placed
    p.save(tmp_path / "placement.json")
    cur = str(tmp_path / "placement.json")
    log = _log(tmp_path / "log.csv", p, 1.0, extra="not-placed")
    assert main(["replan", cur, "--history", str(log)]) == 2
    err = capsys.readouterr().err
    assert "--history" in err and "not-placed" in err
    assert main(["replan", cur, "--history", str(tmp_path / "missing.csv")]) == 2
    assert "--history" in capsys.readouterr().err
    assert main(["replan", cur, "--history", str(log), "--workload", "example"]) == 2
    assert "not allowed with" in capsys.readouterr().err
    assert main(["replan", cur]) == 2
    err = capsys.readouterr().err
    assert "--workload" in err and "--history" in err


def test_a_restart_raises_the_rank_limit_instead_of_adding_a_gpu():
    """New rank-32 adapters on a fleet started with ``--max-lora-rank 8``: without a restart they
    need a new instance; with one, the running instance restarts with the rank it needs, keeps its
    30 adapters and loads the 4 new ones -- one GPU fewer, so it is chosen."""
    old = [{"count": 30, "rank": 8, "rate": 0.2, "prefix": "a8-"}]
    wl = _workload(groups=old)
    policy = get_policy("greedy-plus")
    ctx = PlacementContext.for_workload(wl)
    p = policy.place(wl, 4, ctx)
    assert len(p.gpus) == 1 and p.gpus[0].max_lora_rank == 8
    wl2 = _workload(groups=old + [{"count": 4, "rank": 32, "rate": 0.1, "prefix": "new-"}])
    r = replan(p, wl2, policy, ctx, scratch=False)
    inc, rs = r.candidates
    assert (inc.name, len(inc.instances), inc.restarts) == ("incremental", 2, 0)
    assert r.chosen is rs and rs.name == "incremental-restart"
    assert (len(rs.instances), rs.restarts, rs.restart_kept, rs.loads, rs.unloads) == (1, 1, 30, 4, 0)
    (it,) = rs.instances
    assert it.cfg.max_lora_rank == 32 and it.replaces == "gpu0" and it.origin is None
    launch, = _steps(r.plan, "launch")
    assert launch["flags"]["max_lora_rank"] == 32 and len(launch["lora_modules"]) == 34
    assert [s["instance"] for s in _steps(r.plan, "stop")] == ["gpu0"]
    _check_transition(r.plan)


def test_a_state_failing_one_draw_at_load_but_passing_the_placement_test_is_ok(placed):
    """The twin's verdict is one Poisson draw: near the boundary a set can pass at 1 + margin and fail
    at 1.0; the state judge then takes the placement test's verdict, and only both failing is starving."""
    wl, _, ctx, p = placed

    class Fails:
        def gpu_verdict(self, *args, **kwargs):
            return False

    class Judge:
        def __init__(self, verdict):
            self.verdict = verdict

        def ok(self, pairs, cfg):
            return self.verdict

    assert StateJudge(wl, Fails(), ctx, Judge(True)).ok([(0, 1.0)], p.gpus[0])
    assert not StateJudge(wl, Fails(), ctx, Judge(False)).ok([(0, 1.0)], p.gpus[0])


def test_a_state_carrying_part_of_its_target_is_ok_and_a_mixture_is_judged(placed):
    """Twin verdicts on one draw are not monotone near the boundary: an instance carrying a part of
    the traffic its target (which passed the placement test) carries is ok; one that carries traffic
    beyond both its start and its target is judged, and its failure makes the state not ok."""
    from lora_opt.replan.replan import Candidate, Instance
    from lora_opt.replan.replan_steps import _Transition

    wl, _, _, p = placed
    cfg = p.gpus[0]

    class Fails:
        def ok(self, pairs, cfg):
            return False

    start = [Instance("gpu0", cfg, [(0, 1.0), (1, 1.0), (5, 1.0)], origin=0),
             Instance("gpu1", cfg, [(2, 1.0)], origin=1)]
    target = Candidate("t", [Instance("gpu0", cfg, [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)], origin=0),
                             Instance("gpu1", cfg, [(5, 1.0)], origin=1)])
    tr = _Transition(start, target, wl, Fails())
    tr.route[2] = {"gpu0": 1.0}           # gpu1's adapter on gpu0 while gpu0 still has its leaving one
    state = tr.check("mixture", 1)
    assert not state["ok"] and {s["instance"]: s["within_target"] for s in state["instances"]} == \
        {"gpu0": False, "gpu1": True}
    tr.route[5] = {"gpu1": 1.0}           # the leaving one gone: each carries part of its target
    state = tr.check("part", 2)
    assert state["ok"] and state["starving"] == ["gpu0", "gpu1"]
