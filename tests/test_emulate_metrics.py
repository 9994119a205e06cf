"""``/metrics`` of ``lora-opt emulate`` per imitated vLLM version, under the requests the real-vLLM
test (tests/real_vllm/test_metrics_real.py) sends to real vLLM 0.32 and to the emulator alike: the
helpers here are shared with it, so what runs without the tier is what is compared against real vLLM.

What differs by version (lora_opt.emulate.metrics): from 0.32 ``vllm:lora_requests_info`` lists the
same adapters in both labels (those with a request that has produced output); 0.32 does not count a
client's disconnect as ``abort``; 0.8.5 lists running and waiting adapters apart."""
from __future__ import annotations

import asyncio
import functools
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the profile the emulator runs (its speeds do not matter here)
PROFILE = "llama-3.1-8b-h100-64gb"
#: family (as prometheus_client's parser names it) -> type, for what lora-opt reads or compares
FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:lora_requests_info": "gauge", "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter", "vllm:cache_config_info": "gauge",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
}
#: the sample names lora-opt's validate keeps from a scrape (lora_opt.validate.live.SCRAPED, less V0's name)
SCRAPED_NAMES = {b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc",
                 b"vllm:lora_requests_info", b"vllm:num_preemptions_total", b"vllm:prompt_tokens_total",
                 b"vllm:generation_tokens_total"}
MAX_TOKENS = 480
PROMPT_LEN = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=32)
def families(text: str) -> dict:
    """family name -> (type, samples [(name, labels, value)]) of the families in :data:`FAMILIES`."""
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text) if f.name in FAMILIES}


def value(text: str, sample: str, **labels) -> float:
    fam = families(text)
    for _, samples in fam.values():
        for name, lab, v in samples:
            if name == sample and all(lab.get(k) == want for k, want in labels.items()):
                return v
    raise KeyError(f"{sample} {labels}")


def newest_lora(text: str) -> dict | None:
    """The newest vllm:lora_requests_info series' labels (the one with the largest value)."""
    _, samples = families(text).get("vllm:lora_requests_info", (None, []))
    return max(samples, key=lambda s: s[2])[1] if samples else None


def adapters(label: str) -> set[str]:
    return {a for a in label.split(",") if a}


