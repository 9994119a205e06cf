"""``lora-opt probe``: the measurement plan a profile needs, run on a live OpenAI-compatible server
(vLLM or ``lora-opt emulate``) or on servers it launches from a ``vllm serve`` command.

Families (each a short benchmark; rows of the real-runs CSV format under experiment
``digital_twin_dynamic/estimators/probe/<family>``, fitted by ``lora-opt calibrate --runs ROWS``
through :mod:`lora_opt.calibration.probe_fit`):

========  =====================================================  ==============================
family    what is sent                                           what it identifies
========  =====================================================  ==============================
decode    B streams, same prompt, ``ignore_eos``; LoRA off        base, per_seq, per_ctx (step =
                                                                  base + per_seq B + per_ctx ctx)
prefill   one request at a time, prompts of several lengths       per_token (TTFT slope)
lora      B streams on D distinct adapters, one launch per rank   jump (at max_loras), slope per rank
loading   a burst of K one-token requests on non-resident         CPU->GPU and disk->CPU ms per rank
          adapters beside a pacer stream, cold minus warm
kv        every launch's ``vllm:cache_config_info``               KV tokens per (max_loras, rank)
startup   launches at growing max_loras (full plan, --launch)     the memory frontier (ok / refused)
========  =====================================================  ==============================

With ``--launch`` every family gets the server it needs (LoRA off; one ``max_lora_rank`` per launch
with generated adapter names whose residency is known: vLLM loads ``--lora-modules`` in order, the
last ``max_cpu_loras`` stay in CPU and the last ``max_loras`` in GPU slots).  On one live server
(``--endpoint``) only what that server allows is measured: decode/prefill when it serves no
adapter, the LoRA family at its rank otherwise; adapter loads and start-up need ``--launch``.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.validate.live import _get
from lora_opt.validate.probe_measure import (MAX_BURST_SHARE, MAX_STREAM_SPREAD, batch_run, burst_load_ms, kv_tokens_from_metrics,
                                             ttft_runs, window_step)

#: runs of a window with bursts (see probe_measure) repeated at most this many times
RETRIES = 2

FAMILY_PREFIX = "digital_twin_dynamic/estimators/probe/"


@dataclass(frozen=True)
class Plan:
    """The points of each family (and a wall-time budget per family: points left when it is spent
    are skipped, and the summary says so)."""

    name: str
    decode_batches: tuple = (1, 8, 32)
    decode_prompts: tuple = (32, 1024)
    decode_out: int = 96
    prefill_prompts: tuple = (256, 2048, 6144)
    prefill_reps: int = 3
    ranks: tuple = (8, 16, 32, 64)
    lora_batches: tuple = (16,)
    lora_distinct: tuple = (1, 2, 4, 8, 16)
    lora_prompt: int = 128
    lora_out: int = 96
    max_loras: int = 16
    load_burst: int = 12
    startup_max_loras: tuple = ()
    family_budget_s: float = 120.0

    @property
    def max_batch(self) -> int:
        return max(self.decode_batches + self.lora_batches)


PLANS = {
    # <= 10 min on a GPU: 5 launches (~1-2 min each with vLLM) and ~40 short benchmarks
    "quick": Plan("quick"),
    # <= 1 h: more batch sizes and contexts, two max_loras per rank (slot share), the start-up frontier
    "full": Plan("full", decode_batches=(1, 4, 16, 32, 64, 128), decode_prompts=(32, 512, 2048), decode_out=128,
                 prefill_prompts=(128, 512, 2048, 4096, 8192), prefill_reps=5,
                 lora_batches=(16, 32, 64), lora_distinct=(1, 2, 4, 8, 16, 32), lora_out=96, max_loras=32,
                 startup_max_loras=(8, 16, 32, 64, 128, 256), family_budget_s=900.0),
    # a smoke test of the whole pipeline (tests, the runbook's dry run)
    "smoke": Plan("smoke", decode_batches=(1, 16), decode_prompts=(32, 512), decode_out=64,
                  prefill_prompts=(256, 2048), prefill_reps=2, ranks=(8,), lora_batches=(8,),
                  lora_distinct=(1, 8), lora_out=48, max_loras=8, load_burst=6),
}


@dataclass
class ProbeContext:
    """What every family's rows record: the model label, the time scale, the server's flags."""

    model: str
    speed: float
    flags: dict
    kv_tokens: float = math.nan

    def row(self, family: str, label: str, status: str = "ok", **values) -> dict:
        f = self.flags
        base = {"experiment": FAMILY_PREFIX + family, "run_name": label, "model": self.model, "status": status,
                "dataset": "random", "enable_lora": int(bool(f.get("enable_lora"))),
                "max_loras": f.get("max_loras"), "max_lora_rank": f.get("max_lora_rank"),
                "max_cpu_loras": f.get("max_cpu_loras"), "max_num_seqs": f.get("max_num_seqs"),
                "max_num_batched_tokens": f.get("max_num_batched_tokens"),
                "gpu_memory_utilization": f.get("gpu_memory_utilization"),
                "gpu_kv_cache_tokens": self.kv_tokens, "probe_family": family, "probe_speed": self.speed}
        return {**base, **values}


def _run(coro):
    return asyncio.run(coro)


async def _text(url: str, path: str) -> str:
    status, body = await _get(url, path)
    return body.decode(errors="replace") if status == 200 else ""


def server_info(url: str) -> dict:
    """The server's /version, models (base + adapters) and KV tokens (from /metrics)."""
    async def fetch():
        return await asyncio.gather(_text(url, "/version"), _text(url, "/v1/models"), _text(url, "/metrics"))
    version, models, metrics = _run(fetch())
    try:
        data = json.loads(models)["data"]
    except (ValueError, KeyError, TypeError):
        raise InputError(f"probe: {url}/v1/models did not answer with vLLM's model list") from None
    base = [m["id"] for m in data if not m.get("parent")]
    adapters = [m["id"] for m in data if m.get("parent")]
    try:
        ver = json.loads(version).get("version", "")
    except (ValueError, AttributeError):
        ver = ""
    return {"version": ver, "base": base[0] if base else "", "adapters": adapters,
            "kv_tokens": kv_tokens_from_metrics(metrics)}


