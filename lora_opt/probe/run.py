"""Running a probe plan: on servers launched per family (``--launch``) or on one live server
(``--endpoint``); the rows CSV, a summary and one MLflow run (experiment ``probe``)."""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_json, atomic_write_text
from lora_opt.placement.vllm_launch import release_of, resolve_vllm_version, validate_serve_args
from lora_opt.probe.launch import LORA_OPTIONS, LaunchedServer, ServeCommand
from lora_opt.probe.plan import (Plan, ProbeContext, ProbeOptions, decode_family, lora_family, lora_prefill_family,
                                 loading_family, plan_points, prefill_family, progress_bar, server_info)
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run
from lora_opt.validate.ingest import rows_csv

#: generated adapter names: disk-only, CPU-only, GPU-resident (vLLM's start-up order decides residency)
DISK, CPU, GPU = "probe-disk-", "probe-cpu-", "probe-gpu-"


def _flags(cmd: ServeCommand, enable_lora: bool) -> dict:
    def num(name, cast=int):
        v = cmd.flag(name)
        return cast(v) if v is not None else None
    return {"enable_lora": enable_lora, "max_loras": num("--max-loras") if enable_lora else None,
            "max_lora_rank": num("--max-lora-rank") if enable_lora else None,
            "max_cpu_loras": num("--max-cpu-loras") if enable_lora else None,
            "max_num_seqs": num("--max-num-seqs"), "max_num_batched_tokens": num("--max-num-batched-tokens"),
            "gpu_memory_utilization": num("--gpu-memory-utilization", float)}


def lora_command(base: ServeCommand, plan: Plan, rank: int, adapter_path: str, max_loras: int | None = None) -> ServeCommand:
    """The launch of one rank: max_loras A GPU-resident adapters (the LoRA family's), K CPU-only and K
    disk-only ones (the loading family's), listed disk, CPU, GPU: the last A in GPU slots, the last
    A + K in the CPU cache."""
    a = max_loras or plan.max_loras
    k = plan.load_burst
    path = adapter_path.format(rank=rank)
    # (a start-up launch with many slots lists no more adapters than the LoRA family uses)
    names = ([f"{DISK}{i}" for i in range(k)] + [f"{CPU}{i}" for i in range(k)]
             + [f"{GPU}{i}" for i in range(min(a, plan.max_loras))])
    return base.with_options(drop=LORA_OPTIONS, enable_lora=True, max_loras=a, max_lora_rank=rank,
                             max_cpu_loras=a + k, max_num_seqs=max(plan.max_batch, int(base.flag("--max-num-seqs", 0))),
                             lora_modules=[f"{n}={path}" for n in names])


def no_lora_command(base: ServeCommand, plan: Plan) -> ServeCommand:
    return base.with_options(drop=LORA_OPTIONS + ("--enable-lora",),
                             max_num_seqs=max(plan.max_batch, int(base.flag("--max-num-seqs", 0))))


def _launched(cmd: ServeCommand, opts: ProbeOptions, name: str, enable_lora: bool):
    """(server, context, info) of a launch, or (server, None, None) when it did not start."""
    srv = LaunchedServer(cmd, server_cmd=opts.server_cmd, log_path=opts.out / "logs" / f"{name}.log",
                         health_timeout_s=opts.health_timeout_s)
    if not srv.start():
        return srv, None, None
    info = server_info(srv.url)
    prompts = info["prompts"]
    if prompts.max_model_len is None and cmd.flag("--max-model-len") is not None:
        # a server whose model card does not say: the command's own limit
        prompts = dataclasses.replace(prompts, max_model_len=int(cmd.flag("--max-model-len")))
    ctx = ProbeContext(opts.model, opts.speed, _flags(cmd, enable_lora), info["kv_tokens"], prompts, info.get("kv_blocks", math.nan))
    return srv, ctx, info


def _kv_row(ctx: ProbeContext, label: str, srv: LaunchedServer) -> dict:
    return ctx.row("kv", label, probe_startup_s=srv.startup_s)


def launch_commands(base: ServeCommand, plan: Plan, adapter_path: str) -> dict[str, ServeCommand]:
    """Every command ``probe --launch`` starts, by launch name, in the order it starts them."""
    out = {"no_lora": no_lora_command(base, plan)}
    out.update({f"rank_{r}": lora_command(base, plan, r, adapter_path) for r in plan.ranks})
    rank = max(plan.ranks)
    out.update({f"startup_a{a}_r{rank}": lora_command(base, plan, rank, adapter_path, max_loras=a)
                for a in plan.startup_max_loras})
    return out


