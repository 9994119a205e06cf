"""A front for a fleet: reads a router table (``router.json``: adapter -> [{endpoint, weight}]) and
forwards each completions / chat request to one instance that can serve its adapter, chosen by a
router policy of the fleet twin (``twin.routers``: ``static`` draws with the placement's weights,
``round-robin``, ``least-requests``, ``power-of-two``, ``consistent-hash``, ``lora-affinity``; see
:class:`RouteTable`); streams pass through event by event (a client that goes away closes the
upstream connection, so the instance aborts the request).  Works for emulated and real fleets alike
(a policy reading the instances' metrics: emulated fleets served by this process).
Any other model name (the base model, an unknown adapter) goes to one endpoint drawn uniformly,
which answers it (vLLM's 404 for an unknown adapter); so does a body that is not JSON (the
instance answers vLLM's 400).

It answers as a gateway when an instance cannot: an instance that refuses or drops the connection
is a 502, one that does not accept it within ``connect_timeout_s`` (or, when set, does not answer
within ``read_timeout_s``) a 504, an empty route table a 503 -- every error in vLLM's shape
``{"error": {"message", "type", "param", "code"}}`` with ``type`` the HTTP phrase, as vLLM's own
handler of HTTP errors writes it.  A stream whose instance dies after it started cannot change
its status: it ends with an error event and ``data: [DONE]``, as vLLM ends a stream that fails
after its 200.

Instances die: one whose connection is refused is *ejected* at once and the request -- which never
reached it -- goes to another instance that serves its adapter; every ``interval_s`` each instance's
``/health`` is checked, failing ones are ejected and passing ones re-admitted
(:mod:`lora_opt.emulate.router_health`; ``GET /router/routes`` shows each one's state).  A request
that reached an instance is never retried (the instance may have run it): its failure is the client's
502 / 504.  With every instance of an adapter ejected, they are tried anyway (one may be back)."""
# no "from __future__ import annotations": FastAPI reads the route annotations (Request) at definition

import asyncio
import contextlib
import functools
import json
import math
import time
from http import HTTPStatus

import numpy as np

from lora_opt.emulate.request_validation import APIError
from lora_opt.emulate.router_health import EndpointHealth, check_forever, next_engine
from lora_opt.emulate.router_metrics import RouterMetrics, usage_of
from lora_opt.errors import InputError
from lora_opt.http_pool import instance_client
from lora_opt.replan.router_config import HealthChecks
from twin.engine_fleet import scrape
from twin.fleet import SCRAPE_INTERVAL_S
from twin.routers import FleetView, RouterSetup, make_router

#: request headers passed on to the instance (the body's type, vLLM's request id and API key, the
#: emulator's send instant -- lora_opt.emulate.server.SENT_HEADER)
FORWARDED_HEADERS = ("content-type", "authorization", "x-request-id", "x-lora-opt-sent")
#: seconds an instance has to accept a connection before the router answers 504
CONNECT_TIMEOUT_S = 10.0
#: seconds the router waits for each instance's /v1/models when it lists the fleet's models
MODELS_TIMEOUT_S = 5.0
#: the generator stream (spawned from the router's seed) of requests no policy routes
UNROUTED_STREAM = 99


def gateway_error(status: int, message: str) -> APIError:
    """An error the router itself answers: vLLM's shape, ``type`` the HTTP phrase (vLLM's handler
    of HTTP errors: ``HTTPStatus(code).phrase``)."""
    return APIError(status, message, HTTPStatus(status).phrase)


def upstream_error(exc: Exception, endpoint: str, read_timeout_s: float | None) -> APIError:
    """The gateway's answer to a failed exchange with ``endpoint``: 504 when it timed out, else 502."""
    import httpx
    if isinstance(exc, httpx.ConnectTimeout):
        return gateway_error(504, f"upstream {endpoint} did not accept the connection within {CONNECT_TIMEOUT_S:g} s")
    if isinstance(exc, httpx.TimeoutException):
        return gateway_error(504, f"upstream {endpoint} did not answer within {read_timeout_s:g} s")
    if isinstance(exc, httpx.ConnectError):
        return gateway_error(502, f"upstream {endpoint} is unreachable: {str(exc) or 'connection refused'}")
    return gateway_error(502, f"upstream {endpoint} failed: {type(exc).__name__}: {str(exc) or 'connection lost'}")


