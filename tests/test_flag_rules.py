"""vLLM's flag rules per release (twin.flag_rules), each against the release's source as it states
the rule (the file and line are cited in each test; the sources read: the vllm 0.5.0, 0.8.5 and
0.33.0 sdists from PyPI, and the vllm 0.32.0 CPU wheel the real-vLLM tier installs).

A scenario is resolved as the profile's release resolves ``vllm serve``'s flags: the H100 profiles
are vLLM 0.8.5 (refuses a budget below max_num_seqs, clamps nothing), Llama-2's 0.5.0 (the same
refusal, its budget at least max_model_len without chunked prefill), the CPU probe profile 0.32 and
tests/data/profile-0.33.yaml 0.33 (a defaulted max_num_seqs clamped to a smaller budget, a defaulted
budget capped at max_num_seqs x max_model_len).  A refusal is a ScenarioError naming the field.
"""
import dataclasses

import pytest

import twin
from lora_opt.cli import main
from lora_opt.errors import InputError
from lora_opt.placement.plan import GPUConfig
from lora_opt.placement.policies.base import gpu_config
from lora_opt.placement.workload_file import workload_from_dict
from twin.errors import ScenarioError
from twin.flag_rules import RULES, flag_rules
from twin.flags import EngineFlags, flag_values, resolve_flags
from twin.paths import REPO_ROOT
from twin.profile import load_profile
from twin.scenario import build_scenario

H100 = "llama-3.1-8b-h100-64gb"           # vLLM 0.8.5, V1 (chunked prefill)
LLAMA2 = "llama-2-7b-h100-64gb"           # vLLM 0.5.0, V0 (no chunked prefill)
V032 = "probe-llama-cpu-vllm032"          # vLLM 0.32
V033 = str(REPO_ROOT / "tests" / "data" / "profile-0.33.yaml")


def _resolved(profile: str, engine: dict, ranks=(8,)):
    sc = build_scenario(profile, [{"rank": r, "rate": 1.0} for r in ranks], engine=engine)
    return sc.resolved_engine(load_profile(profile))


def test_each_profile_gets_its_release_rules():
    assert [load_profile(p).flag_rules().release for p in (LLAMA2, H100, V032, V033)] == ["0.5.0", "0.8.5", "0.32.0", "0.33.0"]
    assert load_profile(LLAMA2).flag_rules().chunked_prefill is False
    assert set(RULES) == {(0, 5), (0, 8), (0, 32), (0, 33)}
    with pytest.raises(ScenarioError, match=r"profile x\.vllm_version: '0\.9\.1': lora-opt knows vLLM's flag rules of "
                                            r"0\.5\.0, 0\.8\.5, 0\.32\.0, 0\.33\.0"):
        flag_rules("0.9.1", where="profile x.vllm_version")


# ---- vLLM 0.8.5 (the H100 profiles) --------------------------------------------------------------
def test_085_refuses_a_budget_below_its_default_max_num_seqs():
    """vllm 0.8.5 vllm/engine/arg_utils.py:1620-1621 (``_set_default_args_v1``): an unset max_num_seqs
    takes the default (256 on a < 70 GiB GPU) as it is; vllm/config.py:2033 (``SchedulerConfig._verify_args``):
    ``if self.max_num_batched_tokens < self.max_num_seqs: raise ValueError``.  vLLM 0.32's clamp is not
    0.8.5's: the instance does not start -- a ScenarioError naming the field, from simulate and place."""
    assert load_profile(H100).defaults.max_num_seqs == 256
    with pytest.raises(ScenarioError, match=r"engine\.max_num_batched_tokens: 128 < max_num_seqs 256 \(the "
                                            r"profile's default\): vLLM 0\.8\.5 refuses to start .*vllm/config\.py:2033"):
        _resolved(H100, {"max_num_batched_tokens": 128})
    sc = build_scenario(H100, [{"rank": 8, "rate": 0.5}], engine={"max_num_batched_tokens": 128}, duration_s=20)
    with pytest.raises(ScenarioError, match="max_num_batched_tokens: 128"):
        twin.simulate(sc)


