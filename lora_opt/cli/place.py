"""``lora-opt place``: a workload and a GPU pool in, a checked placement out -- a table,
``placement.json`` and, with ``--emit-vllm``, one ``vllm serve`` command per GPU and a router table.

The table, the verdict (exit status) and the files are placement logic and live in
``lora_opt.placement.report``; this module reads the flags, runs the policy and prints.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lora_opt.cli.conventions import CONFIDENCE, GPUS, NONNEGATIVE_S, POSITIVE_S, finite_float, show_progress
from lora_opt.placement.policies import DEFAULT_POLICY, ORACLE_FILES, POLICIES
from lora_opt.placement.router_config import ROUTER_CONFIGS

#: spelled here so that --help needs no import of the calibration stage (start-up time); tests check it
DEFAULT_CONFIDENCE = 0.9


def register(sub) -> None:
    pl = sub.add_parser("place", help="place a workload's adapters on GPUs; vLLM launch commands and a router table")
    pl.add_argument("--workload", required=True, help="workload YAML/JSON, or a bundled workload by name (example)")
    pl.add_argument("--gpus", type=GPUS, required=True, help="GPUs in the pool")
    pl.add_argument("--policy", choices=list(POLICIES),
                    help=f"placement policy (default: {DEFAULT_POLICY}); given, --deployment defaults to static: its "
                         "placement is the answer")
    pl.add_argument("--out", help="output directory (default: outputs/placement-<workload>)")
    pl.add_argument("--emit-vllm", action="store_true",
                    help="also write one vllm serve command per GPU and router.json")
    pl.add_argument("--emit-router", choices=list(ROUTER_CONFIGS),
                    help="also write the router's configuration: gateway (Gateway API Inference Extension "
                         "InferencePool/InferenceModel YAML, one pool per replica set) or vllm-router:POLICY (its "
                         "command line; only for a placement with every adapter on every GPU)")
    pl.add_argument("--vllm-version", metavar="X.Y",
                    help="the vLLM release the commands are written for: 0.32 or 0.33 (default: the profile's "
                         "vllm_version when it is one of these, else 0.33)")
    pl.add_argument("--model", help="model for vllm serve (default: the profile's model)")
    pl.add_argument("--surrogate", help="surrogate directory, or a registered version: models:/lora-opt-starvation@champion, "
                                        "models:/NAME/VERSION (default: the bundled one for the profile)")
    pl.add_argument("--confidence", type=CONFIDENCE,
                    help=f"decide at this confidence, in (0, 1): greedy-plus verifies each GPU at the load the "
                         f"profile's error model derives for it, and the table gives each GPU's margin and probability "
                         f"of starving (default {DEFAULT_CONFIDENCE:g} where the profile has an error model -- "
                         "configs/error_models/ -- else the fixed --margin)")
    pl.add_argument("--error-model", metavar="FILE", help="error model YAML (lora-opt error-model) instead of the "
                                                          "profile's bundled one")
    pl.add_argument("--margin", type=finite_float(0.0, 1.0),
                    help="greedy-plus: a fixed capacity headroom over the expected load instead of --confidence "
                         "(default 0.1 for a profile without an error model)")
    pl.add_argument("--verify-s", type=NONNEGATIVE_S, help="greedy-plus: seconds of twin verification per GPU (0 = off; default 900)")
    pl.add_argument("--ttft-p99-s", type=POSITIVE_S, help="p99 TTFT bound: greedy-plus's in its verification, and the "
                                                          "SLO --deployment judges every deployment at (default 5)")
    pl.add_argument("--oracle", choices=list(ORACLE_FILES), help="greedy-plus: surrogate to consult (default full)")
    pl.add_argument("--history", metavar="LOG.csv",
                    help="request log (timestamp_s, adapter, input_tokens, output_tokens): rates are estimated "
                         "from it and greedy-plus verifies every GPU on these requests, bursts included")
    pl.add_argument("--prometheus", metavar="URL",
                    help="rates (and lengths) from a Prometheus server that scrapes the gateway: each adapter of the "
                         "workload at its requests over --window (inference_model_request_total, the Gateway API "
                         "Inference Extension's per-adapter counter; lora-opt emulate's router exports it too)")
    pl.add_argument("--window", default="1h", help="--prometheus: the window ending now (a Prometheus duration: "
                                                   "15m, 1h, 1d; default 1h)")
    # spelled here so that --help needs no import of the search stage; tests check it is DEPLOYMENT_CHOICES
    pl.add_argument("--deployment", choices=("static", "every-gpu", "hybrid", "best"),
                    help="the deployments judged on the fleet twin at the same SLO and load (the confidence's "
                         "verification load, rho, the p99 TTFT bound), the one with the fewest GPUs returned: best "
                         "(all three; the default without --policy), static (the policy's placement alone, not judged "
                         "on the fleet; the default with --policy), "
                         "every-gpu (every adapter on every GPU, loaded on use, lora-affinity picker) or hybrid (the "
                         "hottest adapters everywhere, the tail placed by the policy)")
    pl.add_argument("--json", action="store_true", help="print the placement and verdict as one JSON object")
    pl.set_defaults(run=run)


def _policy_options(args: argparse.Namespace) -> dict:
    opts = {}
    if args.policy == "greedy-plus":
        opts["progress"] = sys.stderr.isatty() and show_progress(args)
        for k in ("margin", "verify_s", "ttft_p99_s", "oracle"):
            v = getattr(args, k, None)
            if v is not None:
                opts[k] = v
    return opts


def resolve_deployment(args: argparse.Namespace) -> None:
    """The policy and deployment a command line means: asking for a policy is asking for its placement
    (``static``); without one, the default policy and every deployment judged (``best``)."""
    if args.deployment is None:
        args.deployment = "static" if args.policy is not None else "best"
    if args.policy is None:
        args.policy = DEFAULT_POLICY


def run(args: argparse.Namespace) -> int:
    resolve_deployment(args)
    # imports inside run: only the command that runs pays for them (start-up time)
    from lora_opt.placement.workload_file import load_workload

    wl = load_workload(args.workload)
    if args.prometheus:
        from lora_opt.errors import InputError
        from lora_opt.placement.prometheus_demand import read_demand, workload_from_demand
        if args.history:
            raise InputError("--prometheus and --history: give one source of rates")
        demand = read_demand(args.prometheus, args.window)
        wl = workload_from_demand(wl, demand)
        if not args.json:
            print(prometheus_line(demand))
    if args.vllm_version is not None:     # refused before any placement work
        from lora_opt.errors import InputError
        from lora_opt.placement.vllm_launch import resolve_vllm_version
        resolve_vllm_version(args.vllm_version, error=InputError)
    from lora_opt.placement.confidence import resolve_bound
    from twin.profile import load_profile

    setting = resolve_bound(load_profile(wl.profile), args.confidence, args.error_model,
                            margin_given=args.margin is not None)
    opts = _policy_options(args)
    if setting.bound is not None and args.policy == "greedy-plus":
        opts.update(confidence=setting.confidence, error_model=args.error_model)
    return run_place(wl, args.gpus, args.policy, out_dir=args.out, emit_vllm=args.emit_vllm, model=args.model,
                     surrogate=args.surrogate, policy_options=opts, as_json=args.json,
                     history=args.history, vllm_version=args.vllm_version, emit_router=args.emit_router,
                     confidence=setting, slo_ttft_p99_s=args.ttft_p99_s,
                     deployment=None if args.deployment == "static" else args.deployment)


def prometheus_line(demand) -> str:
    """What a command read from Prometheus, in one line."""
    lengths = (f"; lengths in {demand.lengths['mean_in']:.0f} +- {demand.lengths['std_in']:.0f}, out "
               f"{demand.lengths['mean_out']:.0f} +- {demand.lengths['std_out']:.0f} tokens" if demand.lengths
               else "; no token counts (the workload's lengths kept)")
    return (f"rates from {demand.url}: {demand.requests:,.0f} requests of {len(demand.rates)} model(s) over the last "
            f"{demand.window} (scrape interval {demand.scrape_interval_s:g} s){lengths}")


def run_place(wl, gpus: int, policy_name: str, *, out_dir: str | None, emit_vllm: bool, model: str | None,
              surrogate: str | None, policy_options: dict, as_json: bool = False, out=None,
              history: str | None = None, **launch: str | None) -> int:
    """Place ``wl`` on ``gpus`` GPUs with the named policy, write the files, print the table and
    verdict (or one JSON object); the verdict's exit status.  ``launch``: ``vllm_version`` (the
    release the vllm serve commands are written for) and ``emit_router`` (``--emit-router``)."""
    unknown = set(launch) - {"vllm_version", "emit_router", "confidence", "deployment", "slo_ttft_p99_s"}
    if unknown:
        raise TypeError(f"run_place: unknown launch option(s) {sorted(unknown)}")
    vllm_version, emit_router = launch.get("vllm_version"), launch.get("emit_router")
    setting = launch.get("confidence")
    from lora_opt.placement.policies import PlacementContext, get_policy
    from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_OK
    from lora_opt.placement.report import clean_outputs, placement_table, table_notes, verdict, write_outputs

    out = out or sys.stdout
    policy = get_policy(policy_name, **policy_options)
    log = None
    if history:
        from lora_opt.placement.workload_file import load_request_log
        wl, log, span = load_request_log(wl, history)
    ctx = PlacementContext.for_workload(wl, surrogate, history=log, history_s=span if history else 0.0)
    p = policy.place(wl, gpus, ctx)
    judged = None
    if launch.get("deployment"):
        p, judged = _recommended(wl, gpus, p, policy, surrogate, setting, policy_options, launch["deployment"],
                                 launch.get("slo_ttft_p99_s") or SLO_TTFT_P99_S, history)
    if setting is not None and p.meta.get("feasible"):
        from lora_opt.placement.confidence import annotate
        annotate(p, wl, setting)          # each GPU's margin and probability of starving at the confidence
    code, message = verdict(p)
    if judged is not None and not judged[0].ok:
        why = no_deployment_message(judged, gpus)
        # the policy's own verdict first where it is already infeasible (how many GPUs it needs)
        code, message = EXIT_NOT_ACCEPTABLE, (f"{message}\n{why}" if code == EXIT_NOT_ACCEPTABLE else why)
    if judged is not None and code == EXIT_OK and judged[0].fleet.router != "static":
        # judged behind a picker: router.json's fixed weights are not what was judged; with the launch
        # commands comes the configuration of a router that has the picker (unless another was asked for)
        emit_router = emit_router or (router_config_for(judged[0].fleet.router) if emit_vllm else None)
        p.meta.setdefault("notes", []).append(router_note(judged[0], emit_router))
    out_path = Path(out_dir or f"outputs/placement-{wl.name or 'workload'}")
    written = []
    router_text = {}
    if emit_router and code == EXIT_OK:             # refused (PlacementError) before anything is written
        from lora_opt.placement.router_config import router_files
        from lora_opt.placement.plan import PlacementError
        from lora_opt.placement.vllm_launch import resolve_vllm_version
        router_text = router_files(p, emit_router, vllm_release=resolve_vllm_version(
            vllm_version, getattr(ctx.profile, "vllm_version", None), PlacementError))
    if code != EXIT_NOT_ACCEPTABLE:                 # infeasible: nothing placed to write
        written = write_outputs(p, ctx.profile, out_path, emit_vllm=emit_vllm and code == EXIT_OK, model=model,
                                vllm_version=vllm_version)
        from lora_opt.io import atomic_write_text
        for name, text in router_text.items():
            (out_path / name).parent.mkdir(parents=True, exist_ok=True)
            written.append(atomic_write_text(out_path / name, text, 0o755 if name.endswith(".sh") else None))
    elif out_path.is_dir():
        clean_outputs(out_path)          # a previous run's placement must not pass for this one's
    if as_json:
        extra = {"deployments": [_candidate_dict(c) for c in judged]} if judged is not None else {}
        out.write(json.dumps({"exit": code, "message": message, "files": [str(w) for w in written],
                              **p.to_dict(), **extra}) + "\n")
        return code
    deployed = f"; deployment {p.meta['deployment']}" if judged is not None and "deployment" in p.meta else ""
    out.write(f"workload {wl.name}: {len(wl.adapters)} adapters, {wl.total_rate:.2f} req/s; policy {policy.name}"
              f"{deployed}; profile {wl.profile}\n")
    if history:
        out.write(f"rates from {history}: {len(log):,} requests over {span:,.0f} s\n")
    if judged is not None:
        from lora_opt.search.recommend import candidates_table
        out.write(candidates_table(judged) + "\n")
        out.write(recommendation_line(judged) + "\n")
    out.write(placement_table(p) + "\n")
    for note in table_notes(p):          # what the columns mean, for the values shown
        out.write(f"  {note}\n")
    for note in p.meta.get("notes", []):
        out.write(f"note: {note}\n")
    out.write(message + "\n")
    for w in written:
        out.write(f"  -> {w}\n")
    return code


#: --deployment's p99 TTFT bound when --ttft-p99-s is not given (greedy-plus's verification default)
SLO_TTFT_P99_S = 5.0


def _recommended(wl, gpus, static, policy, surrogate, setting, policy_options, deployment, ttft_p99_s, history):
    """(the placement of the recommended deployment -- the static one when none meets the SLO --, the judged
    candidates, best first): ``lora_opt.search.recommend`` at the confidence's verification load (without an
    error model: 1 + the fixed margin) and the p99 TTFT bound ``ttft_p99_s``."""
    import time

    from lora_opt.placement.policies import PlacementContext
    from lora_opt.search.recommend import recommend
    load = setting.bound.verification_load if setting is not None and setting.bound is not None else \
        1.0 + policy_options.get("margin", 0.1)
    t0 = time.perf_counter()
    judged = recommend(wl, gpus, static, policy=policy, load=load,
                       ctx_for=lambda w: PlacementContext.for_workload(w, surrogate),
                       ttft_p99_s=ttft_p99_s, deployment=deployment)
    best = judged[0]
    how = (f"derived from the confidence {setting.confidence:g}" if setting is not None and setting.bound is not None
           else f"the fixed margin {policy_options.get('margin', 0.1):g}")
    p = best.placement if best.ok and best.placement is not None else static
    p.meta.setdefault("notes", []).append(judged_note(wl, load, how, ttft_p99_s, history))
    if not best.ok or best.placement is None:
        return static, judged
    p.meta.update(deployment=best.deployment, judged_load=load, judged_router=best.fleet.router,
                  # the wall time of the whole answer: the policy's placement, then the judging
                  policy_wall_ms=static.meta.get("policy_wall_ms", 0.0) + (time.perf_counter() - t0) * 1000)
    if p is static:
        return static, judged
    p.meta.setdefault("gpus_pool", gpus)
    on = p.by_gpu()
    p.meta.setdefault("incoming_rate_req_s",
                      [sum(p.adapters[k].rate * w for k, w in on[g]) for g in range(len(p.gpus))])
    return p, judged


def judged_note(wl, load: float, how: str, ttft_p99_s: float, history: str | None) -> str:
    """How the deployments were judged, in words."""
    from lora_opt.search.recommend import judge_window_s
    traffic = ("the workload's evaluation traffic" +
               (" at the rates observed in the request log (not its own requests)" if history else ""))
    return (f"deployments judged on the fleet twin: {judge_window_s(wl):g} s of {traffic} at {load:.3f}x every rate "
            f"({how}), "
            f"no GPU starving at rho {wl.rho:g}, p99 TTFT <= {ttft_p99_s:g} s")


def router_config_for(router: str) -> str:
    """The ``--emit-router`` configuration of a fleet-twin router: the Gateway API Inference Extension for the
    picker, vllm-router for its policies."""
    from lora_opt.placement.router_config import VLLM_ROUTER_POLICIES
    return f"vllm-router:{router}" if router in VLLM_ROUTER_POLICIES else "gateway"


def router_note(best, emit_router: str | None) -> str:
    """What routes a deployment judged behind a router other than its weights, and where its configuration is."""
    on_use = " with adapters loaded on use" if best.fleet.adapters == "on-demand" else ""
    wanted = router_config_for(best.fleet.router)
    name = "the Gateway API Inference Extension" if wanted == "gateway" else "vllm-router"
    file = "router/inference-pools.yaml" if wanted == "gateway" else "router/vllm-router.sh"
    where = (f"{file} has {name}'s configuration" if emit_router == wanted else
             f"--emit-router {emit_router} was asked for instead of {wanted}" if emit_router else
             f"--emit-vllm also writes {name}'s configuration")
    return (f"{best.deployment} was judged behind the {best.fleet.router} router{on_use}: route with it ({where}); "
            "router.json's fixed weights are not what was judged")


def recommendation_line(judged) -> str:
    """The recommended deployment, the runner-up and why each other deployment lost, in words."""
    from lora_opt.search.recommend import P99_TIE
    best = judged[0]
    if not best.ok:
        return "no deployment meets the SLO (see the notes above)"
    why = []
    seen = {best.deployment}
    for c in judged[1:]:
        if c.deployment in seen:      # a deployment's other tries (missed confirmations): in the table
            continue
        seen.add(c.deployment)
        if not c.ok:
            why.append(f"{c.deployment} misses it ({c.detail or 'not met'}"
                       + (f" at {c.gpus} GPU(s))" if c.gpus else ")"))
        elif c.gpus > best.gpus:
            why.append(f"{c.deployment} needs {c.gpus} GPU(s)")
        elif c.ttft_p99_ms <= best.ttft_p99_ms * (1 + P99_TIE):
            why.append(f"{c.deployment} also {c.gpus}, p99 TTFT {c.ttft_p99_ms:,.0f} ms (within {P99_TIE:.0%}: a tie) "
                       f"but {c.adapter_loads_per_s:.1f} adapter loads/s against {best.adapter_loads_per_s:.1f}")
        else:
            why.append(f"{c.deployment} also {c.gpus}, p99 TTFT {c.ttft_p99_ms:,.0f} ms "
                       f"(+{c.ttft_p99_ms / best.ttft_p99_ms - 1:.0%})")
    runner = next((c for c in judged[1:] if c.ok and c.deployment != best.deployment), None)
    if runner is not None:          # the runner-up first, named
        i = [c for c in judged[1:] if c.deployment != best.deployment].index(runner)
        why.insert(0, "runner-up: " + why.pop(i))
    from lora_opt.search.recommend import CONFIRM_DRAWS, JUDGE_SEEDS
    draws = f" on all {JUDGE_SEEDS + CONFIRM_DRAWS} draws of the traffic" if best.confirmed else ""
    return (f"recommended: {best.deployment} on {best.gpus} GPU(s), p99 TTFT {best.ttft_p99_ms:,.0f} ms -- the fewest "
            f"GPUs that meet the SLO{draws}" + ("; " + "; ".join(why) if why else ""))


def no_deployment_message(judged, gpus: int) -> str:
    """Why nothing is recommended: each deployment's binding constraint."""
    why = "; ".join(f"{c.deployment}: {c.detail or 'not met'}" + (f" at {c.gpus} GPUs" if c.gpus else "")
                    for c in judged)
    return f"infeasible: no deployment meets the SLO within {gpus} GPUs ({why}); rerun with more --gpus"


def _candidate_dict(c) -> dict:
    return {"deployment": c.deployment, "gpus": c.gpus, "ok": c.ok, "ttft_p99_ms": c.ttft_p99_ms,
            "served_fraction": c.served_fraction, "adapter_loads_per_s": c.adapter_loads_per_s, "detail": c.detail,
            "router": c.fleet.router if c.fleet else None, "adapters": c.fleet.adapters if c.fleet else None}
