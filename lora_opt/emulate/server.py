"""One emulated vLLM instance's HTTP surface (FastAPI on uvicorn, as vLLM serves).

Streams: a request's tokens reach its response through the request's ``asyncio.Event`` (set by the
engine when tokens are due); the response writes every token due since the last write as one SSE
chunk each (vLLM's chunks), in one socket write.  A client that disconnects -- seen by a watcher
of the ASGI ``http.disconnect`` message, or by a failed write -- aborts the request in the engine
(its KV blocks are freed), as vLLM aborts it.  Overload queues in the engine (WAITING); a
connection is never refused by the emulator.
"""
# no "from __future__ import annotations": FastAPI reads the route annotations (Request) at definition

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from lora_opt.emulate.engine import BASE_ADAPTER, OnlineEngine
from lora_opt.emulate.metrics import EngineMetrics
from lora_opt.emulate.protocol import APIError, Formatter, parse_request

#: the vLLM version /version reports when the profile does not say
EMULATOR_TAG = "lora-opt-emulate"


@dataclass
class Instance:
    """An emulated engine and what its API needs: the served model name, adapter ids -> engine
    adapter index (``loaded`` = servable now: /v1/unload_lora_adapter takes one out)."""

    engine: OnlineEngine
    model: str
    adapters: dict[str, int]
    vllm_version: str
    metrics: EngineMetrics
    max_model_len: int
    runtime_lora_updating: bool = False
    free_slots: list = field(default_factory=list)
    """Engine indices not yet taken by an adapter loaded at run time."""
    loaded: set = field(default_factory=set)
    first_token_late: deque = field(default_factory=lambda: deque(maxlen=100_000))
    """Wall seconds each streamed first token left after its due time (the machine's delay, not
    the schedule's: TTFT measured by a client includes it)."""

    def __post_init__(self):
        self.loaded = set(self.adapters)
        self.metrics.engine = self.engine

    def adapter_of(self, model: str) -> int:
        if model in ("", self.model):
            return BASE_ADAPTER
        if model in self.loaded:
            return self.adapters[model]
        raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError")


def _error(exc: APIError):
    from starlette.responses import JSONResponse
    return JSONResponse(exc.body(), status_code=exc.status)


def _stream_response(inst: Instance, req, fmt: Formatter, finish_reason: str):
    # starlette only where an emulator runs
    from starlette.responses import Response

    class SSE(Response):
        media_type = "text/event-stream"

        def __init__(self):
            super().__init__(content=None, media_type=self.media_type)

        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            watcher = asyncio.ensure_future(_watch_disconnect(receive, req))
            sent = 0
            try:
                first = fmt.first_chunk()
                if first:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                while True:
                    await req.event.wait()
                    req.event.clear()
                    if req.aborted or req.gone:
                        return
                    n = req.generated
                    if n > sent:
                        body = fmt.chunks(sent, n, finish_reason if req.finished else None)
                        if req.finished:
                            body += fmt.tail(n)
                        first = sent == 0
                        sent = n
                        await send({"type": "http.response.body", "body": body, "more_body": not req.finished})
                        if first:           # how late the first token left against its due time (wall s)
                            eng = inst.engine
                            inst.first_token_late.append(time.perf_counter() - eng.t0 - req.first_t / eng.speed)
                    if req.finished:
                        return
            except OSError:
                pass                            # the client went away mid-write
            finally:
                watcher.cancel()
                inst.engine.abort(req)          # no-op once finished

    return SSE()


async def _watch_disconnect(receive, req) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            req.gone = True
            req.event.set()
            return


#: the header a client on this host may send: its send instant, ``time.perf_counter()`` seconds
SENT_HEADER = "x-lora-opt-sent"
#: wall seconds a declared send instant may lie before the handler runs (beyond: another clock)
SENT_MAX_AGE_S = 2.0


def _sent_wall(request) -> float | None:
    """The client's declared send instant when it is on this host (``perf_counter`` is the system's
    monotonic clock, shared by processes on one machine) and plausible, else None.  Why: the
    emulator's own intake (accept, parse, the loop's other work) runs in wall time on a shared core
    and, multiplied by ``--speed``, becomes simulated time before the engine sees the request --
    time a GPU server's front end does not spend (the profile's front-end delay already models
    vLLM's) -- and under load it bunches arrivals, which a queue turns into extra TTFT."""
    raw = request.headers.get(SENT_HEADER)
    if raw is None or request.client is None or request.client.host not in ("127.0.0.1", "::1"):
        return None
    try:
        sent = float(raw)
    except ValueError:
        return None
    age = time.perf_counter() - sent
    return sent if 0.0 <= age <= SENT_MAX_AGE_S else None


