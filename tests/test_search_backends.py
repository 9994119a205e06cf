"""Search conventions and Optuna built-ins: the project's hypervolume against Optuna's, exit status 3
without a feasible point; the Ray Tune backend (slow).  (--json, OPTUNA_STORAGE and the plots: the
CLI tests of test_search.py.)"""
import json

import numpy as np
import pytest
import yaml

from lora_opt.search.study import hypervolume

TINY = {"profile": "llama-3.1-8b-h100-64gb", "name": "tiny",
        "adapters": [{"count": 14, "rank": 8, "rate": 0.4, "prefix": "s-"},
                     {"count": 10, "rank": 16, "rate": 0.3, "prefix": "m-"}],
        "evaluation": {"duration_s": 120}}


def test_hypervolume_matches_optunas_on_random_fronts():
    """``lora_opt.search.study.hypervolume`` (2-D staircase) against Optuna's exact
    ``optuna._hypervolume.compute_hypervolume`` (the WFG code Optuna's hypervolume history uses),
    on random point sets -- dominated points, ties and points beyond the reference included."""
    from optuna._hypervolume import compute_hypervolume
    rng = np.random.default_rng(0)
    for i in range(200):
        n = int(rng.integers(1, 30))
        pts = np.column_stack([rng.integers(1, 9, n).astype(float), rng.uniform(0, 5, n)])
        if i % 3 == 0:
            pts[:, 1] = np.round(pts[:, 1])              # ties in latency too
        ref = np.array([float(rng.integers(5, 10)), float(rng.uniform(2, 6))])
        inside = pts[(pts <= ref).all(axis=1)]
        ours = hypervolume([tuple(p) for p in pts], tuple(ref))
        assert ours == pytest.approx(compute_hypervolume(inside, ref), rel=1e-12, abs=1e-12)


@pytest.fixture()
def tiny_file(tmp_path):
    wfile = tmp_path / "w.yaml"
    wfile.write_text(yaml.safe_dump(TINY))
    return wfile


def test_search_exits_3_when_no_trial_is_feasible(tiny_file, tmp_path, capsys):
    from lora_opt.cli import main
    rc = main(["search", "--workload", str(tiny_file), "--gpus", "2", "--trials", "2", "--workers", "1",
               "--no-seeds", "--ttft-slo-ms", "0.001", "--out", str(tmp_path / "o")])
    assert rc == 3 and "no feasible trial" in capsys.readouterr().out


def test_search_options_are_checked_where_they_are_made():
    from lora_opt.errors import InputError
    from lora_opt.search.study import SearchOptions
    for bad, match in (({"trials": 0}, "--trials: must be >= 1, got 0"), ({"trials": 2.5}, "--trials: expected an integer"),
                       ({"seed": -1}, "--seed: must be >= 0"), ({"workers": 0}, "--workers: must be >= 1"),
                       ({"workers": True}, "--workers: expected an integer")):
        with pytest.raises(InputError, match=match):
            SearchOptions(**bad)
    assert SearchOptions(trials=np.int64(3), workers=None).trials == 3


def test_a_backend_is_a_name_and_its_function(tiny_file, tmp_path, monkeypatch):
    """Issue 38: ``BACKENDS`` maps each name to the function that drives the trials -- a name added
    runs its own function (never ask/tell by default), a name not in it is refused before any work."""
    from lora_opt.errors import InputError
    from lora_opt.search import run as search_run
    from lora_opt.search.study import SearchOptions, run_search

    assert all(callable(b.run) for b in search_run.BACKENDS.values())      # --backend's choices: test_cli_commands
    with pytest.raises(InputError, match="--backend: 'nope' not allowed; allowed values: ask-tell, tune"):
        search_run.SearchRequest(backend="nope")
    calls = []

    def traced(setup, ctx, traffic, options, *, where, timeout_s):
        calls.append((where, timeout_s))
        return run_search(setup, ctx, traffic, options, timeout_s=timeout_s)

    monkeypatch.setitem(search_run.BACKENDS, "traced", search_run.Backend(traced, reproducible=False))
    done = search_run.search(str(tiny_file), 2, search_run.SearchRequest(backend="traced", out=str(tmp_path / "o"),
                                                                         timeout_s=30.0, progress=False),
                             SearchOptions(trials=2, workers=1, seeds=False, progress=False), track=False)
    assert calls == [(tmp_path / "o", 30.0)]
    assert done.result["backend"] == "traced" and done.result["reproducible"] is False
    assert done.result["storage"] == f"sqlite:///{tmp_path / 'o' / 'study.db'}"
    assert "(traced: the trials depend on the order they finished in" in search_run.report(done)


@pytest.mark.slow
def test_tune_and_ask_tell_give_feasible_fronts_with_the_same_seeds(tmp_path):
    """Both backends on the same tiny workload, seed and trial budget: each finds a feasible front
    (constraints respected: Tune's searcher passed them to Optuna), in the same kind of storage."""
    # Ray Tune's dependencies are the tune extra's, which dev does not include (dev's other extras
    # happen to bring them today, fsspec through tokenizers' huggingface_hub; nothing promises it).
    # Without them `import ray.tune` raises a plain ImportError, which importorskip (pytest >= 8.2)
    # propagates -- a failure, not a skip -- unless told to catch it.
    pytest.importorskip("ray.tune", exc_type=ImportError,
                        reason="needs Ray Tune's dependencies: pip install -e '.[dev,tune]' (the tune extra)")
    import optuna

    from lora_opt.placement.policies import PlacementContext
    from lora_opt.placement.workload_file import workload_from_dict
    from lora_opt.search.study import SearchOptions, SearchSetup, Traffic, load_study, run_search, study_front
    from lora_opt.search.tune import run_tune_search

    wl = workload_from_dict(TINY)
    ctx = PlacementContext.for_workload(wl)
    setup = SearchSetup.build(wl, 3, ctx)
    db = f"sqlite:///{tmp_path}/s.db"
    common = dict(trials=10, storage=db, seed=1, workers=2, progress=False)
    a = run_search(setup, ctx, Traffic(None, 120, seed=1), SearchOptions(study_name="ask", **common))
    t = run_tune_search(setup, ctx, Traffic(None, 120, seed=1), SearchOptions(study_name="tune", **common),
                        tune_dir=tmp_path / "tune")
    for res in (a, t):
        assert res.trials == 10 and res.front
        study = load_study(db, res.study_name)
        assert [f["trial"] for f in res.front] == [x.number for x in study_front(study)]
        for x in study_front(study):
            assert x.constraints and all(v <= 0 for v in x.constraints.values())
        assert any(x.user_attrs.get("seed") for x in study.trials)       # greedy seeds enqueued in both
    assert (tmp_path / "tune" / "tune").is_dir()                              # Tune's experiment directory
    # resume: the same call again finds the finished experiment and adds nothing
    again = run_tune_search(setup, ctx, Traffic(None, 120, seed=1), SearchOptions(study_name="tune", **common),
                            tune_dir=tmp_path / "tune")
    assert again.trials == 10
    assert optuna.load_study(study_name="tune", storage=db).trials[0].state.name == "COMPLETE"
