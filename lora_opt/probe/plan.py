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
loading   lone one-token requests cycling over adapters in        CPU->GPU and disk->CPU ms per rank
          slots, over one more than the slots / the CPU cache
kv        every launch's ``vllm:cache_config_info``               KV tokens per (max_loras, rank)
startup   launches at growing max_loras (full plan, --launch)     the memory frontier (ok / refused)
========  =====================================================  ==============================

With ``--launch`` every family gets the server it needs (LoRA off; one ``max_lora_rank`` per launch
with generated adapter names whose residency is known: vLLM loads ``--lora-modules`` in order, the
last ``max_cpu_loras`` stay in CPU and the last ``max_loras`` in GPU slots).  On one live server
(``--endpoint``) only what that server allows is measured: decode/prefill when it serves no
adapter, the LoRA family at its rank otherwise; adapter loads and start-up need ``--launch``.

Every server is asked first what it accepts (:func:`lora_opt.emulate.client.server_prompt_tokens`):
prompts are token ids its own ``/tokenize`` produced (a small vocabulary refuses others) and no
longer than its ``max_model_len`` leaves room for the output.  A measurement the client could not
resolve (no gap above zero, a step or load <= 0, a load within its own noise, bursts) is written
as ``noisy`` with the reason, never ``ok``: ``calibrate`` fits ``ok`` rows only.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path

from lora_opt.emulate.client import PromptTokens, error_message, server_prompt_tokens
from lora_opt.errors import InputError
from lora_opt.probe.measure import (MAX_BURST_SHARE, MAX_STREAM_SPREAD, batch_run, cycle_load_ms,
                                    kv_blocks_from_metrics, load_cycles, ttft_runs, window_noise, window_step)
from lora_opt.validate.live import http_get

#: runs of a window with bursts (see lora_opt.probe.measure) repeated at most this many times
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
    # short prompts too: most requests' are, and on a CPU prefill grows faster than linearly
    prefill_prompts: tuple = (128, 256, 1024, 2048, 6144)
    prefill_reps: int = 3
    ranks: tuple = (8, 16, 32, 64)
    lora_batches: tuple = (16,)
    lora_distinct: tuple = (1, 2, 4, 8, 16)
    # one adapter at other batch sizes too: LoRA's fixed cost a step apart from its cost per token (vLLM's
    # CPU build: ~5 ms a step at rank 16 even at one sequence; a fit at one batch size puts it on the tokens)
    lora_step_batches: tuple = (1, 4, 32)
    lora_prompt: int = 128
    lora_out: int = 96
    # TTFT of lone prompts through an adapter: what LoRA costs prefill tokens (prefill_share); lengths
    # on both sides of where the cost per token steps up on vLLM's CPU build (tokens x rank ~8,192)
    lora_prefill_prompts: tuple = (64, 128, 256, 384, 512, 768, 1024)
    max_loras: int = 16
    # adapters of a LoRA launch only in the CPU cache, and as many only on disk (the loading family's)
    load_burst: int = 12
    startup_max_loras: tuple = ()
    family_budget_s: float = 120.0

    @property
    def max_batch(self) -> int:
        return max(self.decode_batches + self.lora_batches + self.lora_step_batches)

    @property
    def lora_points(self) -> int:
        """Points of one LoRA server: its decode windows and its lone prompts through an adapter."""
        return (len(self.lora_batches) * len(self.lora_distinct) + len(self.lora_step_windows)
                + len(self.lora_prefill_prompts))

    @property
    def lora_step_windows(self) -> tuple:
        """Batch sizes of the one-adapter windows beyond ``lora_batches``'."""
        return tuple(b for b in self.lora_step_batches if b not in self.lora_batches)


PLANS = {
    # <= 10 min on a GPU: 5 launches (~1-2 min each with vLLM) and ~40 short benchmarks
    "quick": Plan("quick"),
    # <= 1 h: more batch sizes and contexts, two max_loras per rank (slot share), the start-up frontier
    "full": Plan("full", decode_batches=(1, 4, 16, 32, 64, 128), decode_prompts=(32, 512, 2048), decode_out=128,
                 prefill_prompts=(128, 512, 2048, 4096, 8192), prefill_reps=5,
                 lora_batches=(16, 32, 64), lora_distinct=(1, 2, 4, 8, 16, 32), lora_step_batches=(1, 4), lora_out=96,
                 max_loras=32,
                 startup_max_loras=(8, 16, 32, 64, 128, 256), family_budget_s=900.0),
    # a smoke test of the whole pipeline (tests, the runbook's dry run)
    "smoke": Plan("smoke", decode_batches=(1, 16), decode_prompts=(32, 512), decode_out=64,
                  prefill_prompts=(256, 2048), prefill_reps=2, ranks=(8,), lora_batches=(8,), lora_step_batches=(1,),
                  lora_distinct=(1, 8), lora_out=48, lora_prefill_prompts=(256, 1024), max_loras=8, load_burst=6),
}


