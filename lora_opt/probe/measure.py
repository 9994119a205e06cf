"""What ``lora-opt probe`` can observe from outside a server, and how each measurement isolates one
estimator (times are converted to simulated ms: wall x ``speed``; ``speed`` = 1 for vLLM).

* **Step time in a pure-decode window** (:func:`window_step`): B streams sent together with
  ``ignore_eos`` and the same ``max_tokens``; once every stream has its first token (all prompts
  done) and before the first one ends, every step is a decode of exactly B sequences, so each
  stream's inter-token gaps are those steps.  A stream's mean gap over the window is
  ``(t_last - t_first) / gaps``: the noise of single timestamps (event-loop lag) is divided by the
  number of steps; a window where tokens came in bursts (the server fell behind and caught up) is
  flagged by its share of near-zero gaps and repeated.  The steps' mean context is counted from the token times
  (each stream's KV holds its prompt and the tokens it has so far; +-1 token per stream).  A window
  is trusted only when the client resolved its steps (:func:`window_noise`): tokens that all came in
  one read (no gap above zero), a step <= 0, bursts or disagreeing streams make it ``noisy``.
* **Prefill cost** (:func:`ttft_runs`): the TTFT of one request on an idle server is its chunked
  prefill steps plus a constant (HTTP, front end); the slope over prompt lengths is the per-token cost.
* **Adapter load time** (:func:`cycle_load_ms`): lone one-token requests, one after the other, cycling
  over adapters: over a few that sit in slots (no load), over one more than the slots (vLLM's LRU
  misses on every request: each copies an adapter from the CPU cache into a slot) and over one more
  than the CPU cache (each reads one from disk first).  The differences of the median TTFTs are one
  load each; the medians' spread is the measurement's own noise, and a load <= 0 or within
  :data:`LOAD_MIN_SIGMAS` of it is ``noisy`` (:func:`load_verdict`).  (Issue 24: a burst beside a
  pacer stream, the earlier method, left the real CPU server's 2-9 ms loads inside its noise.)

Prompts are token ids the server accepts (:class:`lora_opt.emulate.client.PromptTokens`); a failed
request's note carries the HTTP status and the server's message (:func:`failure_note`).
"""
from __future__ import annotations

import asyncio
import math
import re
import time

import numpy as np

# the emulator's raw-HTTP streaming request (a timestamp per token: counted from each chunk's token
# ids, as vLLM merges tokens into one chunk when its front end falls behind): the client validate
# uses, shared
from lora_opt.emulate.client import PromptTokens, Record, split_url, stream_one

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
#: a window needs at least this many gaps above zero: fewer, and the tokens came in a few reads (a
#: server or proxy that buffers the stream) -- the client cannot see the steps at all
MIN_POSITIVE_GAPS = 4
#: adapters of the warm cycle (every one in a slot): its lone requests load nothing
WARM_CYCLE = 4
#: passes over each cycle measured, after an unmeasured one that brings vLLM's two LRU tiers to the
#: cycle's steady state; the warm cycle is short, so more passes give it as many requests as the others
LOAD_PASSES = {"warm": 8, "cpu": 2, "disk": 1}
#: rounds of the three cycles (warm, CPU, disk), interleaved: a server whose speed drifts during the
#: measurement slows all three alike
LOAD_ROUNDS = 2
#: prompt tokens of a lone load request (one output token): a short prefill, the load dominates
LOAD_PROMPT_TOKENS = 16
#: a load is trusted when it exceeds this many standard deviations of its own noise (a load that is
#: really 0 passes ~0.1 % of the time)
LOAD_MIN_SIGMAS = 3.0


def failure_note(records: list[Record]) -> str:
    """Why the first failed request of ``records`` failed: the HTTP status and the server's message
    (``Record.error``), or how far its stream got."""
    for r in records:
        if r.error:
            return r.error
        if r.status != 200:
            return f"HTTP {r.status}" if r.status else "no response"
        if len(r.token_times) < r.out_len:
            return (f"HTTP 200 but the stream ended after {len(r.token_times)} of {r.out_len} tokens "
                    f"(prompt {r.in_len} tokens: the server cut max_tokens at its max_model_len?)")
    return ""


