"""``lora-opt evaluate``: replay a placement's traffic on the twin, one simulation per GPU (Ray when it pays)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lora_opt.cli.conventions import (CONFIDENCE, NONNEGATIVE_S, POSITIVE_S, SEED, add_fleet_flags, add_ray_flags, add_tracking_flag,
                                      finite_float, show_progress)
from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK, InputError
from twin.routers import ADAPTER_MODES, ROUTERS
from twin.scenario import ARRIVAL_PROCESSES, LENGTH_SOURCES, TRACE_MAPPINGS
from twin.workload import TRACES


#: --grace-s's default (s): lora_opt.placement.evaluate.GRACE_S, spelled here so --help needs no import
GRACE_DEFAULT_S = 60.0


def register(sub) -> None:
    ev = sub.add_parser("evaluate", help="replay a placement's traffic on the twin, one simulation per GPU "
                                           "(on Ray when the work pays its start-up)",
                        epilog=f"exit status: {EXIT_OK} every GPU served its traffic; {EXIT_NOT_ACCEPTABLE} a GPU "
                               "starves, a GPU would not start or requests of unplaced adapters went unserved (the "
                               "table, --json and --out are written all the same); 2 bad input")
    ev.add_argument("placement", help="placement.json written by lora-opt place (or the directory holding it)")
    ev.add_argument("--workload", help="workload file (its evaluation section); default: Poisson at the placement's rates")
    ev.add_argument("--arrivals", choices=list(ARRIVAL_PROCESSES), help="arrival process")
    ev.add_argument("--trace", help=f"trace to replay ({', '.join(TRACES)}, or a CSV); implies --arrivals trace")
    ev.add_argument("--mapping", choices=list(TRACE_MAPPINGS), help="trace requests -> adapters")
    ev.add_argument("--time-scale", type=finite_float(0.0, 1e6, lo_open=True), help="trace: multiply inter-arrival times (< 1 = more load)")
    ev.add_argument("--start-s", type=NONNEGATIVE_S, help="trace: skip this many (scaled) seconds")
    ev.add_argument("--duration-s", type=POSITIVE_S, help="replayed seconds")
    ev.add_argument("--lengths", help=f"length model ({', '.join(LENGTH_SOURCES)})")
    ev.add_argument("--seed", type=SEED, help="seed of arrivals, lengths, mapping and routing draws")
    add_fleet_flags(ev, ROUTERS, ADAPTER_MODES)
    add_ray_flags(ev)
    ev.add_argument("--grace-s", type=NONNEGATIVE_S,
                    help="starvation verdict ignores requests arriving this close to the end (default "
                         f"{GRACE_DEFAULT_S:g}; 0 = benchmark_serving's definition; below --duration-s)")
    ev.add_argument("--confidence", type=CONFIDENCE,
                    help="also judge each GPU at this confidence, in (0, 1): the twin's capacity for it, its margin and "
                         "probability of starving from the profile's error model; a GPU whose margin at C is below "
                         "rho - 1 makes the placement not acceptable (exit 3)")
    ev.add_argument("--error-model", metavar="FILE", help="error model YAML for --confidence (default: the profile's bundled one)")
    ev.add_argument("--json", action="store_true", help="print the evaluation as one JSON object")
    ev.add_argument("--out", help="also write the evaluation JSON here")
    add_tracking_flag(ev)
    ev.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.placement.evaluate import (JudgeOptions, check_grace_below_window, evaluation_table,
                                             judge_and_record, with_evaluation, workload_from_placement)
    from lora_opt.placement.instances import FleetOptions
    from lora_opt.placement.plan import Placement, PlacementError
    from lora_opt.placement.workload_file import load_workload

    if not Path(args.placement).exists():
        raise PlacementError(f"placement file not found: {args.placement}")
    p = Placement.load(args.placement)            # a file, or the directory lora-opt place wrote
    wl = load_workload(args.workload) if args.workload else workload_from_placement(p)
    wl = with_evaluation(wl, process=args.arrivals, trace=args.trace, mapping=args.mapping,
                         time_scale=args.time_scale, start_s=args.start_s, duration_s=args.duration_s,
                         lengths=args.lengths, seed=args.seed)
    grace_s = GRACE_DEFAULT_S if args.grace_s is None else args.grace_s
    check_grace_below_window(grace_s, wl.evaluation.duration_s, "--grace-s:", "the replayed duration (--duration-s)",
                             note=" (the default)" if args.grace_s is None else "", error=InputError)
    scrape = {} if args.scrape_interval_s is None else {"scrape_interval_s": args.scrape_interval_s}
    options = JudgeOptions(fleet=FleetOptions(args.router, args.adapters, **scrape), grace_s=grace_s,
                           confidence=args.confidence, error_model=args.error_model, workers=args.workers,
                           ray_address=args.ray_address, progress=show_progress(args))
    ev, code = judge_and_record(args.placement, p, wl, options, out=args.out, tracking_uri=args.tracking_uri,
                                track=not args.no_track)
    if args.json:
        print(json.dumps(ev))
    else:
        arrivals = wl.evaluation.arrivals
        print(f"placement {args.placement} ({p.policy}), workload {wl.name}: replay "
              f"{arrivals.process}{' ' + arrivals.trace if arrivals.trace else ''}"
              f", {wl.evaluation.duration_s:,.0f} s, rho {wl.rho}"
              + (f"; fleet: router {args.router}, adapters {args.adapters}" if "router" in ev else ""))
        print(evaluation_table(ev))
        if "at_confidence" in ev:
            from lora_opt.placement.report import confidence_notes, confidence_table
            print(f"at confidence {args.confidence:g} (the twin's capacity per GPU and the error model):")
            print(confidence_table(p))
            for note in confidence_notes(p)[:2]:
                print(f"  {note}")
        if code != EXIT_OK:
            below = ev.get("at_confidence", {}).get("gpus_below")
            problems = [f"GPU(s) {below} below rho at confidence {args.confidence:g}" if below else "",
                        f"{ev['gpus_starving']} GPU(s) starving" if ev["gpus_starving"] else "",
                        f"{ev['gpus_failing_startup']} GPU(s) failing to start" if ev["gpus_failing_startup"] else "",
                        f"{ev['unrouted_requests']:,} requests unserved" if ev.get("unrouted_requests") else ""]
            print(f"NOT ACCEPTABLE: {', '.join(x for x in problems if x)} (exit status {code})")
    return code