async def _generate(inst: Instance, request, chat: bool):
    try:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise APIError(400, f"[{{'type': 'json_invalid', 'loc': ('body', {getattr(e, 'pos', 0)}), "
                                f"'msg': 'JSON decode error', 'ctx': {{'error': {str(e)!r}}}}}]") from None
        p = parse_request(body, chat, inst.max_model_len)
        adapter = inst.adapter_of(p.model)
    except APIError as e:
        return _error(e)
    eng = inst.engine
    if p.ignore_eos or p.min_tokens >= p.max_tokens:
        out_len = p.max_tokens
    else:
        out_len = max(1, p.min_tokens, eng.draw_output_len(p.max_tokens))
    finish_reason = "length" if out_len == p.max_tokens else "stop"
    req = eng.submit(p.prompt_tokens, out_len, adapter, _sent_wall(request))
    req.finish_reason = finish_reason
    req.stream = p.stream
    fmt = Formatter(p, p.model or inst.model)
    if p.stream:
        return _stream_response(inst, req, fmt, finish_reason)
    watcher = asyncio.ensure_future(_watch_disconnect(request.receive, req))
    try:
        while not req.finished:
            await req.event.wait()
            req.event.clear()
            if req.aborted or req.gone:
                eng.abort(req)
                return None
    finally:
        watcher.cancel()
        eng.abort(req)
    from starlette.responses import JSONResponse
    return JSONResponse(fmt.full(req.generated, finish_reason))


def build_app(inst: Instance):
    """The FastAPI app of one instance."""
    # fastapi only where an emulator runs (start-up of other commands)
    from fastapi import FastAPI, Request
    from starlette.responses import Response

    app = FastAPI(title="lora-opt emulate", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": inst.vllm_version}

    @app.get("/v1/models")
    async def models():
        data = [{"id": inst.model, "object": "model", "created": 0, "owned_by": "vllm", "root": inst.model,
                 "parent": None, "max_model_len": inst.max_model_len, "permission": []}]
        data += [{"id": a, "object": "model", "created": 0, "owned_by": "vllm", "root": f"adapters/{a}",
                  "parent": inst.model, "max_model_len": None, "permission": []}
                 for a in inst.adapters if a in inst.loaded]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(inst, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(inst, request, chat=True)

    @app.get("/metrics")
    async def metrics():
        return Response(inst.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/emulator/stats")
    async def stats(reset: int = 0):
        out = inst.engine.report()
        lag = inst.engine.stats.lag_wall_s
        out["lag_ms"]["mean"] = 1000.0 * sum(lag) / len(lag) if lag else 0.0
        late = np.asarray(inst.first_token_late) * 1000.0
        out["first_token_late_ms"] = {"mean": float(late.mean()) if late.size else 0.0,
                                      "p50": float(np.percentile(late, 50)) if late.size else 0.0,
                                      "p99": float(np.percentile(late, 99)) if late.size else 0.0, "count": int(late.size)}
        if reset:
            inst.engine.reset_lag()
            inst.first_token_late.clear()
        return out

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        return _lora_update(inst, await request.body(), load=True)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        return _lora_update(inst, await request.body(), load=False)

    app.state.instance = inst
    return app


def _lora_update(inst: Instance, raw: bytes, load: bool):
    """vLLM's runtime adapter (un)loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).  The kernel's
    adapter table is fixed, so a new adapter takes one of the instance's spare slots (made at
    start-up, rank ``--max-lora-rank``: its load costs are that rank's); an unloaded adapter can be
    loaded back into its own slot; a slot is never reused for another adapter (its cache state)."""
    from starlette.responses import PlainTextResponse
    try:
        if not inst.runtime_lora_updating:
            raise APIError(404, "Not Found", "NotFoundError")
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError(400, "JSON decode error") from None
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided." if load else
                           "'lora_name' needs to be provided to unload a LoRA adapter.")
        if load:
            if name in inst.loaded:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.")
            if name not in inst.adapters:
                if not inst.free_slots:
                    raise APIError(400, f"The emulator cannot add adapter '{name}': all its runtime LoRA slots "
                                        "are taken (lora_opt.emulate.fleet.RUNTIME_LORA_SLOTS).")
                if not isinstance(body.get("lora_path"), str) or not body["lora_path"]:
                    raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
                index = inst.free_slots.pop(0)
                inst.adapters[name] = index
                inst.metrics.adapter_ids[index - 1] = name
            inst.loaded.add(name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
        if name not in inst.loaded:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        inst.loaded.discard(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
    except APIError as e:
        return _error(e)