def test_085_refuses_an_explicit_max_num_seqs_above_its_default_budget():
    """vllm 0.8.5 vllm/engine/arg_utils.py:1612-1618: an unset budget takes the default (2048 for the
    OpenAI server on a < 70 GiB GPU) as it is; vllm/config.py:2033 refuses it below max_num_seqs."""
    with pytest.raises(ScenarioError, match=r"engine\.max_num_batched_tokens: 2048 \(the profile's default\) < "
                                            r"max_num_seqs 4096: vLLM 0\.8\.5 refuses"):
        _resolved(H100, {"max_num_seqs": 4096})


def test_085_does_not_cap_a_defaulted_budget_at_max_num_seqs_times_max_model_len():
    """vllm 0.8.5 vllm/engine/arg_utils.py:1612-1618 and vllm/config.py:1967-1984: no
    ``max_num_seqs x max_model_len`` cap (0.32's arg_utils.py:3167 is not in 0.8.5)."""
    assert _resolved(H100, {"max_num_seqs": 1, "max_model_len": 1024}).max_num_batched_tokens == 2048


def test_085_an_explicit_pair_and_a_default_pair_start():
    """The committed configurations: max_num_seqs = max_num_batched_tokens = 2048, and the defaults."""
    assert _resolved(H100, {"max_num_seqs": 2048, "max_num_batched_tokens": 2048}).max_num_seqs == 2048
    eng = _resolved(H100, {})
    assert (eng.max_num_seqs, eng.max_num_batched_tokens) == (256, 2048)


def test_simulate_says_which_flag_085_refuses(tmp_path, capsys):
    """The refusal is an answer naming the field, not a traceback."""
    sc = tmp_path / "sc.yaml"
    sc.write_text(f"profile: {H100}\nadapters: [{{count: 4, rank: 8, rate: 0.5}}]\nduration_s: 10\n"
                  "engine: {max_num_batched_tokens: 128}\n")
    rc = main(["simulate", str(sc)])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert "max_num_batched_tokens: 128 < max_num_seqs 256 (the profile's default): vLLM 0.8.5 refuses to start" in err


def test_a_workload_pins_both_so_placement_derives_neither():
    """A workload's engine: section always sets max_num_seqs and max_num_batched_tokens (2048 each,
    ``PlacementEngine``; null is refused): an explicit pair, refused below on reading, derived by no
    release -- placements are untouched by the releases' derived defaults."""
    wl = workload_from_dict({"profile": H100, "adapters": [{"id": "a", "rank": 8, "rate": 1}]})
    cfg = gpu_config(wl, load_profile(H100), [8], 1, 4)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (2048, 2048)
    with pytest.raises(InputError, match="max_num_seqs: required, got null"):
        workload_from_dict({"profile": H100, "adapters": [{"id": "a", "rank": 8, "rate": 1}],
                            "engine": {"max_num_seqs": None}})


# ---- vLLM 0.5.0 (Llama-2) ------------------------------------------------------------------------
def test_050_budget_is_at_least_max_model_len_without_chunked_prefill():
    """vllm 0.5.0 vllm/config.py:705: without chunked prefill an unset budget is
    ``max(max_model_len, 2048)`` (the profile records 4096, its value at Llama-2's 4,096 tokens);
    no cap at max_num_seqs x max_model_len, no clamp of max_num_seqs (vllm/engine/arg_utils.py:50)."""
    assert _resolved(LLAMA2, {}).max_num_batched_tokens == 4096
    assert _resolved(LLAMA2, {"max_model_len": 8192}).max_num_batched_tokens == 8192
    assert _resolved(LLAMA2, {"max_num_seqs": 1, "max_model_len": 1024}).max_num_batched_tokens == 4096


def test_050_runs_the_calibrations_max_num_seqs_and_refuses_a_budget_below_it():
    """The real vLLM 0.5.0 runs set max_num_seqs 4096 and left the budget to its default (4096 for
    Llama-2's context): they start.  vllm/config.py:731 refuses a budget below max_num_seqs."""
    eng = _resolved(LLAMA2, {"max_num_seqs": 4096})
    assert (eng.max_num_seqs, eng.max_num_batched_tokens) == (4096, 4096)
    with pytest.raises(ScenarioError, match=r"4096 \(the profile's default\) < max_num_seqs 8192: vLLM 0\.5\.0 "
                                            r"refuses to start .*vllm/config\.py:731"):
        _resolved(LLAMA2, {"max_num_seqs": 8192})
    with pytest.raises(ScenarioError, match=r"128 < max_num_seqs 256 \(the profile's default\): vLLM 0\.5\.0"):
        _resolved(LLAMA2, {"max_num_batched_tokens": 128})


