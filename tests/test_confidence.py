"""Decisions at a stated confidence: the conformal bound, the error model files, greedy-plus's derived
verification load, and place / evaluate / replan with --confidence."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_opt.calibration.error_fit import coverage_table, fit_models, tradeoff_table
from lora_opt.calibration.error_model import (DEFAULT_CONFIDENCE, POOLED, ErrorModel, bundled_error_model,
                                              check_confidence, conformal_lower, conformal_rank, exceed_probability,
                                              load_error_model, max_confidence)
from lora_opt.cli import main
from lora_opt.cli.place import DEFAULT_CONFIDENCE as CLI_DEFAULT_CONFIDENCE
from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.policies.greedy import GreedyPlus
from lora_opt.placement.workload_file import load_workload

SMALL = """profile: llama-3.1-8b-h100-64gb
adapters:
  - {count: 40, rank: 8, rate: 0.2, prefix: s-}
  - {count: 20, rank: 16, rate: 0.1, prefix: m-}
evaluation: {duration_s: 300}
"""


def write(tmp_path, text, name="w.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return str(f)


def test_the_cli_spells_the_default_confidence_of_the_library():
    assert CLI_DEFAULT_CONFIDENCE == DEFAULT_CONFIDENCE


@pytest.mark.parametrize("n, c, k", [(9, 0.9, 1), (19, 0.9, 2), (33, 0.9, 3), (8, 0.9, 0), (99, 0.99, 1),
                                     (98, 0.99, 0), (3, 0.5, 2)])
def test_conformal_rank(n, c, k):
    assert conformal_rank(n, c) == k
    assert (conformal_lower(np.arange(1.0, n + 1), c) is None) == (k == 0)
    assert (c <= max_confidence(n) + 1e-12) == (k >= 1)


def test_conformal_lower_is_the_kth_smallest():
    s = [5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 8.0, 7.0, 6.0, 10.0, 11.0]      # n = 11: k = floor(12 x 0.25) = 3
    assert conformal_lower(s, 0.75) == 3.0


@settings(max_examples=25, deadline=None)
@given(n=st.integers(5, 60), c=st.sampled_from([0.5, 0.8, 0.9]), seed=st.integers(0, 2**31 - 1))
def test_split_conformal_coverage_holds_on_exchangeable_draws(n, c, seed):
    """P(new >= bound) >= C, averaged over many calibration sets (the guarantee is marginal)."""
    rng = np.random.default_rng(seed)
    trials, hits, used = 400, 0, 0
    for _ in range(trials):
        x = rng.lognormal(0.0, 0.2, n + 1)
        q = conformal_lower(x[:n], c)
        if q is None:
            continue
        used += 1
        hits += x[n] >= q
    if used:
        assert hits / used >= c - 4 * np.sqrt(c * (1 - c) / used)       # four standard errors below at worst


def test_exceed_probability_never_claims_less_than_the_data_shows():
    s = np.linspace(0.8, 1.2, 9)
    assert exceed_probability(s, 0.1) == pytest.approx(1 / 10)           # floor 1/(n+1)
    assert exceed_probability(s, 1.0) == pytest.approx(5 / 10)
    assert exceed_probability(s, 5.0) == 1.0


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, float("nan"), "x", None])
def test_check_confidence_refuses_what_is_not_a_probability(bad):
    with pytest.raises(InputError, match="--confidence"):
        check_confidence(bad)


def test_bound_uses_own_runs_then_pooled_then_refuses():
    m = ErrorModel("p", {"p": list(np.linspace(0.9, 1.1, 19)), POOLED: list(np.linspace(0.7, 1.1, 99))}, path="f.yaml")
    own = m.bound(0.9)
    assert own.samples == "p" and own.n == 19 and own.ratio == pytest.approx(np.linspace(0.9, 1.1, 19)[1])
    assert own.verification_load == pytest.approx(1 / own.ratio)
    pooled = m.bound(0.99)
    assert pooled.samples == POOLED and pooled.ratio == pytest.approx(0.7)
    with pytest.raises(InputError, match=r"--confidence 0.995: too few held-apart runs in f.yaml"):
        m.bound(0.995)
    # P(starve): a GPU whose twin capacity is 2x rho x its load is safe; at exactly rho x load, likely to starve
    assert m.p_starve(2000.0, 1000.0 / 0.9, 0.9, "p") == pytest.approx(1 / 20)
    assert m.p_starve(1000.0, 1000.0 / 0.9, 0.9, "p") > 0.4


def test_error_model_files_round_trip_and_bad_files_name_the_file(tmp_path):
    m = ErrorModel("p", {"p": [0.9, 1.0], POOLED: [0.8, 0.9, 1.0]}, fitted_on="test")
    path = m.save(tmp_path / "p.yaml")
    back = load_error_model(path)
    assert back.profile == "p" and back.capacity_ratio == m.capacity_ratio and back.fitted_on == "test"
    bad = tmp_path / "bad.yaml"
    bad.write_text("capacity_ratio: {p: [0.9, -1]}\n")
    with pytest.raises(InputError, match=r"bad.yaml: capacity_ratio.p must be a list of positive"):
        load_error_model(bad)
    bad.write_text("profile: p\n")
    with pytest.raises(InputError, match="bad.yaml: an error model needs"):
        load_error_model(bad)


def test_every_bundled_gpu_profile_has_an_error_model_fitted_on_its_report_half():
    for prof in ("llama-3.1-8b-h100-64gb", "qwen-2.5-7b-h100-64gb", "llama-2-7b-h100-64gb"):
        m = bundled_error_model(prof)
        assert m is not None and m.path == f"configs/error_models/{prof}.yaml"
        assert len(m.samples(prof)) >= 30 and len(m.samples(POOLED)) >= 99      # C 0.9 own, 0.99 pooled
        assert "report half" in m.fitted_on
    cpu = bundled_error_model("probe-llama-cpu-vllm032")       # the real CPU vLLM's, from its committed sittings
    assert cpu is not None and "sittings" in cpu.fitted_on and set(cpu.capacity_ratio) == {"probe-llama-cpu-vllm032"}
    from lora_opt.tracking import profile_info
    for prof in ("llama-3.1-8b-h100-64gb", "qwen-2.5-7b-h100-64gb", "llama-2-7b-h100-64gb", "probe-llama-cpu-vllm032"):
        assert bundled_error_model(prof).meta["profile_sha256"] == profile_info(prof)[1], \
            f"{prof}: the profile changed since its error model was fitted: refit it"


def _synthetic_runs():
    """Two workloads of a report half and one of a fit half, with known ratios."""
    rows = []
    for wl, half, ratio in (("a", "report", 0.9), ("b", "report", 1.0), ("c", "fit", 0.95)):
        for n, load in ((8, 0.5), (16, 1.0), (32, 2.0)):
            cap = 1000.0
            rows.append({"model": "m", "profile": "p", "workload": wl, "half": half, "n_served_adapters": n,
                         "real_incoming": load * 1000, "twin_incoming": load * 1000,
                         "twin_throughput": min(cap, load * 1000), "twin_capacity": cap,
                         "real_throughput": min(ratio * cap, load * 1000),
                         "capacity_observed": load * 1000 > ratio * cap})
    df = pd.DataFrame(rows)
    df["capacity_ratio"] = df["real_throughput"] / df["twin_capacity"]
    return df


def test_fit_and_scores_are_cross_fitted_on_synthetic_runs():
    df = _synthetic_runs()
    models = fit_models(df)
    # report half only: workload a's two saturated runs (ratio 0.9), b's one (1.0); c (fit half) is left out
    assert models["p"].samples("p").tolist() == [0.9, 0.9, 1.0]
    cov = coverage_table(df, (0.5,))
    rep = cov[(cov["scored_on"] == "report half") & (cov["model"] == "all")].iloc[0]
    # a's runs are scored with b's bound (1.0): not covered; b's with a's (0.9): covered
    assert rep["runs"] == 3 and rep["coverage"] == pytest.approx(1 / 3)
    fit = cov[(cov["scored_on"] == "fit half") & (cov["model"] == "all")].iloc[0]
    assert fit["runs"] == 2
    picks, summary = tradeoff_table(df, (0.5,))
    a = picks[picks["workload"] == "a"].set_index("rule")
    # real: 16 adapters serve 900 of 1000 tok/s (= rho), 32 starve; the twin serves 16 fully
    assert a.loc["point (twin at 1x)", "pick"] == 16 and a.loc["point (twin at 1x)", "real_max_pack"] == 16
    assert a.loc["C=0.5", "pick"] == 16 and not a.loc["C=0.5", "starves"]
    # the fixed 1.1x asks capacity >= 0.99 x 1000 at 16 adapters: 1000 passes
    assert a.loc["fixed 1.1x", "pick"] == 16
    assert set(summary["rule"]) == {"point (twin at 1x)", "fixed 1.1x", "C=0.5"}


def test_runs_without_a_second_served_adapter_count_have_no_max_pack_trade_off():
    # one served-adapter count per workload (e.g. error-model --family loaded_adapters_without_offloading_rate_0.025):
    # no Max_pack to pick, so empty tables -- once a KeyError on the empty picks
    df = _synthetic_runs()
    one = df[df["n_served_adapters"] == df.groupby("workload")["n_served_adapters"].transform("min")]
    picks, summary = tradeoff_table(one, (0.5,))
    assert picks.empty and summary.empty and "rule" in summary.columns


def test_greedy_plus_verifies_at_the_load_the_confidence_derives():
    wl = load_workload("example")
    ctx = PlacementContext.for_workload(wl)
    pol = GreedyPlus(confidence=0.9)
    pol.prepare(ctx)
    bound = bundled_error_model(ctx.profile.name).bound(0.9)
    assert pol.verify_load == pytest.approx(1 / bound.ratio)
    assert pol.load_factor == pytest.approx(pol.verify_load / 0.9)
    assert GreedyPlus().verify_load == pytest.approx(1.1)           # no confidence: the fixed margin


def test_place_prints_margin_and_probability_of_starving(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["place", "--workload", write(tmp_path, SMALL), "--gpus", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"margin@{DEFAULT_CONFIDENCE:g}" in text and "P(starve)" in text and "derived from the confidence" in text
    p = Placement.load(out / "placement.json")
    assert p.meta["confidence"]["confidence"] == DEFAULT_CONFIDENCE
    assert len(p.meta["p_starve"]) == len(p.gpus) and all(0 < x <= 1 for x in p.meta["p_starve"])
    assert all(m > -0.1 for m in p.meta["margin_at_confidence"])
    # the fixed margin still exists, and then no confidence is claimed
    rc = main(["place", "--workload", write(tmp_path, SMALL), "--gpus", "2", "--out", str(out), "--margin", "0.1"])
    text = capsys.readouterr().out
    assert rc == 0 and "P(starve)" not in text and "fixed margin 0.1" in text


@pytest.mark.parametrize("args, match", [
    (["--confidence", "1"], "--confidence: must be in (0, 1)"),
    (["--confidence", "0"], "--confidence: must be in (0, 1]"),
    (["--confidence", "0.9", "--margin", "0.1"], "--confidence and --margin: give one"),
    (["--confidence", "0.995"], "too few held-apart runs in configs/error_models/llama-3.1-8b-h100-64gb.yaml"),
])
def test_bad_confidence_is_a_clear_error(tmp_path, capsys, args, match):
    rc = main(["place", "--workload", write(tmp_path, SMALL), "--gpus", "2", "--out", str(tmp_path / "o"), *args])
    assert rc == 2 and match in capsys.readouterr().err


def test_a_profile_without_error_model_refuses_an_explicit_confidence(tmp_path, capsys):
    from twin.paths import PROFILES_DIR

    # a recalibrated profile (another file) is another twin: the bundled error model does not apply to it
    prof = tmp_path / "recalibrated.yaml"
    prof.write_text((PROFILES_DIR / "llama-3.1-8b-h100-64gb.yaml").read_text() + "\n# recalibrated\n")
    wl = write(tmp_path, SMALL.replace("llama-3.1-8b-h100-64gb", str(prof)))
    rc = main(["place", "--workload", wl, "--gpus", "2", "--confidence", "0.9", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "has no error model (configs/error_models/llama-3.1-8b-h100-64gb.yaml was fitted for the " \
                       "profile file with sha256" in err
    rc = main(["place", "--workload", wl, "--gpus", "2", "--out", str(tmp_path / "o")])
    text = capsys.readouterr().out
    assert rc == 0 and "P(starve)" not in text and "fixed margin 0.1" in text       # the default falls back
    bad = write(tmp_path, "capacity_ratio: []\n", "em.yaml")
    rc = main(["place", "--workload", write(tmp_path, SMALL), "--gpus", "2", "--error-model", bad,
               "--out", str(tmp_path / "o")])
    assert rc == 2 and "em.yaml: an error model needs" in capsys.readouterr().err


def test_a_higher_confidence_needs_more_gpus_on_the_example(tmp_path, capsys):
    used = {}
    for c in ("0.9", "0.99"):
        # a static placement: the recommendation (the default) may pick a deployment that needs the whole pool at both
        rc = main(["place", "--workload", "example", "--gpus", "4", "--deployment", "static", "--confidence", c,
                   "--out", str(tmp_path / c)])
        text = capsys.readouterr().out
        assert rc == 0, text
        used[c] = len(Placement.load(tmp_path / c / "placement.json").gpus)
        assert f"margin@{c}" in text
    assert used["0.99"] > used["0.9"]


def test_evaluate_judges_each_gpu_at_the_confidence(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["place", "--workload", write(tmp_path, SMALL), "--gpus", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    rc = main(["evaluate", str(out), "--confidence", "0.9", "--duration-s", "300", "--workers", "1", "--no-track"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "at confidence 0.9" in text and "P(starve)" in text


@pytest.mark.slow
def test_the_bundled_error_models_are_what_a_refit_on_todays_twin_gives(tmp_path, monkeypatch):
    """The error model must be refitted whenever the twin's numbers move: a refit of the bundled runs with
    the current twin reproduces configs/error_models/ (about 1-2 minutes on 2 cores)."""
    from twin.paths import CONFIGS_DIR

    monkeypatch.chdir(tmp_path)
    rc = main(["error-model", "--out", str(tmp_path / "em"), "--no-track"])
    assert rc == 0
    for path in sorted((tmp_path / "em" / "models").glob("*.yaml")):
        fresh, bundled = load_error_model(path), load_error_model(CONFIGS_DIR / "error_models" / path.name)
        for key, vals in bundled.capacity_ratio.items():
            assert fresh.capacity_ratio[key] == pytest.approx(vals, rel=1e-5), (
                f"{path.name}: {key} moved -- rerun lora-opt error-model --out experiments/error_model "
                "--models-dir configs/error_models")
