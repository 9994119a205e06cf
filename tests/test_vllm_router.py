"""vLLM's own router (PyPI ``vllm-router`` 0.1.17, the optional extra ``lora-opt[router]``) in front of
emulated instances vs the fleet twin: ``experiments/fleet_router/vllm_router.py`` on a short stream.

Skipped unless the ``vllm-router`` executable is found ($VLLM_ROUTER_BIN, PATH, this Python's bin, or the
real-vLLM tier's, which tools/vllm_tier/build.sh installs: CI runs this test)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_router_health import _vllm_router_binary as router_binary

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_vllm_router_in_front_of_emulated_instances_vs_the_fleet_twin(tmp_path):
    """Per policy: vllm-router's measured shares and latencies vs the fleet twin replaying what the
    router did (round_robin: the same rule; power_of_two: uniform random, as vllm-router 0.1.17 is in
    front of vLLM; consistent_hash: its probed adapter -> instance map) -- throughput within 2 %, mean
    TTFT and ITL within 10 % (round_robin, consistent_hash) or 25 % (power_of_two: the router's own
    unseeded draws are not the twin's, so the two sides route different random splits)."""
    binary = router_binary()
    if binary is None:
        why = "vllm-router is not installed: pip install 'lora-opt[router]' (or set VLLM_ROUTER_BIN)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI installs it (tools/vllm_tier/build.sh, the README's test command)")
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "fleet_router" / "vllm_router.py"),
                        "--instances", "3", "--duration-s", "40", "--speed", "2", "--router-bin", binary,
                        "--out", str(tmp_path), "--no-track"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=900)
    print(r.stdout[-4000:], r.stderr[-4000:])
    assert r.returncode == 0
    results = {x["policy"]: x for x in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(results) == {"round_robin", "power_of_two", "consistent_hash"}
    for policy, x in results.items():
        m, t = x["vllm_router"], x["twin_as_routed"]
        assert m["errors"] == 0, policy
        tol = 0.25 if policy == "power_of_two" else 0.10
        assert abs(m["throughput_tok_s"] / t["throughput_tok_s"] - 1) <= 0.02, policy
        assert abs(m["ttft_mean_ms"] / t["ttft_mean_ms"] - 1) <= tol, policy
        assert abs(m["itl_mean_ms"] / t["itl_mean_ms"] - 1) <= tol, policy
    rr = results["round_robin"]["vllm_router"]["shares"]
    assert max(abs(s - 1 / 3) for s in rr) < 0.01                 # a counter over requests
    ch = results["consistent_hash"]
    want = [sum(1 for a, e in ch["hash_map"].items() if e == i) for i in range(3)]
    assert sum(want) == 10                                       # every adapter on one instance
    assert ch["vllm_router"]["shares"] == pytest.approx(ch["twin_as_routed"]["shares"], abs=0.01)
