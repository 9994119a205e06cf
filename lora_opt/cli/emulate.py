"""``lora-opt emulate``: an OpenAI-compatible vLLM multi-LoRA endpoint (or a fleet, one per GPU of
a placement) driven by the twin in real time."""
from __future__ import annotations

import argparse
import os
import sys

from lora_opt.cli.common import finite_float, int_range
from lora_opt.cli.conventions import verbosity
from twin.profile import bundled_profiles

PORT = int_range(0, 65535)


def register(sub) -> None:
    e = sub.add_parser("emulate", help="serve vLLM's OpenAI API from the twin in real time (one instance or a "
                                       "placement's fleet)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--scenario", help="one instance: a scenario file (profile, adapters, engine flags, lengths)")
    src.add_argument("--placement", help="a fleet: DIR/placement.json, one instance per GPU on the ports its "
                                         "router.json names (or --base-port + GPU index)")
    e.add_argument("--profile", help="one instance from vLLM's flags: the model profile (YAML, or a bundled "
                                     f"name: {', '.join(bundled_profiles())})")
    e.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="the adapters (vLLM's flag; rank from PATH/adapter_config.json, else --max-lora-rank)")
    count = int_range(1, 10_000_000)
    for flag, typ in (("--max-loras", count), ("--max-lora-rank", count), ("--max-cpu-loras", count),
                      ("--max-num-seqs", count), ("--max-num-batched-tokens", count),
                      ("--gpu-memory-utilization", finite_float(0.0, 1.0, lo_open=True)), ("--max-model-len", count)):
        e.add_argument(flag, type=typ, help="vLLM's flag (default: the profile's)")
    e.add_argument("--served-model-name", help="the base model's name in the API (default: the profile's model)")
    e.add_argument("--host", help="bind address (default 127.0.0.1; a placement: its router.json's hosts)")
    e.add_argument("--port", type=PORT, default=8000, help="one instance: port (default 8000)")
    e.add_argument("--base-port", type=PORT, help="a placement: GPU i listens on BASE_PORT + i (instead of router.json)")
    e.add_argument("--router-port", type=PORT,
                   help="also serve a router on this port: it forwards each request to an instance of its "
                        "adapter by the placement's weights")
    e.add_argument("--speed", type=finite_float(0.001, 10_000.0), default=1.0, help="simulated seconds per wall second (default 1)")
    e.add_argument("--lengths", help="length model EOS stops are drawn from (default: the scenario's, else sharegpt)")
    e.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="seed of the EOS draws")
    e.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: warning; info with -v)")
    e.set_defaults(run=run)


def _specs(args):
    from lora_opt.emulate.fleet import spec_from_flags, spec_from_scenario, specs_from_placement, with_lengths
    from lora_opt.errors import InputError
    host = args.host or "127.0.0.1"
    if args.placement:
        specs = specs_from_placement(args.placement, base_port=args.base_port, host=args.host,
                                     lengths=args.lengths or "sharegpt")
    elif args.scenario:
        specs = [spec_from_scenario(args.scenario, port=args.port, host=host,
                                    served_model_name=args.served_model_name)]
        if args.lengths:
            specs = [with_lengths(s, args.lengths) for s in specs]
    elif args.profile:
        engine = {k: getattr(args, k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs",
                                                 "max_num_batched_tokens", "gpu_memory_utilization", "max_model_len")}
        specs = [spec_from_flags(args.profile, args.lora_modules, engine, port=args.port, host=host,
                                 served_model_name=args.served_model_name, lengths=args.lengths or "sharegpt")]
    else:
        raise InputError("one of --scenario, --placement or --profile (with --lora-modules) is required")
    if args.speed <= 0:
        raise InputError(f"--speed: must be > 0, got {args.speed}")
    return specs


def run(args: argparse.Namespace) -> int:
    import asyncio

    from lora_opt.emulate.fleet import make_instance, route_table, serve
    specs = _specs(args)
    updating = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")
    instances = [(s, make_instance(s, speed=args.speed, seed=args.seed, runtime_lora_updating=updating))
                 for s in specs]

    router = None
    if args.router_port is not None:
        router = (args.host or "127.0.0.1", args.router_port, route_table(specs, args.placement))

    def ready():
        for s, inst in instances:
            print(f"{s.name}: {inst.model} + {len(inst.adapters)} adapters on http://{s.host}:{s.port}/v1 "
                  f"(speed {args.speed:g})", flush=True)
        if router is not None:
            print(f"router: http://{router[0]}:{router[1]}/v1 -> {len(specs)} instances", flush=True)
        print("ready", flush=True)

    try:                                # vLLM's loop (uvloop) and HTTP parser (httptools) when installed
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(instances, log_level=args.log_level or ("info" if verbosity(args) >= 1 else "warning"),
                         ready=ready, router=router))
    print("emulate: stopped", file=sys.stderr, flush=True)
    return 0
