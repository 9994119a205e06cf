"""``lora-opt replan CURRENT/placement.json --workload NEW.yaml`` (or ``--history LOG.csv``): a placement for the new demand with
the fewest adapter moves and instance restarts, and the plan to get there (``plan.json``: vLLM runtime
LoRA calls, router switches, launches, drains, stops, every intermediate state judged).

The placement logic lives in ``lora_opt.replan.replan``; this module reads the flags, runs it,
writes the files and prints.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

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


def policy_from_flags(args: argparse.Namespace, profile):
    """greedy-plus with the flags given (its GPU test is what replan judges instances with); with
    --confidence, verifying at the load the profile's error model derives (refused beside --margin)."""
    from lora_opt.placement.confidence import resolve_bound
    from lora_opt.placement.policies import get_policy

    opts = {k: getattr(args, k) for k in ("margin", "verify_s", "ttft_p99_s", "oracle") if getattr(args, k) is not None}
    if args.confidence is not None:
        resolve_bound(profile, args.confidence, args.error_model, margin_given=args.margin is not None)
        opts.update(confidence=args.confidence, error_model=args.error_model)
    return get_policy("greedy-plus", **opts)


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
    from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK, InputError
    from lora_opt.io import atomic_write_json
    from lora_opt.placement.plan import Placement
    from lora_opt.placement.policies import PlacementContext
    from lora_opt.replan.replan import ReplanCosts, replan
    from lora_opt.placement.report import verdict, write_outputs
    from lora_opt.placement.workload_file import load_workload

    if not 1 <= args.base_port <= 65535:
        raise InputError(f"--base-port: must be a port in 1..65535, got {args.base_port}")
    current = Placement.load(args.current)
    if args.workload:
        wl = load_workload(args.workload)
    elif args.prometheus:
        wl = prometheus_workload(current, args.prometheus, args.window, quiet=args.json)
    else:
        wl = history_workload(current, args.history)
    costs = ReplanCosts(args.move_cost, args.restart_cost)
    ctx = PlacementContext.for_workload(wl, args.surrogate)
    policy = policy_from_flags(args, ctx.profile)
    r = replan(current, wl, policy, ctx, costs=costs, consolidate=not args.no_consolidate,
               scratch=not args.no_scratch, host=args.host, base_port=args.base_port)
    code, message = verdict(r.placement)
    if code == EXIT_OK and not r.plan["transition_ok"]:
        code, message = EXIT_NOT_ACCEPTABLE, "the transition has a state where an instance the plan loaded starves"
    out_dir = Path(args.out or f"outputs/replan-{wl.name or 'workload'}")
    written = write_outputs(r.placement, ctx.profile, out_dir, emit_vllm=args.emit_vllm and code == EXIT_OK,
                            model=None)
    plan = {"current": str(args.current), "workload": wl.name, "exit": code, "message": message, **r.plan}
    written.append(atomic_write_json(out_dir / "plan.json", plan, indent=1))
    if args.json:
        sys.stdout.write(json.dumps(plan) + "\n")
        return code
    print(plan_summary(plan))
    print(message)
    for w in written:
        print(f"  -> {w}")
    return code


def history_workload(current, log: str):
    """The running placement's adapters (ids, ranks, its engine flags and rho) with the rates of a
    request log; the log's problems as ``--history`` errors.  The instances are then judged on
    Poisson traffic at these rates (``place --history`` also replays the log's bursts)."""
    from lora_opt.errors import InputError
    from lora_opt.placement.evaluate import workload_from_placement
    from lora_opt.placement.workload_file import load_request_log

    base = workload_from_placement(current)
    try:
        wl, _, span = load_request_log(base, log)
    except InputError as exc:
        raise InputError(f"--history: {exc} (the adapters are the running placement's)") from None
    return dataclasses.replace(wl, name=f"{base.name or 'placement'}-history", meta={**wl.meta, "history_s": span})


def prometheus_workload(current, url: str, window: str, quiet: bool = False):
    """The running placement's adapters with the demand Prometheus saw over ``window``."""
    from lora_opt.placement.evaluate import workload_from_placement
    from lora_opt.placement.prometheus_demand import read_demand, workload_from_demand

    base = workload_from_placement(current)
    demand = read_demand(url, window)
    wl = workload_from_demand(base, demand)
    if not quiet:
        print(demand.summary())
    return dataclasses.replace(wl, name=f"{base.name or 'placement'}-prometheus")


def plan_summary(plan: dict) -> str:
    """The candidates, the instances' fate, the step counts and the transition's verdict, as text."""
    from lora_opt.replan.replan_steps import step_counts
    lines = [f"{'candidate':<19} {'GPUs':>4} {'moves':>6} {'loads':>6} {'unloads':>7} {'restarts':>8} "
             f"{'launches':>8} {'cost':>7}"]
    for c in plan["candidates"]:
        mark = " <- chosen" if c["name"] == plan["chosen"] else ""
        lines.append(f"{c['name']:<19} {c['gpus']:>4} {c['moves']:>6} {c['loads']:>6} {c['unloads']:>7} "
                     f"{c['restarts']:>8} {c['launches']:>8} {c['cost_gpu_equivalents']:>7.2f}{mark}"
                     + ("" if c["feasible"] else "  (infeasible)"))
    acts: dict[str, list[str]] = {}
    for it in plan["instances"]:
        acts.setdefault(it["action"], []).append(it["instance"])
    lines.append("instances: " + "; ".join(f"{k} {', '.join(v)}" for k, v in acts.items()))
    lines.append(f"steps: {len(plan['steps'])} ({step_counts(plan['steps']) or 'none'}); "
                 f"peak GPUs during the transition {plan['peak_gpus']}")
    if plan["starving_at_start"]:
        lines.append(f"starving under the new demand before the plan: {', '.join(plan['starving_at_start'])}")
    bad = [s for s in plan["states"][1:] if not s["ok"]]
    lines.append(f"intermediate states judged: {len(plan['states']) - 1}, "
                 + ("all ok (no instance the plan loads starves)" if not bad else
                    f"{len(bad)} NOT ok: " + "; ".join(f"{s['label']}: {', '.join(s['starving'])}" for s in bad[:3])))
    if any(s["action"] in ("load", "unload") for s in plan["steps"]):
        lines.append(f"runtime loads/unloads need {plan['env']} on the running instances")
    return "\n".join(lines)
