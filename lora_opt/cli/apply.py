"""``lora-opt apply PLAN``: carry out a replan's plan on a running fleet (vLLM's runtime LoRA
endpoints, the router's table, launches, drains, stops) and, with ``--workload``, measure the
transition under the new demand's traffic.  The work lives in ``lora_opt.apply``."""
from __future__ import annotations

import argparse
import json
import os
import sys

from lora_opt.cli.conventions import POSITIVE_S, add_tracking_flag, finite_float, int_range
from lora_opt.cli.probe import SERVER_CMD_ENV


def register(sub) -> None:
    a = sub.add_parser("apply", help="carry out a replan's plan on a running fleet; with --workload, measure the "
                                     "transition under traffic (failed requests, TTFT)")
    a.add_argument("plan", metavar="PLAN", help="plan.json, or the folder lora-opt replan wrote (its placement.json "
                                                "is the placement the plan leads to)")
    a.add_argument("--router", help="the router's URL (http://HOST:PORT): route steps switch its table "
                                    "(POST /router/routes: lora-opt emulate --router-port); traffic flows through it")
    a.add_argument("--workload", help="the new demand (workload YAML): its evaluation traffic flows through the "
                                      "router while the plan runs, and the transition is measured")
    a.add_argument("--speed", type=finite_float(0.001, 1000.0), default=1.0,
                   help="simulated seconds per wall second of the fleet (lora-opt emulate's --speed; 1 for vLLM)")
    a.add_argument("--start-after-s", type=POSITIVE_S, default=30.0,
                   help="simulated seconds of traffic before the first step (default 30)")
    a.add_argument("--duration-s", type=POSITIVE_S,
                   help="simulated seconds of traffic (default: the workload's evaluation duration)")
    a.add_argument("--model", help="vllm serve MODEL of launched instances (default: the profile's model)")
    a.add_argument("--server-cmd", default=os.environ.get(SERVER_CMD_ENV),
                   help=f"command replacing 'vllm serve MODEL' in launches (env {SERVER_CMD_ENV}), e.g. "
                        "'lora-opt emulate --profile P --speed 2'")
    a.add_argument("--adapter-dir", help="load adapters from ADAPTER_DIR/<id> instead of their placement paths")
    a.add_argument("--unload-grace-s", type=finite_float(0.0, 600.0), default=0.5,
                   help="wall seconds between a route switch and the unloads after it (default 0.5)")
    a.add_argument("--drain-timeout-s", type=POSITIVE_S, default=600.0,
                   help="wall seconds a drain may take before it fails (default 600)")
    a.add_argument("--retries", type=int_range(0, 100), default=2,
                   help="times a failed step is tried again, after reading the fleet again and launching a kept "
                        "instance that no longer answers (default 2)")
    a.add_argument("--dry-run", action="store_true",
                   help="print what the plan would still do on the fleet as it is (each step in effect or to do, "
                        "each running instance answering or dead) and act on nothing")
    a.add_argument("--keep-launched", action="store_true",
                   help="leave the instances this run launched running when it ends (default: stopped)")
    a.add_argument("--out", help="output directory (default: outputs/apply-<plan folder>)")
    a.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_tracking_flag(a)
    a.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from pathlib import Path

    from lora_opt.apply.executor import ApplyOptions
    from lora_opt.apply.run import apply_plan
    from lora_opt.apply.transition import TrafficOptions
    from lora_opt.replan.replan_steps import step_counts
    from lora_opt.placement.workload_file import load_workload

    if args.dry_run:
        return dry_run(args)
    wl = load_workload(args.workload) if args.workload else None
    folder = Path(args.plan) if Path(args.plan).is_dir() else Path(args.plan).parent
    opts = ApplyOptions(router=args.router, model=args.model, server_cmd=args.server_cmd, adapter_dir=args.adapter_dir,
                        unload_grace_s=args.unload_grace_s, drain_timeout_s=args.drain_timeout_s,
                        retries=args.retries)
    traffic = TrafficOptions(speed=args.speed, start_after_s=args.start_after_s, duration_s=args.duration_s)
    summary, code = apply_plan(args.plan, opts=opts, out=args.out or f"outputs/apply-{folder.resolve().name}",
                               workload=wl, traffic=traffic, keep_launched=args.keep_launched,
                               tracking_uri=args.tracking_uri, track=not args.no_track)
    if args.json:
        sys.stdout.write(json.dumps(summary, default=str) + "\n")
        return code
    print(f"steps: {step_counts(summary['steps'], status=True) or 'none'}")
    v = summary["verdict"]
    if summary.get("windows"):
        w = summary["windows"]
        for name in ("before", "during", "after"):
            d = w[name]
            print(f"{name:<7} sent {d['requests']:>5}  ok {d['ok']:>5}  failed {d['failed']:>3}  held {d['held']:>4}  "
                  f"TTFT p50 {d['ttft_p50_ms']:>7.0f} ms  p99 {d['ttft_p99_ms']:>7.0f} ms")
        during = (f"p99 TTFT during the steps {v['ttft_p99_during_ms']:.0f} ms" if v["requests_during"]
                  else "no request sent during the steps")
        print(f"failed requests {v['failed_requests']}; {during} "
              f"(bound of the plan's states {v['slo_ttft_p99_ms']:.0f} ms"
              + (")" if v["slo_applies"] else f"; not applicable: the twin judged {', '.join(v['starving_at_start'])} "
                 "starving under the new demand before any step)"))
    print("transition ok" if v["ok"] else "transition NOT ok")
    for w in summary["written"]:
        print(f"  -> {w}")
    return code


def dry_run(args: argparse.Namespace) -> int:
    """``apply --dry-run``: the difference between the fleet as it is and the plan's end, nothing acted on."""
    from lora_opt.apply.run import fleet_diff

    rows = fleet_diff(args.plan, args.router)
    if args.json:
        sys.stdout.write(json.dumps({"plan": str(args.plan), "diff": rows}) + "\n")
        return 0
    todo = sum(r["state"] == "to do" for r in rows)
    for r in rows:
        step = f"{r['step']:>4}" if r["step"] is not None else "   -"
        print(f"{step} {r['action']:<7} {r['instance']:<8} {r['state']:<9} {r['detail'][:110]}")
    print(f"{todo} step(s) to do, {sum(r['state'] == 'in effect' for r in rows)} in effect; "
          f"{sum(r['state'] == 'DEAD' for r in rows)} running instance(s) not answering (nothing was changed)")
    return 0