class RouteTable:
    """The front's routing: adapter id -> the instances (endpoints) that can serve it, and a
    ``twin.routers`` policy choosing one per request -- the fleet twin's own policies, fed a
    ``twin.routers.FleetView`` built as the fleet twin builds it (one owner of every routing rule):

    * ``table``: adapter id -> [{endpoint, weight}] (``router.json``; the ``static`` policy's weights);
    * ``candidates``: adapter id -> endpoints that can serve it (default: its table entries;
      on-demand adapters: every instance whose ``--max-lora-rank`` admits it);
    * ``endpoints``: the instances in fleet order (engine index k = ``endpoints[k]``; default sorted);
    * in flight: the router's own count per instance (sent, response not yet ended: :meth:`done`);
    * scraped metrics (policies reading ``metrics``): the instances' kernel states, read by
      :meth:`scrape` every ``scrape_interval_s`` simulated seconds (``engines``: one
      ``(OnlineEngine, {adapter id: its index in that engine})`` per endpoint; the emulator's
      instances run in this process).

    A model no candidate list names (the base model, an unknown adapter) goes to an instance drawn
    uniformly by a generator of its own (the instance answers it; not a request the policy routes)."""

    def __init__(self, table: dict, seed=0, *, policy: str = "static", endpoints: list[str] | None = None,
                 candidates: dict | None = None, engines: list | None = None,
                 scrape_interval_s: float = SCRAPE_INTERVAL_S, health: HealthChecks | None = None):
        routes = {a: [(e["endpoint"].rstrip("/"), float(e["weight"])) for e in es] for a, es in table.items() if es}
        cands = {a: [ep.rstrip("/") for ep in eps] for a, eps in (candidates or {}).items() if eps} or \
            {a: [ep for ep, _ in rs] for a, rs in routes.items()}
        known = {ep for eps in cands.values() for ep in eps} | {ep for rs in routes.values() for ep, _ in rs}
        self.endpoints = [ep.rstrip("/") for ep in endpoints] if endpoints else sorted(known)
        index = {ep: k for k, ep in enumerate(self.endpoints)}
        missing = sorted(known - set(index))
        if missing:
            raise InputError(f"router: endpoints {', '.join(missing)} are not instances of the fleet")
        self.adapter_ids = sorted(set(cands) | set(routes))
        self.adapter_index = {a: k for k, a in enumerate(self.adapter_ids)}
        self.candidates = {self.adapter_index[a]: np.array(sorted({index[ep] for ep in eps}), np.int64)
                           for a, eps in cands.items()}
        n = len(self.endpoints)
        setup = RouterSetup(n_engines=n, adapter_ids=self.adapter_ids, seed=seed,
                            routes={self.adapter_index[a]: [(index[ep], w) for ep, w in rs] for a, rs in routes.items()})
        self.policy = make_router(policy, setup)
        self.view = FleetView(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n),
                              [frozenset()] * n, [frozenset()] * n, np.zeros(n, np.int64))
        self.connecting = np.zeros(n, np.int64)
        """Per instance: requests sent whose response has not begun (the instance has not taken them yet)."""
        self.retired: set[int] = set()
        """Instances being drained (``retire``): no request is sent to them any more, routed or not."""
        self.health = EndpointHealth(n, health or HealthChecks())
        """Which instances are ejected (dead: sent nothing until their health checks pass again)."""
        self.engines = None
        if engines is not None:
            if len(engines) != n:
                raise InputError(f"router: {len(engines)} engines for {n} endpoints")
            self.view.max_loras[:] = [eng.eng.max_loras for eng, _ in engines]
            self.engines = []
            for eng, ids in engines:        # engine adapter index -> fleet adapter index (-1: base, spares)
                to_fleet = np.full(len(eng.sc.adapter_table()[0]), -1, np.int64)
                for aid, k in ids.items():
                    to_fleet[k] = self.adapter_index.get(aid, -1)
                self.engines.append((eng, to_fleet))
        elif self.policy.reads_state == "metrics":
            raise InputError(f"--router {policy}: reads the instances' metrics, which only an emulated fleet "
                             "served by this process has here")
        self.scrape_interval_s = float(scrape_interval_s)
        self.scrapes = 0
        self.requests = 0           # requests the policy routed (the static policy's draw index)
        ss = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        # models the policy does not route: a stream of their own, so they never shift the policy's draws
        self.rng = np.random.default_rng(np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, UNROUTED_STREAM)))

    def table(self) -> dict:
        """The routes as they stand: adapter id -> [{endpoint, weight}] (``router.json``'s shape;
        the candidates with equal weights where the policy keeps no weights; a weighted endpoint that is
        no candidate any more -- retired -- left out, as the static policy leaves it out of its draw)."""
        weights = getattr(self.policy, "routes", None)
        out = {}
        for a, k in self.adapter_index.items():
            if k not in self.candidates:
                continue
            if weights is not None and k in weights:
                engines, cw = weights[k]
                ws = np.diff(cw, prepend=0.0)
                on = np.isin(engines, self.candidates[k])
                out[a] = [{"endpoint": self.endpoints[e], "weight": float(w)}
                          for e, w in zip(engines[on].tolist(), ws[on])]
            else:
                out[a] = [{"endpoint": self.endpoints[e], "weight": 1.0} for e in self.candidates[k].tolist()]
        return out

    def reroute(self, table: dict) -> dict:
        """Replace the routes of the adapters ``table`` names (adapter id -> [{endpoint, weight}];
        an empty list: the adapter is routed nowhere) -- a replan's ``route`` step.  Endpoints new
        to the router join the fleet (engine indices stay: requests in flight keep their counts).
        Only for policies that read no scraped metrics (those read engines this process serves).
        Returns what changed: {"adapters": n, "new_endpoints": [...]}."""
        if self.policy.reads_state == "metrics":
            raise InputError(f"router {self.policy.name}: reads the instances' metrics; its routes cannot change "
                             "while it runs")
        parsed = {}
        for a, es in table.items():
            if not isinstance(a, str) or not isinstance(es, list):
                raise InputError("routes: expected adapter id -> [{endpoint, weight}]")
            rs = []
            for e in es:
                if not isinstance(e, dict) or not isinstance(e.get("endpoint"), str):
                    raise InputError(f"routes.{a}: every entry needs an endpoint URL")
                w = e.get("weight", 1.0)
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                    raise InputError(f"routes.{a}: weight must be a finite number > 0, got {w!r}")
                rs.append((e["endpoint"].rstrip("/"), float(w)))
            parsed[a] = rs
        added = sorted({ep for rs in parsed.values() for ep, _ in rs} - set(self.endpoints))
        if added:
            self.endpoints += added
            grow = len(added)
            v = self.view
            for name in ("in_flight", "waiting", "running", "kv_usage", "max_loras"):
                arr = getattr(v, name)
                setattr(v, name, np.concatenate([arr, np.zeros(grow, arr.dtype)]))
            self.connecting = np.concatenate([self.connecting, np.zeros(grow, np.int64)])
            self.health.grow(len(self.endpoints))
            v.running_adapters = list(v.running_adapters) + [frozenset()] * grow
            v.waiting_adapters = list(v.waiting_adapters) + [frozenset()] * grow
        index = {ep: k for k, ep in enumerate(self.endpoints)}
        # an endpoint routed to again is live again (a later launch on a retired instance's address)
        self.retired -= {index[ep] for rs in parsed.values() for ep, _ in rs}
        weights = getattr(self.policy, "routes", None)
        for a, rs in parsed.items():
            if a not in self.adapter_index:
                self.adapter_index[a] = len(self.adapter_ids)
                self.adapter_ids.append(a)
            k = self.adapter_index[a]
            if rs:
                self.candidates[k] = np.array(sorted({index[ep] for ep, _ in rs}), np.int64)
            else:
                self.candidates.pop(k, None)
            if weights is not None:          # the static policy's table
                if rs:
                    weights[k] = (np.array([index[ep] for ep, _ in rs], np.int64), np.cumsum([w for _, w in rs]))
                else:
                    weights.pop(k, None)
        return {"adapters": len(parsed), "new_endpoints": added}

    def retire(self, endpoint: str) -> dict:
        """Send nothing more to ``endpoint`` (a drain before its instance stops): it leaves the candidates
        of every adapter and the draw of models no policy routes.  Its requests in flight finish.  An
        adapter it was the only instance of is unrouted from now on (listed in ``unrouted``: the caller
        judges whether that adapter still has demand).  ({"endpoint", "in_flight", "unrouted"})"""
        ep = endpoint.rstrip("/")
        if ep not in self.endpoints:
            raise InputError(f"retire: {ep} is not an instance of the fleet ({', '.join(self.endpoints)})")
        e = self.endpoints.index(ep)
        self.retired.add(e)
        unrouted = []
        # out of the candidates is out of every policy's choice (the static one renormalises its weights over
        # the candidates left, as for an engine that is down)
        for a, c in list(self.candidates.items()):
            if e not in c.tolist():
                continue
            keep = c[c != e]
            if keep.size:
                self.candidates[a] = keep
            else:
                self.candidates.pop(a)
                unrouted.append(self.adapter_ids[a])
        return {"endpoint": ep, "in_flight": int(self.view.in_flight[e]), "unrouted": sorted(unrouted)}

    def pick(self, model: str | None) -> str:
        """The endpoint of ``model``'s next request (counted in flight: call :meth:`done` at its end)."""
        return self.endpoints[self.pick_engine(model)]

    def pick_engine(self, model: str | None, exclude=()) -> int:
        """The engine of ``model``'s next request among the live ones (not retired, not ejected, not in
        ``exclude``: those a retry already tried).  When every one left is ejected, the ejected ones are
        tried anyway (Envoy's "panic" routing: one may be back before its checks say so, and a refused
        connection is answered at once); a 503 naming why when none is left at all."""
        a = self.adapter_index.get(model) if model is not None else None
        tried, ejected = set(exclude), set(self.health.ejected)
        if a is None or a not in self.candidates:
            engines = np.array([k for k in range(len(self.endpoints)) if k not in self.retired], np.int64)
        else:
            engines = self.candidates[a]
        left = engines[~np.isin(engines, sorted(tried))] if tried else engines
        if ejected and left.size:
            healthy = left[~np.isin(left, sorted(ejected))]
            left = healthy if healthy.size else left
        if not left.size:
            what = f"no live instance serves {model}" if a is not None and a in self.candidates else \
                "the router has no instance to send the request to"
            raise gateway_error(503, f"{what} ({self.why_down(engines.tolist(), exclude) or 'empty route table'})")
        if a is None or a not in self.candidates:
            e = int(left[self.rng.integers(left.size)])
        else:
            reads = self.policy.reads_state
            e = self.policy.pick(self.requests, a, left, self.view if reads else None)
            self.requests += 1
        self.view.in_flight[e] += 1
        return e

    def why_down(self, engines, exclude=()) -> str:
        """'endpoint: why' of each engine of ``engines`` that is ejected, retired or already tried."""
        out = []
        for e in engines:
            if e in self.health.ejected:
                out.append(f"{self.endpoints[e]} ejected ({self.health.ejected[e][0]})")
            elif e in self.retired:
                out.append(f"{self.endpoints[e]} retired")
            elif e in exclude:
                out.append(f"{self.endpoints[e]} refused the connection")
        return "; ".join(out)

    def done(self, engine: int) -> None:
        """A response of ``engine`` ended (finished, failed or abandoned)."""
        self.view.in_flight[engine] -= 1

    def scrape(self) -> None:
        """Read every instance's metrics now (``twin.engine_fleet.scrape``: what vLLM's ``/metrics``
        says), adapter indices mapped to the fleet's."""
        v = self.view
        for e, (eng, to_fleet) in enumerate(self.engines):
            v.running[e], v.waiting[e], v.kv_usage[e], run, wait = scrape(eng.state)
            run, wait = to_fleet[run], to_fleet[wait]
            v.running_adapters[e] = frozenset(run[run >= 0].tolist())
            v.waiting_adapters[e] = frozenset(wait[wait >= 0].tolist())
        self.scrapes += 1

    async def scrape_every_interval(self) -> None:
        """Scrape at every simulated ``k x scrape_interval_s`` (the first instance's clock) until
        cancelled -- the fleet twin's ticks; a policy reading nothing does not need it."""
        clock = self.engines[0][0]
        dt = self.scrape_interval_s
        k = 0
        while True:
            k = max(k + 1, math.floor(clock.sim_now() / dt) + 1) if dt > 0 else k + 1
            wait = clock.t0 + k * dt / clock.speed - time.perf_counter() if dt > 0 else 0.001
            await asyncio.sleep(max(0.0, wait))
            self.scrape()


