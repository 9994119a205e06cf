"""The additive LoRA form (issue 36): ms per step, slot, distinct adapter, sequence and token, no factor.
The step model prices it, the kernel agrees (``test_engine``'s property test runs it on
``tests/data/profile-additive.yaml``), the early stop's bound stays a lower bound, a bad form is a clear
error, the end-to-end fit writes it into every rank, and the run-level fit on the bundled fit half explains it."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

import twin
from lora_opt.calibration import realruns
from lora_opt.calibration.additive_fit import additive_of, fit_additive
from lora_opt.calibration.e2e_fit import split_rows
from lora_opt.calibration.e2e_params import with_e2e_params
from lora_opt.calibration.runs_csv import load_runs
from twin.errors import ScenarioError
from twin.profile import LoraOverheadSpec, load_profile, profile_from_dict, profile_to_dict
from twin.paths import REPO_ROOT

ADDITIVE = REPO_ROOT / "tests" / "data" / "profile-additive.yaml"


def test_the_step_model_adds_the_terms_and_ignores_the_factor():
    lat = load_profile(ADDITIVE).latency
    lora = lat.lora[16]
    assert lora.additive and lora.extra(5, 32) == 0.0 and lora.jump_at(32) == 0.0
    n_seqs, n_tokens, ctx, n_ad, slots = 40, 300, 12_000, 7, 32
    no_lora = lat.model_ms(n_seqs, n_tokens, ctx, 0, 16, slots)
    with_lora = lat.model_ms(n_seqs, n_tokens, ctx, n_ad, 16, slots)
    expected = 0.7 + 0.034 * slots + 0.59 * n_ad + 0.02 * n_seqs + 0.005 * n_tokens
    assert with_lora - no_lora == pytest.approx(expected)
    # the same engine without the form: the factor on the step
    factor = LoraOverheadSpec(jump=1.0, slope=0.0193)
    assert factor.extra(n_ad, slots) == pytest.approx(1.0 + 0.0193 * n_ad)


def test_an_unknown_form_names_the_allowed_ones():
    d = yaml.safe_load(ADDITIVE.read_text())
    d["latency"]["lora"][16]["form"] = "multiplicative"
    with pytest.raises(ScenarioError, match=r"form: 'multiplicative' not in \['factor', 'additive'\]"):
        profile_from_dict(d, "x.yaml")


def test_the_form_round_trips_and_a_factor_profile_writes_as_before():
    p = load_profile(ADDITIVE)
    assert profile_to_dict(p)["latency"]["lora"][16]["form"] == "additive"
    factor = load_profile(REPO_ROOT / "tests" / "data" / "profile-0.33.yaml")
    assert "form" not in profile_to_dict(factor)["latency"]["lora"][16]
    assert "adapter_ms" not in profile_to_dict(factor)["latency"]["lora"][16]


def test_the_early_stop_bound_is_below_every_simulated_request():
    """The work bound prices the additive terms from below: a simulation with it stopping early agrees with one
    run to the end on whether the engine starves."""
    from twin.scenario import scenario_from_dict
    base = {"profile": str(ADDITIVE), "duration_s": 120, "seed": 3, "lengths": {"source": "mean"},
            "engine": {"max_loras": 8, "max_lora_rank": 16}}
    for rate in (0.2, 3.0):
        adapters = [{"count": 8, "rank": 16, "rate": rate}]
        full = twin.simulate(scenario_from_dict({**base, "adapters": adapters}))
        stop = twin.simulate(scenario_from_dict({**base, "adapters": adapters, "early_stop": True}))
        assert stop.starving == full.starving


def test_the_e2e_constants_go_to_every_rank():
    d = yaml.safe_load(ADDITIVE.read_text())
    d["latency"]["lora"] = {8: {"jump": 0.9, "slope": 0.02}, 16: {"jump": 1.0, "slope": 0.02}}
    add = additive_of([1.0, 0.03, 0.5, 0.04, 0.25])
    assert add["seq_ms"] == pytest.approx(0.03) and add["token_ms"] == pytest.approx(0.01)
    out = with_e2e_params(d, None, None, (5.0, 0.1), 0.0, add)
    for spec in out["latency"]["lora"].values():
        assert spec["form"] == "additive" and spec["adapter_ms"] == 0.5
        assert spec["jump"] in (0.9, 1.0)             # the estimators' factor stays, unused
    assert profile_from_dict(out).latency.lora[8].additive
    # negative or out-of-range refinement steps are clipped
    assert additive_of([-1.0, 0.1, 0.1, 0.1, 1.7])["step_ms"] == 0.0
    assert additive_of([-1.0, 0.1, 0.1, 0.1, 1.7])["seq_ms"] == 0.0


def test_the_run_level_fit_on_the_bundled_fit_half():
    """On Llama-3.1's fit half (rank 16, 74 runs) the run-level additive fit explains mean ITL within ~6 %
    SMAPE, and every constant is positive: each term is there in the data."""
    fit_rows, _ = split_rows(load_runs(realruns.REAL_RUNS_CSV), "llama-3.1-8b-instruct")
    lat = load_profile("llama-3.1-8b-h100-64gb").latency
    params, info = fit_additive(fit_rows, lat, 0.5)
    assert info["n_runs"] == len(fit_rows) > 60
    assert info["itl_smape_run_level"] < 8.0
    assert all(params[k] > 0 for k in ("step_ms", "slot_ms", "adapter_ms", "seq_ms", "token_ms"))
    assert np.isclose(params["seq_ms"], params["token_ms"])          # a prefill token at half a decode token's cost


def _two_ranks(rule: str):
    d = yaml.safe_load(ADDITIVE.read_text())
    e16 = d["latency"]["lora"][16]
    d["latency"]["lora"] = {8: {**e16, "adapter_ms": 0.3, "step_ms": 0.7}, 16: {**e16, "adapter_ms": 0.6}}
    if rule != "nearest":
        d["latency"]["lora_rank_rule"] = rule
    return profile_from_dict(d, "two-ranks.yaml")


def test_a_rank_without_an_entry_is_the_nearest_or_on_the_line_through_two():
    near, lin = _two_ranks("nearest").latency, _two_ranks("linear").latency
    assert near.lora_for_rank(32).adapter_ms == 0.6 and near.lora_for_rank(64).adapter_ms == 0.6
    assert lin.lora_for_rank(16).adapter_ms == 0.6                        # a fitted rank is itself
    assert lin.lora_for_rank(32).adapter_ms == pytest.approx(1.2)         # 0.3 at 8, 0.6 at 16: linear in the rank
    assert lin.lora_for_rank(12).adapter_ms == pytest.approx(0.45)
    assert lin.lora_for_rank(4).adapter_ms == pytest.approx(0.15)
    assert lin.lora_for_rank(32).step_ms == pytest.approx(0.7)            # equal at both ranks: flat
    assert lin.lora_for_rank(32).additive
    assert "lora_rank_rule" in profile_to_dict(_two_ranks("linear"))["latency"]
    assert "lora_rank_rule" not in profile_to_dict(_two_ranks("nearest"))["latency"]
    with pytest.raises(ScenarioError, match=r"lora_rank_rule: 'cubic' not in \['nearest', 'linear'\]"):
        _two_ranks("cubic")


def test_e2e_adapter_ms_by_rank_adds_the_ranks_the_profile_lacks():
    d = yaml.safe_load(ADDITIVE.read_text())
    d["latency"]["lora"] = {8: {"jump": 0.9, "slope": 0.02}}
    add = additive_of([1.0, 0.03, 0.5, 0.04, 0.5])
    out = with_e2e_params(d, None, None, (0.0, 0.0), 0.0, add, {8: 0.3, 16: 0.5})
    assert sorted(out["latency"]["lora"]) == [8, 16]
    assert out["latency"]["lora"][8]["adapter_ms"] == 0.3 and out["latency"]["lora"][16]["adapter_ms"] == 0.5
    assert out["latency"]["lora"][16]["step_ms"] == out["latency"]["lora"][8]["step_ms"] == 1.0


def test_a_model_entry_with_an_unknown_rank_rule_is_refused(tmp_path):
    from lora_opt.calibration.model_table import load_model_table
    from lora_opt.errors import InputError
    from twin.paths import MODEL_TABLE_PATH

    bad = tmp_path / "models.yaml"
    text = MODEL_TABLE_PATH.read_text()
    assert "    lora_cost: additive\n" in text
    bad.write_text(text.replace("    lora_cost: additive\n", "    lora_cost: additive\n    lora_rank_rule: cubic\n", 1))
    with pytest.raises(InputError, match=r"lora_rank_rule: 'cubic'; allowed: \['nearest', 'linear'\]"):
        load_model_table(bad)


def test_recalibrating_an_additive_profile_gives_it_back(tmp_path):
    """``lora-opt calibrate`` refits the estimators and carries the end-to-end fit: the bundled additive profile
    (the rank-8 and rank-16 entries, the rank rule, the front end) comes back as it is."""
    import shutil

    from lora_opt.calibration import profile_fit as cal

    src = REPO_ROOT / "configs" / "profiles" / "llama-3.1-8b-h100-64gb.yaml"
    if (yaml.safe_load(src.read_text())["fit"].get("e2e") or {}).get("lora_form") != "additive":
        pytest.skip("the bundled Llama-3.1 profile is not additive")
    out = tmp_path / "llama.yaml"
    shutil.copy(src, out)
    cal.calibrate(REPO_ROOT / "data" / "real_runs" / "real_runs_vllm_lora.csv", "llama-3.1-8b-instruct", out)
    got, bundled = yaml.safe_load(out.read_text()), yaml.safe_load(src.read_text())
    for d in (got, bundled):
        d["fit"].pop("command")                 # names its output path
    assert got == bundled
    lat = load_profile(out).latency
    assert lat.lora[8].additive and lat.lora[16].additive and lat.lora[8].adapter_ms < lat.lora[16].adapter_ms
