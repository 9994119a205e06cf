"""Launch commands per vLLM version, against a real vLLM 0.32 (the tier's CPU build).

* the commands ``lora-opt place --emit-vllm --vllm-version 0.32`` writes parse with vLLM 0.32's own parser,
  and the 0.33 commands do not (the first-contact failure: ``--disable-prefix-caching``);
* the emitted command of a placement for the tier's model starts the real server with only the port and
  the CPU backend's block size changed, and ``/v1/models`` lists every adapter of the placement;
* the recorded 0.32 option table is the tier's parser's (re-dumped and compared).
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from real_vllm_tier import ROOT, free_port, tier_env

from lora_opt.probe.launch import read_launch

DUMP = ROOT / "tools" / "vllm_tier" / "dump_serve_args.py"


def _workload(tier: dict, path: Path) -> Path:
    lines = ["profile: llama-3.1-8b-h100-64gb", "adapters:"]
    for name, a in tier["adapters"].items():
        lines.append(f"  - {{id: {name}, rank: {a['rank']}, rate: 0.2, path: {a['path']}}}")
    lines += ["engine:", "  max_model_len: 512", "  max_num_seqs: 16", "  max_num_batched_tokens: 512"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _place(tier: dict, tmp_path: Path, version: str) -> Path:
    out = tmp_path / f"place-{version}"
    cmd = [sys.executable, "-m", "lora_opt", "place", "--workload", str(_workload(tier, tmp_path / "w.yaml")),
           "--gpus", "1", "--emit-vllm", "--vllm-version", version, "--model", tier["model"],
           "--verify-s", "0", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out / "vllm" / "serve_commands.txt"


def _vllm_parses(tier: dict, command_line: str) -> subprocess.CompletedProcess:
    cmd = read_launch(command_line)
    argv = cmd.argv()
    return subprocess.run([str(Path(tier["bin"]) / "python"), str(DUMP), "--check", *argv],
                          capture_output=True, text=True, timeout=120, env=tier_env(tier))


@pytest.fixture(scope="module")
def emitted(tier, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    return {v: _place(tier, tmp, v) for v in ("0.32", "0.33")}


def test_recorded_032_table_is_the_tiers_parser(tier, tmp_path):
    out = tmp_path / "dumped.json"
    r = subprocess.run([str(Path(tier["bin"]) / "python"), str(DUMP), str(out)], capture_output=True, text=True,
                       timeout=120, env=tier_env(tier))
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = json.loads((ROOT / "data" / "reference" / "vllm_serve_args-0.32.0.json").read_text())
    assert json.loads(out.read_text()) == recorded


def test_emitted_commands_parse_with_their_versions_parser(tier, emitted):
    line32 = emitted["0.32"].read_text().splitlines()[0]
    line33 = emitted["0.33"].read_text().splitlines()[0]
    assert "--no-enable-prefix-caching" in line32 and "--disable-prefix-caching" in line33
    ok = _vllm_parses(tier, line32)
    assert ok.returncode == 0, ok.stderr[-2000:]
    refused = _vllm_parses(tier, line33)         # 0.33's spelling: what first contact hit
    assert refused.returncode == 2 and "unrecognized arguments: --disable-prefix-caching" in refused.stderr


def test_emitted_command_starts_real_vllm_with_every_adapter(tier, emitted, launch_vllm):
    cmd = read_launch(str(emitted["0.32"]), 0)
    # only the port (tests pick a free one) and the CPU backend's block size (a multiple of 32 there;
    # --block-size 16 is refused on CPU: "No common block size for 16") change
    changed = cmd.with_options(port=free_port(), block_size=128)
    assert {k: v for k, v in changed.options.items() if k not in ("--port", "--block-size")} == \
        {k: v for k, v in cmd.options.items() if k not in ("--port", "--block-size")}
    changed.env.update(tier_env(tier))
    server = launch_vllm(changed)
    try:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
            cards = json.load(r)["data"]
        served = [c["id"] for c in cards]
        placed = [v.split("=", 1)[0] for v in cmd.options["--lora-modules"]]
        assert sorted(placed) == sorted(tier["adapters"])
        assert served[0] == tier["model"] and served[1:] == placed
        assert all(c["root"] == tier["adapters"][c["id"]]["path"] for c in cards[1:])
    finally:
        server.stop()
