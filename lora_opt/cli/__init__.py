"""The ``lora-opt`` command line.  Heavy imports happen inside each command so that
``lora-opt --help`` and ``lora-opt simulate`` start quickly."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_opt import settings  # noqa: F401  (sets the no-network environment defaults)
from twin.paths import DATA_DIR

REAL_RUNS_CSV = DATA_DIR / "real_runs" / "real_runs_vllm_lora.csv"


def _fmt_stats(s: dict) -> str:
    if s.get("mean") is None:
        return "n/a"
    return f"mean {s['mean']:9.1f}   median {s['median']:9.1f}   p99 {s['p99']:9.1f}"


def print_summary(res, sc, out=sys.stdout) -> None:
    w = out.write
    e = res.engine
    w(f"profile {sc.profile}   max_loras {e['max_loras']}   max_lora_rank {e['max_lora_rank']}   "
      f"max_cpu_loras {e['max_cpu_loras']}   max_num_seqs {e['max_num_seqs']}   "
      f"max_num_batched_tokens {e['max_num_batched_tokens']}\n")
    if res.status == "oom":
        w(f"status      OOM at start-up: {res.oom_reason}\n")
        w(f"incoming    {res.incoming_token_rate:,.0f} tok/s over {res.arrived} requests -- nothing served\n")
        return
    verdict = "STARVING" if res.starving else "not starving"
    w(f"status      ok, {verdict} (throughput {res.throughput_tok_s:,.0f} vs rho x incoming "
      f"{sc.rho} x {res.incoming_token_rate:,.0f} tok/s)\n")
    if res.stopped_early_s is not None:
        w(f"            stopped early at {res.stopped_early_s:,.0f} s: starvation was certain\n")
    w(f"requests    {res.completed:,} completed of {res.arrived:,} arrived in {res.duration_s:,.0f} s\n")
    w(f"throughput  {res.throughput_tok_s:,.1f} tok/s  (input {res.input_throughput:,.1f}, "
      f"output {res.output_throughput:,.1f})\n")
    w(f"TTFT ms     {_fmt_stats(res.ttft_ms)}\n")
    w(f"ITL ms      {_fmt_stats(res.itl_ms)}\n")
    w(f"TPOT ms     {_fmt_stats(res.tpot_ms)}\n")
    w(f"batch       running {res.running_mean:.1f}, waiting {res.waiting_mean:.1f} (time means); "
      f"preemptions {res.preemptions:,}\n")
    w(f"adapters    loads CPU->GPU {res.adapter_loads_cpu:,}, disk->CPU {res.adapter_loads_disk:,}; "
      f"KV cache {res.kv_cache_tokens:,} tokens\n")
    w(f"twin        {res.steps:,} steps in {res.wall_s:.2f} s\n")


def cmd_simulate(args) -> int:
    import twin

    sc = twin.load_scenario(args.scenario)
    overrides = {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.early_stop:
        overrides["early_stop"] = True
    if overrides:
        from twin.scenario import replace
        sc = replace(sc, **overrides)
    res = twin.simulate(sc, timeseries=bool(args.timeseries))
    if args.timeseries and res.timeseries is not None:
        import pandas as pd
        path = Path(args.timeseries)
        path.parent.mkdir(parents=True, exist_ok=True)
        df = pd.DataFrame(res.timeseries)
        if path.suffix == ".parquet":
            df.to_parquet(path, index=False)
        else:
            df.to_csv(path, index=False)
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        print_summary(res, sc)
        if args.timeseries:
            print(f"time series -> {args.timeseries}")
    return 0


def cmd_bench(args) -> int:
    from lora_opt.cli.bench import bench_dataset, bench_twin

    if args.what == "twin":
        return bench_twin(out=args.out, repeats=args.repeats)
    if args.what == "dataset":
        return bench_dataset(grid=args.grid, sample=args.sample)
    if args.what == "place":
        from lora_opt.cli.bench import bench_place
        return bench_place(out=args.out, repeats=args.repeats)
    if args.what == "search":
        from lora_opt.cli.bench import bench_search
        return bench_search(out=args.out)
    raise SystemExit(f"lora-opt bench: unknown benchmark {args.what!r}")


def cmd_calibrate(args) -> int:
    from lora_opt.calibration.profile_fit import calibrate

    calibrate(args.runs, args.model, args.out, report_dir=args.report)
    print(f"profile -> {args.out}" + (f"; report -> {args.report}" if args.report else ""))
    return 0


def cmd_fidelity(args) -> int:
    from lora_opt.calibration.fidelity import run_fidelity

    cmd = "lora-opt fidelity" + (f" --family {args.family}" if args.family else "") + f" --out {args.out}"
    summary = run_fidelity(args.runs, family=args.family, out_dir=args.out, workers=args.workers,
                           ray_address=args.ray_address, command=cmd)
    o = summary["smape"]["report half"]
    print(f"{summary['n_runs']} runs in {summary['wall_s']:.0f} s; report half ({o['n_runs']} runs), SMAPE % "
          "(ours sharegpt / ours mean / published twin on its runs):")
    for name in ("throughput", "itl_mean", "ttft_mean", "tpot_mean", "running_mean"):
        e = o[name]
        peer = f" / {e['peer']:.1f}" if e.get("peer") is not None and e.get("peer_runs") else ""
        print(f"  {name:<13} {e['sharegpt']:6.1f} / {e['mean']:6.1f}{peer}")
    mp = summary["max_pack"]
    print(f"  Max_pack exact {mp['exact']}/{mp['n']}, within one step {mp['within_one']}/{mp['n']}")
    print(f"report -> {args.out}/report.md")
    return 0


def cmd_calibrate_e2e(args) -> int:
    from lora_opt.calibration.e2e_fit import FIT_HALF, fit_model

    models = [args.model] if args.model else sorted(FIT_HALF)
    for m in models:
        if m not in FIT_HALF:
            from twin.errors import ScenarioError
            raise ScenarioError(f"--model {m!r}: allowed values: {', '.join(sorted(FIT_HALF))}")
        rec = fit_model(m, args.runs, workers=args.workers)
        print(f"{m}: {rec['params']} (fit half {rec['fit_half']!r}, {rec['fit_runs']} runs, "
              f"loss {rec['fit_half_loss']:.2f} %, {rec['wall_s']:.0f} s)")
    return 0


def cmd_dataset(args) -> int:
    from lora_opt.surrogates.dataset import generate

    s = generate(args.profile, args.grid, args.out, workers=args.workers, ray_address=args.ray_address,
                 limit=args.limit, tracking_uri=args.tracking_uri)
    print(f"{s['rows']:,} rows in {args.out} ({s['rows_resumed']:,} already there, {s['rows_labelled_now']:,} "
          f"labelled in {s['wall_s']:.1f} s, {s['rows_per_s']:.1f} rows/s); dataset hash {s['dataset_hash']}")
    return 0


def cmd_train(args) -> int:
    from lora_opt.surrogates.surrogate import train_cli

    m = train_cli(args.dataset, args.out, tracking_uri=args.tracking_uri, fast=args.fast)
    ch = m["chosen"]
    reg, clf = m["regressor"][ch["regressor"]], m["classifier"][ch["classifier"]]
    print(f"throughput: {ch['regressor']}, held-out SMAPE {reg['test_smape']:.1f} %")
    print(f"starvation: {ch['classifier']}, threshold {ch['threshold']:.3f}; held-out "
          + ", ".join(f"{k} {v:.3g}" for k, v in clf["test"].items() if isinstance(v, float)))
    print("distilled : " + ", ".join(f"{k} {v} leaves" for k, v in m['distilled']['leaves'].items()))
    print(f"surrogate -> {args.out} (surrogate.joblib, distilled.json, rules.txt, metrics.json)")
    return 0


def _policy_options(args) -> dict:
    opts = {}
    if args.policy == "greedy-plus":
        opts["progress"] = sys.stderr.isatty() and not args.json
        for k in ("margin", "verify_s", "ttft_p99_s", "oracle"):
            v = getattr(args, k, None)
            if v is not None:
                opts[k] = v
    return opts


def cmd_place(args) -> int:
    from lora_opt.cli.place import run_place
    from lora_opt.placement.workload_file import load_workload

    wl = load_workload(args.workload)
    return run_place(wl, args.gpus, args.policy, out_dir=args.out, emit_vllm=args.emit_vllm, model=args.model,
                     surrogate=args.surrogate, policy_options=_policy_options(args), as_json=args.json,
                     history=args.history)


def cmd_evaluate(args) -> int:
    from lora_opt.placement.evaluate import evaluate_placement, evaluation_table, with_evaluation, workload_from_placement
    from lora_opt.placement.plan import Placement, PlacementError
    from lora_opt.placement.workload_file import load_workload

    if not Path(args.placement).exists():
        raise PlacementError(f"placement file not found: {args.placement}")
    try:
        p = Placement.load(args.placement)
    except json.JSONDecodeError as exc:
        raise PlacementError(f"{args.placement}: not a placement JSON ({exc})") from None
    wl = load_workload(args.workload) if args.workload else workload_from_placement(p)
    wl = with_evaluation(wl, process=args.arrivals, trace=args.trace, mapping=args.mapping,
                         time_scale=args.time_scale, start_s=args.start_s, duration_s=args.duration_s,
                         lengths=args.lengths, seed=args.seed)
    ev = evaluate_placement(p, wl, workers=args.workers, ray_address=args.ray_address, progress=not args.json,
                            grace_s=args.grace_s)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(ev, indent=1))
    if args.json:
        print(json.dumps(ev))
    else:
        print(f"placement {args.placement} ({p.policy}), workload {wl.name}: replay "
              f"{wl.evaluation.arrivals.process}{' ' + wl.evaluation.arrivals.trace if wl.evaluation.arrivals.trace else ''}"
              f", {wl.evaluation.duration_s:,.0f} s, rho {wl.rho}")
        print(evaluation_table(ev))
    return 0


def _criterion(args, rho: float):
    from lora_opt.placement.evaluate import Criterion
    if args.ttft_slo_ms is None and args.itl_slo_ms is None:
        return Criterion(rho=args.rho if args.rho is not None else rho)
    return Criterion(rho=args.rho, ttft_ms=args.ttft_slo_ms, itl_ms=args.itl_slo_ms, attainment=args.attainment)


def cmd_search(args) -> int:
    from lora_opt.placement.policies import PlacementContext
    from lora_opt.search.study import SearchSetup, front_table, replay_front, run_search, traffic_halves
    from lora_opt.placement.workload_file import load_workload

    wl = load_workload(args.workload)
    if args.trials < 1:
        from twin.errors import ScenarioError
        raise ScenarioError(f"--trials: must be >= 1, got {args.trials}")
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
    (out / "front.json").write_text(json.dumps({"study": res.study_name, "storage": res.storage,
                                                "criterion": setup.criterion.label, "objective": args.objective,
                                                "trials": res.trials, "complete": res.complete,
                                                "failed": res.failed, "wall_s": res.wall_s, "front": rows},
                                               indent=1, default=str))
    print(f"study {res.study_name} in {res.storage}: {res.trials} trials ({res.complete} complete, {res.failed} "
          f"failed{f', {res.resumed_stale} in flight at the last kill marked failed' if res.resumed_stale else ''}); "
          f"{res.wall_s:.0f} s; criterion {setup.criterion.label}")
    print("Pareto front (GPUs vs " + args.objective + " in ms; search traffic, then the held-out replay):")
    print(front_table(rows, args.objective) if rows else "  no feasible trial yet")
    print(f"  -> {out}/front.json, placement-*.json;  optuna-dashboard {res.storage}")
    return 0


def cmd_pareto(args) -> int:
    import shlex

    from lora_opt.placement.workload_file import load_workload
    from lora_opt.search.pareto import ParetoConfig, criteria_sweep, pareto_report

    wl = load_workload(args.workload)
    criteria = criteria_sweep(args.rhos, args.ttft_slos_ms, args.itl_slos_ms, args.attainment)
    config = ParetoConfig(criteria, objective=args.objective, trials=args.trials, ref_latency_ms=args.ref_latency_ms,
                          workers=args.workers, ray_address=args.ray_address)
    command = "lora-opt " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["pareto"] else "lora-opt pareto ..."
    _, out = pareto_report(wl, args.gpus, config, history=args.history, out=args.out,
                           tracking_uri=args.tracking_uri, command=command)
    print((out / "report.md").read_text().split("## Every point")[0])
    print(f"-> {out}/report.md, pareto.json, pareto_front.png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lora-opt",
        description="Serve many LoRA adapters on vLLM with as few GPUs as possible: a calibrated "
                    "digital twin of the engine and the tools built on it.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("simulate", help="simulate one vLLM instance described by a scenario file")
    s.add_argument("scenario", help="scenario YAML/JSON (see configs/scenarios/example.yaml)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    s.add_argument("--timeseries", metavar="FILE",
                   help="write time, running, waiting, KV usage, loaded adapters (CSV or .parquet)")
    s.add_argument("--seed", type=int, help="override the scenario's seed")
    s.add_argument("--early-stop", action="store_true",
                   help="stop as soon as starvation is certain (recorded in stopped_early_s)")
    s.set_defaults(func=cmd_simulate)

    b = sub.add_parser("bench", help="benchmarks (speed and memory), reported as numbers, not tests")
    b.add_argument("what", choices=["twin", "dataset", "place", "search"], help="what to benchmark")
    b.add_argument("--grid", default="papers", help="dataset: grid to sample (default: papers)")
    b.add_argument("--sample", type=int, default=64, help="dataset: grid points to label per worker count")
    b.add_argument("--out", help="also write the results as JSON here")
    b.add_argument("--repeats", type=int, default=3, help="timed repetitions per scenario (best is kept)")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("calibrate", help="fit a profile's estimators on real vLLM measurements")
    c.add_argument("--runs", required=True, help="CSV of real runs (data/real_runs/real_runs_vllm_lora.csv)")
    c.add_argument("--model", required=True, help="model name as in the CSV's model column")
    c.add_argument("--out", required=True, help="profile YAML to write")
    c.add_argument("--report", help="directory for the fit report (markdown + PNG)")
    c.set_defaults(func=cmd_calibrate)

    e = sub.add_parser("calibrate-e2e", help="fit the constants only end-to-end runs identify, on half of them")
    e.add_argument("--model", help="model name as in the CSV (default: every bundled model)")
    e.add_argument("--runs", default=str(REAL_RUNS_CSV))
    e.add_argument("--workers", type=int, help="parallel workers (default: all cores)")
    e.set_defaults(func=cmd_calibrate_e2e)

    d = sub.add_parser("dataset", help="label a grid of single-GPU configurations with the twin (Ray, resumable)")
    d.add_argument("--profile", help="profile name or path (default: the grid file's profile)")
    d.add_argument("--grid", required=True, help="grid YAML, or a bundled grid name (papers, tiny)")
    d.add_argument("--out", required=True, help="dataset directory (Parquet shards); rerun to resume")
    d.add_argument("--workers", type=int, help="parallel workers (1 = serial, no Ray; default: all cores)")
    d.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")
    d.add_argument("--limit", type=int, help="only the first N grid points")
    d.add_argument("--tracking-uri", help="MLflow tracking URI (default: local mlruns/)")
    d.set_defaults(func=cmd_dataset)

    tr = sub.add_parser("train", help="train the throughput / starvation surrogates on a dataset, distil them")
    tr.add_argument("--dataset", required=True, nargs="+",
                    help="dataset directory (or several, concatenated) written by lora-opt dataset")
    tr.add_argument("--out", required=True, help="output directory for the models, rules and metrics")
    tr.add_argument("--tracking-uri", help="MLflow tracking URI (default: local mlruns/)")
    tr.add_argument("--fast", action="store_true", help="tiny hyper-parameter grids (smoke runs)")
    tr.set_defaults(func=cmd_train)

    pl = sub.add_parser("place", help="place a workload's adapters on GPUs; vLLM launch commands and a router table")
    pl.add_argument("--workload", required=True, help="workload YAML/JSON (see configs/workloads/)")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs in the pool")
    pl.add_argument("--policy", default="greedy-plus",
                    choices=["greedy-plus", "greedy", "greedy-fast", "dlora", "loraserve"],
                    help="placement policy (default: greedy-plus)")
    pl.add_argument("--out", help="output directory (default: outputs/placement-<workload>)")
    pl.add_argument("--emit-vllm", action="store_true",
                    help="also write one vllm serve command per GPU (vLLM 0.33 flags) and router.json")
    pl.add_argument("--model", help="model for vllm serve (default: the profile's model)")
    pl.add_argument("--surrogate", help="surrogate directory (default: the bundled one for the profile)")
    pl.add_argument("--margin", type=float, help="greedy-plus: capacity headroom over the expected load (default 0.1)")
    pl.add_argument("--verify-s", type=float, help="greedy-plus: seconds of twin verification per GPU (0 = off; default 900)")
    pl.add_argument("--ttft-p99-s", type=float, help="greedy-plus: p99 TTFT bound in the verification (default 5)")
    pl.add_argument("--oracle", choices=["full", "distilled"], help="greedy-plus: surrogate to consult (default full)")
    pl.add_argument("--history", metavar="LOG.csv",
                    help="request log (timestamp_s, adapter, input_tokens, output_tokens): rates are estimated "
                         "from it and greedy-plus verifies every GPU on these requests, bursts included")
    pl.add_argument("--json", action="store_true", help="print the placement and verdict as one JSON object")
    pl.set_defaults(func=cmd_place)

    ev = sub.add_parser("evaluate", help="replay a placement's traffic on the twin, one simulation per GPU (Ray)")
    ev.add_argument("placement", help="placement.json written by lora-opt place")
    ev.add_argument("--workload", help="workload file (its evaluation section); default: Poisson at the placement's rates")
    ev.add_argument("--arrivals", choices=["poisson", "lognormal", "nonstationary", "trace"], help="arrival process")
    ev.add_argument("--trace", help="trace to replay (azure-code, azure-conv, mooncake-*, or a CSV); implies --arrivals trace")
    ev.add_argument("--mapping", choices=["uniform", "powerlaw", "rates"], help="trace requests -> adapters")
    ev.add_argument("--time-scale", type=float, help="trace: multiply inter-arrival times (< 1 = more load)")
    ev.add_argument("--start-s", type=float, help="trace: skip this many (scaled) seconds")
    ev.add_argument("--duration-s", type=float, help="replayed seconds")
    ev.add_argument("--lengths", help="length model (sharegpt, sharegpt-8k, arxiv, trace, ...)")
    ev.add_argument("--seed", type=int, help="seed of arrivals, lengths, mapping and routing draws")
    ev.add_argument("--workers", type=int, help="parallel workers (1 = serial, no Ray; default: all cores)")
    ev.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")
    ev.add_argument("--grace-s", type=float, default=60.0,
                    help="starvation verdict ignores requests arriving this close to the end (0 = benchmark_serving's definition)")
    ev.add_argument("--json", action="store_true", help="print the evaluation as one JSON object")
    ev.add_argument("--out", help="also write the evaluation JSON here")
    ev.set_defaults(func=cmd_evaluate)

    def add_criterion(q):
        q.add_argument("--rho", type=float, help="feasibility: starvation threshold (default: the workload's rho)")
        q.add_argument("--ttft-slo-ms", type=float, help="feasibility by SLO instead: TTFT target (ms)")
        q.add_argument("--itl-slo-ms", type=float, help="feasibility by SLO instead: ITL target (ms)")
        q.add_argument("--attainment", type=float, default=0.9, help="SLO attainment required (default 0.9)")

    se = sub.add_parser("search", help="Optuna multi-objective search (GPUs vs latency) over placements, trials on Ray")
    se.add_argument("--workload", required=True, help="workload YAML/JSON")
    se.add_argument("--gpus", type=int, required=True, help="GPUs in the pool")
    se.add_argument("--trials", type=int, default=64, help="trials in the study, counting resumed ones (default 64)")
    se.add_argument("--storage", help="Optuna storage URL (default: sqlite:///<out>/study.db; resumes)")
    se.add_argument("--study", help="study name (default: <workload>-<gpus>gpus-<objective>)")
    se.add_argument("--objective", default="p99_ttft", choices=["p99_ttft", "mean_ttft", "p99_itl", "mean_itl"],
                    help="latency objective (default p99_ttft)")
    add_criterion(se)
    se.add_argument("--history", metavar="LOG.csv",
                    help="request log (as for place): rates and search traffic from its first half, the front "
                         "replayed on its second half")
    se.add_argument("--seed", type=int, default=0, help="sampler seed")
    se.add_argument("--no-seeds", action="store_true", help="do not start from the greedy placements")
    se.add_argument("--timeout-s", type=float, default=600.0, help="a trial running longer is recorded as failed")
    se.add_argument("--surrogate", help="surrogate directory for the greedy seeds (default: bundled)")
    se.add_argument("--workers", type=int, help="parallel trials (1 = serial, no Ray; default: all cores)")
    se.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")
    se.add_argument("--out", help="output directory (default: outputs/search-<workload>)")
    se.set_defaults(func=cmd_search)

    pa = sub.add_parser("pareto", help="GPU count vs latency fronts: rho and SLO sweeps, greedy policies and search")
    pa.add_argument("--workload", required=True, help="workload YAML/JSON")
    pa.add_argument("--gpus", type=int, default=4, help="GPUs in the pool (default 4)")
    pa.add_argument("--rhos", type=float, nargs="+", default=[0.70, 0.75, 0.80, 0.85, 0.90, 0.95])
    pa.add_argument("--ttft-slos-ms", type=float, nargs="*", default=[1000.0, 5000.0],
                    help="p99-style TTFT targets, each a criterion with --attainment (default 1000 5000)")
    pa.add_argument("--itl-slos-ms", type=float, nargs="*", default=[100.0], help="ITL targets (default 100)")
    pa.add_argument("--attainment", type=float, default=0.9)
    pa.add_argument("--history", metavar="LOG.csv",
                    help="request log (as for place): rates, greedy-plus verification and search traffic from "
                         "its first half; every point replayed on its second half")
    pa.add_argument("--objective", default="p99_ttft", choices=["p99_ttft", "mean_ttft", "p99_itl", "mean_itl"])
    pa.add_argument("--trials", type=int, default=24, help="search trials per criterion (0 = greedy policies only)")
    pa.add_argument("--ref-latency-ms", type=float, default=60_000.0,
                    help="hypervolume reference latency (default 60 s)")
    pa.add_argument("--workers", type=int, help="parallel workers (1 = serial, no Ray; default: all cores)")
    pa.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")
    pa.add_argument("--out", help="output directory (default: outputs/pareto-<workload>)")
    pa.add_argument("--tracking-uri", help="MLflow tracking URI (default: local mlruns/)")
    pa.set_defaults(func=cmd_pareto)

    f = sub.add_parser("fidelity", help="replay the real vLLM runs on the twin and compare, with the published twin")
    f.add_argument("--runs", default=str(REAL_RUNS_CSV),
                   help="real runs CSV (default: the bundled one)")
    f.add_argument("--family", help="only experiments containing this text (e.g. rank_16_rates_1.6)")
    f.add_argument("--out", default="outputs/fidelity", help="report directory")
    f.add_argument("--workers", type=int, help="parallel workers (1 = serial, no Ray; default: all cores)")
    f.add_argument("--ray-address", help="existing Ray cluster (default: RAY_ADDRESS or a local instance)")
    f.set_defaults(func=cmd_fidelity)
    return p


def main(argv: list[str] | None = None) -> int:
    from twin.errors import ScenarioError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ScenarioError as exc:
        print(f"lora-opt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lora-opt {args.command}: interrupted", file=sys.stderr)
        return 130