def check_launch_commands(base: ServeCommand, plan: Plan, adapter_path: str, vllm_version: str) -> None:
    """Refuse, before any server starts, a plan whose commands ``vllm_version``'s parser would not take
    (the option table recorded from that release: :mod:`lora_opt.placement.vllm_launch`)."""
    problems = []
    for name, cmd in launch_commands(base, plan, adapter_path).items():
        problems += [f"{name}: {q}" for q in validate_serve_args(cmd.argv(), vllm_version)]
    if problems:
        raise InputError(f"probe --launch: vLLM {release_of(vllm_version)} would refuse these commands: "
                         + "; ".join(dict.fromkeys(problems)))


def probe_launched(base: ServeCommand, opts: ProbeOptions) -> tuple[list[dict], dict]:
    """Every family on servers launched from ``base`` (stopped at the end, also on Ctrl-C)."""
    plan = opts.plan
    commands = launch_commands(base, plan, opts.adapter_path)
    rows, info_all = [], {"launches": []}
    bar = progress_bar(plan_points(plan, True), opts.progress, f"probe {plan.name}")
    tick = lambda: bar.update(1)  # noqa: E731 - a progress callback
    try:
        srv, ctx, info = _launched(commands["no_lora"], opts, "no_lora", False)
        with srv:
            if ctx is None:
                raise InputError(f"probe --launch: the LoRA-off server did not start (exit {srv.exit_code}): "
                                 f"{srv.log_tail()}")
            info_all["version"] = info["version"]
            info_all["prompts"] = ctx.prompts.source
            info_all["max_model_len"] = ctx.prompts.max_model_len
            info_all["launches"].append({"name": "no_lora", "startup_s": srv.startup_s, "kv_tokens": ctx.kv_tokens})
            rows.append(_kv_row(ctx, "kv_no_lora", srv))
            rows += decode_family(srv.url, ctx, plan, info["base"], tick)
            rows += prefill_family(srv.url, ctx, plan, info["base"], tick)
        for rank in plan.ranks:
            srv, ctx, info = _launched(commands[f"rank_{rank}"], opts, f"rank_{rank}", True)
            with srv:
                if ctx is None:
                    rows.append(ProbeContext(opts.model, opts.speed, {}).row(
                        "kv", f"kv_r{rank}", status="failed", max_lora_rank=rank, probe_note=srv.log_tail()))
                    bar.update(plan.lora_points + 2)
                    continue
                info_all["launches"].append({"name": f"rank_{rank}", "startup_s": srv.startup_s,
                                             "kv_tokens": ctx.kv_tokens})
                rows.append(_kv_row(ctx, f"kv_r{rank}", srv))
                gpu = [f"{GPU}{i}" for i in range(plan.max_loras)]
                rows += lora_family(srv.url, ctx, plan, gpu, tick)
                k = plan.load_burst
                rows += loading_family(srv.url, ctx, gpu, [f"{CPU}{i}" for i in range(k)],
                                       [f"{DISK}{i}" for i in range(k)], tick)
                rows += lora_prefill_family(srv.url, ctx, plan, gpu[0], tick)
        rows += startup_family(commands, opts, tick)
    finally:
        bar.close()
    return rows, info_all


def startup_family(commands: dict[str, ServeCommand], opts: ProbeOptions, tick) -> list[dict]:
    """Start-up at growing max_loras (the plan's largest rank): ok with its KV tokens, or refused
    (``commands``: :func:`launch_commands`)."""
    rows = []
    rank = max(opts.plan.ranks)
    for a in opts.plan.startup_max_loras:
        cmd = commands[f"startup_a{a}_r{rank}"]
        srv, ctx, _ = _launched(cmd, opts, f"startup_a{a}_r{rank}", True)
        with srv:
            if ctx is None:
                rows.append(ProbeContext(opts.model, opts.speed, _flags(cmd, True)).row(
                    "startup", f"startup_a{a}_r{rank}", status="failed", probe_note=srv.log_tail(2)))
            else:
                rows.append(ctx.row("startup", f"startup_a{a}_r{rank}", probe_startup_s=srv.startup_s))
        tick()
    return rows