# ---- vLLM 0.32 / 0.33 ----------------------------------------------------------------------------
@pytest.mark.parametrize("profile,release", [(V032, "0.32.0"), (V033, "0.33.0")])
def test_032_033_clamp_a_defaulted_max_num_seqs_to_a_smaller_budget(profile, release):
    """vllm 0.32 vllm/engine/arg_utils.py:3180 / 0.33 arg_utils.py:3234
    (``_set_default_max_num_seqs_and_batched_tokens_args``): ``if orig_max_num_seqs is None:
    self.max_num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)`` -- lowered, not refused:
    the instance runs."""
    prof = load_profile(profile)
    assert prof.defaults.max_num_seqs == 256 and prof.flag_rules().release == release
    eng = _resolved(profile, {"max_num_batched_tokens": 128})
    assert (eng.max_num_seqs, eng.max_num_batched_tokens) == (128, 128)
    if profile == V032:
        sc = build_scenario(profile, [{"rank": 8, "rate": 0.5}], engine={"max_num_batched_tokens": 128}, duration_s=20)
        res = twin.simulate(sc)
        assert res.status == "ok" and res.engine.max_num_seqs == 128


@pytest.mark.parametrize("profile", [V032, V033])
def test_032_033_cap_a_defaulted_budget_at_max_num_seqs_times_max_model_len(profile):
    """vllm 0.32 vllm/engine/arg_utils.py:3167 / 0.33 arg_utils.py:3221: ``self.max_num_batched_tokens =
    min(self.max_num_seqs * model_config.max_model_len, self.max_num_batched_tokens)`` when unset."""
    assert _resolved(profile, {"max_num_seqs": 1, "max_model_len": 1024}).max_num_batched_tokens == 1024
    assert _resolved(profile, {"max_num_seqs": 1, "max_model_len": 4096}).max_num_batched_tokens == 2048


@pytest.mark.parametrize("profile,line", [(V032, "vllm/config/scheduler.py:328"), (V033, "vllm/config/scheduler.py:331")])
def test_032_033_refuse_an_explicit_max_num_seqs_above_the_defaulted_budget(profile, line):
    """The clamp is of a *defaulted* max_num_seqs only (``orig_max_num_seqs is None``): an explicit
    4096 over the default budget 2048 is refused by ``SchedulerConfig.verify_max_model_len`` (0.32
    vllm/config/scheduler.py:328, 0.33 :331)."""
    with pytest.raises(ScenarioError, match=rf"2048 \(the profile's default\) < max_num_seqs 4096: .*{line}"):
        _resolved(profile, {"max_num_seqs": 4096})


# ---- every release -------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", [LLAMA2, H100, V032, V033])
def test_an_explicit_pair_below_is_refused_where_the_file_is_read(profile):
    """Every release refuses ``max_num_batched_tokens < max_num_seqs`` (0.5.0 config.py:731, 0.8.5
    config.py:2033, 0.32 config/scheduler.py:328, 0.33 :331); set both, the scenario is refused on reading."""
    with pytest.raises(ScenarioError, match=r"scenario\.engine\.max_num_batched_tokens: 128 must be >= max_num_seqs 256"):
        build_scenario(profile, [{"rank": 8, "rate": 1.0}], engine={"max_num_batched_tokens": 128, "max_num_seqs": 256})


def test_resolution_keeps_set_flags_and_unknown_defaults_unset():
    flags = EngineFlags(max_loras=2, max_num_seqs=64, max_num_batched_tokens=512)
    for rules in RULES.values():
        assert resolve_flags(flags, {}, rules) == EngineFlags(max_loras=2, max_cpu_loras=2, max_num_seqs=64,
                                                              max_num_batched_tokens=512)
        assert resolve_flags(flags, {"max_loras": 8, "max_num_seqs": 256}, rules) == resolve_flags(flags, {}, rules)


def test_a_resolved_gpu_config_is_not_resolved_again():
    """A placement GPU's flags (every one set) are the scenario's resolved engine as they are."""
    prof = load_profile(H100)
    cfg = GPUConfig(8, 16, 12, 256, 2048, 0.9, 4096)
    sc = build_scenario(H100, [{"rank": 8, "rate": 1.0}], engine=cfg)
    assert sc.resolved_engine(prof) is sc.engine and flag_values(sc.engine) == dataclasses.asdict(cfg)