async def _send(url: str, model: str, in_len: int, max_tokens: int, t0: float, k: int,
                prompts: PromptTokens | None) -> Record:
    host, port, root = split_url(url)
    rec = Record(0.0, int(in_len), int(max_tokens))
    await stream_one(host, port, root + "/v1/completions", model, rec, t0,
                     (prompts or PromptTokens()).prompt(k, in_len), count_token_ids=True)
    return rec


def _complete(rec: Record) -> bool:
    return rec.status == 200 and len(rec.token_times) >= rec.out_len


async def batch_run(url: str, models: list[str], batch: int, prompt: int, out: int, seed: int = 0,
                    prompts: PromptTokens | None = None) -> list[Record]:
    """``batch`` streams sent at once, stream k on ``models[k % len(models)]``."""
    t0 = time.perf_counter()
    return list(await asyncio.gather(*[_send(url, models[k % len(models)], prompt, out, t0, seed * 100_000 + k,
                                             prompts) for k in range(batch)]))


def window_step(records: list[Record], prompt: int, speed: float) -> dict:
    """Mean step time (ms) of the pure-decode window and the steps' mean context (k tokens)."""
    if not records:
        return {"ok": False, "why": "no stream"}
    if not all(_complete(r) for r in records):
        return {"ok": False, "why": f"a stream failed: {failure_note([r for r in records if not _complete(r)])}"}
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
    mean_gap = float(np.mean(gaps_all))
    # (<=: when every gap is 0 -- all tokens in one read -- every gap is a burst)
    burst = float(np.mean(gaps_all <= BURST_GAP * mean_gap))
    spread = float(np.std(per_stream) / np.mean(per_stream)) if np.mean(per_stream) > 0 else math.inf
    return {"ok": True, "step_ms": span / steps * ms, "step_ms_median": float(np.median(gaps_all)) * ms,
            "burst_share": burst, "positive_gaps": int(np.count_nonzero(gaps_all > 0)),
            "ctx_ktokens": ctx_sum / steps / 1000.0, "gaps": int(steps),
            "step_ms_sd": float(np.std(per_stream)) * ms, "window_s": (t_b - t_a) * speed,
            "stream_spread": spread}


def window_noise(w: dict) -> str:
    """Why a measured window's step cannot be trusted ('' when it can): no gap the client could time,
    a step <= 0, tokens in bursts, streams that disagree."""
    if w["positive_gaps"] < MIN_POSITIVE_GAPS:
        return (f"no measurable token gaps ({w['positive_gaps']} of {w['gaps']} gaps above 0: the tokens came "
                "in a few reads -- a server or proxy buffering the stream?)")
    if not w["step_ms"] > 0:
        return f"step {w['step_ms']:.3g} ms <= 0"
    if w["burst_share"] > MAX_BURST_SHARE:
        return (f"tokens came in bursts ({w['burst_share']:.0%} of gaps near 0, at most {MAX_BURST_SHARE:.0%}): "
                "the machine could not keep time; lower the server's --speed / load")
    if w["stream_spread"] > MAX_STREAM_SPREAD:
        return (f"streams disagreed (relative sd {w['stream_spread']:.1%}, at most {MAX_STREAM_SPREAD:.0%}): "
                "the machine could not keep time; lower the server's --speed / load")
    return ""


async def ttft_runs(url: str, model: str, prompt: int, reps: int, speed: float, seed: int = 0,
                    prompts: PromptTokens | None = None) -> tuple[list[float], str]:
    """TTFT (ms) of ``reps`` single requests, one after the other (the server idle in between), and
    the first failure's note ('' when none failed)."""
    out, note = [], ""
    for k in range(reps):
        t0 = time.perf_counter()
        rec = await _send(url, model, prompt, 2, t0, seed * 100_000 + k, prompts)
        if _complete(rec):
            out.append((rec.token_times[0] - rec.sent) * 1000.0 * speed)
        else:
            note = note or failure_note([rec])
    return out, note


def _median_sd(x: np.ndarray) -> float:
    """The sd of a sample's median, from its MAD (robust to the odd request the machine delayed)."""
    mad = float(np.median(np.abs(x - np.median(x))))
    return 1.2533 * 1.4826 * mad / math.sqrt(x.size)


