"""``lora-opt validate``: replay a placement's traffic against live OpenAI-compatible endpoints
(vLLM or ``lora-opt emulate``), measure it as ``vllm bench serve`` does, compare with the twin."""
from __future__ import annotations

import argparse

from lora_opt.cli.conventions import (NONNEGATIVE_S, POSITIVE_S, SEED, add_tracking_flag, finite_float, int_range,
                                      show_progress)
from twin.scenario import ARRIVAL_PROCESSES, LENGTH_SOURCES, TRACE_MAPPINGS
from twin.workload import TRACES


def register(sub) -> None:
    v = sub.add_parser("validate", help="replay a placement's traffic on live endpoints and compare with the twin "
                                        "(one MLflow run in experiment 'validation')",
                       description="Replay a placement's traffic on live endpoints, write what was measured, then "
                                   "run the twin on the same requests (as the endpoints admit them: vLLM >= 0.32 "
                                   "clamps max_tokens to max_model_len - prompt, older versions refuse) and compare. "
                                   "Exit status: 0 all requests succeeded; 3 some failed; 5 the live side was "
                                   "measured and written but the twin step failed (reason in twin_error.json); "
                                   "130 Ctrl-C (what was measured is written); 2 bad input.")
    v.add_argument("placement", help="placement.json written by lora-opt place (or the directory holding it)")
    target = v.add_mutually_exclusive_group(required=True)
    target.add_argument("--endpoints", nargs="+", metavar="ROUTER_JSON|URL",
                        help="router.json (adapter -> endpoints, as place --emit-vllm writes it), or one URL per GPU "
                             "(http://HOST:PORT[/v1]) in GPU order: one per GPU of the placement or one per used GPU")
    target.add_argument("--twin-only", metavar="RUN_DIR",
                        help="send nothing: run the twin again on the requests of the validation stored in RUN_DIR "
                             "(an earlier --out) with the placement's profile as it is now (after a recalibration), "
                             "compare with what was measured there and rewrite the twin's files in RUN_DIR")
    v.add_argument("--workload", help="workload file (its evaluation section: arrivals, lengths, seed); default: "
                                      "Poisson at the placement's rates")
    src = v.add_mutually_exclusive_group()          # the request sources, as evaluate takes them
    src.add_argument("--arrivals", choices=list(ARRIVAL_PROCESSES), help="arrival process (as evaluate)")
    src.add_argument("--trace", help=f"trace to replay ({', '.join(TRACES)}, or a CSV); implies --arrivals trace")
    src.add_argument("--history", metavar="LOG.csv",
                     help="replay these requests (timestamp_s|timestamp, adapter, input_tokens, output_tokens: "
                          "place --history's log) on the endpoints and on the twin")
    v.add_argument("--mapping", choices=list(TRACE_MAPPINGS), help="trace requests -> adapters")
    v.add_argument("--time-scale", type=finite_float(0.0, 1e6, lo_open=True),
                   help="trace: multiply inter-arrival times (< 1 = more load)")
    v.add_argument("--start-s", type=NONNEGATIVE_S, help="trace: skip this many (scaled) seconds")
    v.add_argument("--lengths", help=f"length model ({', '.join(LENGTH_SOURCES)})")
    v.add_argument("--duration", type=POSITIVE_S, help="replayed (simulated) seconds (default: the workload's; "
                                                       "--history: the log's span)")
    v.add_argument("--seed", type=SEED, help="seed of arrivals, lengths and routing draws (default: the workload's)")
    v.add_argument("--speed", type=finite_float(0.001, 1000.0), default=1.0,
                   help="simulated seconds per wall second: the endpoints are `lora-opt emulate --speed X` "
                        "(default 1: real time, what a real vLLM needs)")
    v.add_argument("--scrape-s", type=finite_float(0.1, 3600.0), default=5.0,
                   help="scrape each endpoint's /metrics every this many (simulated) seconds (default 5)")
    v.add_argument("--repeats", type=int_range(2, 100), metavar="K",
                   help="replay the same requests K >= 2 times (OUT/repeat-1 .. repeat-K, the endpoints drained between "
                        "them) and judge the twin against the server's own spread: per metric the median real-vs-real "
                        "SMAPE beside the twin's SMAPE to the real median, 'within the noise' when the latter is <= "
                        "1.25x the former (OUT/noise.json)")
    v.add_argument("--out", default="validation", help="output directory (default ./validation)")
    v.add_argument("--gpu", default="", help="the GPU's name, recorded with the run (e.g. H100-80GB)")
    v.add_argument("--workers", type=int_range(1, 4096), help="parallel twin simulations (default: all cores)")
    v.add_argument("--no-track", action="store_true", help="do not log an MLflow run")
    v.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_tracking_flag(v)
    v.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.validate.run import ValidateOptions, validate, validate_report

    options = ValidateOptions(placement=args.placement, endpoints=args.endpoints, twin_only=args.twin_only,
                              workload=args.workload, arrivals=args.arrivals, trace=args.trace, history=args.history,
                              mapping=args.mapping, time_scale=args.time_scale, start_s=args.start_s,
                              lengths=args.lengths, duration=args.duration, seed=args.seed, speed=args.speed,
                              scrape_s=args.scrape_s, repeats=args.repeats, out=args.out, gpu=args.gpu,
                              workers=args.workers, track=not args.no_track, tracking_uri=args.tracking_uri,
                              progress=show_progress(args), on_repeat=print)
    done = validate(options)
    print(validate_report(done, as_json=args.json))
    return done.code
