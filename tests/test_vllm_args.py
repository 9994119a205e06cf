"""The ``vllm serve`` arguments lora-opt emits, for adapter ids and paths at the edges of the id rule
(``twin.parsing.check_adapter_id`` / ``check_adapter_path``), against vLLM 0.33's parser (issue 12).

Two checks of the same commands:

* always: every emitted option exists in the option table dumped from vLLM 0.33.0's own parser
  (``data/reference/vllm_serve_args-0.33.0.json``, provenance in data/README.md) with a value of its
  type and choices, each ``--lora-modules`` value reads back as the intended ``name=path``, and the
  shell line written to ``serve_commands.txt`` splits back into the same argv;
* where the ``[vllm]`` extra is installed: vLLM's parser itself
  (``vllm.entrypoints.common.cli_args.make_arg_parser``, ``VLLM_TARGET_DEVICE=cpu``) parses them to
  the same adapters -- and refuses or misreads what the id rule refuses.
"""
from __future__ import annotations

import importlib.util
import json
import shlex

import pytest

from lora_opt.placement.plan import Adapter, GPUConfig, Placement
from lora_opt.placement.report import write_outputs
from lora_opt.errors import InputError
from lora_opt.placement.vllm_launch import (PINNED_SWITCHES, SERVE_ARG_TABLES, release_of, resolve_vllm_version,
                                            serve_arg_table, serve_command, serve_options, switch_spelling,
                                            validate_serve_args)
from twin import ScenarioError
from twin.flags import DEFAULT_VLLM_VERSION
from twin.parsing import MAX_ID_CHARS, MAX_PATH_CHARS, check_adapter_id, check_adapter_path
from twin.profile import load_profile

PROFILE = load_profile("llama-3.1-8b-h100-64gb")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

#: ids the rule accepts, each at one of its edges: length 1 and the maximum, a trailing '-', single
#: dots (never '..'), '/', shell metacharacters (the lines are shell-quoted), non-ASCII letters,
#: JSON-looking braces (the value keeps its '=': vLLM never takes the JSON path), '@' and a digit first
EDGE_IDS = ["a", "x" * MAX_ID_CHARS, "a-", "_", ".a", "a.", "a.b.c", "org/name", "a'b", 'a"b', "a$(id)",
            "a;b", "a|b&c", "a:b", "a{b}", "[a]", "a\\b", "ü-adapter", "日本", "@a", "1", "a%20b", "a*?"]
#: paths the rule accepts: spaces, '.' and '...' components (not '..'), a hub id, a trailing '/',
#: a URL-like one, backslashes, non-ASCII, '~' (not expanded: quoted), the maximum length
EDGE_PATHS = ["/m/a b", "/m/./a", "/m/.../a", "org/name", "/m/a/", "s3://bucket/a", "C:\\m\\a", "/m/ü",
              "~/a", "/m/$HOME", "/" + "p" * (MAX_PATH_CHARS - 1), None]
#: what the rule refuses, with the reason vLLM (or the shell line) would go wrong
REFUSED_IDS = ["a=b", "a,b", "-a", "--a", "a b", "a\tb", "a\nb", "..", "a..b", "", "a\x00b", "a\u2028b"]
REFUSED_PATHS = ["/m/../a", "../a", "/m/a=b", "/m/a,b", "-p", "/m/a\nb", "/m/a\rb", "", "/m/a\x1bb"]


def _gpu() -> GPUConfig:
    return GPUConfig(max_loras=16, max_lora_rank=16, max_cpu_loras=32, max_num_seqs=256,
                     max_num_batched_tokens=2048, gpu_memory_utilization=0.9, max_model_len=8192)


def _placement(ids: list[str], paths: list[str | None]) -> Placement:
    adapters = [Adapter(a, 8, 0.1, path=p) for a, p in zip(ids, paths)]
    return Placement(profile="llama-3.1-8b-h100-64gb", adapters=adapters, gpus=[_gpu()],
                     routes={a.id: [(0, 1.0)] for a in adapters}, policy="test")


def _edge_placements() -> list[Placement]:
    """Every edge id and every edge path, on one GPU each (at most 16 adapters per GPU)."""
    pairs = [(aid, EDGE_PATHS[k % len(EDGE_PATHS)]) for k, aid in enumerate(EDGE_IDS)]
    pairs += [(f"p{k}", path) for k, path in enumerate(EDGE_PATHS)]
    return [_placement([a for a, _ in pairs[i:i + 16]], [p for _, p in pairs[i:i + 16]])
            for i in range(0, len(pairs), 16)]


def _modules(argv: list[str]) -> list[str]:
    i = argv.index("--lora-modules")
    return argv[i + 1:]


def test_the_edge_cases_are_accepted_by_the_rule():
    for aid in EDGE_IDS:
        assert check_adapter_id(aid, "id") == aid
    for path in EDGE_PATHS:
        assert path is None or check_adapter_path(path, "path") == path


@pytest.mark.parametrize("release", list(SERVE_ARG_TABLES))
def test_recorded_tables_are_their_releases(release):
    doc = serve_arg_table(release)
    assert release_of(doc["vllm"]) == release and len(doc["options"]) > 300
    for name in ("--lora-modules", "--max-loras", "--enable-lora", "--max-lora-rank"):
        assert name in serve_options(release)


