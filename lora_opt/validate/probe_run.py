"""Running a probe plan: on servers launched per family (``--launch``) or on one live server
(``--endpoint``); the rows CSV, a summary and one MLflow run (experiment ``probe``)."""
from __future__ import annotations

import math
import time
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_json, atomic_write_text
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run
from lora_opt.validate.ingest import rows_csv
from lora_opt.validate.probe import (Plan, ProbeContext, ProbeOptions, _plan_points, _progress, decode_family,
                                     lora_family, loading_family, prefill_family, server_info)
from lora_opt.validate.probe_launch import LORA_OPTIONS, LaunchedServer, ServeCommand

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
    ctx = ProbeContext(opts.model, opts.speed, _flags(cmd, enable_lora), info["kv_tokens"])
    return srv, ctx, info


def _kv_row(ctx: ProbeContext, label: str, srv: LaunchedServer) -> dict:
    return ctx.row("kv", label, probe_startup_s=srv.startup_s)


def run_launch(base: ServeCommand, opts: ProbeOptions) -> tuple[list[dict], dict]:
    """Every family on servers launched from ``base`` (stopped at the end, also on Ctrl-C)."""
    plan = opts.plan
    rows, info_all = [], {"launches": []}
    mml = int(base.flag("--max-model-len", 8192))
    bar = _progress(_plan_points(plan, True), opts.progress, f"probe {plan.name}")
    tick = lambda: bar.update(1)  # noqa: E731 - a progress callback
    try:
        srv, ctx, info = _launched(no_lora_command(base, plan), opts, "no_lora", False)
        with srv:
            if ctx is None:
                raise InputError(f"probe --launch: the LoRA-off server did not start (exit {srv.exit_code}): "
                                 f"{srv.log_tail()}")
            info_all["version"] = info["version"]
            info_all["launches"].append({"name": "no_lora", "startup_s": srv.startup_s, "kv_tokens": ctx.kv_tokens})
            rows.append(_kv_row(ctx, "kv_no_lora", srv))
            rows += decode_family(srv.url, ctx, plan, info["base"], tick)
            rows += prefill_family(srv.url, ctx, plan, info["base"], mml, tick)
        for rank in plan.ranks:
            srv, ctx, info = _launched(lora_command(base, plan, rank, opts.adapter_path), opts, f"rank_{rank}", True)
            with srv:
                if ctx is None:
                    rows.append(ProbeContext(opts.model, opts.speed, {}).row(
                        "kv", f"kv_r{rank}", status="failed", max_lora_rank=rank, probe_note=srv.log_tail()))
                    bar.update(len(plan.lora_batches) * len(plan.lora_distinct) + 2)
                    continue
                info_all["launches"].append({"name": f"rank_{rank}", "startup_s": srv.startup_s,
                                             "kv_tokens": ctx.kv_tokens})
                rows.append(_kv_row(ctx, f"kv_r{rank}", srv))
                gpu = [f"{GPU}{i}" for i in range(plan.max_loras)]
                rows += lora_family(srv.url, ctx, plan, gpu, tick)
                k = plan.load_burst
                rows += loading_family(srv.url, ctx, gpu[0], [f"{CPU}{i}" for i in range(k)],
                                       [f"{DISK}{i}" for i in range(k)], tick)
        rows += startup_family(base, opts, tick)
    finally:
        bar.close()
    return rows, info_all


def startup_family(base: ServeCommand, opts: ProbeOptions, tick) -> list[dict]:
    """Start-up at growing max_loras (the plan's largest rank): ok with its KV tokens, or refused."""
    rows = []
    rank = max(opts.plan.ranks)
    for a in opts.plan.startup_max_loras:
        cmd = lora_command(base, opts.plan, rank, opts.adapter_path, max_loras=a)
        srv, ctx, _ = _launched(cmd, opts, f"startup_a{a}_r{rank}", True)
        with srv:
            if ctx is None:
                rows.append(ProbeContext(opts.model, opts.speed, _flags(cmd, True)).row(
                    "startup", f"startup_a{a}_r{rank}", status="failed", probe_note=srv.log_tail(2)))
            else:
                rows.append(ctx.row("startup", f"startup_a{a}_r{rank}", probe_startup_s=srv.startup_s))
        tick()
    return rows


def run_live(url: str, opts: ProbeOptions) -> tuple[list[dict], dict]:
    """The families one running server allows (see :mod:`lora_opt.validate.probe`)."""
    info = server_info(url)
    plan = opts.plan
    lora = bool(info["adapters"])
    if lora and opts.max_lora_rank is None:
        raise InputError("probe --endpoint: the server serves adapters; give its --max-lora-rank (vLLM does not "
                         "report it)")
    flags = {"enable_lora": lora, "max_lora_rank": opts.max_lora_rank if lora else None,
             "max_num_batched_tokens": opts.max_num_batched_tokens}
    ctx = ProbeContext(opts.model, opts.speed, flags, info["kv_tokens"])
    rows = [ctx.row("kv", "kv_live")]
    total = len(plan.lora_batches) * len(plan.lora_distinct) if lora else (
        len(plan.decode_batches) * len(plan.decode_prompts) + len(plan.prefill_prompts))
    bar = _progress(total, opts.progress, f"probe {plan.name}")
    try:
        if lora:
            rows += lora_family(url, ctx, plan, info["adapters"], lambda: bar.update(1))
        else:
            rows += decode_family(url, ctx, plan, info["base"], lambda: bar.update(1))
            rows += prefill_family(url, ctx, plan, info["base"], 1 << 30, lambda: bar.update(1))
    finally:
        bar.close()
    return rows, {"version": info["version"], "launches": []}


def write_outputs(rows: list[dict], info: dict, opts: ProbeOptions, source: str, wall_s: float) -> dict:
    """rows.csv (real-runs format + probe_* columns) and summary.json; the summary."""
    fams: dict[str, dict] = {}
    for r in rows:
        f = fams.setdefault(r["probe_family"], {"ok": 0, "failed": 0})
        key = r["status"] if r["status"] in ("ok", "noisy") else "failed"
        f[key] = f.get(key, 0) + 1
    summary = {"source": source, "plan": opts.plan.name, "model": opts.model, "speed": opts.speed,
               "server_cmd": opts.server_cmd, "version": info.get("version", ""), "wall_s": wall_s,
               "families": fams, "launches": info.get("launches", []), "rows": len(rows),
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
    t0 = time.perf_counter()
    if launch is not None:
        rows, info = run_launch(launch, opts)
        source = " ".join(launch.argv(opts.server_cmd)[:3])
    else:
        rows, info = run_live(endpoint, opts)
        source = endpoint
    summary = write_outputs(rows, info, opts, source, time.perf_counter() - t0)
    if track:
        summary["mlflow_run_id"] = log_probe_run(summary, opts.out, tracking_uri)
    summary["kv_tokens"] = [r.get("gpu_kv_cache_tokens") for r in rows if r["probe_family"] == "kv"
                            and not math.isnan(float(r.get("gpu_kv_cache_tokens") or math.nan))]
    return summary