@dataclass
class ProbeContext:
    """What every family's rows record: the model label, the time scale, the server's flags; and the
    prompts its server accepts."""

    model: str
    speed: float
    flags: dict
    kv_tokens: float = math.nan
    prompts: PromptTokens = PromptTokens()
    kv_blocks: float = math.nan

    def row(self, family: str, label: str, status: str = "ok", **values) -> dict:
        f = self.flags
        base = {"experiment": FAMILY_PREFIX + family, "run_name": label, "model": self.model, "status": status,
                "dataset": "random", "enable_lora": int(bool(f.get("enable_lora"))),
                "max_loras": f.get("max_loras"), "max_lora_rank": f.get("max_lora_rank"),
                "max_cpu_loras": f.get("max_cpu_loras"), "max_num_seqs": f.get("max_num_seqs"),
                "max_num_batched_tokens": f.get("max_num_batched_tokens"),
                "gpu_memory_utilization": f.get("gpu_memory_utilization"),
                "gpu_kv_cache_tokens": self.kv_tokens, "gpu_kv_blocks": self.kv_blocks, "probe_family": family, "probe_speed": self.speed}
        return {**base, **values}


def _run(coro):
    return asyncio.run(coro)


async def _text(url: str, path: str) -> tuple[str, str]:
    """(the body of a 200, '') or ('', why not: the HTTP status and the server's message)."""
    status, body = await http_get(url, path)
    if status == 200:
        return body.decode(errors="replace"), ""
    return "", ("no answer" if status == 0 else f"HTTP {status}: {error_message(body)}")


def server_info(url: str) -> dict:
    """The server's /version, models (base + adapters), KV tokens (from /metrics) and the prompts it
    accepts (token ids from its /tokenize, its max_model_len)."""
    async def fetch():
        return await asyncio.gather(_text(url, "/version"), _text(url, "/v1/models"), _text(url, "/metrics"),
                                    server_prompt_tokens(url))
    (version, _), (models, models_why), (metrics, _), prompts = _run(fetch())
    try:
        data = json.loads(models)["data"]
    except (ValueError, KeyError, TypeError):
        raise InputError(f"probe: {url}/v1/models did not answer with vLLM's model list"
                         + (f" ({models_why})" if models_why else "")) from None
    base = [m["id"] for m in data if not m.get("parent")]
    adapters = [m["id"] for m in data if m.get("parent")]
    try:
        ver = json.loads(version).get("version", "")
    except (ValueError, AttributeError):
        ver = ""
    kv_blocks, block_size = kv_blocks_from_metrics(metrics)
    return {"version": ver, "base": base[0] if base else "", "adapters": adapters,
            "kv_tokens": kv_blocks * block_size, "kv_blocks": kv_blocks,
            "prompts": prompts, "max_model_len": prompts.max_model_len}


# ---- families ----------------------------------------------------------------------------------
def _noise(w: dict) -> float:
    """How far a window is from clean (<= 1: within MAX_BURST_SHARE and MAX_STREAM_SPREAD; a window
    whose steps were not resolved at all is worse than any, a failed one worst)."""
    if not w["ok"]:
        return math.inf
    if not w["step_ms"] > 0 or window_noise(w).startswith("no measurable"):
        return 1e300
    return max(w["burst_share"] / MAX_BURST_SHARE, w["stream_spread"] / MAX_STREAM_SPREAD)


def measured_window(url: str, models: list[str], b: int, p: int, out: int, speed: float, seed: int,
                    prompts: PromptTokens | None = None) -> dict:
    """One batch run's pure-decode window, repeated while it was noisy (:func:`window_noise`: tokens
    in bursts or in one read, streams disagreeing); the cleanest kept, ``noisy`` (the reason) when
    none was clean."""
    best = None
    for attempt in range(1 + RETRIES):
        w = window_step(_run(batch_run(url, models, b, p, out, seed=seed + attempt, prompts=prompts)), p, speed)
        w["attempts"] = attempt + 1
        if best is None or _noise(w) < _noise(best):
            best = w
        if w["ok"] and not window_noise(w):
            break
    best["noisy"] = window_noise(best) if best["ok"] else ""
    return best


