"""The router through instances dying (``lora_opt.emulate.router_health``): an instance whose connection
is refused is ejected and its request sent to another instance of the adapter; failing health checks
eject, passing ones re-admit; a request that reached an instance is never retried; ``GET /router/routes``
shows each instance's state.  Bookkeeping first (no I/O), then over HTTP, then ``lora-opt emulate``'s
own fleet with one instance shut down -- the case a user hit: every second request a 502."""
from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_emulate import Emulator, _free_port
from test_emulate_router import COMPLETION, FakeInstance, _client, router  # noqa: F401  (router: a fixture)

from lora_opt.emulate.fleet import free_ports
from lora_opt.emulate.request_validation import APIError
from lora_opt.emulate.router import RouteTable
from lora_opt.emulate.router_health import EndpointHealth, health_url
from lora_opt.errors import InputError
from lora_opt.replan.router_config import HealthChecks, gateway_manifests, vllm_router_command
from lora_opt.placement.workload_file import workload_from_dict
from lora_opt.search.deployments import every_gpu_placement
from twin.profile import load_profile

FAST = HealthChecks(interval_s=0.2, timeout_s=1.0, failure_threshold=2, success_threshold=2)


# ---- bookkeeping --------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("interval_s", -1), ("timeout_s", 0), ("failure_threshold", 0),
                                          ("success_threshold", 1.5), ("interval_s", float("nan")),
                                          ("endpoint", "health"), ("retry_for_s", -0.5),
                                          ("retry_for_s", float("inf"))])
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(InputError, match=field):
        HealthChecks(**{field: value})


def test_thresholds_eject_and_readmit():
    h = EndpointHealth(2, FAST)
    assert not h.eject(0, "x")                      # no checks running: nothing could re-admit it
    h.checking = True
    assert h.record(0, False, "HTTP 500") is None and h.record(0, False, "HTTP 500") == "ejected"
    assert h.state(0, False)["state"] == "ejected" and h.state(0, False)["reason"] == "HTTP 500"
    assert h.record(0, True) is None and h.record(0, False, "HTTP 500") is None     # a pass then a fail: no run
    assert h.record(0, True) is None and h.record(0, True) == "readmitted"
    assert h.record(1, False, "refused", refused=True) == "ejected"                 # refused: at once
    assert h.state(1, True)["state"] == "retired"
    assert [e["event"] for e in h.events] == ["ejected", "readmitted", "ejected"]
    assert health_url("http://h:1/v1", "/health") == "http://h:1/health"


def test_ejected_instances_are_picked_only_when_no_other_is_left_and_a_503_names_them():
    a, b, c = (f"http://127.0.0.1:{p}/v1" for p in (9201, 9202, 9203))
    t = RouteTable({"x": [{"endpoint": a, "weight": 1.0}, {"endpoint": b, "weight": 1.0}],
                    "y": [{"endpoint": c, "weight": 1.0}]}, seed=1, policy="round-robin", health=FAST)
    t.health.checking = True
    t.health.eject(0, "health check: connection refused")
    picks = {t.pick("x") for _ in range(20)} | {t.pick("base") for _ in range(40)}
    assert a not in picks and {b, c} <= picks
    assert t.pick("x", ) == b and t.endpoints[t.pick_engine("x", exclude=[2])] == b
    assert t.endpoints[t.pick_engine("x", exclude=[1])] == a     # a retry that tried b: a, ejected, anyway
    with pytest.raises(APIError) as e:
        t.pick_engine("x", exclude=[0, 1])              # both tried: nothing left
    assert e.value.status == 503 and f"{a} ejected" in e.value.message and f"{b} refused" in e.value.message
    t.health.eject(2, "HTTP 500")
    assert t.pick("y") == c                             # its only instance, ejected: tried anyway ("panic")
    with pytest.raises(APIError, match="no live instance serves y"):
        t.pick_engine("y", exclude=[2])                 # ... unless a retry already tried it
    t.reroute({"z": [{"endpoint": "http://127.0.0.1:9204/v1", "weight": 1.0}]})     # a new instance: healthy
    assert t.health.state(3, False)["state"] == "healthy" and t.pick("z").endswith(":9204/v1")


