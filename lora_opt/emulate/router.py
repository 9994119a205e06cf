"""A front for a fleet: reads a router table (``router.json``: adapter -> [{endpoint, weight}]) and
forwards each completions / chat request to one endpoint of its adapter, drawn with the
placement's weights; streams pass through byte for byte (a client that goes away closes the
upstream stream, so the instance aborts the request).  Works for emulated and real fleets alike.
Any other model name (the base model, an unknown adapter) goes to one endpoint drawn uniformly,
which answers it (vLLM's 404 for an unknown adapter)."""
# no "from __future__ import annotations": FastAPI reads the route annotations (Request) at definition

import json
import random

from lora_opt.emulate.protocol import APIError


class RouteTable:
    """adapter id -> (endpoints, weights); ``pick`` draws one endpoint (seeded)."""

    def __init__(self, table: dict, seed: int = 0):
        self.routes = {a: ([e["endpoint"].rstrip("/") for e in es], [float(e["weight"]) for e in es])
                       for a, es in table.items() if es}
        self.endpoints = sorted({e for es, _ in self.routes.values() for e in es})
        self.rng = random.Random(seed)

    def pick(self, model: str | None) -> str:
        if model in self.routes:
            endpoints, weights = self.routes[model]
            return self.rng.choices(endpoints, weights)[0]
        if not self.endpoints:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError")
        return self.rng.choice(self.endpoints)


def build_router_app(table: RouteTable):
    # fastapi/httpx only where a router runs
    import httpx
    from fastapi import FastAPI, Request
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="lora-opt router", docs_url=None, redoc_url=None, openapi_url=None)
    client = httpx.AsyncClient(timeout=None, trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def forward(request: Request, suffix: str):
        raw = await request.body()
        try:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None                      # the instance answers the malformed body
            model = body.get("model") if isinstance(body, dict) else None
            endpoint = table.pick(model if isinstance(model, str) else None)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        upstream = client.build_request("POST", endpoint + suffix, content=raw,
                                        headers={"content-type": "application/json"})
        resp = await client.send(upstream, stream=True)

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:                        # also when the client went away: close the upstream
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"), background=BackgroundTask(resp.aclose))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/chat/completions")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": a, "object": "model", "owned_by": "vllm"} for a in table.routes]}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    app.state.client = client
    return app
