"""The placement model, its independent checker, and vLLM 0.33 launch commands."""
import importlib.util

import pytest

from lora_opt.placement.plan import Adapter, GPUConfig, Placement, PlacementError, check_placement, placement_problems
from lora_opt.placement.vllm_launch import check_serve_args, router_table, serve_command, validate_serve_args
from twin import ScenarioError
from twin.profile import load_profile

PROFILE = load_profile("llama-3.1-8b-h100-64gb")


def _gpu(**over):
    g = dict(max_loras=16, max_lora_rank=16, max_cpu_loras=32, max_num_seqs=256, max_num_batched_tokens=2048,
             gpu_memory_utilization=0.9, max_model_len=8192)
    g.update(over)
    return GPUConfig(**g)


def _placement(**over):
    adapters = [Adapter("a", 8, 0.5), Adapter("b", 16, 0.2, path="/models/b"), Adapter("c", 16, 1.0)]
    p = dict(profile="llama-3.1-8b-h100-64gb", adapters=adapters, gpus=[_gpu(), _gpu()],
             routes={"a": [(0, 1.0)], "b": [(0, 1.0)], "c": [(0, 0.25), (1, 0.75)]}, policy="test")
    p.update(over)
    return Placement(**p)


def test_valid_placement_round_trips(tmp_path):
    p = _placement()
    check_placement(p, PROFILE)
    p.save(tmp_path / "placement.json")
    q = Placement.load(tmp_path / "placement.json")
    assert q.to_dict() == p.to_dict()
    assert [a.id for a in q.adapters_on(1)] == ["c"]


@pytest.mark.parametrize("over, words", [
    ({"routes": {"a": [(0, 1.0)], "b": [(0, 1.0)]}}, "adapter c: not routed"),
    ({"routes": {"a": [(0, 1.0)], "b": [(0, 1.0)], "c": [(0, 0.5), (1, 0.2)]}}, "sum to 1"),
    ({"routes": {"a": [(0, 1.0)], "b": [(3, 1.0)], "c": [(0, 1.0)]}}, "does not exist"),
    ({"gpus": [_gpu(max_lora_rank=8), _gpu()]}, "rank 16 > max_lora_rank 8"),
    ({"gpus": [_gpu(max_cpu_loras=4), _gpu()]}, "max_cpu_loras 4 < max_loras 16"),
    ({"gpus": [_gpu(max_loras=384, max_lora_rank=32, max_cpu_loras=384), _gpu()]}, "would not start"),
    ({"gpus": [_gpu(max_lora_rank=24), _gpu()]}, "not in"),
])
def test_checker_names_every_problem(over, words):
    p = _placement(**over)
    assert any(words in s for s in placement_problems(p, PROFILE)), placement_problems(p, PROFILE)
    with pytest.raises(PlacementError, match="not deployable"):
        check_placement(p, PROFILE)


def test_serve_commands_use_vllm_033_flags():
    p = _placement()
    for gpu in range(2):
        argv = serve_command(p, gpu, "meta-llama/Llama-3.1-8B-Instruct", port=8000 + gpu)
        assert validate_serve_args(argv) == []
        for flag in ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules",
                     "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization"):
            assert flag in argv
    assert "b=/models/b" in serve_command(p, 0, "m")
    table = router_table(p)
    assert table["c"] == [{"endpoint": "http://127.0.0.1:8000/v1", "weight": 0.25},
                          {"endpoint": "http://127.0.0.1:8001/v1", "weight": 0.75}]


@pytest.mark.parametrize("bad, words", [
    (["--max-lora-rank", "7"], "not one of"),
    (["--no-such-flag"], "unknown option"),
    (["--enable-lora", "yes"], "takes no value"),
    (["--max-loras", "many"], "not an integer"),
    (["--no-enable-prefix-caching"], "unknown option"),   # 0.33 spells it --disable-prefix-caching
])
def test_recorded_parser_rejects_bad_commands(bad, words):
    argv = ["vllm", "serve", "m", *bad]
    assert any(words in s for s in validate_serve_args(argv))
    with pytest.raises(ScenarioError):
        check_serve_args(argv)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (the [vllm] extra)")
def test_commands_parse_with_vllms_own_parser(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.common.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
    argv = serve_command(_placement(), 0, "meta-llama/Llama-3.1-8B-Instruct")
    args = parser.parse_args(argv[3:] + ["--model", argv[2]])
    assert args.max_loras == 16 and args.enable_lora