# ---- over HTTP ----------------------------------------------------------------------------------
class HealthyFake:
    """An instance on a chosen port that answers /health 200 and a completion, counting the completions."""

    def __init__(self, port: int):
        served = self.served = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                served.append(self.path)
                body = json.dumps({"id": "cmpl-fake", "object": "text_completion", "choices": [],
                                   "usage": {"completion_tokens": 1}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def _wait_state(c, front: str, endpoint: str, state: str, within_s: float = 10.0) -> dict:
    deadline = time.time() + within_s
    while True:
        doc = c.get(front + "/router/routes").json()
        if doc["health"][endpoint]["state"] == state or time.time() > deadline:
            assert doc["health"][endpoint]["state"] == state, (doc["health"], doc["health_checks"])
            return doc
        time.sleep(0.05)


def test_a_dead_instance_is_ejected_its_requests_go_elsewhere_and_it_comes_back(router):  # noqa: F811
    """Round-robin over a closed port and a live instance: every request answered (the refused one
    went to the live instance), the dead one shown ejected with its reason; an instance that starts
    listening there passes its checks, is re-admitted and gets its share; stopped again, ejected again."""
    port = _free_port()
    dead = f"http://127.0.0.1:{port}/v1"
    live = HealthyFake(0)
    live_ep = f"http://127.0.0.1:{live.server.server_address[1]}/v1"
    try:
        r = router({"ad0": [{"endpoint": dead, "weight": 1.0}, {"endpoint": live_ep, "weight": 1.0}]},
                   health=FAST, policy="round-robin")
        with _client() as c:
            codes = [c.post(r.url + "/v1/completions", json=COMPLETION).status_code for _ in range(10)]
            assert codes == [200] * 10 and len(live.served) == 10
            doc = _wait_state(c, r.url, dead, "ejected")
            assert "refused" in doc["health"][dead]["reason"] or "unreachable" in doc["health"][dead]["reason"]
            assert doc["health"][live_ep]["state"] == "healthy"
            back = HealthyFake(port)                    # the instance restarted on its address
            try:
                _wait_state(c, r.url, dead, "healthy")
                codes = [c.post(r.url + "/v1/completions", json=COMPLETION).status_code for _ in range(10)]
                assert codes == [200] * 10 and len(back.served) == 5      # round-robin: its share again
            finally:
                back.stop()
            codes = [c.post(r.url + "/v1/completions", json=COMPLETION).status_code for _ in range(6)]
            assert codes == [200] * 6
            _wait_state(c, r.url, dead, "ejected")
        events = [e["event"] for e in r.table.health.events if e["engine"] == r.table.endpoints.index(dead)]
        assert events == ["ejected", "readmitted", "ejected"]
    finally:
        live.stop()


def test_a_request_that_reached_an_instance_is_never_retried(router):  # noqa: F811
    """An instance that accepts the connection and drops it without answering may have run the
    request: its requests are 502s, never sent again elsewhere (no checks: only the retry rule)."""
    fake = FakeInstance("refuse")
    live = HealthyFake(0)
    live_ep = f"http://127.0.0.1:{live.server.server_address[1]}/v1"
    try:
        r = router({"ad0": [{"endpoint": fake.endpoint, "weight": 1.0}, {"endpoint": live_ep, "weight": 1.0}]},
                   policy="round-robin")
        with _client() as c:
            codes = [c.post(r.url + "/v1/completions", json=COMPLETION).status_code for _ in range(6)]
        assert sorted(codes) == [200] * 3 + [502] * 3 and len(live.served) == 3
    finally:
        fake.stop()
        live.stop()


# ---- lora-opt emulate's own fleet -------------------------------------------------------------
def test_emulate_fleet_with_one_instance_shut_down_answers_every_request():
    """``lora-opt emulate --instances 2 --router round-robin``, instance 1 shut down
    (``POST /emulator/shutdown``): every request through the router is answered, and
    ``GET /router/routes`` shows the instance ejected."""
    base, front = free_ports(2), free_ports(1)
    emu = Emulator(["--profile", "llama-3.1-8b-h100-64gb", "--lora-modules", "ad0=/nonexistent",
                    "--max-lora-rank", "16", "--instances", "2", "--port", str(base), "--router-port", str(front),
                    "--router", "round-robin", "--speed", "20", "--health-interval-s", "0.5"])
    try:
        with httpx.Client(timeout=60, trust_env=False) as c:
            down = f"http://127.0.0.1:{base + 1}"
            assert c.post(down + "/emulator/shutdown").status_code == 200
            deadline = time.time() + 20                  # it stops listening at its server's next tick
            while time.time() < deadline:
                try:
                    c.get(down + "/health", timeout=2)
                except httpx.TransportError:
                    break
                time.sleep(0.05)
            codes = [c.post(f"http://127.0.0.1:{front}/v1/completions", json=COMPLETION).status_code
                     for _ in range(20)]
            assert codes == [200] * 20
            doc = c.get(f"http://127.0.0.1:{front}/router/routes").json()
            assert doc["health"][down + "/v1"]["state"] == "ejected", doc["health"]
            assert doc["health"][f"http://127.0.0.1:{base}/v1"]["state"] == "healthy"
    finally:
        emu.stop()


# ---- the routers --emit-router configures ---------------------------------------------------------
def _vllm_router_binary() -> str | None:
    """$VLLM_ROUTER_BIN, PATH, this Python's bin, or the test tier's (tools/vllm_tier/build.sh installs it)."""
    tier = Path(os.environ.get("LORA_OPT_VLLM_TIER") or Path(__file__).resolve().parents[1] / ".vllm-tier")
    found = os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router")
    candidates = [Path(sys.executable).parent / "vllm-router", tier / "router-venv" / "bin" / "vllm-router"]
    return found or next((str(c) for c in candidates if c.exists()), None)


def test_the_emitted_gateway_manifests_carry_the_same_readiness_probe():
    wl = workload_from_dict({"profile": "llama-3.1-8b-h100-64gb", "adapters": [{"count": 2, "rank": 8, "rate": 0.5}]})
    text = gateway_manifests(every_gpu_placement(wl, load_profile("llama-3.1-8b-h100-64gb"), 2, 4))
    h = HealthChecks()
    for line in ("readinessProbe:", f"httpGet: {{path: {h.endpoint}, port: 8000}}", "periodSeconds: 2",
                 f"failureThreshold: {h.failure_threshold}", f"successThreshold: {h.success_threshold}"):
        assert f"#     {line}" in text or f"#   {line}" in text, line


def test_the_emitted_vllm_router_answers_every_request_with_one_instance_shut_down():
    """``place --emit-router vllm-router:round-robin``'s command (vllm-router 0.1.17, the binary itself)
    in front of ``lora-opt emulate --instances 2`` with instance 1 shut down: every request answered
    (its retry sends the refused ones to the live worker; measured: with retries off, every second
    request is a 500)."""

    binary = _vllm_router_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("vllm-router is not installed: tools/vllm_tier/build.sh (the README's test command) installs it")
        pytest.skip("vllm-router is not installed (tools/vllm_tier/build.sh, or set VLLM_ROUTER_BIN)")
    base, front = free_ports(2), free_ports(1)
    wl = workload_from_dict({"profile": "llama-3.1-8b-h100-64gb", "adapters": [{"id": "ad0", "rank": 8, "rate": 0.5}]})
    argv = vllm_router_command(every_gpu_placement(wl, load_profile("llama-3.1-8b-h100-64gb"), 2, 4), "round-robin",
                               base_port=base, port=front)
    emu = Emulator(["--profile", "llama-3.1-8b-h100-64gb", "--lora-modules", "ad0=/nonexistent",
                    "--max-lora-rank", "16", "--instances", "2", "--port", str(base), "--speed", "20"])
    router = subprocess.Popen([binary, *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(timeout=60, trust_env=False) as c:
            assert c.post(f"http://127.0.0.1:{base + 1}/emulator/shutdown").status_code == 200
            deadline = time.time() + 60
            while True:
                try:
                    c.get(f"http://127.0.0.1:{front}/health")
                    break
                except httpx.TransportError:
                    assert router.poll() is None and time.time() < deadline, "vllm-router did not start"
                    time.sleep(0.2)
            codes = [c.post(f"http://127.0.0.1:{front}/v1/completions", json=COMPLETION).status_code
                     for _ in range(20)]
        assert codes == [200] * 20, codes
    finally:
        router.terminate()
        router.wait(10)
        router.stderr.close()
        emu.stop()
