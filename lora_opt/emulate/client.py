"""An open-loop streaming client (asyncio, raw HTTP/1.1): sends each request of a stream at its arrival
time (/ speed) whatever the server's state, and measures TTFT, inter-token gaps and finish times
from the streamed chunks' arrival times, scaled back to simulated seconds (x speed).  Requests are
``/v1/completions`` with a prompt of ``in_len`` token ids, ``max_tokens = out_len`` and
``ignore_eos`` -- the twin's request exactly.

Prompt token ids: :func:`prompt_ids` draws them from a range any large vocabulary holds, or, given a
:class:`PromptTokens` learned from the server (:func:`server_prompt_tokens`: ids its own ``/tokenize``
produced, and its ``max_model_len``), from ids the server's model is known to have -- a model with a
small vocabulary answers every id outside it ``400 Token id N is out of vocabulary``."""
from __future__ import annotations

import asyncio
import functools
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
    error: str = ""            # why it failed: "HTTP 400: BadRequestError: <the server's message>", an exception
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


async def stream_one(host: str, port: int, path: str, model: str, rec: Record, t0: float,
                     prompt: list | None = None, include_usage: bool = False, count_token_ids: bool = False,
                     extra_headers: str = "") -> None:
    """One streamed request on its own connection (``Connection: close``: the stream ends at EOF).
    A raw HTTP/1.1 exchange: the client must send on time and timestamp chunks as they come, and an
    HTTP library's per-chunk work on a busy core delays both.  A chunk is timestamped when its
    ``"text":`` arrives (the usage chunk has none); ``prompt``: the token ids (default ``[1] * in_len``);
    ``include_usage``: ask for the usage chunk (``vllm bench serve`` does) and record its count;
    ``count_token_ids``: ask for each chunk's token ids (``return_token_ids``) and count those: vLLM's
    front end merges the tokens of several steps into one chunk when it falls behind the engine
    (seen on its CPU build: 62 chunks for 64 tokens), so one chunk is not always one token (a server
    that ignores the field: one token per chunk, as without it).  ``extra_headers``: more header lines
    (``"Name: value\r\n"`` each)."""
    payload = {"model": model, "prompt": prompt if prompt is not None else [1] * rec.in_len,
               "max_tokens": rec.out_len, "ignore_eos": True, "stream": True}
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    if count_token_ids:
        payload["return_token_ids"] = True
    body = json.dumps(payload).encode()
    sent = time.perf_counter()
    rec.sent = sent - t0
    # the send instant, for an emulator on this host (lora_opt.emulate.server.SENT_HEADER; vLLM ignores it)
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Lora-Opt-Sent: {sent:.6f}\r\n{extra_headers}Connection: close\r\n\r\n").encode()
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
            if count_token_ids:
                # whole SSE events only (an event's token ids may straddle two reads)
                *events, tail = (tail + data).split(b"\n\n")
                n = sum(_event_tokens(ev) for ev in events)
            else:
                buf = tail + data
                n = buf.count(b'"text":') - tail.count(b'"text":')
                tail = buf[-8:]
            if n:
                now = time.perf_counter() - t0
                times.extend([now] * n)
            last = (last + data)[-4096:]
    except asyncio.TimeoutError:
        rec.error = f"connect timeout ({CONNECT_TIMEOUT_S:g} s)"
    except (OSError, ValueError, IndexError) as exc:
        rec.error = repr(exc)
    finally:
        if writer is not None:
            writer.close()
        rec.done_marker = b"data: [DONE]" in last
        # the server's own words: an error status's body, or an error event inside a 200 stream
        # (vLLM reports errors raised after the stream started that way)
        if not rec.error and rec.status and (rec.status != 200 or b'data: {"error"' in last):
            rec.error = server_error(rec.status, last)
        if include_usage:
            m = _USAGE.findall(last)
            rec.usage_tokens = int(m[-1]) if m else 0


_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_TOKEN_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')


def _event_tokens(event: bytes) -> int:
    """Tokens of one SSE event: its ``token_ids`` (``"prompt_token_ids"`` does not match: no quote
    before ``token_ids`` there), else 1 per ``"text":`` (a server without ``return_token_ids``), 0 for
    the usage chunk, ``[DONE]`` or an error."""
    if b'"text":' not in event:
        return 0
    m = _TOKEN_IDS.search(event)
    if m is None:
        return 1
    ids = m.group(1).strip()
    return ids.count(b",") + 1 if ids else 0
