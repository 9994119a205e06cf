"""Emulated instances: from a scenario, from vLLM's flags, or one per GPU of a placement; the
memory model's start-up check (an instance vLLM would not start refuses to start); serving them
all on one asyncio loop with clean shutdown on SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from lora_opt.emulate.engine import RUNTIME_ID, OnlineEngine
from lora_opt.emulate.metrics import EngineMetrics
from lora_opt.emulate.router import RouteTable, build_router_app
from lora_opt.replan.router_config import HealthChecks
from lora_opt.emulate.server import Instance, adapter_rank, build_app
from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import scenario_adapters
from twin.fleet import SCRAPE_INTERVAL_S, check_adapter_mode
from twin.flags import VLLM_LORA_RANKS, max_lora_rank_for
from twin.parsing import parse_json_text, read_json_file
from twin.profile import LoadingSpec
from twin.scenario import EngineConfig, Scenario, build_scenario, load_scenario, replace

#: adapters an instance can load at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING) beyond those it started with
RUNTIME_LORA_SLOTS = 32
#: lengths the emulator draws EOS stops from when only flags are given
DEFAULT_LENGTHS = "sharegpt"
#: seconds an instance keeps an idle client connection open: vLLM's own (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); the
#: router's pool lets its connections go well before (lora_opt.http_pool.KEEPALIVE_EXPIRY_S), so it never
#: sends a request on a connection an instance is closing at that moment (issue 38: that race was a 502)
INSTANCE_KEEPALIVE_S = 5
#: seconds the router keeps an idle client connection open: a gateway's (nginx's default; Envoy keeps one an
#: hour), longer than clients' pools keep theirs (httpx's 5 s, the OpenAI client's), for the same reason
ROUTER_KEEPALIVE_S = 75


def free_ports(k: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``k`` consecutive free ports on ``host`` (a fleet of ``--instances k`` from ``--port``)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        try:
            for i in range(1, k):
                with socket.socket() as s:
                    s.bind((host, base + i))
            return base
        except OSError:
            continue


class StartupError(InputError):
    """An instance the memory model says vLLM would not start (the message is vLLM's kind)."""


@dataclass
class InstanceSpec:
    """What one emulated instance serves and where."""

    scenario: Scenario
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    name: str = "instance"
    gpu: int | None = None
    """The placement's GPU index (fleets)."""
    enable_lora: bool = True
    """False: vLLM without ``--enable-lora`` (base model only: no LoRA cost, no slots, no loads)."""
    preloaded: tuple | None = None
    """Ids of the adapters loaded at start-up (``--lora-modules``, in order); the scenario's other
    adapters are loaded on first use (on-demand adapters).  None: all of them."""

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def _vllm_oom_message(reason: str, eng: EngineConfig) -> str:
    if reason.startswith("LoRA slots"):
        return ("torch.OutOfMemoryError: CUDA out of memory while allocating the LoRA buffers "
                f"(--max-loras {eng.max_loras} --max-lora-rank {eng.max_lora_rank}). "
                f"[lora-opt's memory model: {reason}]")
    return ("ValueError: To serve at least one request with the models's max seq len "
            f"({eng.max_model_len}), more KV cache memory is needed than is available. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine. "
            f"[lora-opt's memory model: {reason}]")


def make_instance(spec: InstanceSpec, *, speed: float, seed: int = 0, runtime_lora_updating: bool = False) -> Instance:
    """The instance of ``spec``; raises :class:`StartupError` when vLLM would not start."""
    sc = spec.scenario
    profile = sc.load_profile()
    eng = sc.resolved_engine(profile)
    starts, kv_tokens, reason = profile.startup_check(eng)
    if not spec.enable_lora:
        profile, kv_tokens, ids = _without_lora(profile, eng)
        starts = kv_tokens >= eng.max_model_len
        reason = f"KV cache holds {max(kv_tokens, 0)} tokens < max_model_len {eng.max_model_len}"
    if not starts:
        raise StartupError(f"{spec.name}: {_vllm_oom_message(reason, eng)}")
    preloaded = None
    if spec.enable_lora:
        ids, _, _ = sc.adapter_table()
        if spec.preloaded is not None:
            at = {a: k for k, a in enumerate(ids)}
            preloaded = [at[a] for a in spec.preloaded]
    model = spec.served_model_name or profile.model.name
    spares = RUNTIME_LORA_SLOTS if runtime_lora_updating else 0
    # engine index 0: base-model requests; 1..spares: slots for adapters loaded at run time
    metrics = EngineMetrics(model, [f"{RUNTIME_ID}{k}" for k in range(spares)] + list(ids), eng.max_loras)
    engine = OnlineEngine(sc, profile, eng, kv_tokens, speed=speed, seed=seed, observer=metrics,
                          runtime_slots=spares, preloaded=preloaded)
    return Instance(engine=engine, model=model, adapters={a: k + 1 + spares for k, a in enumerate(ids)},
                    vllm_version=profile.vllm_version, metrics=metrics, max_model_len=eng.max_model_len,
                    runtime_lora_updating=runtime_lora_updating, free_slots=list(range(1, 1 + spares)))


def _without_lora(profile, eng: EngineConfig):
    """vLLM without ``--enable-lora``: no LoRA kernels (no LoRA cost), no slots (all memory after the
    activations goes to KV), no adapter loads; the kernel's base-model adapter carries the requests."""
    zero = {r: 0.0 for r in VLLM_LORA_RANKS}
    profile = dataclasses.replace(profile, latency=dataclasses.replace(profile.latency, lora={}),
                                  loading=LoadingSpec(cpu_to_gpu_ms=zero, disk_to_cpu_ms=dict(zero)))
    kv = profile.kv_capacity_tokens(eng.max_loras, eng.max_lora_rank, eng.gpu_memory_utilization,
                                    eng.max_num_batched_tokens, enable_lora=False, max_num_seqs=eng.max_num_seqs)
    return profile, kv, []


# ---- specs -----------------------------------------------------------------------------------
def _rank_of(path: str, default: int) -> int:
    rank = adapter_rank(path)
    return default if rank is None else rank


def parse_lora_modules(modules: list[str], default_rank: int) -> list[dict]:
    """vLLM's ``--lora-modules``: ``name=path`` or JSON ``{"name", "path"[, "base_model_name"]}``; the
    rank is the adapter's ``adapter_config.json`` ``r`` when the path has one, else ``default_rank``."""
    out = []
    for m in modules:
        if m.lstrip().startswith("{"):
            try:
                d = parse_json_text(m, "--lora-modules", InputError)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise InputError(f"--lora-modules: bad JSON module {m!r} (needs name and path)") from None
        elif "=" in m:
            name, path = m.split("=", 1)
        else:
            raise InputError(f"--lora-modules: {m!r} is not name=path")
        out.append({"id": name, "rank": _rank_of(path, default_rank), "rate": 1.0})
    return out


def spec_from_flags(profile: str, modules: list[str], engine: dict, *, port: int, host: str,
                    served_model_name: str | None = None, lengths: str = DEFAULT_LENGTHS) -> InstanceSpec:
    """One instance from vLLM's own flags (``engine``: EngineFlags names, None = profile default);
    no ``modules``: vLLM without ``--enable-lora`` (the base model only)."""
    rank = engine.get("max_lora_rank") or 16
    adapters = parse_lora_modules(modules, rank)
    if not adapters:                    # the scenario needs an adapter; a no-LoRA instance serves none
        sc = build_scenario(profile, [{"id": "no-lora", "rank": rank, "rate": 1.0}],
                            engine={k: v for k, v in engine.items() if v is not None}, lengths=lengths, where="flags")
        return InstanceSpec(sc, port=port, host=host, served_model_name=served_model_name, name="instance",
                            enable_lora=False)
    if engine.get("max_lora_rank") is None:
        engine = {**engine, "max_lora_rank": max_lora_rank_for(a["rank"] for a in adapters)}
    sc = build_scenario(profile, adapters, engine={k: v for k, v in engine.items() if v is not None},
                        lengths=lengths, where="flags")
    return InstanceSpec(sc, port=port, host=host, served_model_name=served_model_name, name="instance")


def spec_from_scenario(path: str, *, port: int, host: str, served_model_name: str | None = None) -> InstanceSpec:
    return InstanceSpec(load_scenario(path), port=port, host=host, served_model_name=served_model_name,
                        name=Path(path).name)


def _router_ports(router: dict, p: Placement) -> dict[int, tuple[str, int]]:
    """GPU index -> (host, port) from router.json (routes and router entries are in the same order)."""
    out: dict[int, tuple[str, int]] = {}
    for aid, routes in p.routes.items():
        for (g, _), entry in zip(routes, router.get(aid, [])):
            u = urlparse(entry["endpoint"])
            out.setdefault(g, (u.hostname or "127.0.0.1", u.port or 80))
    return out


def specs_from_placement(path: str, *, base_port: int | None, host: str | None,
                         lengths: str = DEFAULT_LENGTHS, adapters: str = "static") -> list[InstanceSpec]:
    """One instance per used GPU of a placement, with its flags and adapters, on the port its
    ``router.json`` (next to placement.json) names, or ``base_port + GPU index``.  ``adapters``:
    ``static`` serves the adapters placed on the GPU; ``on-demand`` serves every adapter of the
    placement its ``--max-lora-rank`` admits, those placed on it loaded at start-up, the others on
    first use (the fleet twin's instances: ``lora_opt.placement.instances.fleet_engines``)."""
    check_adapter_mode(adapters)
    try:
        p = Placement.load(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"--placement: cannot read {path}: {exc}") from None
    router_file = Path(path).parent / "router.json"
    ports = {}
    if base_port is None and router_file.exists():
        ports = _router_ports(read_json_file(router_file, "router table", InputError, allow_nan=True), p)
    specs = []
    for g, flags in enumerate(p.gpus):
        placed = p.adapters_on(g)
        if not placed:
            continue
        h, port = ports.get(g, ("127.0.0.1", (base_port or 8000) + g))
        served, preloaded = placed, None
        if adapters == "on-demand":
            served = [a for a in p.adapters if a.rank <= flags.max_lora_rank]     # vLLM rejects the others
            on = {a.id for a in placed}
            preloaded = tuple(a.id for a in served if a.id in on)
        sc = build_scenario(p.profile, scenario_adapters(served),
                            engine=flags, lengths=lengths, where=f"placement GPU {g}")
        specs.append(InstanceSpec(sc, port=port, host=host or h, name=f"GPU {g}", gpu=g, preloaded=preloaded))
    if not specs:
        raise InputError(f"--placement: {path} routes no adapter to any GPU")
    return specs


def identical_fleet(spec: InstanceSpec, k: int) -> list[InstanceSpec]:
    """``k`` instances of ``spec`` on ports ``spec.port``, ``spec.port + 1``, ... (a plain fleet:
    every instance serves every adapter)."""
    if spec.port + k - 1 > 65535:
        raise InputError(f"--instances {k}: ports {spec.port}..{spec.port + k - 1} exceed 65535")
    return [dataclasses.replace(spec, port=spec.port + i, name=f"instance {i}") for i in range(k)]


def route_table(specs: list[InstanceSpec], placement_path: str | None = None) -> dict:
    """The router table of instances started here: a placement's routes and weights over its
    instances' endpoints; otherwise each adapter on every instance serving it, equal weights."""
    table: dict = {}
    if placement_path:
        by_gpu = {s.gpu: s for s in specs}
        for aid, routes in Placement.load(placement_path).routes.items():
            table[aid] = [{"endpoint": by_gpu[g].endpoint, "weight": w} for g, w in routes if g in by_gpu]
        return table
    return {a: [{"endpoint": ep, "weight": 1.0} for ep in eps] for a, eps in servers_of(specs).items()}


def servers_of(specs: list[InstanceSpec]) -> dict[str, list[str]]:
    """Adapter id -> the endpoints of the instances whose adapter table holds it."""
    out: dict = {}
    for s in specs:
        if not s.enable_lora:
            continue
        ids, _, _ = s.scenario.adapter_table()
        for a in ids:
            out.setdefault(a, []).append(s.endpoint)
    return out


def front(specs: list[InstanceSpec], instances: list[Instance], placement_path: str | None, *, policy: str = "static",
          seed=0, scrape_interval_s: float = SCRAPE_INTERVAL_S, health: HealthChecks | None = None) -> RouteTable:
    """The router in front of the instances started here: ``policy`` (``twin.routers``) choosing
    among the instances that serve each adapter, ``static`` with the placement's weights (or equal
    weights), reading the instances' own state for the policies that read metrics; ``health``: how it
    ejects and re-admits instances (default :class:`HealthChecks`)."""
    return RouteTable(route_table(specs, placement_path), seed, policy=policy, endpoints=[s.endpoint for s in specs],
                      candidates=servers_of(specs), engines=[(i.engine, i.adapters) for i in instances],
                      scrape_interval_s=scrape_interval_s, health=health)


def with_lengths(spec: InstanceSpec, lengths: str) -> InstanceSpec:
    return dataclasses.replace(spec, scenario=replace(spec.scenario, lengths=dataclasses.replace(
        spec.scenario.lengths, source=lengths)))


# ---- serving ---------------------------------------------------------------------------------
def _server(app, host: str, port: int, log_level: str, lifespan: str = "off",
            keep_alive_s: float = INSTANCE_KEEPALIVE_S):
    # uvicorn only where an emulator runs
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            lifespan=lifespan, timeout_graceful_shutdown=2, timeout_keep_alive=keep_alive_s)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None       # the fleet owns the signals
    return server