async def exercise(base: str, max_tokens: int = MAX_TOKENS) -> dict:
    """Three requests on two adapters (r8-a twice, r16-a), then, once they run, one on r32-a, which
    waits for a LoRA slot (``--max-loras 2``); scrapes ``before``, ``during`` (the four in the engine, the
    three having produced output: both adapters in ``vllm:lora_requests_info``'s running label),
    ``after`` they finish and ``aborted`` (a client left its stream) against ``base``
    (http://HOST:PORT); ``usage`` of the four; ``max_tokens`` each; ``trace``: (seconds, running,
    waiting) of every scrape; ``reached``: whether a ``during`` scrape saw the four in the engine (the
    harness's window: the three must still run when the fourth arrives).

    The four are not streamed: a 2-core machine's vLLM front end writing three streams' chunks answered a
    scrape only once they had all finished (the full real-vLLM tier, 18 s late), so no scrape saw the window."""
    import httpx
    out: dict = {"usage": [], "max_tokens": max_tokens, "trace": []}
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300, trust_env=False) as c:
        async def scrape(tag):
            out[tag] = (await c.get(base + "/metrics")).text
            try:
                out["trace"].append((tag, round(time.monotonic() - t0, 3), value(out[tag], "vllm:num_requests_running"),
                                     value(out[tag], "vllm:num_requests_waiting")))
            except KeyError:
                out["trace"].append((tag, round(time.monotonic() - t0, 3), None, None))

        async def complete(model: str, seed: int):
            body = {"model": model, "prompt": [(seed * 97 + k * 13) % 4000 + 10 for k in range(PROMPT_LEN)],
                    "max_tokens": max_tokens, "ignore_eos": True}
            r = await c.post(base + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out["usage"].append(r.json()["usage"])

        def running_adapters() -> set[str]:
            lora = newest_lora(out["during"])
            return adapters(lora["running_lora_adapters"]) if lora else set()

        await scrape("before")
        tasks = [asyncio.ensure_future(complete(m, k)) for k, m in enumerate(("r8-a", "r16-a", "r8-a"))]
        # wait until the engine runs the three by its own metrics
        deadline = time.monotonic() + 120
        while True:
            await scrape("during")
            if value(out["during"], "vllm:num_requests_running") == 3 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        tasks.append(asyncio.ensure_future(complete("r32-a", 9)))   # both LoRA slots are taken: it waits
        # until the engine has it (waiting), the three run and both adapters have produced output (a request
        # admitted a step after the others has not yet) -- or the window has closed: one of the three finished.
        # Not a wall-clock limit: CI once saw a single scrape in this loop before a 10-s deadline passed, on a
        # 2-core machine whose scrapes and requests were still in the window
        deadline = time.monotonic() + 240
        while True:
            await scrape("during")
            if (value(out["during"], "vllm:num_requests_waiting") == 1
                    and value(out["during"], "vllm:num_requests_running") == 3
                    and running_adapters() == {"r8-a", "r16-a"}):
                break
            if any(t.done() for t in tasks[:3]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        out["reached"] = out["trace"][-1][2:] == (3, 1) and running_adapters() == {"r8-a", "r16-a"}
        await asyncio.wait_for(asyncio.gather(*tasks), 240)
        # "after" is read once the four are counted (CI once saw the fourth "length" finish only in the next scrape)
        deadline = time.monotonic() + 30
        while True:
            await asyncio.sleep(0.5)
            await scrape("after")
            done = [value(out[t], "vllm:e2e_request_latency_seconds_count") for t in ("before", "after")]
            if done[1] - done[0] >= 4 or time.monotonic() > deadline:
                break
        # a client that leaves its stream: vLLM aborts the request
        async with c.stream("POST", base + "/v1/completions", json={
                "model": "r16-a", "prompt": list(range(10, 10 + PROMPT_LEN)), "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                break
        deadline = time.monotonic() + 30
        while True:
            await asyncio.sleep(0.5)
            await scrape("aborted")
            if value(out["aborted"], "vllm:num_requests_running") == 0 or time.monotonic() > deadline:
                break
    return out


@contextmanager
def emulator(*args: str):
    """``lora-opt emulate ARGS`` on a free port (``--max-loras 2 --max-model-len 512`` as the tier's
    server): yields its base URL; stopped at the end."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", "--profile", PROFILE, *args,
                             "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4",
                             "--max-model-len", "512", "--max-num-seqs", "16", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            pass
        assert proc.poll() is None, proc.stderr.read()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def check_meaning(run: dict, release: str) -> None:
    """What the scrapes of :func:`exercise` must show on vLLM ``release`` (measured on 0.32)."""
    before, during, after, aborted = (run[k] for k in ("before", "during", "after", "aborted"))
    # during: three running on two adapters, r32-a waiting for a LoRA slot
    assert run["reached"], f"the scrapes never saw 3 running and 1 waiting: (scrape, s, running, waiting) {run['trace']}"
    assert 0 < value(during, "vllm:kv_cache_usage_perc") <= 1
    lora = newest_lora(during)
    assert lora["max_lora"] == "2"
    if release == "0.8.5":                  # running and waiting adapters apart
        assert adapters(lora["running_lora_adapters"]) == {"r8-a", "r16-a"}
        assert adapters(lora["waiting_lora_adapters"]) == {"r32-a"}
    else:
        # 0.32: both labels list the adapters with a request that has produced output; the waiting
        # r32-a has produced none, so it is in neither
        assert adapters(lora["running_lora_adapters"]) == adapters(lora["waiting_lora_adapters"]) == {"r8-a", "r16-a"}
    # after: idle, the newest series is the empty one; the r32-a series stays (one per label set seen)
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    lora = newest_lora(after)
    assert lora["running_lora_adapters"] == lora["waiting_lora_adapters"] == ""
    _, samples = families(after)["vllm:lora_requests_info"]
    assert any(s[1]["running_lora_adapters"] == "r32-a" for s in samples) or release == "0.8.5"
    # counters: the tokens of the four requests, four "length" finishes, four TTFTs and e2e latencies
    assert len(run["usage"]) == 4 and all(u["completion_tokens"] == run["max_tokens"] for u in run["usage"])

    def delta(sample, a=before, b=after, **labels):
        return value(b, sample, **labels) - value(a, sample, **labels)
    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in run["usage"]) == 4 * PROMPT_LEN
    assert delta("vllm:generation_tokens_total") == 4 * run["max_tokens"]
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:num_preemptions_total") == 0
    # a client's disconnect: aborted (nothing running), yet 0.32 counts no finish of any reason
    assert value(aborted, "vllm:num_requests_running") == 0
    for reason in ("abort", "length", "stop"):
        counted = reason == "abort" and release != "0.32"
        assert delta("vllm:request_success_total", after, aborted, finished_reason=reason) == counted, reason
    assert delta("vllm:e2e_request_latency_seconds_count", after, aborted) == 0
    assert newest_lora(aborted)["running_lora_adapters"] == ""




# ~7 s each; 0.33 differs from 0.32 only in counting aborts
@pytest.mark.parametrize("release", ["0.32", pytest.param("0.33", marks=pytest.mark.slow), "0.8.5"])
def test_metrics_per_imitated_version(release):
    with emulator("--vllm-version", release, "--speed", "5", "--served-model-name", "tiny-llama",
                  "--lora-modules", "r8-a=/x/r8-a", "r16-a=/x/r16-a", "r32-a=/x/r32-a") as url:
        import httpx
        assert "vllm:lora_requests_info{" not in httpx.get(url + "/metrics").text    # no series before a step
        run = asyncio.run(exercise(url))
    check_meaning(run, release)
    reasons = {s[1]["finished_reason"] for s in families(run["after"])["vllm:request_success"][1]}
    assert reasons == ({"stop", "length", "abort"} if release == "0.8.5" else
                       {"stop", "length", "abort", "error", "repetition"})
    info = next(s[1] for s in families(run["after"])["vllm:cache_config_info"][1])
    assert float(info["num_gpu_blocks"]) * float(info["block_size"]) > 0
