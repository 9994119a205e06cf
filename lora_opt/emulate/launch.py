"""``lora-opt emulate``'s work: which instances to serve (a scenario, vLLM's flags, a placement's GPUs, or
``instances`` copies of one), each checked as vLLM's start-up would check it and told which vLLM to imitate
and what it knows of the model; the router in front of them, or a router alone in front of instances served
elsewhere; all served on one loop until SIGINT/SIGTERM.

``emulate`` is the whole command as one call, asked by an :class:`EmulateOptions`; the lines it announces
once every server listens go to its ``ready`` callback (the CLI prints them).  The instances themselves, the
start-up check and the serving are :mod:`lora_opt.emulate.fleet`'s."""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lora_opt.emulate.fleet import (DEFAULT_LENGTHS, InstanceSpec, front, identical_fleet, make_instance, serve,
                                    spec_from_flags, spec_from_scenario, specs_from_placement, with_lengths)
from lora_opt.emulate.model_files import ModelFiles
from lora_opt.emulate.router import RouteTable
from lora_opt.emulate.vllm_versions import choose
from lora_opt.errors import InputError
from lora_opt.placement.instances import routing_seed
from lora_opt.replan.router_config import HealthChecks
from twin.fleet import SCRAPE_INTERVAL_S
from twin.flags import EngineFlags, flag_values
from twin.parsing import parse_json_text, read_config_file