# ---- families ----------------------------------------------------------------------------------
def _noise(w: dict) -> float:
    """How far a window is from clean (<= 1: within MAX_BURST_SHARE and MAX_STREAM_SPREAD)."""
    return max(w["burst_share"] / MAX_BURST_SHARE, w["stream_spread"] / MAX_STREAM_SPREAD) if w["ok"] else math.inf


def measured_window(url: str, models: list[str], b: int, p: int, out: int, speed: float, seed: int) -> dict:
    """One batch run's pure-decode window, repeated while it was noisy (tokens in bursts, streams
    disagreeing: the machine could not keep time); the cleanest kept, ``noisy`` when none was clean."""
    best = None
    for attempt in range(1 + RETRIES):
        w = window_step(_run(batch_run(url, models, b, p, out, seed=seed + attempt)), p, speed)
        w["attempts"] = attempt + 1
        if best is None or _noise(w) < _noise(best):
            best = w
        if _noise(w) <= 1.0:
            break
    best["noisy"] = best["ok"] and _noise(best) > 1.0
    return best


def warm_up(url: str, models: list[str], plan: Plan) -> None:
    """A first batch (vLLM compiles and captures graphs, the emulator's kernel warms up): not measured."""
    _run(batch_run(url, models, min(8, plan.max_batch), 64, 24, seed=999))


def decode_family(url: str, ctx: ProbeContext, plan: Plan, model: str, tick) -> list[dict]:
    rows = []
    warm_up(url, [model], plan)
    for b in plan.decode_batches:
        for p in plan.decode_prompts:
            w = measured_window(url, [model], b, p, plan.decode_out, ctx.speed, seed=b * 7 + p)
            rows.append(_step_row(ctx, "decode", f"decode_b{b}_p{p}", w, b, 0, p, plan.decode_out))
            tick()
    return rows


def _step_row(ctx: ProbeContext, family: str, label: str, w: dict, b: int, d: int, p: int, out: int) -> dict:
    if not w["ok"]:
        return ctx.row(family, label, status="failed", probe_note=w["why"], probe_batch=b,
                       probe_distinct_adapters=d, probe_prompt_tokens=p)
    status = "noisy" if w["noisy"] else "ok"       # calibrate fits "ok" rows only
    return ctx.row(family, label, status=status, completed=b, num_prompts=b, total_input_tokens=b * p, total_output_tokens=b * out,
                   mean_itl_ms=w["step_ms"], running_mean=b, n_served_adapters=d, mean_loras_by_batch=d,
                   probe_batch=b, probe_distinct_adapters=d, probe_prompt_tokens=p,
                   probe_ctx_ktokens_mean=w["ctx_ktokens"], probe_step_ms=w["step_ms"],
                   probe_step_ms_sd=w["step_ms_sd"], probe_gaps=w["gaps"], probe_burst_share=w["burst_share"],
                   probe_attempts=w["attempts"], probe_step_ms_median=w["step_ms_median"],
                   probe_stream_spread=w["stream_spread"],
                   probe_note="noisy: tokens came in bursts or streams disagreed (the machine could not keep "
                              "time): lower the server's --speed / load" if w["noisy"] else "")


