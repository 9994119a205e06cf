"""Workload files: parsing, groups, errors that name the field."""
import pytest

from lora_opt.placement.workload_file import load_workload, workload_from_dict
from lora_opt.errors import InputError
from twin.paths import CONFIGS_DIR

P = "llama-3.1-8b-h100-64gb"


def test_bundled_example_loads():
    wl = load_workload(CONFIGS_DIR / "workloads" / "example.yaml")
    assert wl.name == "example" and len(wl.adapters) == 941
    assert wl.adapters[0].id == "support-bot" and wl.adapters[0].path == "/models/lora/support-bot"
    assert wl.adapters[1].id == "chat-r8-0" and wl.adapters[1].path == "/models/lora/chat-r8-0"
    assert abs(wl.total_rate - 26.0) < 1e-9


def test_groups_expand_with_default_prefix():
    wl = workload_from_dict({"profile": P, "adapters": [{"count": 3, "rank": 8, "rate": 0.1}]})
    assert [a.id for a in wl.adapters] == ["g0-0", "g0-1", "g0-2"]


@pytest.mark.parametrize("data, match", [
    ({"adapters": [{"id": "a", "rank": 8, "rate": 1}]}, r"profile: required"),
    ({"profile": P}, r"adapters: at least one"),
    ({"profile": P, "adapters": [{"id": "a", "rank": 7000, "rate": 1}]}, r"adapters\[0\]\.rank: 7000 outside"),
    ({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": -1}]}, r"adapters\[0\]\.rate: must be >= 0"),
    ({"profile": P, "adapters": [{"id": "a", "rank": 8}]}, r"adapters\[0\]\.rate: required"),
    ({"profile": P, "adapters": [{"id": "a b", "rank": 8, "rate": 1}]}, r"adapters\[0\]\.id"),
    ({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1, "colour": 1}]}, r"unknown field\(s\) \['colour'\]"),
    ({"profile": P, "adapters": [{"id": "a", "rank": 8, "rate": 1}, {"id": "a", "rank": 8, "rate": 1}]},
     r"duplicate adapter id 'a'"),
    ({"profile": P, "adapters": [{"count": 0, "rank": 8, "rate": 1}]}, r"count: must be >= 1"),
    ({"profile": P, "adapters": [{"count": 2, "rank": 8, "rate": 1, "path_template": "/m"}]}, r"path_template"),
    ({"profile": P, "rho": 1.5, "adapters": [{"id": "a", "rank": 8, "rate": 1}]}, r"rho: must be in \(0, 1\]"),
    ({"profile": P, "engine": {"gpu_memory_utilization": 2}, "adapters": [{"id": "a", "rank": 8, "rate": 1}]},
     r"engine.gpu_memory_utilization"),
    ({"profile": P, "engine": {"max_num_seqs": 4096}, "adapters": [{"id": "a", "rank": 8, "rate": 1}]},
     r"engine.max_num_batched_tokens: 2048 must be >= max_num_seqs 4096"),
    ({"profile": P, "evaluation": {"arrivals": {"process": "bursty"}}, "adapters": [{"id": "a", "rank": 8, "rate": 1}]},
     r"arrivals.process: 'bursty' is not allowed; allowed values: poisson"),
    ({"profile": "no-such-gpu", "adapters": [{"id": "a", "rank": 8, "rate": 1}]}, r"unknown profile 'no-such-gpu'"),
])
def test_errors_name_the_field(data, match):
    with pytest.raises(InputError, match=match):
        workload_from_dict(data)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_workload(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("adapters: [ {id: a\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_workload(bad)
