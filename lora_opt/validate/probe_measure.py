"""What ``lora-opt probe`` can observe from outside a server, and how each measurement isolates one
estimator (times are converted to simulated ms: wall x ``speed``; ``speed`` = 1 for vLLM).

* **Step time in a pure-decode window** (:func:`window_step`): B streams sent together with
  ``ignore_eos`` and the same ``max_tokens``; once every stream has its first token (all prompts
  done) and before the first one ends, every step is a decode of exactly B sequences, so each
  stream's inter-token gaps are those steps.  A stream's mean gap over the window is
  ``(t_last - t_first) / gaps``: the noise of single timestamps (event-loop lag) is divided by the
  number of steps; a window where tokens came in bursts (the server fell behind and caught up) is
  flagged by its share of near-zero gaps and repeated.  The steps' mean context is counted from the token times
  (each stream's KV holds its prompt and the tokens it has so far; +-1 token per stream).
* **Prefill cost** (:func:`ttft_runs`): the TTFT of one request on an idle server is its chunked
  prefill steps plus a constant (HTTP, front end); the slope over prompt lengths is the per-token cost.
* **Adapter load time** (:func:`burst_load_ms`): a long "pacer" stream on a resident adapter; a burst
  of K one-token requests on K non-resident adapters; the pacer's next M steps take longer by the
  burst's loads.  The same burst again (now resident) gives the same steps without the loads: the
  difference of the two M-step sums is K loads (the burst's prefill and LoRA terms cancel).
"""
from __future__ import annotations

import asyncio
import math
import re
import time

import numpy as np

# the emulator's raw-HTTP streaming request (one token timestamp per SSE chunk): the client
# validate uses, shared
from lora_opt.emulate.client import Record, _one, prompt_ids, split_url

#: steps on each side of the pure-decode window left out (the streams' front-end delays differ)
WINDOW_MARGIN_STEPS = 2.0
#: a gap shorter than this share of the mean gap was a burst (tokens held back, then delivered together)
BURST_GAP = 0.25
#: a window with more burst gaps than this share is repeated: the client no longer resolves the steps.
#: Bursts inside the window do not bias the mean (only its end points count); measured on the emulator
#: at load average 18 on 2 cores: speed 2, 3-17 % bursts, means within 0.5 % of the known steps;
#: speed 10, 59-87 % bursts, means off by 2-20 %
MAX_BURST_SHARE = 0.5
#: ... or whose streams' mean gaps differ by more than this (relative sd): they all saw the same steps
#: (speed 2 above: <= 0.6 %; speed 10: 5-8 %)
MAX_STREAM_SPREAD = 0.02
#: pacer steps a load burst is given to finish in
BURST_WINDOW_STEPS = 40


async def _send(url: str, model: str, in_len: int, max_tokens: int, t0: float, k: int) -> Record:
    host, port, root = split_url(url)
    rec = Record(0.0, int(in_len), int(max_tokens))
    await _one(host, port, root + "/v1/completions", model, rec, t0, prompt_ids(k, in_len))
    return rec


def _complete(rec: Record) -> bool:
    return rec.status == 200 and len(rec.token_times) >= rec.out_len


async def batch_run(url: str, models: list[str], batch: int, prompt: int, out: int, seed: int = 0) -> list[Record]:
    """``batch`` streams sent at once, stream k on ``models[k % len(models)]``."""
    t0 = time.perf_counter()
    return list(await asyncio.gather(*[_send(url, models[k % len(models)], prompt, out, t0, seed * 100_000 + k)
                                       for k in range(batch)]))


def window_step(records: list[Record], prompt: int, speed: float) -> dict:
    """Mean step time (ms) of the pure-decode window and the steps' mean context (k tokens)."""
    if not records or not all(_complete(r) for r in records):
        return {"ok": False, "why": "a stream failed or ended early"}
    times = [np.asarray(r.token_times, float) for r in records]
    gaps = np.concatenate([np.diff(t) for t in times])
    med = float(np.median(gaps)) if gaps.size else 0.0
    t_a = max(t[0] for t in times) + WINDOW_MARGIN_STEPS * med
    t_b = min(t[-1] for t in times) - WINDOW_MARGIN_STEPS * med
    span = steps = ctx_sum = 0.0
    per_stream, window_gaps = [], []
    for t in times:
        idx = np.nonzero((t >= t_a) & (t <= t_b))[0]
        if idx.size < 2:
            continue
        j0, j1 = int(idx[0]), int(idx[-1])
        span += t[j1] - t[j0]
        steps += j1 - j0
        per_stream.append((t[j1] - t[j0]) / (j1 - j0))
        window_gaps.append(np.diff(t[j0:j1 + 1]))
        # the step producing a stream's token j (0-based) reads prompt + j - 1 tokens of KV; by the
        # time that token arrives the stream has j + 1 tokens: prompt + (tokens by then) - 2, for every
        # stream q at about the same time (+-1 token: their front-end delays differ)
        at = t[j0 + 1:j1 + 1]
        held = sum(np.searchsorted(q, at, side="right") for q in times)
        ctx_sum += float(np.sum(len(times) * (prompt - 2) + held))
    if steps < 4:
        return {"ok": False, "why": f"pure-decode window too short ({int(steps)} gaps): more output tokens"}
    ms = 1000.0 * speed
    # the mean gap: single timestamps' noise divided by the steps.  A server (or client) that fell
    # behind delivers tokens in bursts when it catches up (gaps near 0): the share of such gaps says
    # how far the window can be trusted (the probe repeats a run above MAX_BURST_SHARE)
    gaps_all = np.concatenate(window_gaps)
    burst = float(np.mean(gaps_all < BURST_GAP * np.mean(gaps_all)))
    return {"ok": True, "step_ms": span / steps * ms, "step_ms_median": float(np.median(gaps_all)) * ms,
            "burst_share": burst,
            "ctx_ktokens": ctx_sum / steps / 1000.0, "gaps": int(steps),
            "step_ms_sd": float(np.std(per_stream)) * ms, "window_s": (t_b - t_a) * speed,
            "stream_spread": float(np.std(per_stream) / np.mean(per_stream))}