def front_server(table: RouteTable, host: str, port: int, log_level: str = "warning"):
    """The router's uvicorn server: its app (:func:`build_router_app`), its health checks (the app's
    lifespan) and a gateway's keep-alive (:data:`ROUTER_KEEPALIVE_S`)."""
    return _server(build_router_app(table), host, port, log_level, lifespan="on", keep_alive_s=ROUTER_KEEPALIVE_S)


async def _serve_one(server) -> bool:
    """Run one uvicorn server; False when it could not start (uvicorn exits on a bind error)."""
    try:
        await server.serve()
    except SystemExit:
        return False
    return True


def _stopper(server, inst: Instance):
    """What ``POST /emulator/shutdown`` calls: this instance's server exits, its engine stops (its
    requests end), the others keep serving."""
    def stop():
        server.should_exit = True
        inst.engine.close()
    return stop


async def _until_started(servers, tasks) -> None:
    """Until every server listens, or one of the tasks ended (it could not start)."""
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            return
        await asyncio.sleep(0.01)


async def serve(instances: list[tuple[InstanceSpec, Instance]], *, log_level: str = "warning",
                ready=None, stop: asyncio.Event | None = None, router: tuple | None = None) -> None:
    """Serve every instance on this loop until SIGINT/SIGTERM (or ``stop`` is set, or -- no router -- every
    instance was shut down by ``POST /emulator/shutdown``); ``ready``:
    called once every server listens.  ``router``: (host, port, :class:`RouteTable`) of a front
    that forwards to the instances (``lora_opt.emulate.router``; :func:`front`)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):     # not the main thread
            pass
    servers = []
    for spec, inst in instances:
        inst.engine.start()
        app = build_app(inst)
        server = _server(app, spec.host, spec.port, log_level)
        app.state.shutdown = _stopper(server, inst)
        servers.append(server)
    fronts, scraping = [], None
    if router is not None:
        host, port, table = router
        servers.append(front_server(table, host, port, log_level))
        fronts.append(InstanceSpec(scenario=None, port=port, host=host, name="router"))
        if table.policy.reads_state == "metrics":
            table.scrape()              # compiles the kernel's scrape before the first request needs it
            scraping = asyncio.ensure_future(table.scrape_every_interval())
    # the instances listen before the router starts: its first health checks must not find them refusing
    n_inst = len(instances)
    tasks = [asyncio.ensure_future(_serve_one(s)) for s in servers[:n_inst]]
    await _until_started(servers[:n_inst], tasks)
    if not any(t.done() for t in tasks):
        tasks += [asyncio.ensure_future(_serve_one(s)) for s in servers[n_inst:]]
        await _until_started(servers, tasks)
    failed = [t for t in tasks if t.done()]
    if not failed and ready is not None:
        ready()
    if not failed:
        if router is None and n_inst:       # every instance shut down (POST /emulator/shutdown): the process ends
            done = asyncio.ensure_future(asyncio.wait(tasks[:n_inst]))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({done, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for t in (done, stopped):
                t.cancel()
        else:
            await stop.wait()
    if scraping is not None:
        scraping.cancel()
    for s in servers:
        s.should_exit = True
    for _, inst in instances:
        inst.engine.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    if failed:
        specs = [spec for spec, _ in instances] + fronts
        where = ", ".join(f"{spec.host}:{spec.port}" for spec, t in zip(specs, tasks) if t in failed)
        raise InputError(f"could not listen on {where} (address in use?)")
