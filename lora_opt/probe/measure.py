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
* **Adapter load time** (:func:`burst_load_ms`): a long "pacer" stream on a resident adapter; a burst
  of K one-token requests on K non-resident adapters; the pacer's next M steps take longer by the
  burst's loads.  The same burst again (now resident) gives the same steps without the loads: the
  difference of the two M-step sums is K loads (the burst's prefill and LoRA terms cancel).  The warm
  window is measured :data:`WARM_REPEATS` times: their spread is the measurement's own noise, and a
  load <= 0 or within :data:`LOAD_MIN_SIGMAS` of it is ``noisy`` (:func:`load_verdict`).

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
from lora_opt.emulate.client import PromptTokens, Record, _one, split_url

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
#: pacer steps a load burst is given to finish in
BURST_WINDOW_STEPS = 40
#: times the warm burst's window is measured: their spread is the load measurement's noise
WARM_REPEATS = 3
#: warm windows whose burst overran the window (a busy machine) measured again, at most this many
WARM_RETRIES = 2
#: a load is trusted when it exceeds this many standard deviations of its own noise (with the sd from
#: WARM_REPEATS windows, a load that is really 0 passes ~5 % of the time: Student t, 2 dof)
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
    await _one(host, port, root + "/v1/completions", model, rec, t0, (prompts or PromptTokens()).prompt(k, in_len),
               count_token_ids=True)
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


async def _wait_tokens(rec: Record, n: int, task: asyncio.Future, timeout_s: float) -> bool:
    end = time.perf_counter() + timeout_s
    while len(rec.token_times) < n:
        if task.done() or time.perf_counter() > end:
            return False
        await asyncio.sleep(0.0005)
    return True


def _pacer_stopped(pacer: Record, task: asyncio.Future, timeout_s: float) -> str:
    """Why the pacer gave no more tokens (after :func:`_wait_tokens` gave up)."""
    if not task.done():
        return f"the pacer stream gave no token for {timeout_s:g} s"
    return (f"the pacer stream ended ({failure_note([pacer]) or f'all {pacer.out_len} tokens used'}) before the "
            "measurement did")


async def _burst_span(url: str, pacer: Record, task, models: list[str], t0: float, k0: int,
                      timeout_s: float, prompts: PromptTokens | None) -> tuple[float | None, str]:
    """Send one-token requests on ``models`` right after a pacer token; the pacer's next
    BURST_WINDOW_STEPS steps (wall s), or None and why (the burst did not finish inside them, a
    request failed)."""
    i0 = len(pacer.token_times) - 1
    burst = await asyncio.gather(*[_send(url, m, 16, 1, t0, k0 + k, prompts) for k, m in enumerate(models)])
    if not all(_complete(b) for b in burst):
        return None, f"a burst request failed: {failure_note([b for b in burst if not _complete(b)])}"
    if not await _wait_tokens(pacer, i0 + 1 + BURST_WINDOW_STEPS, task, timeout_s):
        return None, _pacer_stopped(pacer, task, timeout_s)
    t_end = pacer.token_times[i0 + BURST_WINDOW_STEPS]
    if max(b.token_times[-1] for b in burst) > t_end:
        return None, f"a burst did not finish within {BURST_WINDOW_STEPS} pacer steps"
    return t_end - pacer.token_times[i0], ""


def load_verdict(cold_ms: float, warm_ms: list[float]) -> dict:
    """The burst's load time (cold minus the warm windows' mean, ms), its noise (the sd of that
    difference, from the warm windows' spread) and ``noisy`` ('' or why it cannot be trusted: <= 0,
    or within LOAD_MIN_SIGMAS of its noise)."""
    warm = np.asarray(warm_ms, float)
    load = float(cold_ms - warm.mean())
    # cold and each warm window are the same measurement (but for the loads): the warm ones' sd is
    # one window's noise; cold minus a mean of n has sd * sqrt(1 + 1/n)
    noise = float(warm.std(ddof=1) * math.sqrt(1.0 + 1.0 / warm.size)) if warm.size > 1 else math.nan
    if not load > 0:
        why = (f"load {load:.3g} ms <= 0: the loads were not seen (cold window {cold_ms:.4g} ms, "
               f"warm {warm.mean():.4g} ms)")
    elif not load > LOAD_MIN_SIGMAS * noise:
        why = (f"load {load:.3g} ms within its noise (sd {noise:.3g} ms over {warm.size} warm windows; "
               f"needs > {LOAD_MIN_SIGMAS:g} sd)")
    else:
        why = ""
    return {"load_ms": load, "noise_ms": noise, "noisy": why}


async def burst_load_ms(url: str, pacer_model: str, models: list[str], speed: float, *, seed: int = 0,
                        timeout_s: float = 120.0, prompts: PromptTokens | None = None) -> dict:
    """Total load time (ms) of ``models`` (not resident): the pacer's window with the cold burst
    minus the same window with the same burst warm (WARM_REPEATS times; :func:`load_verdict`)."""
    t0 = time.perf_counter()
    prompts = prompts or PromptTokens()
    # twice the tokens the windows need (a server that delivers tokens in bursts -- vLLM's CPU build:
    # up to ~10 per read -- overshoots every wait), within max_model_len; cancelled when done
    pacer = Record(0.0, 16, prompts.longest(16, 2 * (1 + WARM_REPEATS + WARM_RETRIES) * (BURST_WINDOW_STEPS + 2) + 16))
    host, port, root = split_url(url)
    task = asyncio.ensure_future(_one(host, port, root + "/v1/completions", pacer_model, pacer, t0,
                                      prompts.prompt(seed * 100_000 + 99_999, 16), count_token_ids=True))
    spans, why = [], ""
    try:
        if not await _wait_tokens(pacer, 4, task, timeout_s):
            return {"ok": False, "why": f"the pacer stream did not start: {_pacer_stopped(pacer, task, timeout_s)}"}
        attempts = 0
        while len(spans) < 1 + WARM_REPEATS:         # the cold burst, then the same adapters warm
            if spans and not await _wait_tokens(pacer, len(pacer.token_times) + 2, task, timeout_s):
                why = _pacer_stopped(pacer, task, timeout_s)
                break
            span, why = await _burst_span(url, pacer, task, models, t0, seed * 100_000 + 1000 * attempts, timeout_s,
                                          prompts)
            attempts += 1
            if span is None:
                # a warm window can be measured again (the cold one cannot: its loads are done)
                if spans and why.startswith("a burst did not finish") and attempts <= WARM_REPEATS + WARM_RETRIES:
                    continue
                break
            spans.append(span * 1000.0 * speed)
    finally:
        task.cancel()             # (closes the connection: vLLM aborts the request)
        await asyncio.gather(task, return_exceptions=True)
    if len(spans) < 1 + WARM_REPEATS:
        return {"ok": False, "why": why}
    return {"ok": True, "cold_ms": spans[0], "warm_ms": float(np.mean(spans[1:])), "warm_spans_ms": spans[1:],
            **load_verdict(spans[0], spans[1:])}


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
