"""``lora-opt emulate``: an OpenAI-compatible vLLM multi-LoRA endpoint (or a fleet, one per GPU of
a placement) driven by the twin in real time."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from lora_opt.cli.conventions import SCRAPE_DEFAULT_S, finite_float, int_range, verbosity
from lora_opt.replan.router_config import HealthChecks
from twin.flags import DEFAULT_VLLM_VERSION, EngineFlags, serve_option
from twin.profile import bundled_profiles
from twin.routers import ADAPTER_MODES, ROUTERS

PORT = int_range(0, 65535)


def register(sub) -> None:
    e = sub.add_parser("emulate", help="serve vLLM's OpenAI API from the twin in real time (one instance or a "
                                       "placement's fleet)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--scenario", help="one instance: a scenario file (profile, adapters, engine flags, lengths)")
    src.add_argument("--placement", help="a fleet: DIR/placement.json, one instance per GPU on the ports its "
                                         "router.json names (or --base-port + GPU index)")
    src.add_argument("--routes", metavar="ROUTER_JSON",
                     help="the router alone, on --router-port, in front of instances served elsewhere: its table "
                          "(router.json: adapter id -> [{endpoint, weight}], as place writes it; a placement folder: "
                          "its router.json); its own process, so that it can fail and be restarted alone")
    e.add_argument("--profile", help="one instance from vLLM's flags: the model profile (YAML, or a bundled "
                                     f"name: {', '.join(bundled_profiles())})")
    e.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="the adapters (vLLM's flag; rank from PATH/adapter_config.json, else --max-lora-rank)")
    count = int_range(1, 10_000_000)
    fraction = finite_float(0.0, 1.0, lo_open=True)
    for f in dataclasses.fields(EngineFlags):      # vLLM's own flags; the one float flag is a fraction
        e.add_argument(serve_option(f.name), type=fraction if "float" in str(f.type) else count,
                       help="vLLM's flag (default: the profile's)")
    e.add_argument("--served-model-name", help="the base model's name in the API (default: the profile's model)")
    e.add_argument("--model", metavar="MODEL_DIR",
                   help="the model directory vllm serve is given: its config.json's vocab_size (token ids beyond it are "
                        "refused, as vLLM does) and max_position_embeddings (the default --max-model-len), its "
                        "tokenizer.json (text prompts counted as vLLM counts them; needs the tokenizers package, "
                        "else 4 characters a token) and chat template (jinja2); /v1/models' root")
    e.add_argument("--vllm-version", metavar="VERSION",
                   help="the vLLM version to imitate (/version, error shapes, length rules): 0.32, 0.33 or 0.8.5 "
                        f"(default: the profile's vllm_version when it is one of these, else {DEFAULT_VLLM_VERSION})")
    e.add_argument("--host", help="bind address (default 127.0.0.1; a placement: its router.json's hosts)")
    e.add_argument("--port", type=PORT, default=8000, help="one instance: port (default 8000)")
    e.add_argument("--base-port", type=PORT, help="a placement: GPU i listens on BASE_PORT + i (instead of router.json)")
    e.add_argument("--instances", type=int_range(1, 1000), default=1,
                   help="a plain fleet: this many identical instances of --scenario / --profile on ports --port, "
                        "--port + 1, ... (default 1)")
    e.add_argument("--router-port", type=PORT,
                   help="also serve a router on this port: it forwards each request to an instance that serves "
                        "its adapter, chosen by --router")
    e.add_argument("--router", choices=list(ROUTERS), default="static",
                   help="the router's policy, the fleet twin's (lora-opt evaluate --router): static = the placement's "
                        "weights (a plain fleet: equal weights); round-robin, least-requests, power-of-two, "
                        "consistent-hash, lora-affinity (default static)")
    e.add_argument("--adapters", choices=list(ADAPTER_MODES), default="static",
                   help="static: an instance serves the adapters placed on it (a plain fleet: all, loaded at start-up); "
                        "on-demand: every adapter its --max-lora-rank admits, loaded on first use (LRU CPU cache and "
                        "GPU slots at the profile's load costs; a placement's own adapters loaded at start-up) "
                        "(default static)")
    e.add_argument("--scrape-interval-s", type=finite_float(0.0, 3600.0), default=SCRAPE_DEFAULT_S,
                   help="simulated seconds between the router's reads of the instances' metrics (lora-affinity; "
                        f"0: at every request) (default {SCRAPE_DEFAULT_S:g})")
    e.add_argument("--health-interval-s", type=finite_float(0.0, 3600.0), default=HealthChecks.interval_s,
                   help="seconds between the router's checks of every instance's /health: failing ones are ejected "
                        "(sent nothing), passing ones re-admitted; a refused connection ejects at once and its "
                        f"request goes to another instance of its adapter (0: no checks, no ejection) "
                        f"(default {HealthChecks.interval_s:g})")
    e.add_argument("--health-timeout-s", type=finite_float(0.001, 3600.0), default=HealthChecks.timeout_s,
                   help=f"seconds a health check waits for its answer (default {HealthChecks.timeout_s:g})")
    e.add_argument("--health-failures", type=int_range(1, 1000), default=HealthChecks.failure_threshold,
                   help="failed health checks in a row that eject an instance "
                        f"(default {HealthChecks.failure_threshold})")
    e.add_argument("--health-successes", type=int_range(1, 1000), default=HealthChecks.success_threshold,
                   help="passed health checks in a row that re-admit an ejected instance "
                        f"(default {HealthChecks.success_threshold})")
    e.add_argument("--retry-for-s", type=finite_float(0.0, 3600.0), default=HealthChecks.retry_for_s,
                   help="seconds the router tries again a request that reached no instance (every instance of its "
                        "adapter refused it, or none is routed), every 0.5 s, before answering it with an error: "
                        "an instance relaunched meanwhile serves it; a request sent to an instance is never tried "
                        f"again (default {HealthChecks.retry_for_s:g})")
    e.add_argument("--speed", type=finite_float(0.001, 10_000.0), default=1.0, help="simulated seconds per wall second (default 1)")
    e.add_argument("--lengths", help="length model EOS stops are drawn from (default: the scenario's, else sharegpt)")
    e.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="seed of the EOS draws and of the router's draws")
    e.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: warning; info with -v)")
    e.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lora_opt.emulate.launch import EmulateOptions, emulate
    options = EmulateOptions(
        scenario=args.scenario, placement=args.placement, routes=args.routes, profile=args.profile,
        lora_modules=tuple(args.lora_modules),
        engine=EngineFlags(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineFlags)}),
        served_model_name=args.served_model_name, model=args.model, vllm_version=args.vllm_version,
        host=args.host, port=args.port, base_port=args.base_port, instances=args.instances,
        router_port=args.router_port, router=args.router, adapters=args.adapters,
        scrape_interval_s=args.scrape_interval_s,
        health=HealthChecks(args.health_interval_s, args.health_timeout_s, args.health_failures,
                            args.health_successes, retry_for_s=args.retry_for_s),
        speed=args.speed, lengths=args.lengths, seed=args.seed, log_level=args.log_level,
        verbose=verbosity(args) >= 1,
        runtime_lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"))
    emulate(options, ready=_print_ready, warn=lambda message: print(f"emulate: {message}", file=sys.stderr))
    print("emulate: router stopped" if args.routes else "emulate: stopped", file=sys.stderr, flush=True)
    return 0


def _print_ready(lines: list[str]) -> None:
    """Every server listens: its line each, then ``ready`` (what scripts and tests wait for)."""
    for line in lines:
        print(line, flush=True)
    print("ready", flush=True)
