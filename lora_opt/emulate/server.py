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
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lora_opt.emulate.engine import BASE_ADAPTER, OnlineEngine
from lora_opt.emulate.metrics import EngineMetrics
from lora_opt.emulate.model_files import ModelFiles, no_model_files
from lora_opt.emulate.protocol import (
    ApiContext,
    Formatter,
    LoadLoRA,
    UnloadLoRA,
    parse_detokenize,
    parse_request,
    parse_tokenize,
    read_json_body,
    request_id,
    sanitize_message,
    validate_fields,
)
from lora_opt.emulate.request_validation import APIError, DetailError
from lora_opt.emulate.vllm_versions import VllmBehaviour, choose
from lora_opt.errors import InputError
from twin.parsing import read_json_file

#: the vLLM version /version reports when the profile does not say
EMULATOR_TAG = "lora-opt-emulate"


@dataclass
class Instance:
    """An emulated engine and what its API needs: the served model name, adapter ids -> engine
    adapter index (``loaded`` = servable now, in ``/v1/models`` order: /v1/unload_lora_adapter takes
    one out, a load puts it at the end), the vLLM version imitated (``behaviour``), the model's
    tokenizer and vocabulary (``files``), the cards' ``root`` paths."""

    engine: OnlineEngine
    model: str
    adapters: dict[str, int]
    vllm_version: str
    metrics: EngineMetrics
    max_model_len: int
    runtime_lora_updating: bool = False
    free_slots: list = field(default_factory=list)
    """Engine indices not yet taken by an adapter loaded at run time."""
    loaded: dict = field(default_factory=dict)
    first_token_late: deque = field(default_factory=lambda: deque(maxlen=100_000))
    """Wall seconds each streamed first token left after its due time (the machine's delay, not
    the schedule's: TTFT measured by a client includes it)."""
    behaviour: VllmBehaviour | None = None
    files: ModelFiles = field(default_factory=no_model_files)
    model_root: str | None = None
    """The base card's ``root`` (vLLM: the model path or id it was started with)."""
    lora_roots: dict = field(default_factory=dict)
    """Adapter id -> its card's ``root`` (vLLM: the adapter's path)."""
    max_lora_rank: int | None = None
    """Runtime loads of a higher rank are refused (from the adapter's adapter_config.json)."""

    def __post_init__(self):
        self.loaded = dict.fromkeys(self.adapters)
        self.metrics.engine = self.engine
        self.configure(behaviour=self.behaviour)

    def configure(self, *, behaviour: VllmBehaviour | None = None, files: ModelFiles | None = None,
                  model_root: str | None = None, lora_roots: dict | None = None,
                  max_lora_rank: int | None = None) -> None:
        """Set what the instance imitates (the version: by default the profile's, see
        ``lora_opt.emulate.vllm_versions.choose``) and knows of the model."""
        self.behaviour = behaviour or self.behaviour or choose(None, self.vllm_version)
        self.vllm_version = self.behaviour.version
        self.metrics.vllm_version = self.vllm_version
        self.files = files or self.files
        self.model_root = model_root or self.model_root
        self.lora_roots.update(lora_roots or {})
        self.max_lora_rank = max_lora_rank or self.max_lora_rank or self.engine.eng.max_lora_rank
        vocab = self.files.vocab_size or getattr(getattr(self.engine.profile, "model", None), "vocab_size", None)
        self.api = ApiContext(behaviour=self.behaviour, max_model_len=self.max_model_len, vocab_size=vocab,
                              files=self.files)

    def adapter_of(self, model: str | None) -> int:
        if not model or model == self.model:
            return BASE_ADAPTER
        if model in self.loaded:
            return self.adapters[model]
        raise self.not_found(model)

    def not_found(self, model: str) -> APIError:
        if self.behaviour.aliases_in_not_found:
            return APIError(404, f"The model `{model}` does not exist. Valid aliases: {self.model}.", "NotFoundError",
                            "model")
        return APIError(404, f"The model `{model}` does not exist.", "NotFoundError")


def _error(inst: Instance, exc: APIError | DetailError):
    from starlette.responses import JSONResponse
    if isinstance(exc, DetailError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)
    return JSONResponse(exc.body(nested=inst.behaviour.nested_errors), status_code=exc.status)