#: where the servers bind when neither the options nor (a placement) its router.json say
DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True)
class EmulateOptions:
    """What ``emulate`` serves and how.  Exactly one source of instances: ``scenario``, ``placement``,
    ``profile`` (vLLM's flags) -- or ``routes``, the router alone."""

    scenario: str | None = None
    """One instance (or ``instances`` copies): a scenario file (profile, adapters, engine flags, lengths)."""
    placement: str | None = None
    """A fleet: ``DIR/placement.json``, one instance per GPU that serves an adapter, on the port its
    ``router.json`` names (or ``base_port`` + GPU index)."""
    routes: str | None = None
    """The router alone, on ``router_port``, in front of instances served elsewhere: its table (``router.json``:
    adapter id -> [{endpoint, weight}]; a placement folder: its ``router.json``)."""
    profile: str | None = None
    """One instance from vLLM's flags: the model profile (YAML, or a bundled name)."""
    lora_modules: tuple[str, ...] = ()
    """vLLM's ``--lora-modules`` (``name=path`` or JSON): the adapters, their rank from
    ``PATH/adapter_config.json``, else ``engine.max_lora_rank``; none: vLLM without ``--enable-lora``."""
    engine: EngineFlags = EngineFlags()
    """vLLM's engine flags of the ``profile`` instance (unset: the profile's defaults; ``max_model_len``:
    ``model``'s context when it has one)."""
    served_model_name: str | None = None
    """The base model's name in the API (None: the profile's model)."""
    model: str | None = None
    """The model directory ``vllm serve`` is given (:class:`ModelFiles`: vocabulary, context, tokenizer, chat
    template); ``/v1/models``' root."""
    vllm_version: str | None = None
    """The vLLM version to imitate (``lora_opt.emulate.vllm_versions.choose``; None: the profile's when
    imitated, else the default)."""
    host: str | None = None
    """Bind address (None: 127.0.0.1; a placement: its router.json's hosts)."""
    port: int = 8000
    """One instance's port (``instances`` copies: this one and the next ones)."""
    base_port: int | None = None
    """A placement: GPU i listens on ``base_port + i`` (instead of router.json's ports)."""
    instances: int = 1
    """A plain fleet: this many identical instances of ``scenario`` / ``profile`` on ``port``, ``port + 1``, ..."""
    router_port: int | None = None
    """Also serve a router on this port (with ``routes``: the router alone, required)."""
    router: str = "static"
    """The router's policy (``twin.routers.ROUTERS``): ``static`` = the placement's weights (a plain fleet:
    equal weights)."""
    adapters: str = "static"
    """``static``: an instance serves the adapters placed on it (a plain fleet: all, loaded at start-up);
    ``on-demand``: every adapter its ``max_lora_rank`` admits, loaded on first use."""
    scrape_interval_s: float = SCRAPE_INTERVAL_S
    """Simulated seconds between the router's reads of the instances' metrics (0: at every request)."""
    health: HealthChecks = field(default_factory=HealthChecks)
    """How the router ejects and re-admits instances, and how long it retries a request that reached none."""
    speed: float = 1.0
    """Simulated seconds per wall second (> 0)."""
    lengths: str | None = None
    """The length model EOS stops are drawn from (None: the scenario's, else sharegpt)."""
    seed: int = 0
    """Seed of the EOS draws and of the router's draws."""
    log_level: str | None = None
    """uvicorn's log level (None: warning; the instances' servers: info when ``verbose``)."""
    verbose: bool = False
    """The instances' servers log at info unless ``log_level`` says otherwise."""
    runtime_lora_updating: bool = False
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the instances load and unload adapters at run time."""


def emulate(options: EmulateOptions, ready: Callable[[list[str]], None] | None = None,
            warn: Callable[[str], None] | None = None) -> None:
    """Serve what ``options`` asks until SIGINT/SIGTERM (or, without a router, until every instance was shut
    down by ``POST /emulator/shutdown``); ``ready`` gets one line per server once every one listens, ``warn``
    what the user should know before (a tokenizer that cannot be used).  Raises :class:`InputError` (its
    subclass ``lora_opt.emulate.fleet.StartupError`` for an instance vLLM would not start) before serving."""
    if options.routes:
        _serve_router_alone(options, ready)
    else:
        _serve_fleet(options, ready, warn)


def lora_paths(modules) -> dict[str, str]:
    """Adapter id -> path of ``--lora-modules`` (``name=path`` or JSON; the cards' ``root``);
    malformed entries are reported by ``lora_opt.emulate.fleet.parse_lora_modules``."""
    out = {}
    for m in modules:
        if m.lstrip().startswith("{"):
            try:
                d = parse_json_text(m, "--lora-modules")
                out[str(d["name"])] = str(d["path"])
            except (ValueError, KeyError, TypeError):
                continue
        elif "=" in m:
            name, path = m.split("=", 1)
            out[name] = path
    return out


def _model_files(options: EmulateOptions, warn: Callable[[str], None] | None) -> ModelFiles | None:
    if not options.model:
        return None
    files = ModelFiles.load(options.model)
    if files.tokenizer is None and (Path(options.model) / "tokenizer.json").is_file() and warn is not None:
        warn("--model: the tokenizers package is not installed (pip install 'lora-opt[tokenizer]'): "
             "text prompts are counted 4 characters a token, not by the model's tokenizer")
    return files


def instance_specs(options: EmulateOptions, files: ModelFiles | None = None) -> list[InstanceSpec]:
    """The instances ``options`` asks for (not started); ``files``: the model directory's, whose context is
    the default ``max_model_len`` of an instance from flags."""
    host = options.host or DEFAULT_HOST
    if options.placement:
        if options.instances != 1:
            raise InputError("--instances: a placement's fleet has one instance per GPU (omit --instances)")
        specs = specs_from_placement(options.placement, base_port=options.base_port, host=options.host,
                                     lengths=options.lengths or DEFAULT_LENGTHS, adapters=options.adapters)
    elif options.scenario:
        specs = [spec_from_scenario(options.scenario, port=options.port, host=host,
                                    served_model_name=options.served_model_name)]
        if options.lengths:
            specs = [with_lengths(s, options.lengths) for s in specs]
    elif options.profile:
        engine = flag_values(options.engine)
        if engine["max_model_len"] is None and files is not None and files.max_position_embeddings:
            engine["max_model_len"] = files.max_position_embeddings     # vLLM's default: the model's context
        specs = [spec_from_flags(options.profile, list(options.lora_modules), engine, port=options.port, host=host,
                                 served_model_name=options.served_model_name,
                                 lengths=options.lengths or DEFAULT_LENGTHS)]
    else:
        raise InputError("one of --scenario, --placement or --profile (with --lora-modules) is required")
    if not options.placement:
        if options.adapters == "on-demand":        # vLLM's LoRA resolver: nothing loaded until a request names it
            specs = [dataclasses.replace(s, preloaded=()) for s in specs]
        specs = identical_fleet(specs[0], options.instances) if options.instances > 1 else specs
    if options.router != "static" and options.router_port is None:
        raise InputError(f"--router {options.router}: needs --router-port (the router it configures)")
    if options.speed <= 0:
        raise InputError(f"--speed: must be > 0, got {options.speed}")
    return specs


def _serve_fleet(options: EmulateOptions, ready: Callable[[list[str]], None] | None,
                 warn: Callable[[str], None] | None) -> None:
    """The instances (and the router in front, with ``router_port``) on one loop: vLLM's (uvloop) when
    installed."""
    files = _model_files(options, warn)
    specs = instance_specs(options, files)
    instances = [(s, make_instance(s, speed=options.speed, seed=options.seed,
                                   runtime_lora_updating=options.runtime_lora_updating)) for s in specs]
    for _, inst in instances:
        behaviour = choose(options.vllm_version, inst.engine.profile.vllm_version)
        inst.configure(behaviour=behaviour, files=files, model_root=options.model,
                       lora_roots=lora_paths(options.lora_modules))
    router = None
    if options.router_port is not None:
        table = front(specs, [inst for _, inst in instances], options.placement, policy=options.router,
                      seed=routing_seed(options.seed), scrape_interval_s=options.scrape_interval_s,
                      health=options.health)
        router = (options.host or DEFAULT_HOST, options.router_port, table)

    def listening():
        lines = [f"{s.name}: {inst.model} + {len(inst.adapters)} adapters on http://{s.host}:{s.port}/v1 "
                 f"(speed {options.speed:g}, imitating vLLM {inst.vllm_version})" for s, inst in instances]
        if router is not None:
            lines.append(f"router: http://{router[0]}:{router[1]}/v1 -> {len(specs)} instances ({options.router}, "
                         f"{options.adapters} adapters)")
        if ready is not None:
            ready(lines)

    log_level = options.log_level or ("info" if options.verbose else "warning")
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve(instances, log_level=log_level, ready=listening, router=router))


def loop_factory():
    """The emulator's event loop: vLLM's (uvloop) when installed, else asyncio's default (None)."""
    try:                                # vLLM's loop (uvloop) and HTTP parser (httptools) when installed
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return None


def _serve_router_alone(options: EmulateOptions, ready: Callable[[list[str]], None] | None) -> None:
    """``routes``: the router's process alone (no instance), its table checked as ``POST /router/routes``
    checks one."""
    if options.router_port is None:
        raise InputError("--routes: needs --router-port (where the router listens)")
    path = Path(options.routes)
    path = path / "router.json" if path.is_dir() else path
    table = read_config_file(path, "router table", InputError)
    if not isinstance(table, dict):
        raise InputError(f"--routes: {path} is not a router table (adapter id -> [{{endpoint, weight}}])")
    if options.router == "lora-affinity":
        raise InputError("--router lora-affinity: reads the instances' metrics, which only a router serving the "
                         "emulated instances in its own process has (drop --routes)")
    RouteTable({}, policy="static").reroute(table)         # the checks of POST /router/routes, its messages
    rt = RouteTable(table, routing_seed(options.seed), policy=options.router, health=options.health)
    host = options.host or DEFAULT_HOST

    def listening():
        if ready is not None:
            ready([f"router: http://{host}:{options.router_port}/v1 -> {len(rt.endpoints)} instances "
                   f"({options.router})"])
    asyncio.run(serve([], log_level=options.log_level or "warning", ready=listening,
                      router=(host, options.router_port, rt)))
