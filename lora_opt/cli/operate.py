"""``lora-opt operate CURRENT --prometheus URL --router URL``: the closed loop -- every ``--interval-s``,
demand from Prometheus -> replan -> apply, with hysteresis (``lora_opt.apply.operate``)."""
from __future__ import annotations

import argparse
import os

from lora_opt.cli.conventions import POSITIVE_S, add_tracking_flag, finite_float, int_range
from lora_opt.cli.probe import SERVER_CMD_ENV
from lora_opt.cli.replan import add_replan_flags


def register(sub) -> None:
    o = sub.add_parser("operate", help="the closed loop: every interval, demand from Prometheus -> replan -> apply, "
                                       "a new plan only when it saves a GPU or a GPU would starve")
    o.add_argument("current", metavar="CURRENT", help="the placement the fleet runs now: placement.json or the "
                                                      "folder place wrote (ignored when --out holds a state file)")
    o.add_argument("--prometheus", required=True, metavar="URL", help="the Prometheus server that scrapes the gateway")
    o.add_argument("--router", required=True, help="the router's URL (http://HOST:PORT; lora-opt emulate --router-port)")
    o.add_argument("--window", default="5m", help="the demand window before each cycle (a Prometheus duration; "
                                                  "default 5m)")
    o.add_argument("--interval-s", type=POSITIVE_S, default=60.0, help="wall seconds between cycles (default 60)")
    o.add_argument("--reconcile-s", type=finite_float(0.0, 86400.0), default=5.0,
                   help="wall seconds between two reconciliations of the fleet to the running placement between "
                        "cycles: a dead instance launched again, the router's table put back, what a plan cut short "
                        "left undone (0: only at each cycle's start; default 5)")
    o.add_argument("--cycles", type=int_range(1, 10**9), help="stop after this many cycles (default: until Ctrl-C)")
    o.add_argument("--host", default="127.0.0.1", help="host of the instances (default 127.0.0.1)")
    o.add_argument("--base-port", type=int_range(1, 65535), default=8000,
                   help="GPU i of CURRENT listens on BASE_PORT + i (default 8000)")
    o.add_argument("--server-cmd", default=os.environ.get(SERVER_CMD_ENV),
                   help=f"command replacing 'vllm serve MODEL' in launches (env {SERVER_CMD_ENV})")
    o.add_argument("--adapter-dir", help="load adapters from ADAPTER_DIR/<id> instead of their placement paths")
    o.add_argument("--retries", type=int_range(0, 100), default=2, help="apply: tries again of a failed step (default 2)")
    o.add_argument("--out", default="outputs/operate",
                   help="cycles.csv, operate-state.json (a restarted operate continues from it) and one folder "
                        "per cycle that changed the fleet (default outputs/operate)")
    add_replan_flags(o)
    add_tracking_flag(o)
    o.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from pathlib import Path

    from lora_opt.apply.executor import ApplyOptions
    from lora_opt.apply.operate import OperateConfig, operate
    from lora_opt.cli.replan import replan_options
    from lora_opt.placement.plan import Placement
    from twin.profile import load_profile

    current = Placement.load(args.current)
    options = replan_options(args)
    policy = options.policy(load_profile(current.profile))
    cfg = OperateConfig(prometheus=args.prometheus, router=args.router, window=args.window,
                        interval_s=args.interval_s, reconcile_s=args.reconcile_s, cycles=args.cycles, host=args.host,
                        base_port=args.base_port,
                        costs=options.costs,
                        apply=ApplyOptions(server_cmd=args.server_cmd, adapter_dir=args.adapter_dir,
                                           retries=args.retries, log_dir=Path(args.out) / "logs"))

    def say(row: dict) -> None:
        print(f"cycle {row['cycle']:>4}: {row['decision']:<12} GPUs {row['gpus_running']} -> {row['gpus_planned']}  "
              f"{row['why'][:160]}", flush=True)
    return operate(args.current, cfg, policy, args.out, track=not args.no_track, tracking_uri=args.tracking_uri,
                   on_cycle=say)