def _stream_response(inst: Instance, subs: list, fmt: Formatter):
    """The SSE response of a request's choices (``subs``: one engine request each, sharing one event)."""
    # starlette only where an emulator runs
    from starlette.responses import Response

    class SSE(Response):
        media_type = "text/event-stream"

        def __init__(self):
            super().__init__(content=None, media_type=self.media_type)

        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            watcher = asyncio.ensure_future(_watch_disconnect(receive, subs))
            event = subs[0].event
            sent = [0] * len(subs)
            try:
                first = b"".join(fmt.first_chunk(i) for i in range(len(subs)))
                if first:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                while True:
                    await event.wait()
                    event.clear()
                    if any(r.aborted or r.gone for r in subs):
                        return
                    body = b""
                    for i, r in enumerate(subs):
                        n = r.generated
                        if n > sent[i]:
                            body += fmt.chunks(i, sent[i], n, r.finish_reason if r.finished else None)
                            if sent[i] == 0 and i == 0:   # how late the first token left against its due time (wall s)
                                eng = inst.engine
                                inst.first_token_late.append(time.perf_counter() - eng.t0 - r.first_t / eng.speed)
                            sent[i] = n
                    done = all(r.finished for r in subs)
                    if done:
                        body += fmt.tail(sum(r.generated for r in subs))
                    if body:
                        await send({"type": "http.response.body", "body": body, "more_body": not done})
                    if done:
                        return
            except OSError:
                pass                            # the client went away mid-write
            finally:
                watcher.cancel()
                for r in subs:
                    inst.engine.abort(r)        # no-op once finished

    return SSE()


async def _watch_disconnect(receive, subs: list) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            for r in subs:
                r.gone = True
            subs[0].event.set()
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
        p = parse_request(await request.body(), request.headers.get("content-type", ""), chat, inst.api,
                          check_model=inst.adapter_of)
        adapter = inst.adapter_of(p.model)
    except (APIError, DetailError) as e:
        return _error(inst, e)
    eng = inst.engine
    sent_wall = _sent_wall(request)
    subs, echoes = [], []
    for prompt in p.prompts:                    # one engine request per prompt and choice, as vLLM
        for _ in range(p.n):
            if p.ignore_eos or p.min_tokens >= prompt.max_tokens:
                out_len = prompt.max_tokens
            else:
                out_len = max(1, p.min_tokens, eng.draw_output_len(prompt.max_tokens))
            req = eng.submit(prompt.tokens, out_len, adapter, sent_wall)
            req.finish_reason = "length" if out_len == prompt.max_tokens else "stop"
            req.stream = p.stream
            if subs:
                req.event = subs[0].event       # one wake-up for the response of all its choices
            subs.append(req)
            echoes.append(prompt.text if p.echo else "")
    fmt = Formatter(p, p.model or inst.model, request_id(request.headers.get("x-request-id"), inst.behaviour),
                    inst.behaviour)
    if p.stream:
        return _stream_response(inst, subs, fmt)
    watcher = asyncio.ensure_future(_watch_disconnect(request.receive, subs))
    try:
        while not all(r.finished for r in subs):
            await subs[0].event.wait()
            subs[0].event.clear()
            if any(r.aborted or r.gone for r in subs):
                return None
    finally:
        watcher.cancel()
        for r in subs:
            eng.abort(r)
    from starlette.responses import JSONResponse
    return JSONResponse(fmt.full([(r.generated, r.finish_reason, e) for r, e in zip(subs, echoes)]))