_SSE_ERROR = re.compile(rb'data: (\{"error".*?)\n\n', re.S)


def _dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (what is left of it: a tail may start mid-chunk)."""
    out, rest = [], body
    while rest:
        size, sep, rest = rest.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            return body          # not at a chunk boundary: the raw bytes, JSON is found in them anyway
        if not sep or n == 0:
            break
        out.append(rest[:n])
        rest = rest[n + 2:]
    return b"".join(out)


def error_message(body) -> str:
    """``TYPE: message (param P)`` of a vLLM error body: 0.32/0.33's ``{"error": {message, type, param,
    code}}``, 0.8.5's flat ``{"object": "error", message, type, param, code}``, or
    ``{"error": "Unauthorized"}``; the text itself when it is not JSON (a proxy's page)."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    text = body.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:300] or "(empty body)"
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if not isinstance(err, dict):
        return str(err)[:300]
    message = " ".join(str(err.get("message", "")).split())[:300] or json.dumps(err)[:300]
    kind = err.get("type")
    param = err.get("param")
    return (f"{kind}: " if kind else "") + message + (f" (param {param})" if param else "")


def server_error(status: int, raw: bytes) -> str:
    """The failure note of a response (``raw``: its headers and body, or their tail): ``HTTP <status>``
    and the server's message."""
    events = _SSE_ERROR.findall(raw)            # an error event of a stream (in one chunk)
    if events:
        return f"HTTP {status}: {error_message(events[-1])}"
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:                      # the tail began after the headers
        body = raw
    elif b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return f"HTTP {status}: {error_message(body)}"


async def replay(base_url: str, req: Requests, adapter_ids: list[str], speed: float,
                 concurrency_probe: list | None = None, session_header: str | None = None,
                 count_token_ids: bool = False) -> list[Record]:
    """Send every request of ``req`` at ``arrival / speed`` wall seconds from now (adapter index k
    -> model ``adapter_ids[k]``) and wait for all of them.  ``session_header``: also send the adapter
    id in this header (e.g. ``X-Session-ID``, the key vLLM's router ``consistent_hash`` hashes);
    ``count_token_ids``: count each chunk's token ids (a real vLLM merges steps into one chunk when
    its front end falls behind; see :func:`stream_one`)."""
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
        model = adapter_ids[int(req.adapter[k])]
        extra = f"{session_header}: {model}\r\n" if session_header else ""
        tasks.append(asyncio.ensure_future(stream_one(host, port, path, model, records[k], t0, extra_headers=extra,
                                                      count_token_ids=count_token_ids)))
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


def prompt_ids(k: int, n: int, pool=None) -> list:
    """``n`` token ids, different for every request ``k`` (no shared prefix a cache could reuse):
    drawn from ``pool`` (ids the server's tokenizer produced, :class:`PromptTokens`), or without it
    from 100..20,099 (a range any large vocabulary holds)."""
    if pool is not None and len(pool):
        ids = pool if isinstance(pool, np.ndarray) else np.asarray(pool)
        size = len(ids)
        # a start and a stride per request: two prompts share a prefix only if both match (~1/size^2);
        # arithmetic, not a generator per request: the send loop pays for it (~20 us per 1,000 tokens)
        stride = 1 + (k * 104_729) % max(size - 1, 1)
        return ids[(k * 7919 + stride * np.arange(n, dtype=np.int64)) % size].tolist()
    start = (k * 7919) % 20000
    return [100 + (start + j) % 20000 for j in range(n)]


#: a text whose tokens are many distinct ids of any byte-level or word-piece vocabulary: every printable
#: ASCII character alone and in pairs, and common English words
TOKENIZE_TEXT = (" ".join(chr(c) for c in range(33, 127)) + " "
                 + " ".join(chr(a) + chr(b) for a in range(97, 123) for b in range(97, 123, 3)) + " "
                 + "the of and to in is was for on that with as by at from his her they this which be are have "
                   "not or an one had but their all were when there can who more its time into only some "
                   "could them other than then now my first new any these two may people way would "
                   "About Above After Again Below Between Could Every Great House Little Model Number Other "
                   "0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14 #include <stdio.h> def main(): return {} [] () ;")
#: fewer distinct ids than this from /tokenize: the pool is not used (prompts would repeat)
MIN_POOL = 16


@dataclass(frozen=True)
class PromptTokens:
    """What a server accepts as a prompt: ``ids``, token ids its tokenizer produced (so within its
    model's vocabulary; empty: the default range of :func:`prompt_ids`), ``max_model_len`` (its base
    model card's; None when it does not say), and where both came from."""

    ids: tuple = ()
    max_model_len: int | None = None
    source: str = "default ids 100..20099"

    @functools.cached_property
    def _pool(self) -> np.ndarray:
        return np.asarray(self.ids, dtype=np.int64)

    def prompt(self, k: int, n: int) -> list:
        return prompt_ids(k, n, self._pool)

    def longest(self, out_tokens: int, wanted: int) -> int:
        """The longest prompt (<= ``wanted``) that leaves room for ``out_tokens`` within
        ``max_model_len`` (vLLM refuses a longer prompt, and cuts the output short of a longer sum)."""
        return wanted if self.max_model_len is None else max(1, min(wanted, self.max_model_len - out_tokens))


async def server_prompt_tokens(url: str, timeout: float = 10.0) -> PromptTokens:
    """Ask the server: its base model card's ``max_model_len`` (``GET /v1/models``) and the token ids of
    :data:`TOKENIZE_TEXT` (``POST /tokenize``, as ``vllm bench serve`` does).  A server without
    ``/tokenize`` (404, an older emulator) gets the default range, and ``source`` says so."""
    import httpx  # only where a server is asked: keeps the CLI's start-up light

    host, port, root = split_url(url)
    base = f"http://{host}:{port}{root}"
    mml, model = None, None
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        try:
            r = await client.get(base + "/v1/models")
            cards = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            cards = []
        card = next((c for c in cards if isinstance(c, dict) and not c.get("parent")), None)
        if card is not None:
            model = card.get("id")
            mml = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) else None
        try:
            r = await client.post(base + "/tokenize", json={"model": model, "prompt": TOKENIZE_TEXT,
                                                            "add_special_tokens": False})
        except httpx.HTTPError as exc:
            return PromptTokens((), mml, f"default ids 100..20099 (POST /tokenize: {exc!r})")
        if r.status_code != 200:
            return PromptTokens((), mml, f"default ids 100..20099 (POST /tokenize: HTTP {r.status_code}: "
                                         f"{error_message(r.content)})")
        try:
            body = r.json()
            ids = tuple(sorted({int(t) for t in body["tokens"] if int(t) >= 0}))
            mml = mml if mml is not None else (body.get("max_model_len") if isinstance(body.get("max_model_len"), int)
                                               else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return PromptTokens((), mml, "default ids 100..20099 (POST /tokenize answered no token list)")
    if len(ids) < MIN_POOL:
        return PromptTokens((), mml, f"default ids 100..20099 (POST /tokenize gave {len(ids)} distinct ids)")
    return PromptTokens(ids, mml, f"{len(ids)} ids from POST /tokenize (ids {ids[0]}..{ids[-1]})")


async def replay_routed(urls: list[str], req: Requests, target: np.ndarray, models: list[str], speed: float, *,
                        end_s: float, stop: asyncio.Event | None = None, on_start=None,
                        prompts: PromptTokens | None = None, admit=None,
                        session_header: str | None = None) -> list[Record]:
    """Send request k to ``urls[target[k]]`` (model ``models[adapter]``; ``target`` -1: not sent,
    recorded as failed) at ``arrival / speed`` wall seconds from the start, streaming with the usage
    chunk; at ``end_s / speed`` (or when ``stop`` is set) requests still in flight are cancelled
    and recorded with ``error = "unfinished"``.  ``on_start(t0)``: called once with the start;
    ``prompts``: the servers' token ids (default: :func:`prompt_ids`'s range); ``admit(k)``, asked
    at send time: None sends request k, a string keeps it back (recorded with that string as its
    error, never sent: e.g. its adapter is not served by anyone yet); ``session_header``: also send the
    adapter id in this header (as :func:`replay`)."""
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
        held = admit(k) if admit is not None else None
        if held is not None:
            records[k].error = held
            records[k].sent = records[k].due
            continue
        if g < 0:
            records[k].error = "not routed (the placement routes its adapter nowhere)"
            records[k].sent = records[k].due
            continue
        host, port, root = ends[g]
        prompt = (prompts or PromptTokens()).prompt(k, records[k].in_len)
        model = models[int(req.adapter[k])]
        extra = f"{session_header}: {model}\r\n" if session_header else ""
        tasks[k] = asyncio.ensure_future(stream_one(host, port, root + "/v1/completions", model,
                                                    records[k], t0, prompt, True, extra_headers=extra))
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