def prefill_family(url: str, ctx: ProbeContext, plan: Plan, model: str, max_model_len: int, tick) -> list[dict]:
    rows = []
    for p in plan.prefill_prompts:
        p = min(p, max_model_len - 2)
        ttfts = _run(ttft_runs(url, model, p, plan.prefill_reps, ctx.speed, seed=p))
        if len(ttfts) < plan.prefill_reps:
            rows.append(ctx.row("prefill", f"prefill_p{p}", status="failed", probe_prompt_tokens=p,
                                probe_note="a request failed"))
        else:
            mean = sum(ttfts) / len(ttfts)
            rows.append(ctx.row("prefill", f"prefill_p{p}", completed=len(ttfts), num_prompts=len(ttfts),
                                total_input_tokens=p * len(ttfts), total_output_tokens=2 * len(ttfts),
                                mean_ttft_ms=mean, probe_prompt_tokens=p, probe_ttft_ms=mean,
                                probe_batch=1))
        tick()
    return rows


def lora_family(url: str, ctx: ProbeContext, plan: Plan, adapters: list[str], tick) -> list[dict]:
    rows = []
    warm_up(url, adapters[:1], plan)
    for b in plan.lora_batches:
        for d in plan.lora_distinct:
            if d > len(adapters) or d > b:
                tick()
                continue
            w = measured_window(url, adapters[:d], b, plan.lora_prompt, plan.lora_out, ctx.speed, seed=d)
            rows.append(_step_row(ctx, "lora", f"lora_r{ctx.flags.get('max_lora_rank')}_b{b}_d{d}", w, b, d,
                                  plan.lora_prompt, plan.lora_out))
            tick()
    return rows


def loading_family(url: str, ctx: ProbeContext, pacer: str, cpu_only: list[str], disk_only: list[str],
                   tick) -> list[dict]:
    """CPU->GPU from the CPU-resident adapters' burst; disk->CPU from the disk-only ones' burst
    (which pays both) minus the first."""
    rank = ctx.flags.get("max_lora_rank")
    rows = []
    for kind, names in (("cpu", cpu_only), ("disk", disk_only)):
        r = _run(burst_load_ms(url, pacer, names, ctx.speed, seed=1 if kind == "cpu" else 2))
        label = f"load_{kind}_r{rank}"
        if not r["ok"]:
            rows.append(ctx.row("loading", label, status="failed", probe_note=r["why"], probe_load_kind=kind))
        else:
            k = len(names)
            per = r["load_ms"] / k
            col = ({"adapter_loads_from_memory": k, "adapter_load_time_from_memory_s": r["load_ms"] / 1000.0}
                   if kind == "cpu" else
                   {"adapter_loads_from_disk": k, "adapter_load_time_from_disk_s": r["load_ms"] / 1000.0})
            rows.append(ctx.row("loading", label, completed=k, num_prompts=k, adapter_module_ranks=rank,
                                probe_load_kind=kind, probe_load_ms_per_adapter=per, probe_burst=k,
                                probe_cold_window_ms=r["cold_ms"], probe_warm_window_ms=r["warm_ms"], **col))
        tick()
    return rows


@dataclass
class ProbeOptions:
    """How a probe runs (the CLI's flags)."""

    plan: Plan
    model: str
    speed: float = 1.0
    out: Path = Path("probe")
    server_cmd: str | None = None
    adapter_path: str = "adapters/r{rank}"
    max_lora_rank: int | None = None
    max_num_batched_tokens: int | None = None
    health_timeout_s: float = 900.0
    progress: bool = True


def _progress(total: int, enabled: bool, desc: str):
    # tqdm only where a probe runs
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="point", disable=not enabled, leave=False)


def _plan_points(plan: Plan, launch: bool) -> int:
    per_rank = len(plan.lora_batches) * len(plan.lora_distinct) + (2 if launch else 0)
    return (len(plan.decode_batches) * len(plan.decode_prompts) + len(plan.prefill_prompts)
            + len(plan.ranks) * per_rank + len(plan.startup_max_loras))
