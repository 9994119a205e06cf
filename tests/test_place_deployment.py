"""``lora-opt place --deployment``: static, every-gpu and hybrid judged on the fleet twin at one SLO and one
load (lora_opt.search.recommend), the one with the fewest GPUs returned, its files written; no deployment
meeting the SLO is a clear answer naming what binds."""
import json

import pytest
import yaml

from lora_opt.cli import main as cli_main
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.placement.workload_file import workload_from_dict
from lora_opt.search.recommend import DEPLOYMENT_CHOICES, Candidate, candidates_table, recommend
from test_search import TINY
from twin.errors import ScenarioError


@pytest.fixture(scope="module")
def tiny():
    wl = workload_from_dict(TINY)
    policy = get_policy("greedy")
    return wl, policy, policy.place(wl, 4, PlacementContext.for_workload(wl))


def test_every_deployment_is_judged_alike_and_the_fewest_gpus_come_first(tiny):
    wl, policy, static = tiny
    judged = recommend(wl, 4, static, policy=policy, ctx_for=PlacementContext.for_workload, load=1.1,
                       ttft_p99_s=5.0)
    assert {c.deployment for c in judged} == {"static", "every-gpu", "hybrid"}
    assert [c.key() for c in judged] == sorted(c.key() for c in judged)
    best = judged[0]
    assert best.ok and best.gpus == len(best.placement.gpus) and best.ttft_p99_ms <= 5000
    # every candidate that met the SLO needs at least the recommended GPU count
    assert all(c.gpus >= best.gpus for c in judged if c.ok)
    assert "deployment" in candidates_table(judged).splitlines()[0]
    only = recommend(wl, 4, static, policy=policy, ctx_for=PlacementContext.for_workload, load=1.1, ttft_p99_s=5.0,
                     deployment="static")
    assert [c.deployment for c in only] == ["static"]
    with pytest.raises(ScenarioError, match="--deployment: 'cheap' not allowed; allowed values: static, every-gpu"):
        recommend(wl, 4, static, policy=policy, ctx_for=PlacementContext.for_workload, load=1.1, ttft_p99_s=5.0,
                  deployment="cheap")


def test_the_order_is_fewest_gpus_then_p99_then_loads():
    a = Candidate("static", None, True, 3, 200.0, 1.0, 1.0)
    b = Candidate("hybrid", None, True, 2, 900.0, 1.0, 9.0)
    c = Candidate("every-gpu", None, True, 2, 900.0, 1.0, 5.0)
    d = Candidate("every-gpu", None, False, 1, 100.0, 1.0, 0.0)
    assert sorted([a, b, c, d], key=Candidate.key) == [c, b, a, d]
    assert DEPLOYMENT_CHOICES[-1] == "best"
    from lora_opt.cli import build_parser
    place = build_parser()._subparsers._group_actions[0].choices["place"]
    assert next(a for a in place._actions if a.dest == "deployment").choices == DEPLOYMENT_CHOICES


def _place(tmp_path, *extra, policy="greedy"):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(yaml.safe_dump(TINY))
    return cli_main(["place", "--workload", str(wl), "--gpus", "4", *(["--policy", policy] if policy else []),
                     "--out", str(tmp_path / "out"), *extra])