def load_verdict(cold_ms: list[float], warm_ms: list[float]) -> dict:
    """One load's cost (ms): the median TTFT of lone requests that load minus that of lone requests
    that do not; its noise (the sd of that difference, each median's from its MAD); ``noisy`` ('' or
    why it cannot be trusted: <= 0, or within :data:`LOAD_MIN_SIGMAS` of its noise)."""
    cold, warm = np.asarray(cold_ms, float), np.asarray(warm_ms, float)
    load = float(np.median(cold) - np.median(warm))
    noise = math.hypot(_median_sd(cold), _median_sd(warm))
    if not load > 0:
        why = (f"load {load:.3g} ms <= 0: the loads were not seen (median TTFT {np.median(cold):.4g} ms loading, "
               f"{np.median(warm):.4g} ms not)")
    elif not load > LOAD_MIN_SIGMAS * noise:
        why = (f"load {load:.3g} ms within its noise (sd {noise:.3g} ms over {cold.size} + {warm.size} requests; "
               f"needs > {LOAD_MIN_SIGMAS:g} sd)")
    else:
        why = ""
    return {"load_ms": load, "noise_ms": noise, "noisy": why, "n": int(cold.size),
            "cold_ms": float(np.median(cold)), "warm_ms": float(np.median(warm))}


def load_cycles(slots: list[str], cpu_only: list[str], disk_only: list[str]) -> dict[str, list[str]]:
    """The adapter cycles of :func:`cycle_load_ms` on a server with ``len(slots)`` LoRA slots and
    ``len(slots) + len(cpu_only)`` CPU-cache entries, each adapter resident where its name says: cycling
    lone requests over A + 1 adapters of an A-entry LRU misses on every request, over fewer never."""
    return {"warm": slots[:WARM_CYCLE], "cpu": slots + cpu_only[:1], "disk": slots + cpu_only + disk_only[:1]}


async def cycle_load_ms(url: str, cycles: dict[str, list[str]], speed: float, *, seed: int = 0,
                        prompts: PromptTokens | None = None) -> dict:
    """Adapter loads from lone requests (the server idle in between): TTFT cycling over the ``warm``
    adapters (in slots: no load), over one adapter more than the slots (``cpu``: every request copies
    one from the CPU cache into a slot) and one more than the CPU cache (``disk``: every request reads
    one from disk, then copies it); the loads are ``cpu`` - ``warm`` and ``disk`` - ``warm``
    (:func:`load_verdict`; ``disk`` pays both).  vLLM loads before the step's forward pass, in the step,
    as the twin does."""
    ttft: dict[str, list[float]] = {k: [] for k in cycles}
    k = seed * 100_000
    for _ in range(LOAD_ROUNDS):
        for kind, cycle in cycles.items():
            for p in range(1 + LOAD_PASSES[kind]):
                for model in cycle:
                    k += 1
                    rec = await _send(url, model, LOAD_PROMPT_TOKENS, 1, time.perf_counter(), k, prompts)
                    if not _complete(rec):
                        return {"ok": False, "why": f"a load request on {model} failed: {failure_note([rec])}"}
                    if p:           # the first pass settles the LRU tiers
                        ttft[kind].append((rec.token_times[0] - rec.sent) * 1000.0 * speed)
    return {"ok": True, "ttft_ms": ttft,
            **{kind: load_verdict(ttft[kind], ttft["warm"]) for kind in ("cpu", "disk")}}


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_blocks_from_metrics(text: str) -> tuple[float, float]:
    """(KV-cache blocks, tokens per block) from vLLM's ``vllm:cache_config_info`` (``num_gpu_blocks``,
    ``block_size``: 16 when the label is absent); NaNs if the gauge is absent."""
    for ln in text.splitlines():
        if ln.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(ln))
            try:
                return float(labels["num_gpu_blocks"]), float(labels.get("block_size", 16))
            except (KeyError, ValueError):
                return math.nan, math.nan
    return math.nan, math.nan


def kv_tokens_from_metrics(text: str) -> float:
    """KV-cache tokens from vLLM's ``vllm:cache_config_info`` (num_gpu_blocks x block_size); NaN if absent."""
    blocks, block_size = kv_blocks_from_metrics(text)
    return blocks * block_size
