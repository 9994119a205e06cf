"""An open-loop streaming client (asyncio, raw HTTP/1.1): sends each request of a stream at its arrival
time (/ speed) whatever the server's state, and measures TTFT, inter-token gaps and finish times
from the streamed chunks' arrival times, scaled back to simulated seconds (x speed).  Requests are
``/v1/completions`` with a prompt of ``in_len`` token ids, ``max_tokens = out_len`` and
``ignore_eos`` -- the twin's request exactly."""
from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np

from twin.workload import Requests


@dataclass
class Record:
    """One request as the client saw it (wall seconds since the client's start)."""

    sent: float
    in_len: int
    out_len: int
    token_times: list = field(default_factory=list)
    status: int = 0
    error: str = ""
    due: float = 0.0            # when it should have been sent (arrival / speed)
    usage_tokens: int = 0       # completion_tokens of the usage chunk (0: none seen)
    done_marker: bool = False   # the stream ended with ``data: [DONE]``


@dataclass
class Summary:
    """The twin's metrics (``twin.simulate``'s definitions) from what the client saw, in simulated
    seconds: throughput = (prompt + output tokens of requests finished by T) / T; TTFT of those
    requests; ITL = every gap between consecutive tokens that arrived by T."""

    completed: int
    throughput_tok_s: float
    ttft_mean_ms: float
    itl_mean_ms: float
    errors: int
    tokens: int = 0
    send_late_p99_ms: float = 0.0
    """99th percentile of how late the client sent a request (wall ms): above a few ms the client
    could not keep time (an oversubscribed machine) and the numbers measure the machine too."""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def summarise(records: list[Record], speed: float, duration_s: float) -> Summary:
    tok, ttft, gaps, done, errors = 0, [], [], 0, 0
    for r in records:
        if r.status != 200 or len(r.token_times) < r.out_len:
            errors += r.status != 200
            continue
        t = np.asarray(r.token_times) * speed
        if t[-1] <= duration_s:
            done += 1
            tok += r.in_len + r.out_len
            ttft.append(t[0] - r.sent * speed)
        g = np.diff(t[t <= duration_s])
        gaps.extend(g.tolist())
    n_tokens = sum(len(r.token_times) for r in records)
    late = np.array([r.sent - r.due for r in records]) * 1000.0
    return Summary(send_late_p99_ms=float(np.percentile(late, 99)) if late.size else 0.0, completed=done, throughput_tok_s=tok / duration_s,
                   ttft_mean_ms=float(np.mean(ttft) * 1000) if ttft else float("nan"),
                   itl_mean_ms=float(np.mean(gaps) * 1000) if gaps else float("nan"), errors=errors,
                   tokens=n_tokens)


#: wall seconds a connection may take to open before the request counts as failed
CONNECT_TIMEOUT_S = 10.0


