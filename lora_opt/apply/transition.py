"""A transition measured: the new demand's traffic (``lora-opt evaluate``'s requests of the
workload) replayed through the router while :class:`~lora_opt.apply.executor.PlanExecutor`
carries out the plan; every request classed by when it was sent -- ``before`` the first step,
``during`` the steps, ``after`` the last -- and judged as ``lora-opt validate`` judges requests
(``lora_opt.validate.measure``: vllm bench serve's success rule, TTFT in simulated ms).

A request of an adapter no instance serves yet (new to the workload, before its route step) is
``held``: not sent, counted apart -- a gateway has no such model until the switch, which is the
plan's order, not a failure.  The verdict: no failed request, and the p99 TTFT of the requests
sent during the steps within the bound every intermediate state was judged against on the twin
(``plan["slo"]``)."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np

from lora_opt.apply.executor import SUCCESS, PlanExecutor
from lora_opt.emulate.client import replay_routed, server_prompt_tokens
from lora_opt.errors import InputError
from lora_opt.http_pool import instance_client
from lora_opt.placement.evaluate import workload_requests
from lora_opt.validate.measure import request_rows
from twin.workload import Requests

#: the error a held request is recorded with
HELD = "held: no instance serves its adapter yet (new to the workload; its route step comes later)"
#: the windows requests are classed in, by send time
WINDOWS = ("before", "during", "after")
#: the p99 TTFT bound when the plan does not say (greedy-plus's default)
DEFAULT_TTFT_P99_S = 5.0


@dataclass(frozen=True)
class TrafficOptions:
    """The traffic that flows while the plan runs."""

    speed: float = 1.0
    """Simulated seconds per wall second (the emulated fleet's ``--speed``; 1 against real vLLM)."""
    start_after_s: float = 30.0
    """Simulated seconds of traffic before the first step (the ``before`` window)."""
    duration_s: float | None = None
    """Simulated seconds of traffic in all (default: the workload's evaluation duration)."""


def _cut(req: Requests, end_s: float) -> Requests:
    """The requests arriving before ``end_s``."""
    keep = req.arrival < end_s
    return Requests(req.arrival[keep], req.adapter[keep], req.in_len[keep], req.out_len[keep])


def windows(rows: list[dict], steps_start_s: float, steps_end_s: float) -> dict:
    """Per window: requests sent (held ones apart), ok, failed, unfinished, TTFT mean/p50/p99/max
    (simulated ms, ok requests); ``*_s``: the windows' bounds in simulated seconds."""
    out = {}
    for w in WINDOWS:
        rs = [r for r in rows if r["window"] == w]
        ttft = np.array([r["ttft_ms"] for r in rs if r["status"] == "ok"], float)
        out[w] = {"requests": sum(r["status"] != "held" for r in rs),
                  **{k: sum(r["status"] == k for r in rs) for k in ("ok", "failed", "unfinished", "held")},
                  "ttft_mean_ms": float(ttft.mean()) if ttft.size else math.nan,
                  "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft.size else math.nan,
                  "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft.size else math.nan,
                  "ttft_max_ms": float(ttft.max()) if ttft.size else math.nan}
    out["steps_start_s"], out["steps_end_s"] = steps_start_s, steps_end_s
    return out


def class_rows(rows: list[dict], records, steps_start_s: float, steps_end_s: float) -> list[dict]:
    """``rows`` (``request_rows``) with ``window`` and held requests marked ``held``."""
    for row, r in zip(rows, records):
        if r.error == HELD:
            row["status"], row["error"] = "held", ""
        t = row["sent_s"]
        row["window"] = "before" if t < steps_start_s else "during" if t <= steps_end_s else "after"
    return rows


def verdict(win: dict, steps: list, slo_ttft_p99_s: float, starving_at_start: list) -> dict:
    """ok when every step ran (a stop left to the operator counts), no request failed, and the p99
    TTFT during the steps is within the bound -- the bound applies when the twin judged every state
    of the transition ok, the first one included: when the new demand already overloads the
    running placement (``starving_at_start``), the twin predicted a queue there, not the bound."""
    failed = sum(win[w]["failed"] for w in WINDOWS)
    p99 = win["during"]["ttft_p99_ms"]
    steps_ok = all(s.status in SUCCESS for s in steps)
    bound_applies = not starving_at_start
    sent_during = win["during"]["requests"]
    # no request sent while the steps ran (a plan found in effect takes milliseconds): nothing to bound
    ttft_ok = sent_during == 0 if math.isnan(p99) else p99 <= 1000.0 * slo_ttft_p99_s
    return {"ok": steps_ok and failed == 0 and (ttft_ok or not bound_applies), "steps_ok": steps_ok,
            "requests_during": sent_during,
            "failed_requests": failed, "ttft_p99_during_ms": p99, "slo_ttft_p99_ms": 1000.0 * slo_ttft_p99_s,
            "ttft_within_slo": ttft_ok, "slo_applies": bound_applies, "starving_at_start": list(starving_at_start)}


async def measure(ex: PlanExecutor, wl, router_url: str, traffic: TrafficOptions, *, on_step=None) -> dict:
    """Replay ``wl``'s traffic through ``router_url`` and run the plan after ``start_after_s``;
    returns {rows, steps, windows, verdict, info}.  The executor's launched servers are left
    running (the caller stops them: :meth:`PlanExecutor.close`)."""
    T = traffic.duration_s or wl.evaluation.duration_s
    if not 0 < traffic.start_after_s < T:
        raise InputError(f"--start-after-s: must be in (0, {T:g}) (the traffic's duration), got {traffic.start_after_s:g}")
    mml = min(g.max_model_len for g in ex.placement.gpus)
    req = workload_requests(wl, mml)
    req = _cut(req, T)
    models = [a.id for a in wl.adapters]
    target = np.zeros(len(req), np.int64)
    async with instance_client() as client:
        await ex.preflight(client)
        running = ex.running_urls()
        prompts = await server_prompt_tokens(running[0]) if running else None
        started = asyncio.Event()

        def on_start(t0: float) -> None:
            ex.t0 = t0
            started.set()

        def admit(k: int):
            return None if models[int(req.adapter[k])] in ex.routed else HELD

        replay = asyncio.ensure_future(replay_routed([router_url], req, target, models, traffic.speed, end_s=T,
                                                     on_start=on_start, admit=admit, prompts=prompts))
        await started.wait()
        await asyncio.sleep(max(0.0, ex.t0 + traffic.start_after_s / traffic.speed - time.perf_counter()))
        steps = await ex.run(client, on_step=on_step)
        records = await replay
    speed = traffic.speed
    ran = [s for s in steps if not math.isnan(s.started_s)]
    start_s = (ran[0].started_s if ran else traffic.start_after_s / speed) * speed
    end_s = (ran[-1].ended_s if ran else traffic.start_after_s / speed) * speed
    rows = class_rows(request_rows(records, req, target, [router_url], models, speed), records, start_s, end_s)
    win = windows(rows, start_s, end_s)
    slo = float((ex.plan.get("slo") or {}).get("ttft_p99_s") or DEFAULT_TTFT_P99_S)
    info = {"requests": len(req), "duration_s": T, "speed": speed, "start_after_s": traffic.start_after_s,
            "router": router_url, "prompt_tokens": prompts.source if prompts is not None else "",
            "plan_outlasted_traffic": bool(ran and ran[-1].ended_s * speed > T)}
    return {"rows": rows, "steps": steps, "windows": win, "info": info,
            "verdict": verdict(win, steps, slo, ex.plan.get("starving_at_start") or [])}
