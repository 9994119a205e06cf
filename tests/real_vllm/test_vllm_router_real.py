"""vLLM's own router (PyPI ``vllm-router`` 0.1.17, the optional extra ``lora-opt[router]``) in front of two
real vLLM instances (the tier's CPU build and tiny model): its ``round_robin`` splits a stream evenly and
every request is answered -- the real-server side of ``experiments/fleet_router/vllm_router_real.py``.

The ``vllm-router`` executable: $VLLM_ROUTER_BIN, PATH, this Python's bin, or the tier's own
(``tools/vllm_tier/build.sh`` installs it in TIER/router-venv); skipped where none is found, except under CI."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from real_vllm_tier import free_port, tier_command, tier_dir

from lora_opt.probe.launch import ServeCommand

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = ["r8-a", "r16-a"]


def router_binary() -> str | None:
    found = os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router")
    candidates = [Path(sys.executable).parent / "vllm-router", tier_dir() / "router-venv" / "bin" / "vllm-router"]
    return found or next((str(c) for c in candidates if c.exists()), None)


def _helpers():
    """The vllm-router experiments' shared helpers, experiments/fleet_router/router_common.py (a script
    folder, not a package)."""
    path = ROOT / "experiments" / "fleet_router" / "router_common.py"
    spec = importlib.util.spec_from_file_location("fleet_router_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vllm_router_round_robin_in_front_of_two_real_instances(tier, launch_vllm):
    """30 requests through vllm-router ``round_robin`` to two real vLLM instances (instance i's forward
    passes on core i): all answered 200 with their tokens, 15 served by each instance (its
    ``vllm:request_success_total``), as the fleet twin's ``round-robin`` splits the same stream."""
    binary = router_binary()
    if binary is None:
        why = "vllm-router is not installed: pip install 'lora-opt[router]' (or set VLLM_ROUTER_BIN)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI installs it (.ci/run: the README's test command, extras dev and router)")
        pytest.skip(why)
    vr_mod = _helpers()
    from lora_opt.emulate.client import replay
    from twin.workload import Requests
    cores = sorted(os.sched_getaffinity(0))
    servers = []
    for i in range(2):
        cmd = tier_command(tier, adapters=ADAPTERS, max_num_seqs=8)
        cmd = ServeCommand({**cmd.env, "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}, cmd.model, cmd.options)
        servers.append(launch_vllm(cmd))
    urls = [f"http://127.0.0.1:{s.cmd.port}" for s in servers]
    port = free_port()
    n = 30
    req = Requests(arrival=np.arange(n) * 0.2, adapter=np.arange(n) % len(ADAPTERS),
                   in_len=np.full(n, 32), out_len=np.full(n, 8))
    router = vr_mod.start_router(binary, port, urls, "round_robin", Path(tempfile.mkdtemp()) / "router.log")
    try:
        before = vr_mod.served(urls)
        records = asyncio.run(replay(f"http://127.0.0.1:{port}", req, ADAPTERS, 1.0, count_token_ids=True))
        counts = vr_mod.served(urls) - before
    finally:
        vr_mod.stop(router)
        for s in servers:
            s.stop()
    assert [r.status for r in records] == [200] * n
    assert all(len(r.token_times) == r.out_len for r in records)
    assert counts.tolist() == [n // 2, n // 2]