def warm_up(url: str, models: list[str], plan: Plan, prompts: PromptTokens | None = None) -> None:
    """A first batch (vLLM compiles and captures graphs, the emulator's kernel warms up): not measured."""
    p = (prompts or PromptTokens()).longest(24, 64)
    _run(batch_run(url, models, min(8, plan.max_batch), p, 24, seed=999, prompts=prompts))


def prompt_lengths(wanted, out_tokens: int, prompts: PromptTokens) -> list[int]:
    """The plan's prompt lengths cut to what the server's max_model_len leaves for ``out_tokens``
    (lengths that become equal are measured once), in the plan's order."""
    return list(dict.fromkeys(prompts.longest(out_tokens, int(p)) for p in wanted))


def decode_family(url: str, ctx: ProbeContext, plan: Plan, model: str, tick) -> list[dict]:
    rows = []
    warm_up(url, [model], plan, ctx.prompts)
    lengths = prompt_lengths(plan.decode_prompts, plan.decode_out, ctx.prompts)
    for b in plan.decode_batches:
        for p in lengths:
            w = measured_window(url, [model], b, p, plan.decode_out, ctx.speed, seed=b * 7 + p, prompts=ctx.prompts)
            rows.append(_step_row(ctx, "decode", f"decode_b{b}_p{p}", w, b, 0, p, plan.decode_out))
            tick()
        for _ in range(len(plan.decode_prompts) - len(lengths)):
            tick()
    return rows


def _step_row(ctx: ProbeContext, family: str, label: str, w: dict, b: int, d: int, p: int, out: int) -> dict:
    if not w["ok"]:
        return ctx.row(family, label, status="failed", probe_note=w["why"], probe_batch=b,
                       probe_distinct_adapters=d, probe_prompt_tokens=p)
    status = "noisy" if w["noisy"] else "ok"       # calibrate fits "ok" rows only (w["noisy"]: the reason)
    return ctx.row(family, label, status=status, completed=b, num_prompts=b, total_input_tokens=b * p, total_output_tokens=b * out,
                   mean_itl_ms=w["step_ms"], running_mean=b, n_served_adapters=d, mean_loras_by_batch=d,
                   probe_batch=b, probe_distinct_adapters=d, probe_prompt_tokens=p,
                   probe_ctx_ktokens_mean=w["ctx_ktokens"], probe_step_ms=w["step_ms"],
                   probe_step_ms_sd=w["step_ms_sd"], probe_gaps=w["gaps"], probe_burst_share=w["burst_share"],
                   probe_attempts=w["attempts"], probe_step_ms_median=w["step_ms_median"],
                   probe_stream_spread=w["stream_spread"], probe_positive_gaps=w["positive_gaps"],
                   probe_note=f"noisy: {w['noisy']}" if w["noisy"] else "")


def prefill_family(url: str, ctx: ProbeContext, plan: Plan, model: str, tick, *, family: str = "prefill",
                   wanted: tuple | None = None) -> list[dict]:
    """TTFT of lone requests at the plan's prompt lengths (cut to the server's max_model_len); with
    ``family="ttft_lora"``, through the adapter ``model`` at ``plan.lora_prefill_prompts``."""
    rows = []
    wanted = wanted or plan.prefill_prompts
    lengths = prompt_lengths(wanted, 2, ctx.prompts)
    rank = f"r{ctx.flags.get('max_lora_rank')}_" if family == "ttft_lora" else ""
    for p in lengths:
        ttfts, note = _run(ttft_runs(url, model, p, plan.prefill_reps, ctx.speed, seed=p, prompts=ctx.prompts))
        if len(ttfts) < plan.prefill_reps:
            rows.append(ctx.row(family, f"{family}_{rank}p{p}", status="failed", probe_prompt_tokens=p,
                                probe_note=f"a request failed: {note}"))
        else:
            mean = sum(ttfts) / len(ttfts)
            rows.append(ctx.row(family, f"{family}_{rank}p{p}", status="ok" if mean > 0 else "noisy",
                                completed=len(ttfts), num_prompts=len(ttfts),
                                total_input_tokens=p * len(ttfts), total_output_tokens=2 * len(ttfts),
                                mean_ttft_ms=mean, probe_prompt_tokens=p, probe_ttft_ms=mean, probe_batch=1,
                                probe_note="" if mean > 0 else f"noisy: TTFT {mean:.3g} ms <= 0"))
        tick()
    for _ in range(len(wanted) - len(lengths)):
        tick()
    return rows


