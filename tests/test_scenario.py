"""Scenario validation: bad input gets an error naming the field and the allowed values."""
import json

import pytest

from small_scenarios import small_scenario
from twin import ScenarioError, load_scenario, scenario_from_dict
from twin.paths import SCENARIOS_DIR


def test_bundled_example_loads():
    sc = load_scenario(SCENARIOS_DIR / "example.yaml")
    ids, ranks, rates = sc.adapter_table()
    assert len(ids) == 128 and set(ranks) == {8, 16}


def test_json_accepted(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(small_scenario()))
    assert load_scenario(p).duration_s == 60


@pytest.mark.parametrize("mutate, words", [
    (lambda s: s.update(bogus=1), ["unknown field", "bogus", "allowed"]),
    (lambda s: s["engine"].update(colour="red"), ["engine", "colour", "allowed"]),
    (lambda s: s["engine"].update(max_lora_rank=7), ["max_lora_rank", "1, 8, 16, 32, 64, 128, 256, 320, 512"]),
    (lambda s: s["adapters"].__setitem__(0, {"count": 1, "rank": 1024, "rate": 1}), ["rank", "1024"]),
    (lambda s: s["engine"].update(max_lora_rank=8), ["max_lora_rank", "below adapter rank 16"]),
    (lambda s: s["engine"].update(max_cpu_loras=2), ["max_cpu_loras", ">= max_loras"]),
    (lambda s: s["engine"].update(max_num_seqs=1024), ["engine.max_num_batched_tokens", ">= max_num_seqs 1024"]),
    (lambda s: s["adapters"].__setitem__(0, {"count": 1, "rank": 8, "rate": 0}), ["adapters[0].rate", "> 0"]),
    (lambda s: s["adapters"].__setitem__(0, {"count": 1, "rank": 8, "rate": -2}), ["rate", "> 0"]),
    (lambda s: s.update(adapters=[]), ["adapters", "at least one"]),
    (lambda s: s.update(arrivals={"process": "bursty"}), ["arrivals.process", "poisson, lognormal, nonstationary, trace"]),
    (lambda s: s.update(lengths={"source": "books"}), ["lengths.source", "sharegpt"]),
    (lambda s: s.update(rho=1.5), ["rho", "(0, 1]"]),
    (lambda s: s.update(duration_s=0), ["duration_s", "> 0"]),
    (lambda s: s["engine"].update(gpu_memory_utilization=1.2), ["gpu_memory_utilization"]),
    (lambda s: s["engine"].update(max_loras="many"), ["max_loras", "integer"]),
    (lambda s: s.update(arrivals={"process": "trace"}), ["arrivals.trace", "azure-code"]),
    (lambda s: s.update(profile="gpt-9"), ["unknown profile", "llama-3.1-8b-h100-64gb"]),
])
def test_bad_input_names_field(mutate, words):
    s = small_scenario()
    mutate(s)
    with pytest.raises(ScenarioError) as err:
        sc = scenario_from_dict(s)
        sc.load_profile()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_malformed_trace_names_line(tmp_path):
    from twin import simulate
    p = tmp_path / "trace.csv"
    p.write_text("timestamp_ms,input_length,output_length\n0,10,5\n100,12,x\n")
    sc = scenario_from_dict(small_scenario(arrivals={"process": "trace", "trace": str(p)}))
    with pytest.raises(ScenarioError, match="line 3.*output_length"):
        simulate(sc)


def test_trace_with_unknown_header(tmp_path):
    from twin import simulate
    p = tmp_path / "trace.csv"
    p.write_text("when,a,b\n0,1,2\n")
    sc = scenario_from_dict(small_scenario(arrivals={"process": "trace", "trace": str(p)}))
    with pytest.raises(ScenarioError, match="no known layout"):
        simulate(sc)
