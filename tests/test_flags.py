"""The one engine-flags type (twin.flags) and the one scenario builder (twin.scenario.scenario_dict)."""
import dataclasses

import pytest
import yaml

from lora_opt.cli import main
from lora_opt.errors import BAD_INPUT, InputError
from lora_opt.placement.plan import GPUConfig
from lora_opt.placement.workload_file import PlacementEngine, evaluation_scenario, workload_from_dict
from twin.errors import ScenarioError
from twin.flags import PER_INSTANCE_FLAGS, EngineFlagChecks, EngineFlags, flag_values
from twin.profile import EngineDefaults, load_profile, profile_from_dict, profile_to_dict
from twin.scenario import (DEFAULT_RHO, AdapterGroup, EngineConfig, LengthConfig, Scenario, build_scenario,
                           scenario_dict, scenario_from_dict)

P = "llama-3.1-8b-h100-64gb"
FLAGS = {f.name: f for f in dataclasses.fields(EngineFlags)}


def _base_type(field: dataclasses.Field) -> str:
    return str(field.type).replace(" | None", "")


@pytest.mark.parametrize("holder", [EngineConfig, GPUConfig])
def test_scenario_and_placement_flags_are_engine_flags(holder):
    assert issubclass(holder, EngineFlags)
    names = [f.name for f in dataclasses.fields(holder)]
    assert names[:len(FLAGS)] == list(FLAGS)


def test_workload_flags_are_engine_flags_less_the_per_gpu_ones():
    """A workload's engine: section is EngineFlags (a new flag reaches it), and refuses the flags a
    policy chooses per GPU, naming the field and the shared flags."""
    assert issubclass(PlacementEngine, EngineFlags) and PlacementEngine.REFUSED_KEYS == PER_INSTANCE_FLAGS
    for name in PER_INSTANCE_FLAGS:
        with pytest.raises(InputError, match=rf"workload\.engine\.{name}: chosen for each GPU by the placement "
                                             r"policy.*max_num_seqs, max_num_batched_tokens"):
            workload_from_dict({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1}], "engine": {name: 16}})
    wl = workload_from_dict({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1}]})
    assert list(wl.to_dict()["engine"]) == ["max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                                            "max_model_len"]


@pytest.mark.parametrize("subset", [EngineDefaults, PlacementEngine])
def test_profile_and_workload_flags_are_typed_subsets(subset):
    """Every field of a subset is a flag of EngineFlags, of the same type, checked by its validator."""
    assert issubclass(subset, EngineFlagChecks)
    for f in dataclasses.fields(subset):
        assert f.name in FLAGS, f.name
        assert _base_type(f) == _base_type(FLAGS[f.name]), f.name


def test_placement_flags_are_all_required():
    with pytest.raises(TypeError, match="max_model_len"):
        GPUConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1, max_num_seqs=1, max_num_batched_tokens=1,
                  gpu_memory_utilization=0.9)


@pytest.mark.parametrize("flags, words", [
    (EngineFlags(max_lora_rank=7), ["engine.max_lora_rank", "1, 8, 16, 32, 64, 128, 256, 320, 512"]),
    (EngineFlags(max_loras=0), ["engine.max_loras: must be >= 1, got 0"]),
    (EngineFlags(max_loras=4, max_cpu_loras=2), ["engine.max_cpu_loras: 2 must be >= max_loras 4"]),
    (EngineFlags(gpu_memory_utilization=1.5), ["engine.gpu_memory_utilization: must be in (0, 1]"]),
    (EngineFlags(max_num_seqs=4096, max_num_batched_tokens=2048),
     ["engine.max_num_batched_tokens: 2048 must be >= max_num_seqs 4096", "vLLM refuses to start"]),
    (PlacementEngine(max_num_seqs=4096), ["engine.max_num_batched_tokens: 2048 must be >= max_num_seqs 4096"]),
    (EngineDefaults(max_num_seqs=4096), ["engine.max_num_batched_tokens: 2048 must be >= max_num_seqs 4096"]),
])
def test_validator_names_the_flag(flags, words):
    with pytest.raises(ScenarioError) as err:
        flags.validate("engine")
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_unset_flags_are_not_checked():
    EngineFlags().validate()
    EngineFlags(max_num_seqs=4096).validate()           # the profile's budget is not known here
    EngineFlags(max_num_batched_tokens=4096, max_num_seqs=4096).validate()


# ---- max_num_batched_tokens >= max_num_seqs: vLLM refuses to start otherwise --------------------
def test_scenario_rejects_budget_below_max_num_seqs():
    s = {"profile": P, "adapters": [{"count": 1, "rank": 8, "rate": 1.0}],
         "engine": {"max_num_seqs": 4096, "max_num_batched_tokens": 2048}}
    with pytest.raises(ScenarioError, match=r"scenario\.engine\.max_num_batched_tokens: 2048 must be >= "
                                            r"max_num_seqs 4096"):
        scenario_from_dict(s)


@pytest.mark.parametrize("engine", [{"max_num_seqs": 4096, "max_num_batched_tokens": 2048},
                                    {"max_num_seqs": 4096}])       # the workload's default budget is 2048
def test_workload_rejects_budget_below_max_num_seqs(engine):
    with pytest.raises(InputError, match=r"workload\.engine\.max_num_batched_tokens: 2048 must be >= "
                                         r"max_num_seqs 4096"):
        workload_from_dict({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1}], "engine": engine})


def test_profile_defaults_are_validated():
    d = profile_to_dict(load_profile(P))
    d["defaults"] = dict(d["defaults"], max_num_seqs=4096)
    with pytest.raises(ScenarioError, match=r"defaults\.max_num_batched_tokens: 2048 must be >= max_num_seqs 4096"):
        profile_from_dict(d)