async def ttft_runs(url: str, model: str, prompt: int, reps: int, speed: float, seed: int = 0) -> list[float]:
    """TTFT (ms) of ``reps`` single requests, one after the other (the server idle in between)."""
    out = []
    for k in range(reps):
        t0 = time.perf_counter()
        rec = await _send(url, model, prompt, 2, t0, seed * 100_000 + k)
        if _complete(rec):
            out.append((rec.token_times[0] - rec.sent) * 1000.0 * speed)
    return out


async def _wait_tokens(rec: Record, n: int, task: asyncio.Future, timeout_s: float) -> bool:
    end = time.perf_counter() + timeout_s
    while len(rec.token_times) < n:
        if task.done() or time.perf_counter() > end:
            return False
        await asyncio.sleep(0.0005)
    return True


async def _burst_span(url: str, pacer: Record, task, models: list[str], t0: float, k0: int,
                      timeout_s: float) -> float | None:
    """Send one-token requests on ``models`` right after a pacer token; the pacer's next
    BURST_WINDOW_STEPS steps (wall s), None when the burst did not finish inside them."""
    i0 = len(pacer.token_times) - 1
    burst = await asyncio.gather(*[_send(url, m, 16, 1, t0, k0 + k) for k, m in enumerate(models)])
    if not await _wait_tokens(pacer, i0 + 1 + BURST_WINDOW_STEPS, task, timeout_s):
        return None
    t_end = pacer.token_times[i0 + BURST_WINDOW_STEPS]
    if not all(_complete(b) for b in burst) or max(b.token_times[-1] for b in burst) > t_end:
        return None
    return t_end - pacer.token_times[i0]


async def burst_load_ms(url: str, pacer_model: str, models: list[str], speed: float, *, seed: int = 0,
                        timeout_s: float = 120.0) -> dict:
    """Total load time (ms) of ``models`` (not resident): the pacer's window with the cold burst
    minus the same window with the same burst warm."""
    t0 = time.perf_counter()
    pacer = Record(0.0, 16, 2 * BURST_WINDOW_STEPS + 16)
    host, port, root = split_url(url)
    task = asyncio.ensure_future(_one(host, port, root + "/v1/completions", pacer_model, pacer, t0,
                                      prompt_ids(seed * 100_000 + 99_999, 16)))
    try:
        if not await _wait_tokens(pacer, 4, task, timeout_s):
            return {"ok": False, "why": "the pacer stream did not start"}
        cold = await _burst_span(url, pacer, task, models, t0, seed * 100_000, timeout_s)
        if cold is not None and await _wait_tokens(pacer, len(pacer.token_times) + 2, task, timeout_s):
            warm = await _burst_span(url, pacer, task, models, t0, seed * 100_000 + 1000, timeout_s)
        else:
            warm = None
    finally:
        await task
    if cold is None or warm is None:
        return {"ok": False, "why": f"a burst did not finish within {BURST_WINDOW_STEPS} pacer steps"}
    return {"ok": True, "load_ms": (cold - warm) * 1000.0 * speed, "cold_ms": cold * 1000.0 * speed,
            "warm_ms": warm * 1000.0 * speed}


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_tokens_from_metrics(text: str) -> float:
    """KV-cache tokens from vLLM's ``vllm:cache_config_info`` (num_gpu_blocks x block_size); NaN if absent."""
    for ln in text.splitlines():
        if ln.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(ln))
            try:
                return float(labels["num_gpu_blocks"]) * float(labels.get("block_size", 16))
            except (KeyError, ValueError):
                return math.nan
    return math.nan
