"""The fleet router (``lora_opt.emulate.router``) as a gateway: an instance that is down, refuses,
drops the connection, hangs or dies mid-stream gets a 502 / 503 / 504 in vLLM's error shape, or a
stream that ends with an error event and ``[DONE]``; never a 500 traceback.

The router runs in-process (uvicorn in a thread) in front of: a closed port, a fake instance
speaking raw HTTP that misbehaves on purpose, and a ``lora-opt emulate`` subprocess that is killed."""
from __future__ import annotations

import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lora_opt.emulate.router import RouteTable, build_router_app, model_of
from lora_opt.replan.router_config import HealthChecks

ROOT = Path(__file__).resolve().parents[1]
PROFILE = "llama-3.1-8b-h100-64gb"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(timeout: float = 30.0):
    import httpx
    return httpx.Client(timeout=timeout, trust_env=False)


class Router:
    """``build_router_app`` served by uvicorn in a thread on a free port."""

    def __init__(self, table: dict, health: HealthChecks | None = None, policy: str = "static", **kw):
        import uvicorn
        self.port = _free_port()
        # no health checks unless asked: a dead instance stays a 502 (the gateway's own errors)
        self.table = RouteTable(table, policy=policy, health=health or HealthChecks(interval_s=0))
        config = uvicorn.Config(build_router_app(self.table, **kw), host="127.0.0.1", port=self.port,
                                log_level="critical", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "router did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def router():
    started = []

    def start(table, **kw):
        started.append(Router(table, **kw))
        return started[-1]
    yield start
    for r in started:
        r.stop()


class FakeInstance:
    """A raw-HTTP instance that misbehaves: ``refuse`` (accepts, then closes without answering),
    ``hang`` (never answers), ``half_stream`` (a 200 SSE stream: one event, half an event, then the
    connection drops), ``json_cut`` (a JSON 200 whose body stops short)."""

    def __init__(self, behaviour: str):
        release = self.release = threading.Event()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                if behaviour == "hang":
                    release.wait(30)
                elif behaviour == "half_stream":
                    event = b'data: {"choices":[{"index":0,"text":" one"}]}\n\n'
                    body = b"%x\r\n%s\r\n" % (len(event), event) + b'10\r\ndata: {"choices":'
                    self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                         b"transfer-encoding: chunked\r\n\r\n" + body)
                    time.sleep(0.2)
                elif behaviour == "json_cut":
                    self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                         b"content-length: 100\r\n\r\n{\"id\": \"cmpl-1\", ")
                    time.sleep(0.2)
                # refuse: return at once (the connection is closed with no response)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _assert_gateway_error(r, status: int):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    from http import HTTPStatus
    assert body["error"]["code"] == status and body["error"]["type"] == HTTPStatus(status).phrase
    assert body["error"]["param"] is None and "Traceback" not in body["error"]["message"]
    return body["error"]["message"]


def _sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [e for e in text.split("\n\n") if e]


COMPLETION = {"model": "ad0", "prompt": "hi", "max_tokens": 4}


# ---- an instance that cannot answer ----------------------------------------------------------
def test_closed_port_is_a_502_for_requests_streams_and_unknown_models(router):
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    front = router({"ad0": [{"endpoint": dead, "weight": 1.0}]}).url
    with _client() as c:
        message = _assert_gateway_error(c.post(front + "/v1/completions", json=COMPLETION), 502)
        assert dead in message and "unreachable" in message
        _assert_gateway_error(c.post(front + "/v1/chat/completions", json={
            "model": "ad0", "messages": [{"role": "user", "content": "hi"}], "stream": True}), 502)
        # a name the table does not know goes to some instance: that one is down too
        _assert_gateway_error(c.post(front + "/v1/completions", json={**COMPLETION, "model": "zz"}), 502)
        _assert_gateway_error(c.get(front + "/v1/models"), 502)
        assert c.get(front + "/health").status_code == 200        # the router itself is up


