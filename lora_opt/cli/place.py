"""``lora-opt place``: a workload and a GPU pool in, a checked placement out -- a table,
``placement.json`` and, with ``--emit-vllm``, one ``vllm serve`` command per GPU and a router table.

The work (the policy, the deployments judged, the verdict, the files) is ``lora_opt.search.place``'s; this
module reads the flags, calls it and prints.
"""
from __future__ import annotations

import argparse
import json
import sys

from lora_opt.cli.conventions import CONFIDENCE, GPUS, NONNEGATIVE_S, POSITIVE_S, finite_float, show_progress
from lora_opt.placement.policies import DEFAULT_POLICY, ORACLE_FILES, POLICIES
from lora_opt.replan.router_config import ROUTER_CONFIGS
from twin.flags import DEFAULT_VLLM_VERSION

#: spelled here so that --help needs no import of the calibration stage (start-up time); tests check it
DEFAULT_CONFIDENCE = 0.9


def register(sub) -> None:
    pl = sub.add_parser("place", help="place a workload's adapters on GPUs; vLLM launch commands and a router table")
    pl.add_argument("--workload", required=True, help="workload YAML/JSON, or a bundled workload by name (example)")
    pl.add_argument("--gpus", type=GPUS, required=True, help="GPUs in the pool")
    pl.add_argument("--policy", choices=list(POLICIES),
                    help=f"placement policy (default: {DEFAULT_POLICY}); given, --deployment defaults to static: its "
                         "placement is the answer")
    pl.add_argument("--out", help="output directory (default: outputs/placement-<workload>)")
    pl.add_argument("--emit-vllm", action="store_true",
                    help="also write one vllm serve command per GPU and router.json")
    pl.add_argument("--emit-router", choices=list(ROUTER_CONFIGS),
                    help="also write the router's configuration: gateway (Gateway API Inference Extension "
                         "InferencePool/InferenceModel YAML, one pool per replica set) or vllm-router:POLICY (its "
                         "command line; only for a placement with every adapter on every GPU)")
    pl.add_argument("--vllm-version", metavar="X.Y",
                    help="the vLLM release the commands are written for: 0.32 or 0.33 (default: the profile's "
                         f"vllm_version when it is one of these, else {DEFAULT_VLLM_VERSION})")
    pl.add_argument("--model", help="model for vllm serve (default: the profile's model)")
    pl.add_argument("--surrogate", help="surrogate directory, or a registered version: models:/lora-opt-starvation@champion, "
                                        "models:/NAME/VERSION (default: the bundled one for the profile)")
    pl.add_argument("--confidence", type=CONFIDENCE,
                    help=f"decide at this confidence, in (0, 1): greedy-plus verifies each GPU at the load the "
                         f"profile's error model derives for it, and the table gives each GPU's margin and probability "
                         f"of starving (default {DEFAULT_CONFIDENCE:g} where the profile has an error model -- "
                         "configs/error_models/ -- else the fixed --margin)")
    pl.add_argument("--error-model", metavar="FILE", help="error model YAML (lora-opt error-model) instead of the "
                                                          "profile's bundled one")
    pl.add_argument("--margin", type=finite_float(0.0, 1.0),
                    help="greedy-plus: a fixed capacity headroom over the expected load instead of --confidence "
                         "(default 0.1 for a profile without an error model)")
    pl.add_argument("--verify-s", type=NONNEGATIVE_S, help="greedy-plus: seconds of twin verification per GPU (0 = off; default 900)")
    pl.add_argument("--ttft-p99-s", type=POSITIVE_S, help="p99 TTFT bound: greedy-plus's in its verification, and the "
                                                          "SLO --deployment judges every deployment at (default 5)")
    pl.add_argument("--oracle", choices=list(ORACLE_FILES), help="greedy-plus: surrogate to consult (default full)")
    pl.add_argument("--history", metavar="LOG.csv",
                    help="request log (timestamp_s, adapter, input_tokens, output_tokens): rates are estimated "
                         "from it and greedy-plus verifies every GPU on these requests, bursts included")
    pl.add_argument("--prometheus", metavar="URL",
                    help="rates (and lengths) from a Prometheus server that scrapes the gateway: each adapter of the "
                         "workload at its requests over --window (inference_model_request_total, the Gateway API "
                         "Inference Extension's per-adapter counter; lora-opt emulate's router exports it too)")
    pl.add_argument("--window", default="1h", help="--prometheus: the window ending now (a Prometheus duration: "
                                                   "15m, 1h, 1d; default 1h)")
    # spelled here so that --help needs no import of the search stage; tests check it is DEPLOYMENT_CHOICES
    pl.add_argument("--deployment", choices=("static", "every-gpu", "hybrid", "best"),
                    help="the deployments judged on the fleet twin at the same SLO and load (the confidence's "
                         "verification load, rho, the p99 TTFT bound), the one with the fewest GPUs returned: best "
                         "(all three; the default without --policy), static (the policy's placement alone, not judged "
                         "on the fleet; the default with --policy), "
                         "every-gpu (every adapter on every GPU, loaded on use, lora-affinity picker) or hybrid (the "
                         "hottest adapters everywhere, the tail placed by the policy)")
    pl.add_argument("--json", action="store_true", help="print the placement and verdict as one JSON object")
    pl.set_defaults(run=run)


def resolve_deployment(args: argparse.Namespace) -> None:
    """The policy and deployment a command line means: asking for a policy is asking for its placement
    (``static``); without one, the default policy and every deployment judged (``best``)."""
    if args.deployment is None:
        args.deployment = "static" if args.policy is not None else "best"
    if args.policy is None:
        args.policy = DEFAULT_POLICY


def run(args: argparse.Namespace) -> int:
    resolve_deployment(args)
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.placement.workload_file import load_workload
    from lora_opt.search.place import PlaceOptions, place_report, place_workload

    wl = load_workload(args.workload)
    if args.prometheus:
        from lora_opt.errors import InputError
        from lora_opt.placement.prometheus_demand import read_demand, workload_from_demand
        if args.history:
            raise InputError("--prometheus and --history: give one source of rates")
        demand = read_demand(args.prometheus, args.window)
        wl = workload_from_demand(wl, demand)
        if not args.json:
            print(demand.summary())
    options = PlaceOptions(policy=args.policy, deployment=args.deployment, confidence=args.confidence,
                           error_model=args.error_model, margin=args.margin, verify_s=args.verify_s,
                           ttft_p99_s=args.ttft_p99_s, oracle=args.oracle,
                           progress=sys.stderr.isatty() and show_progress(args), history=args.history,
                           surrogate=args.surrogate, out_dir=args.out, emit_vllm=args.emit_vllm,
                           emit_router=args.emit_router, model=args.model, vllm_version=args.vllm_version)
    done = place_workload(wl, args.gpus, options)
    sys.stdout.write(json.dumps(done.to_dict()) + "\n" if args.json else place_report(done))
    return done.code
