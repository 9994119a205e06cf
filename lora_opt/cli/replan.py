"""``lora-opt replan CURRENT/placement.json --workload NEW.yaml`` (or ``--history LOG.csv``): a placement for the new demand with
the fewest adapter moves and instance restarts, and the plan to get there (``plan.json``: vLLM runtime
LoRA calls, router switches, launches, drains, stops, every intermediate state judged).

The work (the new demand read, the replan, the verdict, the files) is ``lora_opt.replan.run``'s; this
module reads the flags, calls it and prints.
"""
from __future__ import annotations

import argparse
import json
import sys

from lora_opt.cli.conventions import CONFIDENCE, NONNEGATIVE_S, POSITIVE_S, finite_float
from lora_opt.placement.policies import ORACLE_FILES

#: the cost flags' range (GPU-equivalents)
COST = finite_float(0.0, 1e6)


def add_replan_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``replan`` and ``schedule`` share: the costs and greedy-plus's GPU test."""
    p.add_argument("--move-cost", type=COST, default=0.0,
                   help="GPU-equivalents one adapter move (a load or an unload on one instance) costs "
                        "(default 0: fewest GPUs first, then fewest launches -- restarts and new instances --, then fewest "
                        "moves)")
    p.add_argument("--restart-cost", type=COST, default=0.0,
                   help="GPU-equivalents one instance restart (new vLLM flags; it keeps its adapters) costs "
                        "(default 0: after GPUs)")
    p.add_argument("--no-consolidate", action="store_true",
                   help="never empty and stop a running instance to save a GPU")
    p.add_argument("--surrogate", help="surrogate directory or registered version (default: the bundled one)")
    p.add_argument("--margin", type=finite_float(0.0, 1.0), help="greedy-plus: capacity headroom over the load (default 0.1)")
    p.add_argument("--confidence", type=CONFIDENCE,
                   help="greedy-plus: verify each GPU at the load the profile's error model derives for this confidence, "
                        "in (0, 1), instead of the fixed --margin (as place does; default: the fixed margin)")
    p.add_argument("--error-model", metavar="FILE", help="error model YAML for --confidence (default: the profile's bundled one)")
    p.add_argument("--verify-s", type=NONNEGATIVE_S, help="greedy-plus: seconds of twin verification per GPU (0 = off; default 900)")
    p.add_argument("--ttft-p99-s", type=POSITIVE_S, help="greedy-plus: p99 TTFT bound in the verification (default 5)")
    p.add_argument("--oracle", choices=list(ORACLE_FILES), help="greedy-plus: surrogate to consult (default full)")


def replan_options(args: argparse.Namespace):
    """The flags of ``add_replan_flags`` as ``lora_opt.replan.run.ReplanOptions``."""
    from lora_opt.replan.replan import ReplanCosts
    from lora_opt.replan.run import ReplanOptions

    return ReplanOptions(costs=ReplanCosts(args.move_cost, args.restart_cost), consolidate=not args.no_consolidate,
                         surrogate=args.surrogate, margin=args.margin, confidence=args.confidence,
                         error_model=args.error_model, verify_s=args.verify_s, ttft_p99_s=args.ttft_p99_s,
                         oracle=args.oracle)


def register(sub) -> None:
    rp = sub.add_parser("replan", help="re-place a running placement for new demand: fewest moves and restarts, "
                                       "and the plan to get there")
    rp.add_argument("current", metavar="CURRENT", help="the running placement: placement.json or the folder place wrote")
    demand = rp.add_mutually_exclusive_group(required=True)
    demand.add_argument("--workload", help="the new demand: a workload YAML/JSON (same profile)")
    demand.add_argument("--history", metavar="LOG.csv",
                        help="the new demand estimated from a request log (timestamp_s or timestamp, adapter, "
                             "input_tokens, output_tokens): each adapter of the running placement at its requests "
                             "/ the log's span (none: rate 0); every adapter in the log must be one of the "
                             "placement's (a new adapter needs --workload, which gives its rank)")
    demand.add_argument("--prometheus", metavar="URL",
                        help="the new demand from a Prometheus server that scrapes the gateway: each adapter of the "
                             "running placement at its requests over --window (inference_model_request_total); "
                             "lengths from its token histograms")
    rp.add_argument("--window", default="1h", help="--prometheus: the window ending now (15m, 1h, 1d; default 1h)")
    rp.add_argument("--out", help="output directory (default: outputs/replan-<workload>)")
    add_replan_flags(rp)
    rp.add_argument("--no-scratch", action="store_true",
                    help="do not also place from scratch (the alternative the costs compare against)")
    rp.add_argument("--emit-vllm", action="store_true",
                    help="also write the new placement's vllm serve commands and router.json (as place does)")
    rp.add_argument("--host", default="127.0.0.1", help="host of the running instances (default 127.0.0.1)")
    rp.add_argument("--base-port", type=int, default=8000,
                    help="GPU i of the running placement listens on base-port + i (default 8000, as place writes)")
    rp.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    rp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.replan.run import ReplanRequest, replan_report, replan_running

    request = ReplanRequest(workload=args.workload, history=args.history, prometheus=args.prometheus,
                            window=args.window, out_dir=args.out, scratch=not args.no_scratch,
                            emit_vllm=args.emit_vllm, host=args.host, base_port=args.base_port)
    done = replan_running(args.current, request, replan_options(args), say=None if args.json else print)
    if args.json:
        sys.stdout.write(json.dumps(done.plan) + "\n")
    else:
        print(replan_report(done))
    return done.code