def model_of(raw: bytes) -> str | None:
    """The body's ``model`` when the body is a JSON object naming one (else None: any instance
    answers it, and the instance says what is wrong with the body)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):         # not JSON, or nested past the parser's depth
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def error_event(err: APIError) -> bytes:
    """The end of a stream whose instance failed after it started: an error event and ``[DONE]``
    (vLLM's in-stream error, serialized with json.dumps as vLLM does)."""
    return f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()


async def relay_events(resp, endpoint: str, read_timeout_s: float | None, on_end=None):
    """An SSE body, passed on whole events at a time: when the instance fails mid-way, a partial
    event is dropped and the stream ends with :func:`error_event` instead of a broken connection.
    ``on_end(usage, failed)``: called once the stream is over (the router's in-flight count and
    metrics), with the stream's last ``usage`` (or None) and whether it ended with an error event."""
    import httpx
    tail = b""                                  # bytes after the last complete event
    usage, failed = None, False
    try:
        async for chunk in resp.aiter_raw():
            data = tail + chunk if tail else chunk
            lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")    # vLLM ends events with \n\n
            cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
            if cut:
                events = data[:cut]
                if b'"usage"' in events:
                    usage = usage_of(events) or usage
                failed = failed or b'data: {"error"' in events
                yield events
                tail = data[cut:]
            else:
                tail = data
        if tail:                                # the instance ended its body mid-event
            yield tail
    except (httpx.HTTPError, OSError) as exc:
        failed = True
        yield error_event(upstream_error(exc, endpoint, read_timeout_s))
    finally:                                    # also when the client went away: close the upstream
        try:
            await resp.aclose()
        finally:
            if on_end is not None:              # the stream is over: it leaves the in-flight count
                on_end(usage, failed)


async def until_client_gone(request) -> None:
    """Returns when the client disconnects (the body is read already: the next ASGI message is the
    disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def add_route_admin(app, table: RouteTable) -> None:
    """The router's own administration (not vLLM's API), what ``lora-opt apply``'s route steps
    call: ``GET /router/routes`` (policy, endpoints, the table as it stands, and per endpoint the
    requests sent that it has not answered yet: ``connecting``, those whose response has not ended:
    ``in_flight``, the ``retired`` endpoints, and each one's ``health``: healthy / ejected / retired, why), ``POST /router/routes`` with ``{"routes": {adapter id:
    [{endpoint, weight}]}}`` (:meth:`RouteTable.reroute`; 400 for a malformed table, 409 for a policy
    whose routes cannot change while it runs) and ``POST /router/retire`` with ``{"endpoint": URL}``
    (:meth:`RouteTable.retire`: nothing more is sent to it; the adapters left without an instance)."""
    from fastapi import Request

    @app.get("/router/routes")
    async def routes():
        return {"policy": table.policy.name, "endpoints": list(table.endpoints), "routes": table.table(),
                "connecting": dict(zip(table.endpoints, table.connecting.tolist())),
                "in_flight": dict(zip(table.endpoints, table.view.in_flight.tolist())),
                "retired": [table.endpoints[e] for e in sorted(table.retired)],
                "health": {ep: table.health.state(e, e in table.retired) for e, ep in enumerate(table.endpoints)},
                "health_checks": {"running": table.health.checking, "rounds": table.health.rounds}}

    async def admin_call(request: Request, key: str, kind: type, expected: str, call):
        """A POST of the router's administration: ``{key: <kind>}`` -> ``call(value)``; 400 for a body that is
        not that (409 for routes a running policy cannot change)."""
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict) or not isinstance(body.get(key), kind):
                raise InputError(f"expected {expected}")
            return call(body[key])
        except (ValueError, RecursionError) as exc:       # InputError is a ValueError
            status = 409 if isinstance(exc, InputError) and "cannot change" in str(exc) else 400
            return error_response(gateway_error(status, str(exc) if isinstance(exc, InputError) else "the body is not JSON"))

    @app.post("/router/retire")
    async def retire(request: Request):
        return await admin_call(request, "endpoint", str, '{"endpoint": URL}', table.retire)

    @app.post("/router/routes")
    async def reroute(request: Request):
        answer = await admin_call(request, "routes", dict, '{"routes": {adapter id: [{"endpoint": URL, "weight": w}]}}',
                                  table.reroute)
        if getattr(app.state, "metrics", None) is not None:
            app.state.metrics.known(table.adapter_ids)       # new adapters' series start at 0
        return answer


async def send_unless_gone(client, request, upstream):
    """``client.send`` unless the client goes away first (then the upstream request is cancelled,
    which closes its connection: the instance aborts the request).  None: gone."""
    send = asyncio.ensure_future(client.send(upstream, stream=True))
    gone = asyncio.ensure_future(until_client_gone(request))
    try:
        await asyncio.wait({send, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not send.done():
            send.cancel()
    return send.result() if send.done() and not send.cancelled() else None


async def model_cards(client, endpoint: str) -> list | None:
    """An instance's ``/v1/models`` cards (None: it did not answer them)."""
    import httpx
    try:
        r = await client.get(endpoint + "/models", timeout=MODELS_TIMEOUT_S)
        data = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError, OSError):
        return None
    return [m for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else None


@contextlib.asynccontextmanager
async def health_checks_while_serving(app, *, table: RouteTable, client):
    """The router app's lifespan: its active health checks run while it serves (its uvicorn server needs
    ``lifespan="on"``; without them no instance is ejected)."""
    checking = asyncio.ensure_future(check_forever(table, client)) if table.health.checks.active else None
    try:
        yield
    finally:
        if checking is not None:
            checking.cancel()
            await asyncio.gather(checking, return_exceptions=True)


def error_response(e: APIError):
    """The router's answer of an error: ``e``'s body (vLLM's shape) with its status."""
    from starlette.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status)


