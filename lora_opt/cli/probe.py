"""``lora-opt probe``: the measurement plan a profile needs, on a live server or on servers launched
from a ``vllm serve`` command; writes real-runs rows that ``lora-opt calibrate --runs`` fits."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from lora_opt.cli.conventions import add_tracking_flag, finite_float, int_range
from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK

#: the command that stands in for ``vllm serve MODEL`` when set (the runbook's dry run on the emulator)
SERVER_CMD_ENV = "LORA_OPT_SERVER_CMD"

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("probe", help="measure what a profile needs on a live vLLM (or emulate) server; rows for "
                                     "calibrate --runs (one MLflow run in experiment 'probe')")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="a running server (http://HOST:PORT[/v1]): the families it allows")
    src.add_argument("--launch", help="a vllm serve command line, a gpuN.sh or serve_commands.txt (as place "
                                      "--emit-vllm writes them): every family on servers launched from it")
    p.add_argument("--gpu-index", type=int_range(0, 100_000), default=0,
                   help="the line of serve_commands.txt to launch (default 0)")
    p.add_argument("--quick", action="store_true", help="the quick plan (<= 10 min on a GPU; the default)")
    p.add_argument("--plan", choices=("quick", "full", "smoke"), help="quick (default), full (<= 1 h) or smoke")
    p.add_argument("--ranks", type=int_range(1, 512), nargs="+", help="max_lora_rank values to launch (default: the plan's)")
    p.add_argument("--model", required=True, help="the rows' model label (calibrate --model takes the profile whose "
                                                  "model dimensions and memory model the fit keeps)")
    p.add_argument("--speed", type=finite_float(0.001, 1000.0), default=1.0,
                   help="simulated seconds per wall second of the server (lora-opt emulate's --speed; 1 for vLLM)")
    p.add_argument("--server-cmd", default=os.environ.get(SERVER_CMD_ENV),
                   help=f"command replacing 'vllm serve MODEL' when launching (env {SERVER_CMD_ENV}), e.g. "
                        "'lora-opt emulate --profile P --speed 2'")
    p.add_argument("--adapter-path", default="adapters/r{rank}",
                   help="a LoRA adapter of rank {rank} (launch mode registers it under generated names; "
                        "default adapters/r{rank})")
    p.add_argument("--max-lora-rank", type=int_range(1, 512), help="--endpoint: the server's max_lora_rank")
    p.add_argument("--max-num-batched-tokens", type=int_range(1, 10_000_000),
                   help="--endpoint: the server's max_num_batched_tokens (the prefill fit needs it)")
    p.add_argument("--vllm-version", metavar="X.Y",
                   help="--launch on vLLM: check every command it will start against that release's vllm serve "
                        "options (0.32 or 0.33) before starting any")
    p.add_argument("--health-timeout", type=finite_float(1.0, 7200.0), default=900.0,
                   help="wall seconds a launched server may take to answer /health (default 900)")
    p.add_argument("--out", default="probe", help="output directory (default ./probe)")
    p.add_argument("--no-track", action="store_true", help="do not log an MLflow run")
    add_tracking_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    import dataclasses

    from lora_opt.probe.launch import read_launch
    from lora_opt.probe.plan import PLANS, ProbeOptions
    from lora_opt.probe.run import probe

    plan = PLANS[args.plan or "quick"]
    if args.ranks:
        plan = dataclasses.replace(plan, ranks=tuple(args.ranks))
    opts = ProbeOptions(plan=plan, model=args.model, speed=args.speed, out=Path(args.out), server_cmd=args.server_cmd,
                        adapter_path=args.adapter_path, max_lora_rank=args.max_lora_rank,
                        max_num_batched_tokens=args.max_num_batched_tokens, health_timeout_s=args.health_timeout,
                        vllm_version=args.vllm_version)
    launch = read_launch(args.launch, args.gpu_index) if args.launch else None
    s = probe(opts, launch=launch, endpoint=args.endpoint, track=not args.no_track, tracking_uri=args.tracking_uri)
    fams = ", ".join(f"{k} {v['ok']} ok" + (f" / {v['failed']} failed" if v["failed"] else "")
                     + (f" / {v['noisy']} noisy" if v.get("noisy") else "") for k, v in s["families"].items())
    print(f"probe ({s['plan']}, {s['wall_s']:.0f} s, server {s['version'] or '?'}): {fams}")
    print(f"wrote {args.out}/rows.csv, summary.json" + (", logs/" if launch else "")
          + (f"; MLflow run {s['mlflow_run_id']} (experiment probe)" if s.get("mlflow_run_id") else ""))
    print(f"next: lora-opt calibrate --runs {args.out}/rows.csv --model PROFILE --out PROFILE.yaml")
    failed = sum(v["failed"] + v.get("noisy", 0) for v in s["families"].values())
    for bad in s["not_ok"]:
        note = bad["note"] or "(no note)"
        log.warning("%s: %s", bad["row"], note if note.startswith(bad["status"]) else f"{bad['status']}: {note}")
    if any(v.get("noisy") for v in s["families"].values()):
        print("noisy rows (not fitted by calibrate): the client could not resolve what they measure (each "
              "row's probe_note says why); rerun slower, on a quieter machine, or with a longer plan")
    return EXIT_NOT_ACCEPTABLE if failed else EXIT_OK
