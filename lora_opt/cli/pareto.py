"""``lora-opt pareto``: GPU count vs latency fronts -- rho and SLO sweeps, greedy policies and search."""
from __future__ import annotations

import argparse
import shlex
import sys

from lora_opt.cli.conventions import (CONFIDENCE_OR_POINT, FRACTION, GPUS, POSITIVE_MS, SEED, add_fleet_flags,
                                      add_ray_flags, add_tracking_flag, int_range)
from lora_opt.errors import EXIT_NOT_ACCEPTABLE
from lora_opt.search.deployments import DEFAULT_DEPLOYMENT, DEPLOYMENTS
from lora_opt.search.study import DEFAULT_OBJECTIVE, OBJECTIVES
from twin.routers import ADAPTER_MODES, ROUTERS


def register(sub) -> None:
    pa = sub.add_parser("pareto", help="GPU count vs latency fronts: rho and SLO sweeps, greedy policies and search")
    pa.add_argument("--workload", required=True, help="workload YAML/JSON")
    pa.add_argument("--gpus", type=GPUS, default=4, help="GPUs in the pool (default 4)")
    pa.add_argument("--rhos", type=FRACTION, nargs="+", default=[0.70, 0.75, 0.80, 0.85, 0.90, 0.95])
    pa.add_argument("--ttft-slos-ms", type=POSITIVE_MS, nargs="*", default=[1000.0, 5000.0],
                    help="p99-style TTFT targets, each a criterion with --attainment (default 1000 5000)")
    pa.add_argument("--itl-slos-ms", type=POSITIVE_MS, nargs="*", default=[100.0], help="ITL targets (default 100)")
    pa.add_argument("--attainment", type=FRACTION, default=0.9)
    pa.add_argument("--history", metavar="LOG.csv",
                    help="request log (as for place): rates, greedy-plus verification and search traffic from "
                         "its first half; every point replayed on its second half")
    pa.add_argument("--confidence", type=CONFIDENCE_OR_POINT, nargs="+", metavar="C",
                    help="decide at these confidences, each in (0, 1) or 'point' (the point estimate): a front per "
                         "method and confidence, the band between them in the plot (default: point)")
    pa.add_argument("--error-model", metavar="FILE", help="error model YAML for --confidence (default: the profile's "
                                                          "bundled one)")
    pa.add_argument("--deployment", nargs="+", choices=list(DEPLOYMENTS), default=[DEFAULT_DEPLOYMENT],
                    help="deployments searched, one study each per criterion and a front each (search, search "
                         "every-gpu, search hybrid): placement (default: lora-opt's placement), every-gpu (every "
                         "adapter on every GPU, one A_max), hybrid (the hottest adapters on every GPU, the tail "
                         "placed; the study chooses how many are hot)")
    add_fleet_flags(pa, ROUTERS, ADAPTER_MODES)
    pa.add_argument("--objective", default=DEFAULT_OBJECTIVE, choices=list(OBJECTIVES))
    pa.add_argument("--trials", type=int_range(0, 1_000_000), default=24, help="search trials per criterion (0 = greedy policies only)")
    pa.add_argument("--ref-latency-ms", type=POSITIVE_MS, default=60_000.0,
                    help="hypervolume reference latency (default 60 s)")
    pa.add_argument("--seed", type=SEED, default=0,
                    help="sampler seed of the studies (the same points for any --workers)")
    add_ray_flags(pa)
    pa.add_argument("--out", help="output directory (default: outputs/pareto-<workload>)")
    pa.add_argument("--json", action="store_true", help="print the result (pareto.json's content) as JSON")
    add_tracking_flag(pa)
    pa.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    import json

    from lora_opt.placement.workload_file import load_workload
    from lora_opt.search.pareto import ParetoConfig, criteria_sweep, pareto_report

    wl = load_workload(args.workload)
    criteria = criteria_sweep(args.rhos, args.ttft_slos_ms, args.itl_slos_ms, args.attainment)
    confidences = tuple(dict.fromkeys(args.confidence or [None]))
    if args.error_model and all(c is None for c in confidences):
        from lora_opt.errors import InputError
        raise InputError("--error-model: only with --confidence C (the point estimate uses no error model)")
    from lora_opt.placement.instances import FleetOptions
    scrape = {} if args.scrape_interval_s is None else {"scrape_interval_s": args.scrape_interval_s}
    config = ParetoConfig(criteria, objective=args.objective, trials=args.trials, seed=args.seed,
                          ref_latency_ms=args.ref_latency_ms, workers=args.workers, ray_address=args.ray_address,
                          confidences=confidences, error_model=args.error_model, deployments=tuple(args.deployment),
                          fleet=FleetOptions(args.router, args.adapters, **scrape))
    command = "lora-opt " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["pareto"] else "lora-opt pareto ..."
    res, out = pareto_report(wl, args.gpus, config, history=args.history, out=args.out,
                             tracking_uri=args.tracking_uri, command=command,
                             track=not args.no_track)
    code = 0 if any(res["fronts"].values()) else EXIT_NOT_ACCEPTABLE   # ran, no feasible point
    if args.json:
        # strict JSON: a point that was never replayed has latency NaN -> null
        print(json.dumps(json.loads(json.dumps(res, default=str), parse_constant=lambda _: None), indent=1))
        return code
    print((out / "report.md").read_text().split("## Every point")[0])
    if code:
        print(f"no feasible point: no method met any criterion (exit status {EXIT_NOT_ACCEPTABLE})")
    print(f"-> {out}/report.md, pareto.json, pareto_front.png")
    return code
