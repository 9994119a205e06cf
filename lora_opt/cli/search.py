"""``lora-opt search``: Optuna multi-objective search (GPUs vs latency) over placements, trials on Ray."""
from __future__ import annotations

import argparse
from pathlib import Path

from lora_opt.cli.common import FRACTION, GPUS, POSITIVE_MS, POSITIVE_S, SEED, add_ray_flags, add_tracking_flag, int_range
from lora_opt.errors import InputError
from lora_opt.io import atomic_write_json
from lora_opt.search.study import DEFAULT_OBJECTIVE, OBJECTIVES


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
    se.add_argument("--storage", help="Optuna storage URL (default: sqlite:///<out>/study.db; resumes)")
    se.add_argument("--study", help="study name (default: <workload>-<gpus>gpus-<objective>)")
    se.add_argument("--objective", default=DEFAULT_OBJECTIVE, choices=list(OBJECTIVES),
                    help=f"latency objective (default {DEFAULT_OBJECTIVE})")
    add_criterion_flags(se)
    se.add_argument("--history", metavar="LOG.csv",
                    help="request log (as for place): rates and search traffic from its first half, the front "
                         "replayed on its second half")
    se.add_argument("--seed", type=SEED, default=0, help="sampler seed")
    se.add_argument("--no-seeds", action="store_true", help="do not start from the greedy placements")
    se.add_argument("--timeout-s", type=POSITIVE_S, default=600.0, help="a trial running longer is recorded as failed")
    se.add_argument("--surrogate", help="surrogate directory for the greedy seeds (default: bundled)")
    add_ray_flags(se, workers_help="parallel trials (1 = serial, no Ray; N > 1 = Ray; default: serial when the trials are too few "
                                        "to pay Ray's start-up, else Ray on all cores)")
    se.add_argument("--out", help="output directory (default: outputs/search-<workload>)")
    add_tracking_flag(se)
    se.set_defaults(run=run)


def _criterion(args: argparse.Namespace, rho: float):
    from lora_opt.placement.evaluate import Criterion
    if args.ttft_slo_ms is None and args.itl_slo_ms is None:
        return Criterion(rho=args.rho if args.rho is not None else rho)
    return Criterion(rho=args.rho, ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms, attainment=args.attainment)


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.placement.policies import PlacementContext
    from lora_opt.placement.workload_file import load_workload
    from lora_opt.search.study import SearchSetup, front_table, replay_front, run_search, traffic_halves
    from lora_opt.tracking import log_command_run

    if args.storage:
        from lora_opt.search.study import check_storage
        check_storage(args.storage)
    wl = load_workload(args.workload)
    if args.trials < 1:
        raise InputError(f"--trials: must be >= 1, got {args.trials}")
    out = Path(args.out or f"outputs/search-{wl.name}")
    out.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{out / 'study.db'}"
    # with a log, its first half sets the rates and is searched on; its second half is held out
    wl, search_traffic, heldout, ctx_kw = traffic_halves(wl, args.history)
    ctx = PlacementContext.for_workload(wl, args.surrogate, **ctx_kw)
    setup = SearchSetup.build(wl, args.gpus, ctx, _criterion(args, wl.rho), args.objective)
    res = run_search(setup, ctx, search_traffic, trials=args.trials,
                     storage=storage, study_name=args.study, seed=args.seed, workers=args.workers,
                     ray_address=args.ray_address, timeout_s=args.timeout_s, seeds=not args.no_seeds)
    rows = replay_front(res.front, setup, heldout, workers=args.workers, ray_address=args.ray_address)
    for r in rows:
        r.pop("placement").save(out / f"placement-{r['gpus']}gpus-trial{r['trial']}.json")
    atomic_write_json(out / "front.json", {"study": res.study_name, "storage": res.storage,
                                           "criterion": setup.criterion.label, "objective": args.objective,
                                           "trials": res.trials, "complete": res.complete,
                                           "failed": res.failed, "wall_s": res.wall_s, "front": rows},
                      indent=1, default=str)
    log_command_run("search", res.study_name, params={"workload": wl.name, "gpus": args.gpus, "trials": args.trials, "objective":
                    args.objective, "criterion": setup.criterion.label, "storage": res.storage, "study": res.study_name},
                    metrics={"trials": res.trials, "complete": res.complete, "failed": res.failed, "front_points": len(rows)},
                    artifacts=[out], profile=wl.profile, seeds={"sampler": args.seed, "evaluation": wl.evaluation.seed},
                    wall_s=res.wall_s, tracking_uri=args.tracking_uri, track=not args.no_track)
    print(f"study {res.study_name} in {res.storage}: {res.trials} trials ({res.complete} complete, {res.failed} "
          f"failed{f', {res.resumed_stale} in flight at the last kill marked failed' if res.resumed_stale else ''}); "
          f"{res.wall_s:.0f} s; criterion {setup.criterion.label}")
    print("Pareto front (GPUs vs " + args.objective + " in ms; search traffic, then the held-out replay):")
    print(front_table(rows, args.objective) if rows else "  no feasible trial yet")
    print(f"  -> {out}/front.json, placement-*.json;  optuna-dashboard {res.storage}")
    return 0