class Forwarder:
    """The router app's requests to its instances (``table``'s, over ``client``; counted in ``metrics``): the
    completions / chat requests it forwards and its ``/v1/models``.  ``read_timeout_s``: :func:`build_router_app`'s."""

    def __init__(self, table: RouteTable, client, metrics: RouterMetrics, read_timeout_s: float | None):
        self.table, self.client, self.metrics, self.read_timeout_s = table, client, metrics, read_timeout_s

    async def forward(self, request, suffix: str):
        """``request`` (a POST to ``/v1`` + ``suffix``) answered by an instance, or the router's error."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response, StreamingResponse
        try:
            raw = await request.body()
        except ClientDisconnect:                # gone before its body arrived: nothing to forward
            return Response(status_code=499)
        model = model_of(raw)
        started = self.metrics.start(model)
        resp = await self.route(request, suffix, raw, model, started)
        if not isinstance(resp, StreamingResponse):         # a stream's relay ends its metrics
            self.metrics.end(started, resp.status_code, usage_of(resp.body) if resp.status_code == 200 else None)
        return resp

    async def route(self, request, suffix: str, raw: bytes, model: str | None, started):
        """``raw`` sent to ``model``'s next instance until one takes it (a refusing one ejected); its answer."""
        import httpx
        from starlette.responses import Response, StreamingResponse
        table, client, metrics, read_timeout_s = self.table, self.client, self.metrics, self.read_timeout_s
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        tried, refused, give_up = [], None, time.monotonic() + table.health.checks.retry_for_s
        while True:
            try:
                engine = await next_engine(table, request, model, tried, give_up)
            except APIError as e:
                return error_response(refused or e)     # the last instance's own failure says more than "none left"
            endpoint = table.endpoints[engine]
            streaming = False
            try:
                table.connecting[engine] += 1       # picked, not yet answered: a replan's unload waits for these
                try:
                    upstream = client.build_request("POST", endpoint + suffix, content=raw, headers=headers)
                    resp = await send_unless_gone(client, request, upstream)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:     # not sent: another instance may
                    refused = upstream_error(exc, endpoint, read_timeout_s)
                    table.health.eject(engine, f"request: {refused.message}")
                    tried.append(engine)
                    continue
                except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:   # sent: never retried
                    return error_response(upstream_error(exc, endpoint, read_timeout_s))
                finally:
                    table.connecting[engine] -= 1
                if resp is None:
                    return Response(status_code=499)          # nobody reads it: the client went away
                media_type = resp.headers.get("content-type")
                if media_type and media_type.startswith("text/event-stream"):
                    streaming = True                # the relay ends it
                    status = resp.status_code

                    def ended(usage, failed):
                        table.done(engine)
                        metrics.end(started, status, usage, failed)
                    return StreamingResponse(relay_events(resp, endpoint, read_timeout_s, ended),
                                             status_code=status, media_type=media_type)
                try:                                # a JSON answer: whole, or a 502 when the instance fails mid-body
                    content = await resp.aread()
                except (httpx.HTTPError, OSError) as exc:
                    return error_response(upstream_error(exc, endpoint, read_timeout_s))
                finally:
                    await resp.aclose()
                return Response(content, status_code=resp.status_code, media_type=media_type)
            finally:
                if not streaming:
                    table.done(engine)

    async def models(self):
        """The fleet's models: every instance's cards, each id once (base models, then adapters, as
        vLLM lists them); an instance that does not answer is left out; none answering: 502."""
        endpoints = self.table.endpoints
        answers = await asyncio.gather(*(model_cards(self.client, e) for e in endpoints))
        if endpoints and not any(a is not None for a in answers):
            return error_response(gateway_error(502, f"no instance answered /v1/models ({', '.join(endpoints)})"))
        cards: dict = {}
        for card in sorted((m for a in answers if a for m in a), key=lambda m: m.get("parent") is not None):
            cards.setdefault(card["id"], card)
        return {"object": "list", "data": list(cards.values())}