@pytest.mark.parametrize("release", list(SERVE_ARG_TABLES))
def test_emitted_arguments_match_the_recorded_option_table(release):
    """Each emitted option exists in the release's table, with a value of its type/choices (flags
    without one); each --lora-modules value is the adapter's name=path as vLLM splits it."""
    opts = serve_options(release)
    for p in _edge_placements():
        argv = serve_command(p, 0, MODEL, vllm_version=release)
        assert validate_serve_args(argv, release) == [], validate_serve_args(argv, release)
        for arg in argv[3:]:
            if arg.startswith("--"):
                assert arg in opts, arg
        expected = [(a.id, a.path or f"adapters/{a.id}") for a in p.adapters]
        assert [tuple(v.split("=")) for v in _modules(argv)] == expected      # vLLM: name, path = v.split("=")
        assert all("," not in v for v in _modules(argv))                      # ',' would send it down JSON


def test_switch_spellings_follow_each_releases_parser():
    """Prefix caching off: 0.32's parser has only --no-enable-prefix-caching, the recorded 0.33 table only
    --disable-prefix-caching (its EnableDisableAction pairing), so each release gets its own; async
    scheduling off has one spelling valid in both, and both get it."""
    assert switch_spelling(PINNED_SWITCHES[0], "0.32") == "--no-enable-prefix-caching"
    assert switch_spelling(PINNED_SWITCHES[0], "0.33") == "--disable-prefix-caching"
    assert {switch_spelling(PINNED_SWITCHES[1], v) for v in SERVE_ARG_TABLES} == {"--no-async-scheduling"}
    p = _placement(["a"], [None])
    assert validate_serve_args(serve_command(p, 0, MODEL, vllm_version="0.33"), "0.32") == \
        ["unknown option --disable-prefix-caching"]


def test_release_resolution():
    assert resolve_vllm_version(None) == DEFAULT_VLLM_VERSION
    assert resolve_vllm_version(None, "0.8.5") == DEFAULT_VLLM_VERSION      # no table for 0.8.5: the newest
    assert resolve_vllm_version(None, "0.32.0") == "0.32"
    assert resolve_vllm_version("0.32.0+cpu", "0.33.0") == "0.32"           # the flag wins
    with pytest.raises(InputError, match=r"--vllm-version: '0.8.5': lora-opt has vllm serve option tables for "
                                         r"0.32, 0.33"):
        resolve_vllm_version("0.8.5", error=InputError)


def test_place_refuses_an_unknown_vllm_version(tmp_path):
    from lora_opt.cli import main
    assert main(["place", "--workload", "example", "--gpus", "4", "--emit-vllm", "--vllm-version", "9.9",
                 "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_serve_commands_file_keeps_one_command_per_gpu_that_splits_back(tmp_path):
    """The files an operator runs: one line per GPU, and the shell reads back the argv lora-opt checked."""
    ids, paths = EDGE_IDS[:16], [EDGE_PATHS[k % len(EDGE_PATHS)] for k in range(16)]
    p = Placement(profile="llama-3.1-8b-h100-64gb", adapters=[Adapter(a, 8, 0.1, path=q) for a, q in zip(ids, paths)],
                  gpus=[_gpu(), _gpu()], routes={a: [(k % 2, 1.0)] for k, a in enumerate(ids)}, policy="test")
    write_outputs(p, PROFILE, tmp_path, emit_vllm=True, model=MODEL)
    lines = (tmp_path / "vllm" / "serve_commands.txt").read_text().splitlines()
    assert len(lines) == 2
    for gpu, line in enumerate(lines):
        words = shlex.split(line)
        assert words[0] == f"CUDA_VISIBLE_DEVICES={gpu}"
        assert words[1:] == serve_command(p, gpu, MODEL, port=8000 + gpu)
        assert validate_serve_args(words[1:]) == []


@pytest.mark.parametrize("aid", REFUSED_IDS)
def test_refused_ids_never_reach_a_command(aid):
    with pytest.raises(ScenarioError, match="adapter id"):
        serve_command(_placement(["ok", aid], [None, None]), 0, MODEL)


@pytest.mark.parametrize("path", REFUSED_PATHS)
def test_refused_paths_never_reach_a_command(path):
    with pytest.raises(ScenarioError, match="adapter path"):
        serve_command(_placement(["ok"], [path]), 0, MODEL)


@pytest.mark.parametrize("value, words", [("a=b=c", "more than one '='"), ("a,b=c", "JSON"), ("ab", "JSON"),
                                          ("=p", "empty name"), ("a=", "empty name")])
def test_recorded_check_reads_lora_modules_as_vllm_does(value, words):
    assert any(words in q for q in validate_serve_args(["vllm", "serve", MODEL, "--lora-modules", value]))


def _vllm_parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser  # optional extra: vLLM's own parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # optional extra
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser  # optional extra
    return make_arg_parser(FlexibleArgumentParser())


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (the optional [vllm] extra; never installed by CI)")


@needs_vllm
def test_edge_commands_parse_with_vllms_own_parser(monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    parser = _vllm_parser()
    for p in _edge_placements():
        argv = serve_command(p, 0, MODEL)
        args = parser.parse_args(argv[3:] + ["--model", argv[2]])
        assert args.enable_lora and args.max_loras == 16
        got = [(m.name, m.path) for m in args.lora_modules]
        assert got == [(a.id, a.path or f"adapters/{a.id}") for a in p.adapters]


@needs_vllm
@pytest.mark.parametrize("value", ["a=b=c", "a,b=/m/a", "a=/m/a,b"])
def test_vllms_parser_refuses_what_the_rule_refuses(monkeypatch, value):
    """Values the id rule keeps off the command line: vLLM's parser errors (two '=', or a ',' that
    sends the value down its JSON path, where it is not JSON: ``parser.error``, a SystemExit).  Two
    '=' raise the ValueError of ``name, path = item.split("=")`` in ``LoRAParserAction`` (read in
    vLLM's source; not run here: vLLM is not installed)."""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    with pytest.raises((SystemExit, ValueError)):
        _vllm_parser().parse_args(["--model", MODEL, "--enable-lora", "--lora-modules", value])