async def _one(host: str, port: int, path: str, model: str, rec: Record, t0: float,
               prompt: list | None = None, include_usage: bool = False) -> None:
    """One streamed request on its own connection (``Connection: close``: the stream ends at EOF).
    A raw HTTP/1.1 exchange: the client must send on time and timestamp chunks as they come, and an
    HTTP library's per-chunk work on a busy core delays both.  A chunk is timestamped when its
    ``"text":`` arrives (the usage chunk has none); ``prompt``: the token ids (default ``[1] * in_len``);
    ``include_usage``: ask for the usage chunk (``vllm bench serve`` does) and record its count."""
    payload = {"model": model, "prompt": prompt if prompt is not None else [1] * rec.in_len,
               "max_tokens": rec.out_len, "ignore_eos": True, "stream": True}
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    body = json.dumps(payload).encode()
    sent = time.perf_counter()
    rec.sent = sent - t0
    # the send instant, for an emulator on this host (lora_opt.emulate.server.SENT_HEADER; vLLM ignores it)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Lora-Opt-Sent: {sent:.6f}\r\nConnection: close\r\n\r\n").encode()
    writer = None
    last = b""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        writer.write(head + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("connection closed before a response")
        rec.status = int(status_line.split()[1])
        tail = b""
        times = rec.token_times
        while True:
            data = await reader.read(65536)
            if not data:
                break
            buf = tail + data
            n = buf.count(b'"text":') - tail.count(b'"text":')
            if n:
                now = time.perf_counter() - t0
                times.extend([now] * n)
            tail = buf[-8:]
            last = (last + data)[-4096:]
    except asyncio.TimeoutError:
        rec.error = f"connect timeout ({CONNECT_TIMEOUT_S:g} s)"
    except (OSError, ValueError, IndexError) as exc:
        rec.error = repr(exc)
    finally:
        if writer is not None:
            writer.close()
        rec.done_marker = b"data: [DONE]" in last
        if include_usage:
            m = _USAGE.findall(last)
            rec.usage_tokens = int(m[-1]) if m else 0


_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


async def replay(base_url: str, req: Requests, adapter_ids: list[str], speed: float,
                 concurrency_probe: list | None = None) -> list[Record]:
    """Send every request of ``req`` at ``arrival / speed`` wall seconds from now (adapter index k
    -> model ``adapter_ids[k]``) and wait for all of them."""
    u = urlparse(base_url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    path = (u.path.rstrip("/") or "") + "/v1/completions"
    if path.startswith("/v1/v1/"):
        path = path[3:]
    records = [Record(0.0, int(i), int(o), due=float(a) / speed) for a, i, o in zip(req.arrival, req.in_len, req.out_len)]
    t0 = time.perf_counter()
    tasks = []
    for k in range(len(req)):
        delay = t0 + float(req.arrival[k]) / speed - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(_one(host, port, path, adapter_ids[int(req.adapter[k])], records[k], t0)))
        if concurrency_probe is not None:
            concurrency_probe.append(sum(not t.done() for t in tasks[-2000:]))
    await asyncio.gather(*tasks)
    return records


#: the error of a request the replay never sent (stopped first)
NOT_SENT = "not sent (interrupted)"


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, root path) of an endpoint URL (``http://h:p`` or ``http://h:p/v1``)."""
    u = urlparse(url)
    root = u.path.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    return u.hostname or "127.0.0.1", u.port or 80, root


def prompt_ids(k: int, n: int) -> list:
    """``n`` token ids, different for every request ``k`` (no shared prefix a cache could reuse)."""
    start = (k * 7919) % 20000
    return [100 + (start + j) % 20000 for j in range(n)]


async def replay_routed(urls: list[str], req: Requests, target: np.ndarray, models: list[str], speed: float, *,
                        end_s: float, stop: asyncio.Event | None = None, on_start=None) -> list[Record]:
    """Send request k to ``urls[target[k]]`` (model ``models[adapter]``; ``target`` -1: not sent,
    recorded as failed) at ``arrival / speed`` wall seconds from the start, streaming with the usage
    chunk; at ``end_s / speed`` (or when ``stop`` is set) requests still in flight are cancelled
    and recorded with ``error = "unfinished"``.  ``on_start(t0)``: called once with the start."""
    ends = [split_url(u) for u in urls]
    records = [Record(0.0, int(i), int(o), due=float(a) / speed)
               for a, i, o in zip(req.arrival, req.in_len, req.out_len)]
    t0 = time.perf_counter()
    if on_start is not None:
        on_start(t0)
    stop = stop or asyncio.Event()
    tasks: dict[int, asyncio.Future] = {}
    for k in range(len(req)):
        delay = t0 + float(req.arrival[k]) / speed - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)        # plain sleep: the send time is what is measured
        if stop.is_set():
            break
        g = int(target[k])
        if g < 0:
            records[k].error = "not routed (the placement routes its adapter nowhere)"
            records[k].sent = records[k].due
            continue
        host, port, root = ends[g]
        tasks[k] = asyncio.ensure_future(_one(host, port, root + "/v1/completions", models[int(req.adapter[k])],
                                              records[k], t0, prompt_ids(k, records[k].in_len), True))
    pending = [t for t in tasks.values() if not t.done()]
    if pending and not stop.is_set():
        left = t0 + end_s / speed - time.perf_counter()
        waiter = asyncio.ensure_future(stop.wait())
        done_all = asyncio.ensure_future(asyncio.wait(pending, timeout=max(0.0, left)))
        await asyncio.wait([done_all, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        done_all.cancel()
    for k, t in tasks.items():
        if not t.done():
            t.cancel()
            records[k].error = records[k].error or "unfinished"
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    for k in range(len(records)):
        if k not in tasks and not records[k].error:
            records[k].error = NOT_SENT
    return records