def test_empty_table_is_a_503_and_unknown_routes_answer_as_vllm(router):
    front = router({}).url
    with _client() as c:
        _assert_gateway_error(c.post(front + "/v1/completions", json=COMPLETION), 503)
        # vLLM 0.32 answers an unknown route / method with FastAPI's own body (tests/real_vllm/test_metrics_real.py)
        r = c.get(front + "/v1/nothing")
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
        r = c.get(front + "/v1/completions")
        assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
        assert c.get(front + "/v1/models").json() == {"object": "list", "data": []}


@pytest.mark.parametrize("behaviour", ["refuse", "json_cut"])
def test_an_instance_that_drops_the_connection_is_a_502(router, behaviour):
    fake = FakeInstance(behaviour)
    try:
        front = router({"ad0": [{"endpoint": fake.endpoint, "weight": 1.0}]}).url
        with _client() as c:
            message = _assert_gateway_error(c.post(front + "/v1/completions", json=COMPLETION), 502)
        assert fake.endpoint in message
    finally:
        fake.stop()


def test_an_instance_that_does_not_answer_is_a_504_after_the_read_timeout(router):
    fake = FakeInstance("hang")
    try:
        front = router({"ad0": [{"endpoint": fake.endpoint, "weight": 1.0}]}, read_timeout_s=0.5).url
        t0 = time.time()
        with _client() as c:
            message = _assert_gateway_error(c.post(front + "/v1/completions", json=COMPLETION), 504)
        assert 0.4 < time.time() - t0 < 5 and "0.5 s" in message
    finally:
        fake.stop()


def test_a_stream_whose_instance_drops_mid_way_ends_with_an_error_event_and_done(router):
    fake = FakeInstance("half_stream")
    try:
        front = router({"ad0": [{"endpoint": fake.endpoint, "weight": 1.0}]}).url
        with _client() as c:
            r = c.post(front + "/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status_code == 200             # sent before the instance failed
        events = _sse_events(r.text)            # the body ended cleanly (no broken chunked encoding)
        assert events[0] == 'data: {"choices":[{"index":0,"text":" one"}]}'   # whole events pass
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])["error"]     # the half event is dropped
        assert error["code"] == 502 and error["type"] == "Bad Gateway" and fake.endpoint in error["message"]
        assert len(events) == 3
    finally:
        fake.stop()


def test_bodies_the_router_cannot_read_go_to_an_instance():
    assert model_of(b'{"model": "ad0"}') == "ad0"
    for raw in (b"", b"{", b"[1, 2]", b'{"model": 5}', b"[" * 100_000 + b"]" * 100_000):
        assert model_of(raw) is None             # never raises (the deep one is a RecursionError)