def _model_list(inst: Instance) -> dict:
    """``/v1/models``: the base model's card, then each loaded adapter's, in vLLM's shape."""
    created = int(time.time())

    def card(mid, root, parent, max_model_len):
        return {"id": mid, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                                "created": created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
    data = [card(inst.model, inst.model_root or inst.model, None, inst.max_model_len)]
    data += [card(a, inst.lora_roots.get(a, f"adapters/{a}"), inst.model, None) for a in inst.loaded]
    return {"object": "list", "data": data}


def _tokenizer_route(inst: Instance, parse):
    """``/tokenize`` and ``/detokenize``: parse the body with ``parse``, vLLM's error on failure."""
    from fastapi import Request

    async def route(request: Request):
        try:
            return parse(await request.body(), request.headers.get("content-type", ""), inst.api,
                         check_model=inst.adapter_of)
        except (APIError, DetailError) as e:
            return _error(inst, e)
    return route


def _emulator_stats(inst: Instance, reset: int) -> dict:
    """``/emulator/stats``: the engine's report, with the mean lag and how late first tokens left
    (``reset``: then start both over)."""
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


def build_app(inst: Instance):
    """The FastAPI app of one instance."""
    # fastapi only where an emulator runs (start-up of other commands)
    from fastapi import FastAPI, Request
    from starlette.responses import Response

    app = FastAPI(title="lora-opt emulate", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():                       # vLLM's SageMaker health route: /health's answer
        return Response(status_code=200)

    @app.get("/load")
    async def load():
        return {"server_load": len(inst.engine.requests)}

    @app.get("/version")
    async def version():
        return {"version": inst.vllm_version}

    @app.get("/v1/models")
    async def models():
        return _model_list(inst)

    app.post("/tokenize")(_tokenizer_route(inst, parse_tokenize))
    app.post("/detokenize")(_tokenizer_route(inst, parse_detokenize))

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
        return _emulator_stats(inst, reset)

    @app.post("/emulator/shutdown")
    async def shutdown():
        """Stop this instance alone (a replan's ``stop`` step on an emulated fleet; a real vLLM is
        stopped by its process).  Requests still running are aborted, as a stopped vLLM drops them."""
        stop = getattr(app.state, "shutdown", None)
        if stop is None:
            return _error(inst, APIError(501, "this instance is not served by lora-opt emulate's fleet loop",
                                         "NotImplementedError"))
        stop()
        return {"stopping": True}

    if inst.runtime_lora_updating:          # vLLM registers these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
        @app.post("/v1/load_lora_adapter")
        async def load_lora(request: Request):
            return _lora_update(inst, await request.body(), request.headers.get("content-type", ""), load=True)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(request: Request):
            return _lora_update(inst, await request.body(), request.headers.get("content-type", ""), load=False)

    app.state.instance = inst
    return app


def adapter_rank(path: str) -> int | None:
    """The rank in ``PATH/adapter_config.json`` (None: no adapter there, as vLLM's loader finds none)."""
    try:
        return int(read_json_file(Path(path) / "adapter_config.json", "adapter config", InputError)["r"])
    except (ValueError, KeyError, TypeError):
        return None


def _lora_update(inst: Instance, raw: bytes, content_type: str, load: bool):
    """vLLM's runtime adapter (un)loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), its checks and
    messages.  The kernel's adapter table is fixed, so a new adapter takes one of the instance's spare
    slots (made at start-up, rank ``--max-lora-rank``: its load costs are that rank's); an unloaded
    adapter can be loaded back into its own slot; a slot is never reused for another adapter (its
    cache state).  One difference, on purpose: an adapter whose rank is above ``--max-lora-rank`` is
    refused with 400 -- vLLM 0.32 answers it 500 ("Call to add_lora method failed"), a server error
    for a client's mistake (docs/emulate.md)."""
    from starlette.responses import PlainTextResponse
    b = inst.behaviour
    try:
        req = validate_fields(LoadLoRA if load else UnloadLoRA, read_json_body(raw, content_type, b), b)
        name = req.lora_name
        if not load:
            if name not in inst.loaded:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del inst.loaded[name]
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
        if not name or not req.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == inst.model:
            raise APIError(400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput")
        if name in inst.loaded and not req.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                                "in place, set 'load_inplace' to True.", "InvalidUserInput")
        rank = adapter_rank(req.lora_path)
        if rank is None:
            raise APIError(404, sanitize_message(f"Loading lora {name} failed: No adapter found for {req.lora_path}"),
                           "NotFoundError")
        if inst.max_lora_rank is not None and rank > inst.max_lora_rank:
            raise APIError(400, f"LoRA rank {rank} is greater than max_lora_rank {inst.max_lora_rank}.",
                           "BadRequestError", "lora_path")
        if name not in inst.adapters:
            if not inst.free_slots:
                raise APIError(400, f"The emulator cannot add adapter '{name}': all its runtime LoRA slots "
                                    "are taken (lora_opt.emulate.fleet.RUNTIME_LORA_SLOTS).")
            index = inst.free_slots.pop(0)
            inst.adapters[name] = index
            inst.metrics.adapter_ids[index - 1] = name
        inst.loaded.setdefault(name, None)      # vLLM lists adapters in the order they were loaded (in place: kept)
        inst.lora_roots[name] = req.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
    except (APIError, DetailError) as e:
        return _error(inst, e)