def lora_family(url: str, ctx: ProbeContext, plan: Plan, adapters: list[str], tick) -> list[dict]:
    rows = []
    warm_up(url, adapters[:1], plan, ctx.prompts)
    p = ctx.prompts.longest(plan.lora_out, plan.lora_prompt)
    for b in plan.lora_batches:
        for d in plan.lora_distinct:
            if d > len(adapters) or d > b:
                tick()
                continue
            w = measured_window(url, adapters[:d], b, p, plan.lora_out, ctx.speed, seed=d, prompts=ctx.prompts)
            rows.append(_step_row(ctx, "lora", f"lora_r{ctx.flags.get('max_lora_rank')}_b{b}_d{d}", w, b, d,
                                  p, plan.lora_out))
            tick()
    for b in plan.lora_step_windows:
        w = measured_window(url, adapters[:1], b, p, plan.lora_out, ctx.speed, seed=100 + b, prompts=ctx.prompts)
        rows.append(_step_row(ctx, "lora", f"lora_r{ctx.flags.get('max_lora_rank')}_b{b}_d1", w, b, 1, p, plan.lora_out))
        tick()
    return rows


def lora_prefill_family(url: str, ctx: ProbeContext, plan: Plan, adapter: str, tick) -> list[dict]:
    """Lone prompts through ``adapter`` (family ``ttft_lora``: what LoRA costs prefill tokens).  Run after
    the loading family: that one measures loads against the residency vLLM's start-up left."""
    return prefill_family(url, ctx, plan, adapter, tick, family="ttft_lora", wanted=plan.lora_prefill_prompts)


def loading_family(url: str, ctx: ProbeContext, slots: list[str], cpu_only: list[str], disk_only: list[str],
                   tick) -> list[dict]:
    """CPU->GPU and disk->CPU->GPU loads per adapter from lone requests cycling over adapters
    (:func:`cycle_load_ms`): ``slots`` are the adapters in the server's ``max_loras`` slots, ``cpu_only``
    the rest of its CPU cache, ``disk_only`` adapters on disk only."""
    rank = ctx.flags.get("max_lora_rank")
    r = _run(cycle_load_ms(url, load_cycles(slots, cpu_only, disk_only), ctx.speed, seed=rank or 0,
                           prompts=ctx.prompts))
    rows = []
    for kind in ("cpu", "disk"):
        label = f"load_{kind}_r{rank}"
        if not r["ok"]:
            rows.append(ctx.row("loading", label, status="failed", probe_note=r["why"], probe_load_kind=kind))
            tick()
            continue
        v = r[kind]
        k, per = v["n"], v["load_ms"]
        col = ({"adapter_loads_from_memory": k, "adapter_load_time_from_memory_s": per * k / 1000.0}
               if kind == "cpu" else
               {"adapter_loads_from_disk": k, "adapter_load_time_from_disk_s": per * k / 1000.0})
        # probe_burst: the loading requests measured; the windows: the median TTFTs, loading and not
        rows.append(ctx.row("loading", label, status="noisy" if v["noisy"] else "ok", completed=k, num_prompts=k,
                            adapter_module_ranks=rank, probe_load_kind=kind, probe_load_ms_per_adapter=per,
                            probe_burst=k, probe_cold_window_ms=v["cold_ms"], probe_warm_window_ms=v["warm_ms"],
                            probe_load_noise_ms=v["noise_ms"],
                            probe_note=f"noisy: {v['noisy']}" if v["noisy"] else "", **col))
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
    #: the vLLM release the launched server is (``--vllm-version``): its parser's refusals checked on the plan's
    #: commands before any server starts (not with ``server_cmd``, which replaces ``vllm serve``)
    vllm_version: str | None = None


def progress_bar(total: int, enabled: bool, desc: str):
    # tqdm only where a probe runs
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="point", disable=not enabled, leave=False)


def plan_points(plan: Plan, launch: bool) -> int:
    per_rank = plan.lora_points + (2 if launch else 0)
    return (len(plan.decode_batches) * len(plan.decode_prompts) + len(plan.prefill_prompts)
            + len(plan.ranks) * per_rank + len(plan.startup_max_loras))
