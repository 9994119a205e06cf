"""The real-vLLM test tier's plain helpers (no fixtures): where the tier is, its manifest, and the
``vllm serve`` command and environment of a server of its model.  Test modules import these as
``from real_vllm_tier import ...`` (a unique module name: ``conftest`` is ambiguous between tests/ and
this folder); the fixtures are in this folder's conftest.py.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
from pathlib import Path

from lora_opt.probe.launch import LaunchedServer, ServeCommand

ROOT = Path(__file__).resolve().parents[2]
BUILD_HINT = "build the real-vLLM tier first: bash tools/vllm_tier/build.sh (2-4 minutes, its own venv)"
#: wall seconds for a real vLLM (CPU build, tiny model) to answer /health: 45-90 s on a 2-core machine,
#: more while the other core is busy with a test's client
HEALTH_TIMEOUT_S = 420.0


def tier_dir() -> Path:
    return Path(os.environ.get("LORA_OPT_VLLM_TIER") or ROOT / ".vllm-tier")


def load_tier() -> dict | None:
    """The tier's manifest (``tier.json``, see tools/vllm_tier/make_assets.py) plus ``bin`` (its venv's
    bin folder) and ``dir``; None when the tier is not built."""
    manifest = tier_dir() / "tier.json"
    if not manifest.is_file() or not (tier_dir() / "venv" / "bin" / "vllm").exists():
        return None
    tier = json.loads(manifest.read_text())
    tier["bin"] = str(tier_dir() / "venv" / "bin")
    tier["dir"] = str(tier_dir())
    return tier


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tier_env(tier: dict) -> dict[str, str]:
    """The environment a real vLLM of the tier runs with: the tier venv first on PATH (its ``vllm``),
    the CPU platform, 1 GiB of KV space, runtime LoRA updates on, no usage reporting, no hub."""
    return {
        "PATH": tier["bin"] + os.pathsep + os.environ.get("PATH", ""),
        "VIRTUAL_ENV": str(Path(tier["bin"]).parent),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": "",
    }


def tier_command(tier: dict, *, adapters=None, max_loras: int = 2, max_lora_rank: int = 32,
                 max_cpu_loras: int = 4, max_model_len: int = 512, max_num_seqs: int = 16,
                 extra: dict | None = None, port: int | None = None) -> ServeCommand:
    """A ``vllm serve`` command for the tier's model (``adapters``: names from the tier, default all;
    ``extra``: more options, ``{"--flag": [values]}``, ``[]`` for a flag without a value)."""
    names = list(tier["adapters"]) if adapters is None else list(adapters)
    options = {
        "--served-model-name": [tier["served_model_name"]],
        "--host": ["127.0.0.1"], "--port": [str(port or free_port())],
        "--max-model-len": [str(max_model_len)], "--max-num-seqs": [str(max_num_seqs)],
        "--enforce-eager": [], "--dtype": ["bfloat16"],
    }
    if names or max_loras:
        options.update({"--enable-lora": [], "--max-loras": [str(max_loras)],
                        "--max-lora-rank": [str(max_lora_rank)], "--max-cpu-loras": [str(max_cpu_loras)]})
    if names:
        options["--lora-modules"] = [f"{n}={tier['adapters'][n]['path']}" for n in names]
    options.update(extra or {})
    return ServeCommand(tier_env(tier), tier["model"], options)


#: the twin profile behind the tests' emulators (its step costs only; the API follows --vllm-version)
EMULATOR_PROFILE = "llama-3.1-8b-h100-64gb"
#: options of a tier server that ``lora-opt emulate`` does not take (the CPU build's own)
CPU_BUILD_OPTIONS = ("--enforce-eager", "--dtype")


def start_emulator_like(tier: dict, cmd: ServeCommand, log_path: Path, *, adapters=None,
                        speed: float | None = None) -> LaunchedServer:
    """``lora-opt emulate`` started with a real tier server's own ``vllm serve`` options, the way
    ``probe --launch --server-cmd`` starts one (what it implies dropped), on a free port, with the tier's
    model directory (vocabulary, tokenizer, chat template) and the tier's vLLM version; ``adapters``:
    the ``--lora-modules`` names in this order (default: the command's).  Started (healthy) or fails."""
    if adapters is not None:
        paths = dict(m.split("=", 1) for m in cmd.options.get("--lora-modules", []))
        cmd = cmd.with_options(lora_modules=[f"{a}={paths[a]}" for a in adapters])
    cmd = cmd.with_options(drop=CPU_BUILD_OPTIONS, port=free_port())
    head = [sys.executable, "-m", "lora_opt.cli", "emulate", "--profile", EMULATOR_PROFILE,
            "--model", tier["model"], "--vllm-version", tier["vllm_version"]]
    if speed is not None:
        head += ["--speed", str(speed)]
    server = LaunchedServer(cmd, server_cmd=shlex.join(head), log_path=log_path, health_timeout_s=120)
    if not server.start():
        raise AssertionError(f"lora-opt emulate did not start (exit {server.exit_code}): {server.log_tail(15)}")
    return server