def probe_endpoint(url: str, opts: ProbeOptions) -> tuple[list[dict], dict]:
    """The families one running server allows (see :mod:`lora_opt.probe.plan`)."""
    info = server_info(url)
    plan = opts.plan
    lora = bool(info["adapters"])
    if lora and opts.max_lora_rank is None:
        raise InputError("probe --endpoint: the server serves adapters; give its --max-lora-rank (vLLM does not "
                         "report it)")
    flags = {"enable_lora": lora, "max_lora_rank": opts.max_lora_rank if lora else None,
             "max_num_batched_tokens": opts.max_num_batched_tokens}
    ctx = ProbeContext(opts.model, opts.speed, flags, info["kv_tokens"], info["prompts"], info.get("kv_blocks", math.nan))
    rows = [ctx.row("kv", "kv_live")]
    total = plan.lora_points if lora else (
        len(plan.decode_batches) * len(plan.decode_prompts) + len(plan.prefill_prompts))
    bar = progress_bar(total, opts.progress, f"probe {plan.name}")
    try:
        if lora:
            rows += lora_family(url, ctx, plan, info["adapters"], lambda: bar.update(1))
            rows += lora_prefill_family(url, ctx, plan, info["adapters"][0], lambda: bar.update(1))
        else:
            rows += decode_family(url, ctx, plan, info["base"], lambda: bar.update(1))
            rows += prefill_family(url, ctx, plan, info["base"], lambda: bar.update(1))
    finally:
        bar.close()
    return rows, {"version": info["version"], "launches": [], "prompts": ctx.prompts.source,
                  "max_model_len": ctx.prompts.max_model_len}


def write_outputs(rows: list[dict], info: dict, opts: ProbeOptions, source: str, wall_s: float) -> dict:
    """rows.csv (real-runs format + probe_* columns) and summary.json; the summary."""
    fams: dict[str, dict] = {}
    for r in rows:
        f = fams.setdefault(r["probe_family"], {"ok": 0, "failed": 0})
        key = r["status"] if r["status"] in ("ok", "noisy") else "failed"
        f[key] = f.get(key, 0) + 1
    summary = {"source": source, "plan": opts.plan.name, "model": opts.model, "speed": opts.speed,
               "server_cmd": opts.server_cmd, "version": info.get("version", ""), "wall_s": wall_s,
               "prompts": info.get("prompts", ""), "max_model_len": info.get("max_model_len"),
               "families": fams, "launches": info.get("launches", []), "rows": len(rows),
               # what was not measured and why (HTTP status and the server's message, the noise)
               "not_ok": [{"row": r["run_name"], "status": r["status"], "note": r.get("probe_note", "")}
                          for r in rows if r["status"] != "ok"],
               "calibrate": f"lora-opt calibrate --runs {opts.out / 'rows.csv'} --model PROFILE --out PROFILE.yaml"}
    atomic_write_text(opts.out / "rows.csv", rows_csv(rows))
    atomic_write_json(opts.out / "summary.json", summary, default=str)
    return summary


def log_probe_run(summary: dict, out: Path, tracking_uri: str | None) -> str:
    """One MLflow run in experiment ``probe``: params, rows per family, the output directory."""
    # mlflow only where a run is logged
    import mlflow

    with tracked_run("probe", run_name=f"probe {summary['plan']} {summary['model']}", tracking_uri=tracking_uri) as run:
        mlflow.log_params({"source": str(summary["source"])[:500], "plan": summary["plan"], "model": summary["model"],
                           "speed": summary["speed"], "server_cmd": str(summary["server_cmd"] or "")[:500],
                           "version": summary["version"]})
        log_flat_metrics("rows", summary["families"])
        log_flat_metrics("", {"wall_s": summary["wall_s"], "rows_total": summary["rows"]})
        log_dir(out)
        return run.info.run_id


def probe(opts: ProbeOptions, *, launch: ServeCommand | None = None, endpoint: str | None = None,
          track: bool = True, tracking_uri: str | None = None) -> dict:
    """Run the plan (``launch`` or ``endpoint``), write the outputs, log the MLflow run."""
    if opts.vllm_version is not None:
        release = resolve_vllm_version(opts.vllm_version, error=InputError)
        if launch is not None and not opts.server_cmd:
            check_launch_commands(launch, opts.plan, opts.adapter_path, release)
    t0 = time.perf_counter()
    if launch is not None:
        rows, info = probe_launched(launch, opts)
        source = " ".join(launch.argv(opts.server_cmd)[:3])
    else:
        rows, info = probe_endpoint(endpoint, opts)
        source = endpoint
    summary = write_outputs(rows, info, opts, source, time.perf_counter() - t0)
    if track:
        summary["mlflow_run_id"] = log_probe_run(summary, opts.out, tracking_uri)
    summary["kv_tokens"] = [r.get("gpu_kv_cache_tokens") for r in rows if r["probe_family"] == "kv"
                            and not math.isnan(float(r.get("gpu_kv_cache_tokens") or math.nan))]
    return summary
