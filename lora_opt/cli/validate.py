"""``lora-opt validate``: replay a placement's traffic against live OpenAI-compatible endpoints
(vLLM or ``lora-opt emulate``), measure it as ``vllm bench serve`` does, compare with the twin."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lora_opt.cli.common import POSITIVE_S, SEED, add_tracking_flag, finite_float, int_range


def register(sub) -> None:
    v = sub.add_parser("validate", help="replay a placement's traffic on live endpoints and compare with the twin "
                                        "(one MLflow run in experiment 'validation')")
    v.add_argument("placement", help="placement.json written by lora-opt place (or the directory holding it)")
    v.add_argument("--endpoints", nargs="+", required=True, metavar="ROUTER_JSON|URL",
                   help="router.json (adapter -> endpoints, as place --emit-vllm writes it), or one URL per GPU "
                        "(http://HOST:PORT[/v1]) in GPU order: one per GPU of the placement or one per used GPU")
    v.add_argument("--workload", help="workload file (its evaluation section: arrivals, lengths, seed); default: "
                                      "Poisson at the placement's rates")
    v.add_argument("--duration", type=POSITIVE_S, help="replayed (simulated) seconds (default: the workload's)")
    v.add_argument("--seed", type=SEED, help="seed of arrivals, lengths and routing draws (default: the workload's)")
    v.add_argument("--speed", type=finite_float(0.001, 1000.0), default=1.0,
                   help="simulated seconds per wall second: the endpoints are `lora-opt emulate --speed X` "
                        "(default 1: real time, what a real vLLM needs)")
    v.add_argument("--scrape-s", type=finite_float(0.1, 3600.0), default=5.0,
                   help="scrape each endpoint's /metrics every this many (simulated) seconds (default 5)")
    v.add_argument("--out", default="validation", help="output directory (default ./validation)")
    v.add_argument("--gpu", default="", help="the GPU's name, recorded with the run (e.g. H100-80GB)")
    v.add_argument("--workers", type=int_range(1, 4096), help="parallel twin simulations (default: all cores)")
    v.add_argument("--no-track", action="store_true", help="do not log an MLflow run")
    v.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_tracking_flag(v)
    v.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.errors import InputError
    from lora_opt.placement.evaluate import evaluation_table, with_evaluation, workload_from_placement
    from lora_opt.placement.plan import Placement
    from lora_opt.placement.workload_file import load_workload
    from lora_opt.validate.live import resolve_endpoints
    from lora_opt.validate.report import placement_hash, validate_placement

    path = Path(args.placement)
    if path.is_dir():
        path = path / "placement.json"
    if not path.is_file():
        raise InputError(f"placement file not found: {args.placement}")
    p = Placement.load(path)
    wl = load_workload(args.workload) if args.workload else workload_from_placement(p)
    wl = with_evaluation(wl, duration_s=args.duration, seed=args.seed)
    if [a.id for a in wl.adapters] != [a.id for a in p.adapters]:
        raise InputError("placement and workload list different adapters (ids or order); validate the placement "
                         "with the workload it was made for")
    urls = resolve_endpoints(p, args.endpoints)
    meta = {"placement": str(path), "placement_hash": placement_hash(path), "gpu": args.gpu,
            "workload": wl.name}
    summary, status = validate_placement(p, wl, urls, args.out, speed=args.speed, scrape_s=args.scrape_s,
                                         workers=args.workers, meta=meta, tracking_uri=args.tracking_uri,
                                         track=not args.no_track, progress=not args.json)
    if args.json:
        print(json.dumps({k: summary[k] for k in ("info", "comparison", "bench", "exit_status")}, default=str))
        return status
    b, c = summary["bench"], summary["comparison"]
    print(f"validate {path} on {len(urls)} endpoint(s) ({', '.join(sorted(set(summary['info']['versions'].values())))})"
          f": {summary['info']['requests']:,} requests, {b['completed']:,} ok, {b['failed']:,} failed, "
          f"{b['unfinished']:,} unfinished at the window's end"
          + (f", {b['not_sent']:,} not sent" if b["not_sent"] else ""))
    print("real:")
    print(evaluation_table(summary["real"]))
    print("twin (same requests):")
    print(evaluation_table(summary["twin"]))
    print("SMAPE % per metric (over GPUs): " + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_per_metric"].items()))
    print("SMAPE % of the fleet: " + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_fleet"].items()))
    print(f"wrote {args.out}/ (real.json, twin.json, comparison.json, bench.json, requests.csv, timeseries.csv, plots/)")
    if summary["info"]["interrupted"]:
        print("interrupted: the outputs hold what was measured until Ctrl-C")
    return status
