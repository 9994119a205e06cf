"""``lora-opt search``: Optuna multi-objective search (GPUs vs latency) over placements, trials on Ray."""
from __future__ import annotations

import argparse
from pathlib import Path

from lora_opt.cli.conventions import (CONFIDENCE, FRACTION, GPUS, POSITIVE_MS, POSITIVE_S, SEED, add_fleet_flags,
                                      add_ray_flags, add_tracking_flag, int_range)
from lora_opt.errors import EXIT_NOT_ACCEPTABLE, InputError
from lora_opt.io import atomic_write_json
from lora_opt.search.deployments import DEFAULT_DEPLOYMENT, DEPLOYMENTS
from lora_opt.search.study import BACKENDS, DEFAULT_BATCH, DEFAULT_OBJECTIVE, OBJECTIVES
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
    se.add_argument("--backend", choices=BACKENDS, default="ask-tell",
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


def _criterion(args: argparse.Namespace, rho: float):
    from lora_opt.placement.evaluate import Criterion
    if args.ttft_slo_ms is None and args.itl_slo_ms is None:
        return Criterion(rho=args.rho if args.rho is not None else rho)
    return Criterion(rho=args.rho, ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms, attainment=args.attainment)


def _stale_note(n: int, backend: str) -> str:
    if not n:
        return ""
    return f", {n} in flight at the last kill " + ("evaluated again" if backend == "ask-tell" else "recorded as failed")


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    import json
    import os

    from tqdm import tqdm

    from lora_opt.placement.policies import PlacementContext
    from lora_opt.placement.workload_file import load_workload
    from twin.errors import ScenarioError
    from lora_opt.tracking import log_command_run

    from lora_opt.placement.instances import FleetOptions
    from lora_opt.search.study import (SearchSetup, check_storage, front_table, load_study, merge_fronts, replay_front,
                                       run_search, traffic_halves)

    if args.backend == "tune":
        try:
            import ray.tune  # noqa: F401  (optional: the tune extra)
        except ImportError as exc:
            raise InputError(f"--backend tune: needs Ray Tune (pip install 'lora-opt[tune]'): {exc}") from None
    storage = args.storage or os.environ.get("OPTUNA_STORAGE")
    if args.storage:
        check_storage(storage)
    elif storage:
        try:
            check_storage(storage)
        except ScenarioError as exc:
            raise InputError(str(exc).replace("--storage", "OPTUNA_STORAGE (the default --storage)", 1)) from None
    if args.trials < 1:
        raise InputError(f"--trials: must be >= 1, got {args.trials}")
    with tqdm(total=None, desc="search: loading the workload, surrogate and traffic", bar_format="{desc} [{elapsed}]",
              disable=args.json) as prep:
        wl = load_workload(args.workload)
        out = Path(args.out or f"outputs/search-{wl.name}")
        out.mkdir(parents=True, exist_ok=True)
        storage = storage or f"sqlite:///{out / 'study.db'}"
        # with a log, its first half sets the rates and is searched on; its second half is held out
        wl, search_traffic, heldout, ctx_kw = traffic_halves(wl, args.history)
        ctx = PlacementContext.for_workload(wl, args.surrogate, **ctx_kw)
        conf = None
        if args.confidence is not None:
            from lora_opt.placement.confidence import resolve_bound
            conf = resolve_bound(ctx.profile, args.confidence, args.error_model)
        elif args.error_model:
            raise InputError("--error-model: only with --confidence (search decides on the point estimate without one)")
        scrape = {} if args.scrape_interval_s is None else {"scrape_interval_s": args.scrape_interval_s}
        setups = [SearchSetup.build(wl, args.gpus, ctx, _criterion(args, wl.rho), args.objective, batch=args.batch,
                                    fleet=FleetOptions(router, args.adapters, **scrape), deployment=deployment,
                                    confidence=conf)
                  for deployment in dict.fromkeys(args.deployment) for router in dict.fromkeys(args.router)]
        prep.set_description_str("search: setup ready")
    kw = dict(trials=args.trials, storage=storage, seed=args.seed, workers=args.workers,
              ray_address=args.ray_address, seeds=not args.no_seeds)
    several = len(setups) > 1
    studies, rows, plots = [], [], []
    for setup in setups:
        # several studies (deployment x router): --study names the first; the others get their default names
        name = args.study if not studies else None
        where = out / f"{setup.deployment}-{setup.fleet.router}" if several else out
        where.mkdir(parents=True, exist_ok=True)
        if args.backend == "tune":
            from lora_opt.search.tune import run_tune_search
            res = run_tune_search(setup, ctx, search_traffic, tune_dir=where / "tune", study_name=name, **kw)
        else:
            res = run_search(setup, ctx, search_traffic, timeout_s=args.timeout_s, study_name=name, **kw)
        front = replay_front(res.front, setup, heldout, workers=args.workers, ray_address=args.ray_address)
        for r in front:
            r.pop("placement").save(where / f"placement-{r['gpus']}gpus-trial{r['trial']}.json")
            r["study"] = res.study_name
        from lora_opt.search.plots import write_study_plots
        plots += write_study_plots(load_study(res.storage, res.study_name), where, args.gpus, args.objective)
        studies.append((setup, res, front))
        rows += front
    setup, res = studies[0][0], studies[0][1]
    if several:
        rows = merge_fronts(rows, args.objective)
    wall_s = sum(r.wall_s for _, r, _ in studies)
    result = {"study": res.study_name, "storage": res.storage, "backend": args.backend, "seed": args.seed,
              "reproducible": args.backend == "ask-tell",
              "criterion": setup.criterion.label, "objective": args.objective,
              "confidence": conf.to_dict() if conf is not None else None,
              "trials": sum(r.trials for _, r, _ in studies), "complete": sum(r.complete for _, r, _ in studies),
              "failed": sum(r.failed for _, r, _ in studies), "wall_s": wall_s, "front": rows,
              "plots": [str(p) for p in plots], "adapters": args.adapters,
              "studies": [{"study": r.study_name, "deployment": s.deployment, "router": s.fleet.router,
                           "adapters": s.fleet.adapters, "trials": r.trials, "complete": r.complete,
                           "failed": r.failed, "front_points": len(f)} for s, r, f in studies]}
    atomic_write_json(out / "front.json", result, indent=1, default=str)
    log_command_run("search", res.study_name, params={"workload": wl.name, "gpus": args.gpus, "trials": args.trials,
                    "objective": args.objective, "criterion": setup.criterion.label, "storage": res.storage,
                    "study": res.study_name, "backend": args.backend, "deployments": ",".join(args.deployment),
                    "routers": ",".join(args.router), "adapters": args.adapters,
                    "confidence": setup.confidence, "verify_load": setup.verify_load},
                    metrics={"trials": result["trials"], "complete": result["complete"], "failed": result["failed"],
                             "front_points": len(rows)},
                    artifacts=[out], profile=wl.profile, seeds={"sampler": args.seed, "evaluation": wl.evaluation.seed},
                    wall_s=wall_s, tracking_uri=args.tracking_uri, track=not args.no_track)
    code = 0 if rows else EXIT_NOT_ACCEPTABLE   # ran, no feasible point
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return code
    for s, r, _ in studies:
        print(f"study {r.study_name} in {r.storage} ({args.backend}): {r.trials} trials ({r.complete} complete, "
              f"{r.failed} failed{_stale_note(r.resumed_stale, args.backend)}); "
              f"{r.wall_s:.0f} s; criterion {s.criterion.label}" + (f"; {s.label}" if s.label != "placement / static / static" else "")
              + ("" if s.confidence is None else f"; at confidence {s.confidence:g}: feasible also at "
                 f"{s.verify_load:.3f}x the load"))
    if args.backend == "tune":
        print("  (tune: the trials depend on the order they finished in -- not reproducible across runs or "
              "--workers; the default backend is)")
    print("Pareto front (GPUs vs " + args.objective + " in ms; search traffic, then the held-out replay"
          + ("; across the studies" if several else "") + "):")
    print(front_table(rows, args.objective) if rows else "  no feasible trial: no placement met the criterion "
          f"(exit status {EXIT_NOT_ACCEPTABLE}); try more --trials or --gpus, or a looser criterion")
    print(f"  -> {out}/front.json, placement-*.json, pareto_front.png, hypervolume_history.png;  "
          + ("(one folder per study) " if several else "") + f"optuna-dashboard {res.storage}")
    return code
