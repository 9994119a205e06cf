"""The real-vLLM CPU tier as the loop's scripts use it (``cpu_loop.py`` and the checks beside it): where
the tier and its outputs live, the real server's launch settings and environment, and the helpers every
stage shares (one lora-opt command as a user runs it, the probe's launch line, repository-relative paths).

Pinning: the engine's forward passes on :data:`ENGINE_CORE`; the scripts, the clients and vLLM's API server
and engine-core processes on :data:`CLIENT_CORE`.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from lora_opt.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]

PROFILE = "probe-llama-cpu-vllm032"
PROFILE_PATH = ROOT / "configs" / "profiles" / f"{PROFILE}.yaml"
MODEL_ENTRY = "probe-llama"
OUT = ROOT / "experiments" / "real_validation" / "cpu"
#: the real server's launch settings shared by the probe and every validation instance
MAX_MODEL_LEN, BLOCK_SIZE, KV_GIB = 2048, 128, 1
CLIENT_CORE, ENGINE_CORE = 1, 0


def tier_dir() -> Path:
    return Path(os.environ.get("LORA_OPT_VLLM_TIER") or ROOT / ".vllm-tier")


def load_probe_tier() -> dict:
    manifest = tier_dir() / "tier-probe.json"
    if not manifest.is_file():
        raise SystemExit("the probe-size model is not built: LORA_OPT_VLLM_TIER_PROBE=1 bash tools/vllm_tier/build.sh")
    return json.loads(manifest.read_text())


def server_env(core: int = ENGINE_CORE) -> dict[str, str]:
    """The environment of every real server: the tier venv's vllm, the CPU platform with KV_GIB of KV cache,
    runtime LoRA updates, forward passes on ``core``, nothing reported or fetched."""
    venv = tier_dir() / "venv"
    return {"PATH": f"{venv / 'bin'}:$PATH", "VIRTUAL_ENV": str(venv),
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": ""}


def env_prefix() -> str:
    """``VAR=VALUE ...`` as the launch line's prefix (``$PATH`` left for the launcher to expand, as a shell does)."""
    return " ".join(f"{k}={v if k == 'PATH' else shlex.quote(v)}" for k, v in server_env().items())


def lora_opt(*args: str, log: Path) -> int:
    """One lora-opt command, as a user runs it; its output to ``log``; its exit status."""
    argv = [sys.executable, "-m", "lora_opt.cli", *args]
    print("$ lora-opt " + shlex.join(args), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    log.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(log, proc.stdout)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip() and "\r" not in ln][-4:]
    print("\n".join("  " + ln for ln in tail) + f"\n  ({time.perf_counter() - t0:.0f} s, exit {proc.returncode})",
          flush=True)
    return proc.returncode


def probe_command(tier: dict) -> str:
    """The probe's launch line: the tier's model as every validation instance serves it."""
    return (f"{env_prefix()} vllm serve {tier['model']} --served-model-name {tier['served_model_name']} "
            f"--host 127.0.0.1 --port 18510 --max-model-len {MAX_MODEL_LEN} --max-num-seqs 64 "
            f"--max-num-batched-tokens 2048 --enforce-eager --dtype bfloat16 --block-size {BLOCK_SIZE} "
            "--no-enable-prefix-caching --enable-lora --max-loras 2 --max-lora-rank 32 --max-cpu-loras 4")


def rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (what the profile's fit.command records)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)