def test_place_recommends_and_writes_the_chosen_deployment(tmp_path, capsys):
    assert _place(tmp_path, "--emit-vllm", policy=None) == 0     # no --policy: --deployment best is the default
    out = capsys.readouterr().out
    assert "recommended: " in out and "meets SLO" in out and "GPU(s)" in out
    chosen = out.split("recommended: ")[1].split(" on ")[0]
    assert f"policy greedy-plus; deployment {chosen};" in out.splitlines()[0]
    p = json.loads((tmp_path / "out" / "placement.json").read_text())
    assert p["meta"]["deployment"] == chosen and p["meta"]["judged_load"] > 1.0
    assert (tmp_path / "out" / "vllm" / "serve_commands.txt").read_text().count("vllm serve") == len(p["gpus"])
    pools = tmp_path / "out" / "router" / "inference-pools.yaml"
    router = p["meta"].get("judged_router")
    if chosen != "static":
        # judged behind a router other than its weights: said, and the launch commands come with that router's
        # configuration -- the picker's told which metric names the commands' vLLM release exports
        assert f"judged behind the {router} router" in out and "router.json's fixed weights" in out
        if router == "lora-affinity":
            text = pools.read_text()
            assert "kind: InferencePool" in text and "-kvCacheUsagePercentageMetric vllm:kv_cache_usage_perc" in text
        else:
            assert f"--policy {router.replace('-', '_')}" in (tmp_path / "out" / "router" / "vllm-router.sh").read_text()
            # vllm-router's consistent_hash keys on X-Session-ID: the clients are told to send the adapter there
            assert ("X-Session-ID" in out) == (router == "consistent-hash")
    else:
        assert not pools.exists()
    assert _place(tmp_path, "--deployment", "every-gpu", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert [c["deployment"] for c in d["deployments"]] == ["every-gpu"] and d["meta"]["deployment"] == "every-gpu"
    assert all(len(r) == len(d["gpus"]) for r in d["routes"].values())        # every adapter on every GPU
    assert not pools.exists()                  # no --emit-vllm: the previous run's files are gone, none written


def test_static_is_the_policys_placement_not_judged(tmp_path, capsys):
    # asked for, or implied by naming a policy: that policy's placement is the answer
    for extra in (["--deployment", "static"], []):
        assert _place(tmp_path, "--json", *extra) == 0
        d = json.loads(capsys.readouterr().out)
        assert "deployments" not in d and "deployment" not in d["meta"] and d["policy"] == "greedy"


def test_a_router_that_cannot_front_the_pick_is_refused_before_anything_is_written(tmp_path, capsys):
    # a loose SLO: the hybrid is picked (the refusal comes after the judgement, before anything is written)
    assert _place(tmp_path, "--deployment", "hybrid", "--ttft-p99-s", "10", "--emit-vllm",
                  "--emit-router", "vllm-router:round-robin") == 2
    err = capsys.readouterr().err
    assert "vllm-router: it sends any request to any GPU" in err and "use gateway" in err
    assert not (tmp_path / "out" / "placement.json").exists()


def test_gateway_manifests_say_what_the_picker_must_read_per_vllm_release():
    from lora_opt.replan.router_config import endpoint_picker_notes
    assert endpoint_picker_notes(None) == [] and endpoint_picker_notes("0.8.5") == []
    for release in ("0.32", "0.33"):
        text = " ".join(endpoint_picker_notes(release))
        assert f"vLLM {release} exports no vllm:gpu_cache_usage_perc" in text and "twice against" in text


def test_no_deployment_meeting_the_slo_says_what_binds(tmp_path, capsys):
    assert _place(tmp_path, "--deployment", "best", "--ttft-p99-s", "0.001") == 3
    out = capsys.readouterr().out
    assert "infeasible: no deployment meets the SLO within 4 GPUs" in out
    assert "static: p99 TTFT" in out and "over the bound" in out and "rerun with more --gpus" in out
    assert not (tmp_path / "out" / "placement.json").exists()


def test_an_unknown_deployment_is_refused_by_name(tmp_path, capsys):
    assert _place(tmp_path, "--deployment", "cheapest") == 2
    assert "argument --deployment: invalid choice: 'cheapest' (choose from 'static', 'every-gpu', 'hybrid', 'best')" \
        in capsys.readouterr().err


def test_the_pick_is_confirmed_on_more_draws_and_a_miss_passes_it_on(monkeypatch):
    """The candidate the recommendation would return is judged on CONFIRM_DRAWS further draws of the traffic;
    a miss there un-meets it (said) and the next one is confirmed."""
    import lora_opt.search.recommend as rec
    from lora_opt.placement.instances import FleetOptions
    a = Candidate("hybrid", object(), True, 2, 100.0, 1.0, 1.0, "20 hot", FleetOptions("lora-affinity"))
    b = Candidate("every-gpu", object(), True, 2, 150.0, 1.0, 2.0, "A_max 8", FleetOptions("lora-affinity", "on-demand"))
    calls = []

    def judged(p, wl, fleet, load, ttft_p99_s, seeds=None):
        calls.append((wl.evaluation.seed, seeds))
        ok = p is b.placement
        return {"ok": ok, "ttft_p99_ms": 160.0 if ok else 9000.0, "served_fraction": 0.97,
                "detail": "" if ok else "p99 TTFT 9,000 ms over the bound (traffic draw 3 of 8; met on the 2 before)"}

    monkeypatch.setattr(rec, "judge", judged)
    wl = workload_from_dict(TINY)
    rec.confirm([a, b], wl, 1.1, 5.0)
    assert a.confirmed and not a.ok and "missed on a confirmation draw: p99 TTFT 9,000 ms" in a.detail
    assert b.confirmed and b.ok and b.ttft_p99_ms == 160.0          # the worst of all its draws
    assert calls == [(wl.evaluation.seed + rec.JUDGE_SEEDS, rec.CONFIRM_DRAWS)] * 2
