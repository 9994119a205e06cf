"""``lora-opt validate``: replay a placement's traffic against live OpenAI-compatible endpoints
(vLLM or ``lora-opt emulate``), measure it as ``vllm bench serve`` does, compare with the twin."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    if [a.id for a in wl.adapters] != [a.id for a in p.adapters]:
        raise InputError("placement and workload list different adapters (ids or order); validate the placement "
                         "with the workload it was made for")
    if args.twin_only:
        return _twin_only(args, p, wl)
    requests = None
    if args.history:
        requests, span = _log_requests(wl, args.history, args.duration)
        wl = with_evaluation(wl, duration_s=args.duration or span, seed=args.seed)
    else:
        wl = with_evaluation(wl, process=args.arrivals, trace=args.trace, mapping=args.mapping,
                             time_scale=args.time_scale, start_s=args.start_s, lengths=args.lengths,
                             duration_s=args.duration, seed=args.seed)
    urls = resolve_endpoints(p, args.endpoints)
    meta = {"placement": str(path), "placement_hash": placement_hash(path), "gpu": args.gpu,
            "workload": wl.name, "requests_from": args.history or args.trace or wl.evaluation.arrivals.process}
    if args.repeats:
        return _repeats(args, p, wl, urls, meta, requests)
    summary, status = validate_placement(p, wl, urls, args.out, speed=args.speed, scrape_s=args.scrape_s,
                                         workers=args.workers, meta=meta, tracking_uri=args.tracking_uri,
                                         track=not args.no_track, progress=show_progress(args),
                                         requests=requests)
    if args.json:
        print(json.dumps({k: summary[k] for k in ("info", "comparison", "bench", "exit_status")}, default=str))
        return status
    b, c, info = summary["bench"], summary["comparison"], summary["info"]
    adm = info["admission"]
    print(f"validate {path} on {len(urls)} endpoint(s) ({', '.join(sorted(set(info['versions'].values())))})"
          f": {info['requests']:,} requests, {b['completed']:,} ok, {b['failed']:,} failed, "
          f"{b['unfinished']:,} unfinished at the window's end"
          + (f", {b['not_sent']:,} not sent" if b["not_sent"] else ""))
    if adm["clamped"] or adm["refused"]:
        print(f"over max_model_len: {adm['clamped']:,} request(s) served with max_tokens clamped, {adm['refused']:,} "
              "refused by the endpoints' rules (vLLM's; left out of the twin)")
    print("real:")
    print(evaluation_table(summary["real"]))
    if summary["twin"] is None:
        print(f"twin: could not run: {info['twin']['reason']}")
        print(f"wrote {args.out}/ (real.json, bench.json, requests.csv, timeseries.csv, plots/; the twin's failure: "
              "twin_error.json)")
    else:
        print("twin (same requests, as the endpoints admit them):")
        print(evaluation_table(summary["twin"]))
        print("SMAPE % per metric (over GPUs): " + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_per_metric"].items()))
        print("SMAPE % of the fleet: " + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_fleet"].items()))
        print(f"wrote {args.out}/ (real.json, twin.json, comparison.json, bench.json, requests.csv, timeseries.csv, "
              "plots/)")
    if summary["info"]["interrupted"]:
        print("interrupted: the outputs hold what was measured until Ctrl-C")
    return status


def _repeats(args: argparse.Namespace, p, wl, urls: dict, meta: dict, requests) -> int:
    """K replays of the same requests, then the twin judged against the server's own spread."""
    import logging

    from lora_opt.errors import EXIT_TWIN_FAILED
    from lora_opt.io import atomic_write_json
    from lora_opt.tracking import log_command_run
    from lora_opt.validate.repeats import noise_lines, noise_table, wait_idle
    from lora_opt.validate.report import validate_placement

    out = Path(args.out)
    comparisons, statuses = [], []
    for k in range(1, args.repeats + 1):
        if k > 1 and not wait_idle(urls):
            logging.getLogger(__name__).warning("repeat %d: the endpoints still had requests after 600 s of waiting; "
                                                "replaying anyway", k)
        summary, status = validate_placement(p, wl, urls, out / f"repeat-{k}", speed=args.speed, scrape_s=args.scrape_s,
                                             workers=args.workers, meta={**meta, "repeat": k}, tracking_uri=args.tracking_uri,
                                             track=not args.no_track, progress=show_progress(args), requests=requests)
        statuses.append(status)
        if summary["comparison"] is not None:
            comparisons.append(summary["comparison"])
        b = summary["bench"]
        print(f"repeat {k}/{args.repeats}: {b['completed']:,} ok, {b['failed']:,} failed -> {out}/repeat-{k}/")
    if len(comparisons) < 2:
        print(f"the twin ran in {len(comparisons)} of {args.repeats} repeats: no spread to judge it against")
        return max(statuses + [EXIT_TWIN_FAILED])
    table = noise_table(comparisons)
    atomic_write_json(out / "noise.json", table, indent=1, default=float)
    if args.json:
        print(json.dumps({"noise": table, "exit_status": max(statuses)}, default=float))
    else:
        print(f"the server against itself ({len(comparisons)} repeats of the same requests) and the twin against the "
              "real median, SMAPE % over the GPUs:")
        print("\n".join(noise_lines(table)))
        print(f"wrote {out}/noise.json")
    log_command_run("validation", f"{wl.name} x{args.repeats}", params={"placement": meta["placement"],
                    "repeats": args.repeats, "noise_factor": table["noise_factor"]},
                    metrics={m: {k: v for k, v in e.items() if k != "within_noise"}
                             for m, e in table["per_metric"].items()},
                    artifacts=[str(out / "noise.json")], seeds={"evaluation": wl.evaluation.seed},
                    tracking_uri=args.tracking_uri, track=not args.no_track)
    return max(statuses)


def _twin_only(args: argparse.Namespace, p, wl) -> int:
    from lora_opt.errors import InputError
    from lora_opt.validate.retwin import retwin

    given = [f for f in ("arrivals", "trace", "history", "mapping", "time_scale", "start_s", "lengths", "duration",
                         "seed") if getattr(args, f) is not None]
    if given:
        raise InputError(f"--twin-only takes the stored run's requests; drop --{given[0].replace('_', '-')}")
    res = retwin(args.twin_only, p, wl, workers=args.workers)
    c = res["comparison"]
    if args.json:
        print(json.dumps({"comparison": c}, default=str))
        return 0
    print(f"validate --twin-only {args.twin_only}: the twin again on the run's {res['info']['requests']:,} requests "
          f"(profile {p.profile})")
    print("SMAPE % per metric (over GPUs): " + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_per_metric"].items()))
    print(f"wrote {args.twin_only}/ (twin.json, comparison.json, twin_timeseries.csv, plots/)")
    return 0


def _log_requests(wl, path: str, duration: float | None):
    """The request log's requests (those arriving before ``duration``) and its span."""
    import dataclasses

    import numpy as np

    from lora_opt.placement.workload_file import load_request_log

    _, req, span = load_request_log(wl, path)
    keep = req.arrival < (duration or span)
    return dataclasses.replace(req, **{f.name: np.ascontiguousarray(getattr(req, f.name)[keep])
                                       for f in dataclasses.fields(req)}), span