# ---- a real emulated instance behind the router, killed ------------------------------------------
@pytest.fixture
def instance():
    """A ``lora-opt emulate`` subprocess imitating vLLM 0.32 (adapter ``ad0``), killable."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", "--profile", PROFILE,
                             "--vllm-version", "0.32", "--lora-modules", "ad0=/nonexistent", "--max-lora-rank", "16",
                             "--max-model-len", "4096",
                             "--port", str(port), "--speed", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            pass
        assert proc.poll() is None, proc.stderr.read()
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_router_in_front_of_an_instance_that_is_killed(router, instance):
    proc, endpoint = instance
    front = router({"ad0": [{"endpoint": endpoint, "weight": 1.0}]}).url
    with _client() as c:
        # alive: answers pass through, errors are the instance's own
        r = c.post(front + "/v1/completions", json=COMPLETION)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        r = c.post(front + "/v1/completions", json={**COMPLETION, "model": "zz"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = c.post(front + "/v1/completions", content=b'{"model": "ad0", "prompt": ',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        ids = [m["id"] for m in c.get(front + "/v1/models").json()["data"]]
        assert ids == ["meta-llama/Llama-3.1-8B-Instruct", "ad0"]       # the instance's cards, base first
        # every answer ended leaves the router's in-flight count (streams too: least-requests reads it, and a
        # drain waits on it -- it once never came down for a stream)
        with c.stream("POST", front + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
        deadline = time.time() + 5
        while c.get(front + "/router/routes").json()["in_flight"][endpoint] and time.time() < deadline:
            time.sleep(0.02)
        assert c.get(front + "/router/routes").json()["in_flight"] == {endpoint: 0}
        # killed mid-stream: the client's stream still ends with an error event and [DONE]
        with c.stream("POST", front + "/v1/completions", json={**COMPLETION, "max_tokens": 3000,
                                                               "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            chunks = r.iter_text()
            text = next(chunks)
            proc.send_signal(signal.SIGKILL)
            text += "".join(chunks)
        events = _sse_events(text)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == 502
        assert all(json.loads(e[len("data: "):])["choices"] for e in events[:-2])    # whole token events
        # dead: every request is a 502
        proc.wait(10)
        _assert_gateway_error(c.post(front + "/v1/completions", json=COMPLETION), 502)
        _assert_gateway_error(c.post(front + "/v1/completions", json={**COMPLETION, "stream": True}), 502)


def test_a_client_that_leaves_a_non_streamed_request_aborts_it_on_the_instance(router, instance):
    import httpx
    _, endpoint = instance
    front = router({"ad0": [{"endpoint": endpoint, "weight": 1.0}]}).url
    with pytest.raises(httpx.ReadTimeout):
        with _client(timeout=1.0) as c:       # the client gives up long before the 3,000 tokens
            c.post(front + "/v1/completions", json={**COMPLETION, "max_tokens": 3000, "ignore_eos": True})
    stats = endpoint[: -len("/v1")] + "/emulator/stats"
    deadline = time.time() + 5
    with _client() as c:
        while c.get(stats).json()["open_requests"] and time.time() < deadline:
            time.sleep(0.05)
        assert c.get(stats).json()["open_requests"] == 0


def test_a_retired_instance_gets_nothing_more_and_its_routes_go_to_the_others(router):
    """``RouteTable.retire`` (a drain's first step): routed adapters lose it as a candidate (the static
    weights renormalised over the rest), models no policy routes are never drawn to it, an adapter it was
    the only instance of is unrouted (and said); a route to it again makes it live again.  Over HTTP:
    ``POST /router/retire`` and ``GET /router/routes``' ``in_flight`` and ``retired``."""
    from lora_opt.errors import InputError
    a, b, c = (f"http://127.0.0.1:{p}/v1" for p in (9101, 9102, 9103))
    t = RouteTable({"x": [{"endpoint": a, "weight": 3.0}, {"endpoint": b, "weight": 1.0}],
                    "y": [{"endpoint": c, "weight": 1.0}]}, seed=4)
    assert t.retire(a) == {"endpoint": a, "in_flight": 0, "unrouted": []}
    assert t.table()["x"] == [{"endpoint": b, "weight": 1.0}]
    picks = [t.pick("x") for _ in range(50)] + [t.pick(None) for _ in range(200)] + [t.pick("base") for _ in range(50)]
    assert a not in picks and {b, c} <= set(picks)
    assert t.retire(c)["unrouted"] == ["y"] and "y" not in t.table()      # its only instance: y is unrouted
    with pytest.raises(InputError, match="not an instance"):
        t.retire("http://127.0.0.1:1/v1")
    t.reroute({"z": [{"endpoint": a, "weight": 1.0}]})
    assert t.retired == {2} and t.pick("z") == a
    r = router({"x": [{"endpoint": a, "weight": 1.0}, {"endpoint": b, "weight": 1.0}]})
    with _client() as cl:
        assert cl.post(r.url + "/router/retire", json={"endpoint": b}).json() == {"endpoint": b, "in_flight": 0,
                                                                                    "unrouted": []}
        doc = cl.get(r.url + "/router/routes").json()
        assert doc["retired"] == [b] and doc["in_flight"] == {a: 0, b: 0} and doc["routes"]["x"][0]["endpoint"] == a
        assert cl.post(r.url + "/router/retire", content=b"[").status_code == 400
        resp = cl.post(r.url + "/router/retire", json={"endpoint": "http://127.0.0.1:1/v1"})
        assert resp.status_code == 400 and "not an instance" in resp.json()["error"]["message"]
