"""search and pareto at a stated confidence: a trial (and every point of a front) counts only when the
twin also serves it at the error model's verification load for C; a study keeps the load its trials
were judged at; pareto draws a front per confidence."""
import json

import pytest
import yaml

from lora_opt.calibration.error_model import Bound
from lora_opt.placement.confidence import ConfidenceSetting
from lora_opt.placement.evaluate import Criterion
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.workload_file import workload_from_dict
from lora_opt.search.study import SearchSetup, Traffic, open_study, replay, run_trial
from twin.errors import ScenarioError

P = "llama-3.1-8b-h100-64gb"
#: one GPU serves it at its load and starves at 8x (the twin's capacity on one H100 is ~3.3x this load)
HOT = {"profile": P, "name": "hot", "adapters": [{"count": 8, "rank": 8, "rate": 1.2, "prefix": "h-"}],
       "evaluation": {"duration_s": 120}}


def setting(ratio: float, confidence: float = 0.9) -> ConfidenceSetting:
    """A confidence setting with a given capacity-ratio bound (verification load 1 / ratio)."""
    return ConfidenceSetting(None, Bound(confidence, ratio, "test", 20), confidence)


@pytest.fixture(scope="module")
def hot():
    wl = workload_from_dict(HOT)
    return wl, PlacementContext.for_workload(wl)


def test_replay_at_a_load_compresses_the_same_requests(hot):
    wl, ctx = hot
    setup = SearchSetup.build(wl, 1, ctx)
    from lora_opt.search.study import decode
    p = decode({"gpus": 1, "share_0": 1.0, "amax_0": 8}, setup)
    one = replay(p, wl, Traffic(None, 120, seed=3), criterion=Criterion(rho=0.9))
    two = replay(p, wl, Traffic(None, 120, seed=3), criterion=Criterion(rho=0.9), load=2.0)
    assert two["duration_s"] == one["duration_s"] == 120                 # the same window judged
    assert two["incoming_token_rate"] == pytest.approx(2 * one["incoming_token_rate"], rel=0.15)
    # logged requests: compressed as they are (their window shortens)
    from lora_opt.placement.evaluate import workload_requests
    req = workload_requests(wl, 4096)
    three = replay(p, wl, Traffic(req, 240), criterion=Criterion(rho=0.9), load=2.0)
    assert three["duration_s"] == 120 and three["requests"] == len(req)


def test_a_trial_at_a_confidence_must_also_hold_the_verification_load(hot):
    wl, ctx = hot
    params = {"gpus": 1, "share_0": 1.0, "amax_0": 8}
    point = run_trial(params, SearchSetup.build(wl, 1, ctx), Traffic(None, 120, seed=1))
    assert point["constraints"][0] == 0                    # one GPU serves the load itself
    strict = SearchSetup.build(wl, 1, ctx, confidence=setting(1 / 8))
    assert strict.verify_load == pytest.approx(8.0) and strict.confidence == 0.9
    at_c = run_trial(params, strict, Traffic(None, 120, seed=1))
    assert at_c["constraints"][0] == 1 and at_c["metrics"]["gpus_starving_at_confidence"] == 1
    assert at_c["values"] == point["values"]                # the objective: at the load itself
    loose = run_trial(params, SearchSetup.build(wl, 1, ctx, confidence=setting(1 / 1.05)), Traffic(None, 120, seed=1))
    assert loose["constraints"][0] == 0


def test_a_study_keeps_the_load_its_trials_were_judged_at(hot, tmp_path):
    wl, ctx = hot
    storage = f"sqlite:///{tmp_path}/s.db"
    from lora_opt.search.study import SearchOptions, run_search
    run_search(SearchSetup.build(wl, 2, ctx, confidence=setting(0.8)), ctx, Traffic(None, 120, seed=1),
               SearchOptions(trials=1, storage=storage, study_name="s", workers=1, seeds=False, progress=False))
    with pytest.raises(ScenarioError, match=r"1\.250x the load.*2\.000x"):
        open_study(SearchSetup.build(wl, 2, ctx, confidence=setting(0.5)), storage, "s", 0)
    study, name = open_study(SearchSetup.build(wl, 2, ctx, confidence=setting(0.5)), storage, None, 0)
    assert name.endswith("-C0.9") and study.user_attrs["verify_load"] == pytest.approx(2.0)


def test_confidence_flag_values():
    import argparse

    from lora_opt.cli.conventions import CONFIDENCE_OR_POINT
    assert CONFIDENCE_OR_POINT("point") is None and CONFIDENCE_OR_POINT("0.9") == 0.9
    for bad in ("1", "0", "1.5", "nan", "high"):
        with pytest.raises(argparse.ArgumentTypeError):
            CONFIDENCE_OR_POINT(bad)


def test_search_and_pareto_cli_at_a_confidence(tmp_path, capsys):
    """search --confidence: the setting in front.json and the printed line; --error-model alone refused;
    pareto --confidence point 0.99: a front per method and confidence, the report names the loads."""
    from lora_opt.cli import main
    wfile = tmp_path / "w.yaml"
    wfile.write_text(yaml.safe_dump(HOT))
    out = tmp_path / "s"
    rc = main(["search", "--workload", str(wfile), "--gpus", "2", "--trials", "3", "--workers", "1", "--out", str(out),
               "--confidence", "0.9", "--no-track"])
    text = capsys.readouterr().out
    res = json.loads((out / "front.json").read_text())
    assert rc == 0 and res["confidence"]["confidence"] == 0.9 and "at confidence 0.9: feasible also at" in text
    assert res["study"].endswith("-C0.9")
    assert main(["search", "--workload", str(wfile), "--gpus", "2", "--error-model", "x.yaml", "--out", str(out)]) == 2
    assert "--error-model: only with --confidence" in capsys.readouterr().err
    po = tmp_path / "p"
    rc = main(["pareto", "--workload", str(wfile), "--gpus", "2", "--rhos", "0.9", "--ttft-slos-ms", "--itl-slos-ms",
               "--trials", "0", "--workers", "1", "--out", str(po), "--confidence", "point", "0.99", "--no-track"])
    capsys.readouterr()
    res = json.loads((po / "pareto.json").read_text(), parse_constant=lambda _: None)
    assert rc == 0 and res["confidences"] == [None, 0.99]
    assert {"greedy-plus", "greedy-plus @ C=0.99", "greedy @ C=0.99"} <= set(res["fronts"])
    assert {p["confidence"] for p in res["points"]} == {None, 0.99}
    # a point feasible at 0.99 is feasible on the point estimate (the same placement, a heavier check)
    greedy = {p["confidence"]: p["feasible"] for p in res["points"] if p["method"] == "greedy"}
    assert greedy[None] or not greedy[0.99]
    report = (po / "report.md").read_text()
    assert "C=0.99: a point counts when the twin also serves it at" in report and "| confidence |" in report
    assert (po / "pareto_front.png").read_bytes()[:4] == b"\x89PNG"
