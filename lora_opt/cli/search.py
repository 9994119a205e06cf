"""``lora-opt search``: Optuna multi-objective search (GPUs vs latency) over placements, trials on Ray.

The study -- storage, backend, the held-out replay, the files, the MLflow run -- is ``lora_opt.search.run``'s;
this module reads the flags, calls it and prints."""
from __future__ import annotations

import argparse

from lora_opt.cli.conventions import (CONFIDENCE, FRACTION, GPUS, POSITIVE_MS, POSITIVE_S, SEED, add_fleet_flags,
                                      add_ray_flags, add_tracking_flag, int_range)
from lora_opt.search.deployments import DEFAULT_DEPLOYMENT, DEPLOYMENTS
from lora_opt.search.run import BACKENDS, DEFAULT_BACKEND
from lora_opt.search.study import DEFAULT_BATCH, DEFAULT_OBJECTIVE, OBJECTIVES
from twin.routers import ADAPTER_MODES, ROUTERS


def add_criterion_flags(p: argparse.ArgumentParser) -> None:
    """The feasibility criterion: rho, or SLO targets with an attainment."""
    p.add_argument("--rho", type=FRACTION, help="feasibility: starvation threshold (default: the workload's rho)")
    p.add_argument("--ttft-slo-ms", type=POSITIVE_MS, help="feasibility by SLO instead: TTFT target (ms)")
    p.add_argument("--itl-slo-ms", type=POSITIVE_MS, help="feasibility by SLO instead: ITL target (ms)")
    p.add_argument("--attainment", type=FRACTION, default=0.9, help="SLO attainment required (default 0.9)")


def register(sub) -> None:
    se = sub.add_parser("search", help="Optuna multi-objective search (GPUs vs latency) over placements, trials on Ray")
    se.add_argument("--workload", required=True, help="workload YAML/JSON")
    se.add_argument("--gpus", type=GPUS, required=True, help="GPUs in the pool")
    se.add_argument("--trials", type=int_range(1, 1_000_000), default=64, help="trials in the study, counting resumed ones (default 64)")
    se.add_argument("--storage", help="Optuna storage URL (default: $OPTUNA_STORAGE, else sqlite:///<out>/study.db; "
                                      "resumes)")
    se.add_argument("--study", help="study name (default: <workload>-<gpus>gpus-<objective>, then "
                                    "-<deployment>-<router>-<adapters> unless placement, static, static)")
    se.add_argument("--objective", default=DEFAULT_OBJECTIVE, choices=list(OBJECTIVES),
                    help=f"latency objective (default {DEFAULT_OBJECTIVE})")
    add_criterion_flags(se)
    se.add_argument("--confidence", type=CONFIDENCE,
                    help="decide at this confidence, in (0, 1): a trial is feasible only when the twin also serves it "
                         "at the load the profile's error model derives for C (default: the point estimate, the "
                         "load as it is)")
    se.add_argument("--error-model", metavar="FILE", help="error model YAML for --confidence (default: the profile's "
                                                          "bundled one)")
    se.add_argument("--deployment", nargs="+", choices=list(DEPLOYMENTS), default=[DEFAULT_DEPLOYMENT],
                    help="what a trial is: placement (default: lora-opt's placement, each adapter on its GPUs) or "
                         "every-gpu (every adapter on every GPU, one A_max); several: one study each, fronts merged")
    add_fleet_flags(se, ROUTERS, ADAPTER_MODES, several=True)
    se.add_argument("--history", metavar="LOG.csv",
                    help="request log (as for place): rates and search traffic from its first half, the front "
                         "replayed on its second half")
    se.add_argument("--seed", type=SEED, default=0,
                    help="sampler seed (ask-tell: the same trials and front for any --workers)")
    se.add_argument("--batch", type=int_range(1, 100_000), default=DEFAULT_BATCH,
                    help=f"ask-tell: trials asked at once, then evaluated in parallel (default {DEFAULT_BATCH}; "
                         "results depend on it, not on --workers)")
    se.add_argument("--backend", choices=list(BACKENDS), default=DEFAULT_BACKEND,
                    help="ask-tell (default): Optuna ask/tell over Ray tasks, reproducible for any --workers; "
                         "tune: a Ray Tune experiment (needs ray[tune]; resumable through <out>/tune)")
    se.add_argument("--no-seeds", action="store_true", help="do not start from the greedy placements")
    se.add_argument("--timeout-s", type=POSITIVE_S, default=600.0,
                    help="ask-tell: a trial running longer is recorded as failed")
    se.add_argument("--surrogate", help="surrogate directory for the greedy seeds (default: bundled)")
    add_ray_flags(se, workers_help="parallel trials (1 = serial, no Ray; N > 1 = Ray; default: serial when the trials are too few "
                                        "to pay Ray's start-up, else Ray on all cores)")
    se.add_argument("--out", help="output directory (default: outputs/search-<workload>)")
    se.add_argument("--json", action="store_true", help="print the result (front.json's content) as JSON")
    add_tracking_flag(se)
    se.set_defaults(run=run)


def _criterion(args: argparse.Namespace):
    """The feasibility criterion the flags give (None: the workload's rho)."""
    from lora_opt.placement.evaluate import Criterion
    if args.ttft_slo_ms is None and args.itl_slo_ms is None:
        return Criterion(rho=args.rho) if args.rho is not None else None
    return Criterion(rho=args.rho, ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms, attainment=args.attainment)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    import json

    from lora_opt.search.run import SearchRequest, report, search
    from lora_opt.search.study import SearchOptions

    request = SearchRequest(objective=args.objective, criterion=_criterion(args), confidence=args.confidence,
                            error_model=args.error_model, deployments=tuple(args.deployment),
                            routers=tuple(args.router), adapters=args.adapters,
                            scrape_interval_s=args.scrape_interval_s, history=args.history, batch=args.batch,
                            backend=args.backend, timeout_s=args.timeout_s, surrogate=args.surrogate, out=args.out,
                            progress=not args.json)
    options = SearchOptions(trials=args.trials, storage=args.storage, study_name=args.study, seed=args.seed,
                            workers=args.workers, ray_address=args.ray_address, seeds=not args.no_seeds)
    done = search(args.workload, args.gpus, request, options, tracking_uri=args.tracking_uri, track=not args.no_track)
    print(json.dumps(done.result, indent=1, default=str) if args.json else report(done))
    return done.code
