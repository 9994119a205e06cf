"""``lora-opt emulate``: the online engine, the HTTP surface, consistency with the batch twin.

Every server is a ``lora-opt emulate`` subprocess on 127.0.0.1 and a free port, stopped (SIGTERM,
then kill) at the end of its fixture; speeds are 10+ so each test takes a few seconds."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from small_scenarios import small_scenario

ROOT = Path(__file__).resolve().parents[1]

#: a small instance with a queue (max_loras 2 of 10 adapters, 8 sequences): mean TTFT ~2.3 s, so
#: the HTTP path's milliseconds are small against it at speed 10; 60 s (464 requests, 6 s of wall
#: time) average out the schedule's sensitivity to arrival jitter (LoRA slots change hands)
CONSISTENCY = small_scenario(engine={"max_loras": 2, "max_num_seqs": 8},
                             lengths={"source": "mean", "mean_in": 200, "mean_out": 40}, duration_s=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


class Emulator:
    def __init__(self, args: list[str], timeout: float = 60.0, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**_env(), **(env or {})}, cwd=ROOT)
        self.lines = []
        t_end = time.time() + timeout
        while time.time() < t_end:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"emulator exited: {self.proc.wait()} {self.proc.stderr.read()}")
            self.lines.append(line)
            if line.strip() == "ready":
                return
        raise RuntimeError("emulator did not start")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()
        return self.proc.returncode


def _start_scenario(tmp_path, scenario: dict, speed: float, extra=()):
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    port = _free_port()
    return Emulator(["--scenario", str(path), "--port", str(port), "--speed", str(speed), *extra]), \
        f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    emu, url = _start_scenario(tmp_path_factory.mktemp("emu"), small_scenario(), 20)
    try:
        yield url
    finally:
        emu.stop()


def _client():
    import httpx
    return httpx.Client(timeout=30, trust_env=False)


def _metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.split()[-1])
    raise KeyError(name)


# ---- the API -------------------------------------------------------------------------------
def test_models_health_version(server):
    with _client() as c:
        assert c.get(server + "/health").status_code == 200
        assert c.get(server + "/version").json()["version"] == "0.8.5"
        ids = [m["id"] for m in c.get(server + "/v1/models").json()["data"]]
    assert ids[0] == "meta-llama/Llama-3.1-8B-Instruct" and ids[1:] == [f"a{i}" for i in range(10)]


def test_completion_and_chat_non_streaming(server):
    with _client() as c:
        r = c.post(server + "/v1/completions", json={"model": "a3", "prompt": [1] * 50, "max_tokens": 7,
                                                   "ignore_eos": True}).json()
        assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"] == {"prompt_tokens": 50, "total_tokens": 57, "completion_tokens": 7,
                              "prompt_tokens_details": None, "completion_tokens_details": None}
        assert len(r["choices"][0]["text"].split()) == 7
        r = c.post(server + "/v1/chat/completions", json={
            "model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "user", "content": "x" * 40}],
            "max_tokens": 30, "min_tokens": 30}).json()
        assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] == 30
        assert r["usage"]["prompt_tokens"] == 10 + 4 + 3       # 40 chars / 4 + message + reply
        # without ignore_eos the length model may stop it early, never beyond max_tokens
        r = c.post(server + "/v1/completions", json={"model": "a1", "prompt": "hello", "max_tokens": 5}).json()
        assert 1 <= r["usage"]["completion_tokens"] <= 5


def _sse(text: str) -> list:
    events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_chunks_usage_and_done(server):
    with _client() as c:
        r = c.post(server + "/v1/completions", json={"model": "a2", "prompt": "abcd" * 10, "max_tokens": 6,
                                                   "ignore_eos": True, "stream": True,
                                                   "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r.text)
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 5 + ["length"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        assert chunks[-1]["usage"]["prompt_tokens"] == 10
        r = c.post(server + "/v1/chat/completions", json={"model": "a0", "messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3, "ignore_eos": True, "stream": True})
        chunks = _sse(r.text)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(chunks) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_metrics_have_vllm_v1_names(server):
    with _client() as c:
        c.post(server + "/v1/completions", json={"model": "a5", "prompt": [3] * 20, "max_tokens": 4, "ignore_eos": True})
        text = c.get(server + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"):
        assert name in text, name
    assert _metric(text, "vllm:request_success_total", finished_reason="length") >= 1
    assert _metric(text, "vllm:generation_tokens_total") >= 4
    assert 'max_lora="4"' in text and 'model_name="meta-llama/Llama-3.1-8B-Instruct"' in text
    # vLLM V1 labels vllm:cache_config_info with CacheConfig's fields (str() of each) and "engine"
    # (vllm/v1/metrics/loggers.py log_metrics_info; vllm/config/cache.py CacheConfig.metrics_info)
    info = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    for label in ('block_size="16"', 'gpu_memory_utilization="', 'num_gpu_blocks="', 'cache_dtype="auto"',
                  'enable_prefix_caching="False"', 'engine="0"'):
        assert label in info, label
    assert info.endswith(" 1.0")


# ---- bad requests --------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, type_", [
    ('{"model": "a1", "prompt": ', 400, "BadRequestError"),                          # malformed JSON
    ('{"model": "a1", "prompt": "x", "max_tokens": "ten"}', 400, "BadRequestError"),  # wrong type
    ('{"model": "a1", "prompt": 5}', 400, "BadRequestError"),
    ('{"model": "a1", "prompt": "x", "stream": "sometimes"}', 400, "BadRequestError"),
    ('{"model": "nope", "prompt": "x"}', 404, "NotFoundError"),                      # unknown adapter
    ('{"model": "a1", "prompt": "x", "max_tokens": 200000}', 400, "BadRequestError"),  # over max_model_len
    ('{"model": "a1", "prompt": "x", "max_tokens": 2, "min_tokens": 3}', 400, "BadRequestError"),
    ('[1, 2]', 400, "BadRequestError"),
])
def test_bad_requests_get_vllm_085_status_and_flat_error(server, body, status, type_):
    """The bundled profile says vLLM 0.8.5: its flat error, no param, the refusal of prompt +
    max_tokens over max_model_len (0.8.5 did not clamp)."""
    with _client() as c:
        r = c.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()
    assert set(err) == {"object", "message", "type", "param", "code"} and err["object"] == "error"
    assert err["type"] == type_ and err["code"] == status and err["param"] is None
    if "200000" in body:
        assert err["message"].startswith("This model's maximum context length is 131072 tokens. However, you "
                                         "requested 200001 tokens (1 in the messages, 200000 in the completion).")
    if "nope" in body:
        assert err["message"] == "The model `nope` does not exist."


@pytest.fixture(scope="module")
def server_033(tmp_path_factory):
    """The same instance imitating vLLM 0.33 (``--vllm-version``), with a model directory whose
    config.json gives the vocabulary (4,096) and the context (``max_position_embeddings`` 2,048)."""
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text(json.dumps({"vocab_size": 4096, "max_position_embeddings": 2048}))
    port = _free_port()
    emu = Emulator(["--profile", "llama-3.1-8b-h100-64gb", "--lora-modules", "a0=/x/a0", "a1=/x/a1",
                    "--max-lora-rank", "16", "--model", str(model), "--served-model-name", "tiny",
                    "--vllm-version", "0.33", "--port", str(port), "--speed", "20"])
    try:
        yield f"http://127.0.0.1:{port}", str(model)
    finally:
        emu.stop()


@pytest.mark.parametrize("body, status, type_, param, message", [
    ({"prompt": [1, 2], "max_tokens": 2, "temperature": -1}, 400, "BadRequestError", "temperature",
     "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
    ({"prompt": [1, 2], "max_tokens": 2, "top_p": 1.5}, 400, "BadRequestError", "top_p",
     "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)"),
    ({"prompt": [1, 5000], "max_tokens": 2}, 400, "BadRequestError", None, "Token id 5000 is out of vocabulary"),
    ({"prompt": [1, -2], "max_tokens": 2}, 400, "Bad Request", "body.prompt.1", None),
    ({"prompt": [1, 2], "max_tokens": 2, "stream_options": {"include_usage": True}}, 400, "BadRequestError",
     "stream_options", "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ({"prompt": [1, 2], "max_tokens": 3000}, 400, "BadRequestError", "max_tokens",
     "max_tokens=3000 cannot be greater than max_model_len=2048. Please request fewer output tokens. "
     "(parameter=max_tokens, value=3000)"),
    ({"prompt": [1] * 2100, "max_tokens": 2}, 400, "BadRequestError", "input_tokens", None),
    ({"prompt": [1, 2], "max_tokens": "ten"}, 400, "Bad Request", "body.max_tokens",
     "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid "
     "integer, unable to parse string as an integer', 'input': 'ten'}"),
    ({"model": "zz", "prompt": [1, 2]}, 404, "NotFoundError", "model",
     "The model `zz` does not exist. Valid aliases: tiny."),
])
def test_vllm_033_errors_name_the_field(server_033, body, status, type_, param, message):
    url, _ = server_033
    with _client() as c:
        r = c.post(url + "/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (type_, param, status)
    if message is not None:
        assert err["message"] == message


def test_vllm_033_clamps_max_tokens_and_reports_its_version(server_033):
    url, model = server_033
    with _client() as c:
        assert c.get(url + "/version").json() == {"version": "0.33.0"}
        card = c.get(url + "/v1/models").json()["data"][0]
        assert (card["id"], card["root"], card["max_model_len"]) == ("tiny", model, 2048)
        r = c.post(url + "/v1/completions", json={"prompt": [1] * 2040, "max_tokens": 100, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True, "n": 3})
        assert len(r.json()["choices"]) == 3 and r.json()["usage"]["completion_tokens"] == 6
        tok = c.post(url + "/tokenize", json={"prompt": "abcdefgh"}).json()
        assert tok["count"] >= 1 and tok["max_model_len"] == 2048 and len(tok["tokens"]) == tok["count"]
        # a body nested past the JSON parser's depth: FastAPI's 400, never a 500 traceback
        r = c.post(url + "/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json() == {"detail": "There was an error parsing the body"}
        r = c.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "Unsupported Media Type" in r.json()["error"]["message"]


def test_unknown_vllm_version_is_refused_cleanly():
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "emulate", "--profile", "llama-3.1-8b-h100-64gb",
                        "--vllm-version", "0.7", "--port", str(_free_port())], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--vllm-version" in r.stderr and "0.32" in r.stderr
    assert "Traceback" not in r.stderr


def test_client_disconnect_aborts_the_request(server):
    import httpx
    with _client() as c:
        before = _metric(c.get(server + "/metrics").text, "vllm:request_success_total", finished_reason="abort")
        with c.stream("POST", server + "/v1/completions", json={"model": "a4", "prompt": [1] * 30,
                                                                "max_tokens": 5000, "ignore_eos": True,
                                                                "stream": True}) as r:
            it = r.iter_bytes()
            assert b'"text"' in next(it)
        # the connection is closed: the engine drops the request and frees its blocks
        deadline = time.time() + 5
        while time.time() < deadline:
            text = c.get(server + "/metrics").text
            if _metric(text, "vllm:request_success_total", finished_reason="abort") == before + 1:
                break
            time.sleep(0.05)
        assert _metric(text, "vllm:request_success_total", finished_reason="abort") == before + 1
        assert _metric(text, "vllm:num_requests_running") == 0
        assert _metric(text, "vllm:kv_cache_usage_perc") == 0.0
    _ = httpx


# ---- consistency with the batch twin ---------------------------------------------------------
def _consistency_run(tmp_path, sc, req, speed):
    from lora_opt.emulate.client import replay, summarise
    emu, url = _start_scenario(tmp_path, CONSISTENCY, speed)
    try:
        ids, _, _ = sc.adapter_table()
        got = summarise(asyncio.run(replay(url, req, ids, speed)), speed, sc.duration_s)
        with _client() as c:
            lag_p99 = c.get(url + "/emulator/stats").json()["lag_ms"]["p99"]
    finally:
        assert emu.stop() == 0
    return got, lag_p99


#: wall ms of scheduling delay (client sending late, engine steps late) above which a run at speed
#: 10 measures the machine's oversubscription more than the emulator
NOISY_MS = 5.0


def test_open_loop_stream_matches_the_batch_twin_at_speed_10(tmp_path):
    """The same requests at their arrival times: throughput within 2 %, mean TTFT and mean ITL
    within 5 % of twin.simulate.  At speed 10 a millisecond of wall-clock delay is 10 simulated ms:
    on a machine whose cores are oversubscribed by other jobs a run can miss, so a miss is retried
    (up to 3 runs, each printed); when every run missed *and* was noisy (the client sent late or the
    engine stepped late by more than NOISY_MS at p99) the test is skipped as unmeasurable here, and
    a miss on a quiet run fails."""
    from twin.scenario import scenario_from_dict
    from twin.simulate import simulate
    from twin.workload import generate_requests
    sc = scenario_from_dict(CONSISTENCY)
    req = generate_requests(sc, sc.resolved_engine(sc.load_profile()).max_model_len)
    twin = simulate(sc, requests=req)
    want = (twin.throughput_tok_s, twin.ttft_ms["mean"], twin.itl_ms["mean"])
    quiet_miss = None
    for attempt in range(3):
        got, lag_p99 = _consistency_run(tmp_path, sc, req, 10.0)
        ratios = (got.throughput_tok_s / want[0], got.ttft_mean_ms / want[1], got.itl_mean_ms / want[2])
        noisy = max(got.send_late_p99_ms, lag_p99) > NOISY_MS
        print(f"attempt {attempt}: twin {want}, emulator {got.as_dict()}, engine lag p99 {lag_p99:.1f} ms, "
              f"ratios {ratios}, noisy {noisy}")
        assert got.errors == 0
        if abs(ratios[0] - 1) <= 0.02 and abs(ratios[1] - 1) <= 0.05 and abs(ratios[2] - 1) <= 0.05:
            return
        if not noisy:
            quiet_miss = ratios
    if quiet_miss is None:
        pytest.skip("every run at speed 10 was delayed by the machine's other jobs (p99 > 5 ms wall)")
    pytest.fail(f"the emulator missed the batch twin on a quiet run: ratios {quiet_miss}")


# ---- the online kernel helpers ----------------------------------------------------------------
def test_aborting_running_and_waiting_requests_keeps_the_invariants():
    from lora_opt.emulate.engine import online_scenario
    from twin.engine import DONE, step
    from twin.engine_online import abort_request, gauges
    from twin.engine_state import add_request
    from twin.scenario import scenario_from_dict
    from twin.simulate import engine_state
    from twin.workload import Requests
    sc = online_scenario(scenario_from_dict(small_scenario(engine={"max_num_seqs": 4})))
    prof = sc.load_profile()
    eng = sc.resolved_engine(prof)
    _, kv, _ = prof.startup_check(eng)
    empty = Requests(np.zeros(0), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
    s = engine_state(sc, prof, eng, empty, kv)
    for k in range(10):
        add_request(s, 0.0, 100, 50, 1 + k % 3)
    for _ in range(5):
        step(s, True)
    running, waiting = gauges(s)[:2]
    assert running == 4 and waiting == 6
    assert abort_request(s, 0) == 1 and abort_request(s, 9) == 2 and abort_request(s, 0) == 0
    assert gauges(s)[:2] == (3, 5)
    while step(s, True) < DONE:
        pass
    assert gauges(s)[:3] == (0, 0, 0)


# ---- fleets, start-up, shutdown ---------------------------------------------------------------
def test_oom_instance_refuses_to_start():
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "emulate", "--profile", "llama-3.1-8b-h100-64gb",
                        "--lora-modules", "x=/nonexistent", "--max-loras", "2000", "--max-lora-rank", "256",
                        "--port", str(_free_port())], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=60)
    assert r.returncode == 2
    assert "CUDA out of memory" in r.stderr


def test_placement_fleet_one_instance_per_gpu_and_clean_sigterm(tmp_path):
    gpu = {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 4, "max_num_seqs": 64,
           "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}
    placement = {"profile": "llama-3.1-8b-h100-64gb", "policy": "test",
                 "adapters": [{"id": f"ad{i}", "rank": 8 if i < 3 else 16, "rate": 0.1} for i in range(5)],
                 "gpus": [gpu, gpu], "routes": {"ad0": [[0, 1.0]], "ad1": [[0, 1.0]], "ad2": [[0, 0.5], [1, 0.5]],
                                                "ad3": [[1, 1.0]], "ad4": [[1, 1.0]]}}
    (tmp_path / "placement.json").write_text(json.dumps(placement))
    base = _free_port()
    while True:                          # two consecutive free ports
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            base = _free_port()
    router = _free_port()
    emu = Emulator(["--placement", str(tmp_path / "placement.json"), "--base-port", str(base), "--speed", "20",
                    "--router-port", str(router)], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        with _client() as c:
            ids = [[m["id"] for m in c.get(f"http://127.0.0.1:{base + g}/v1/models").json()["data"][1:]]
                   for g in (0, 1)]
            r = c.post(f"http://127.0.0.1:{base + 1}/v1/completions",
                       json={"model": "ad2", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200
            assert c.post(f"http://127.0.0.1:{base}/v1/completions",
                          json={"model": "ad3", "prompt": "hi"}).status_code == 404
            # the router forwards by the placement's routes; streams pass through
            front = f"http://127.0.0.1:{router}/v1"
            for model in ("ad0", "ad2", "ad4", "meta-llama/Llama-3.1-8B-Instruct"):
                r = c.post(front + "/completions", json={"model": model, "prompt": "hi", "max_tokens": 2,
                                                         "ignore_eos": True, "stream": True})
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), model
            r = c.post(front + "/completions", json={"model": "zz", "prompt": "hi"})
            assert r.status_code == 404 and r.json()["type"] == "NotFoundError"    # vLLM 0.8.5's flat error
            # runtime adapter updates: unload makes it unknown, loading it back serves it again (at the
            # end of /v1/models, as vLLM lists them)
            g0 = f"http://127.0.0.1:{base}"
            adapter = tmp_path / "adapter"
            adapter.mkdir()
            (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
            (tmp_path / "big").mkdir()
            (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 64}))
            load = {"lora_path": str(adapter)}
            assert c.post(g0 + "/v1/unload_lora_adapter", json={"lora_name": "ad0"}).status_code == 200
            assert c.post(g0 + "/v1/completions", json={"model": "ad0", "prompt": "hi"}).status_code == 404
            assert c.post(g0 + "/v1/load_lora_adapter", json={"lora_name": "ad0", **load}).status_code == 200
            assert c.post(g0 + "/v1/completions", json={"model": "ad0", "prompt": "hi", "max_tokens": 2}).status_code == 200
            assert [m["id"] for m in c.get(g0 + "/v1/models").json()["data"]][1:] == ["ad1", "ad2", "ad0"]
            # a new adapter takes a spare runtime slot, is listed and served; loading it twice is refused
            assert c.post(g0 + "/v1/load_lora_adapter", json={"lora_name": "new", **load}).status_code == 200
            assert "new" in [m["id"] for m in c.get(g0 + "/v1/models").json()["data"]]
            r = c.post(g0 + "/v1/completions", json={"model": "new", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert c.post(g0 + "/v1/load_lora_adapter", json={"lora_name": "new", **load}).status_code == 400
            assert c.post(g0 + "/v1/load_lora_adapter", json={"lora_name": "other"}).status_code == 400   # no path
            # vLLM's answers: a path without an adapter 404, a rank above --max-lora-rank (16) refused with
            # 400 (vLLM 0.32: 500, a server error for the client's mistake), an unknown unload 404
            r = c.post(g0 + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent/x"})
            assert r.status_code == 404 and r.json()["message"] == "Loading lora x failed: No adapter found for " \
                                                                  "/nonexistent/x"
            r = c.post(g0 + "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path / "big")})
            assert r.status_code == 400 and r.json()["message"] == "LoRA rank 64 is greater than max_lora_rank 16."
            assert c.post(g0 + "/v1/unload_lora_adapter", json={"lora_name": "never"}).status_code == 404
    finally:
        rc = emu.stop()
    assert ids == [["ad0", "ad1", "ad2"], ["ad2", "ad3", "ad4"]]
    assert rc == 0