def test_cli_reports_it_as_bad_input(tmp_path, capsys):
    """`place` used to stop on an AssertionError (a policy "bug"), `simulate` used to accept it."""
    wl = tmp_path / "w.yaml"
    wl.write_text(yaml.safe_dump({"profile": P, "adapters": [{"count": 4, "rank": 8, "rate": 0.1}],
                                  "engine": {"max_num_seqs": 4096, "max_num_batched_tokens": 2048}}))
    assert main(["place", "--workload", str(wl), "--gpus", "2", "--out", str(tmp_path / "out")]) == 2
    assert "max_num_batched_tokens: 2048 must be >= max_num_seqs 4096" in capsys.readouterr().err
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump({"profile": P, "adapters": [{"count": 4, "rank": 8, "rate": 0.1}],
                                  "engine": {"max_num_seqs": 4096, "max_num_batched_tokens": 2048}}))
    assert main(["simulate", str(sc)]) == 2
    assert "max_num_batched_tokens: 2048 must be >= max_num_seqs 4096" in capsys.readouterr().err


def test_workload_file_errors_are_bad_input():
    with pytest.raises(BAD_INPUT):
        workload_from_dict({"profile": P, "adapters": [{"id": "a", "rank": 8}]})
    # the twin's verdict on the evaluation traffic is the workload file's fault too
    with pytest.raises(InputError, match="arrivals.trace: required"):
        workload_from_dict({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1}],
                            "evaluation": {"arrivals": {"process": "trace"}}})


# ---- the scenario builder ----------------------------------------------------------------------
def test_scenario_dict_leaves_out_what_is_not_given():
    assert scenario_dict(P, [{"count": 2, "rank": 8, "rate": 0.5}]) == \
        {"profile": P, "adapters": [{"count": 2, "rank": 8, "rate": 0.5}]}
    sc = build_scenario(P, [{"count": 2, "rank": 8, "rate": 0.5}])
    assert sc.rho == DEFAULT_RHO == Scenario.rho and sc.engine == EngineConfig()


def test_scenario_dict_takes_sections_as_dataclasses():
    cfg = GPUConfig(8, 16, 12, 256, 2048, 0.9, 4096)
    d = scenario_dict(P, [AdapterGroup(rank=8, rate=0.5, id="x")], engine=cfg, lengths="mean",
                      duration_s=60, rho=0.8, seed=3, early_stop=True)
    assert d == {"profile": P, "adapters": [{"rank": 8, "rate": 0.5, "count": 1, "id": "x"}],
                 "engine": dataclasses.asdict(cfg), "lengths": {"source": "mean"},
                 "duration_s": 60, "rho": 0.8, "seed": 3, "early_stop": True}
    assert scenario_from_dict(d) == build_scenario(P, [{"rank": 8, "rate": 0.5, "id": "x"}], engine=cfg,
                                                   lengths=LengthConfig(source="mean"), duration_s=60, rho=0.8,
                                                   seed=3, early_stop=True)


def test_build_scenario_errors_name_where():
    with pytest.raises(ScenarioError, match=r"my check\.duration_s: must be > 0"):
        build_scenario(P, [{"count": 1, "rank": 8, "rate": 1.0}], duration_s=0, where="my check")


def test_evaluation_scenario_uses_the_workload_traffic():
    wl = workload_from_dict({"profile": P, "rho": 0.8, "adapters": [{"id": "a", "rank": 8, "rate": 0}],
                             "evaluation": {"duration_s": 120, "seed": 5}})
    sc = scenario_from_dict(evaluation_scenario(wl, wl.adapters, engine=GPUConfig(1, 8, 1, 256, 2048, 0.9, 4096),
                                                duration_s=30))
    assert (sc.rho, sc.seed, sc.duration_s, sc.engine.max_loras) == (0.8, 5, 30, 1)
    assert sc.adapters[0].rate > 0 and sc.adapters[0].id == "a"


# ---- resolution: twin.flags.resolve_flags, the one place unset flags get their values -----------
def _resolved(engine: dict, ranks=(8,)):
    sc = build_scenario(P, [{"rank": r, "rate": 1.0} for r in ranks], engine=engine)
    return sc.resolved_engine(load_profile(P))


def test_resolved_engine_fills_every_flag_from_the_profile():
    prof, eng = load_profile(P), _resolved({"max_loras": 4}, ranks=(8, 9))
    assert type(eng) is EngineConfig and None not in flag_values(eng).values()
    assert flag_values(eng) == {"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4,
                                "max_num_seqs": prof.defaults.max_num_seqs,
                                "max_num_batched_tokens": prof.defaults.max_num_batched_tokens,
                                "gpu_memory_utilization": prof.defaults.gpu_memory_utilization,
                                "max_model_len": prof.model.max_model_len}


# the release's derived defaults and refusal, per vLLM version: tests/test_flag_rules.py


def test_a_gpu_and_a_scenario_resolve_alike():
    """One resolution: a placement GPU's flags (policies.base.gpu_config) are those of a scenario
    setting the same flags, every other one resolved from the profile the same way."""
    from lora_opt.placement.policies.base import gpu_config
    prof = load_profile(P)
    wl = workload_from_dict({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1}],
                             "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 1024}})
    cfg = gpu_config(wl, prof, [8], 1, 4)
    eng = _resolved({"max_loras": 4, "max_num_seqs": 128, "max_num_batched_tokens": 1024,
                     "gpu_memory_utilization": 0.9})
    assert flag_values(cfg) == flag_values(eng)
    assert flag_values(wl.resolved_engine(prof)) == {**flag_values(cfg), **dict.fromkeys(PER_INSTANCE_FLAGS)}