def build_router_app(table: RouteTable, *, read_timeout_s: float | None = None):
    """The router's app.  ``read_timeout_s``: longest wait for an instance's response headers and
    between its stream's reads before a 504 (None: no limit -- an instance queues what it cannot
    run yet, as vLLM does, and a long queue is not a dead instance)."""
    # fastapi/httpx only where a router runs
    import httpx
    from fastapi import FastAPI, Request
    from starlette.responses import Response

    client = instance_client(timeout=httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S), max_connections=None,
                             max_keepalive_connections=256)
    app = FastAPI(title="lora-opt router", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=functools.partial(health_checks_while_serving, table=table, client=client))
    app.state.metrics = metrics = RouterMetrics()
    metrics.known(table.adapter_ids)
    front = Forwarder(table, client, metrics, read_timeout_s)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await front.forward(request, "/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await front.forward(request, "/chat/completions")

    @app.get("/v1/models")
    async def models():
        return await front.models()

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        """Per-adapter requests, tokens and latency under the Inference Extension's names."""
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_route_admin(app, table)

    # an unknown route or method keeps FastAPI's {"detail": ...} answer: real vLLM 0.32 answers those
    # the same way (its handler of HTTP errors catches FastAPI's HTTPException, not the router's)
    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        return error_response(APIError(500, f"the router failed: {type(exc).__name__}", "InternalServerError"))

    app.state.client = client
    return app
