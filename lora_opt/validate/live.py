"""Talking to live endpoints: which GPU is which URL, the open-loop replay (``lora_opt.emulate.
client``'s raw-HTTP client), each endpoint's ``/version`` and its ``/metrics`` scraped every few
simulated seconds (running, waiting, KV usage, LoRA info, preemptions; vLLM V1 names, V0's
``gpu_cache_usage_perc`` accepted)."""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from lora_opt.emulate.client import PromptTokens, Record, replay_routed, server_prompt_tokens, split_url
from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement
from twin.parsing import read_config_file

#: the metric names kept from a scrape (everything else is dropped on arrival)
SCRAPED = (b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc",
           b"vllm:gpu_cache_usage_perc", b"vllm:lora_requests_info", b"vllm:num_preemptions_total",
           b"vllm:prompt_tokens_total", b"vllm:generation_tokens_total")
#: the scraped time series' columns
SERIES_COLUMNS = ("time_s", "gpu", "running", "waiting", "kv_usage", "running_loras", "waiting_loras", "max_lora",
                  "preemptions_total", "prompt_tokens_total", "generation_tokens_total")


def resolve_endpoints(p: Placement, endpoints: list[str]) -> dict[int, str]:
    """GPU index -> endpoint URL: from a ``router.json`` (adapter -> [{endpoint, weight}], entries in
    the placement's route order), or URLs, one per GPU of the placement or one per GPU it uses,
    in GPU order.  Every used GPU must get one."""
    used = [g for g, on in enumerate(p.by_gpu()) if on]
    if len(endpoints) == 1 and not endpoints[0].startswith(("http://", "https://")):
        path = Path(endpoints[0])
        if not path.is_file():
            raise InputError(f"--endpoints: {path} is neither a URL nor a router.json file")
        table = read_config_file(path, f"--endpoints {path}", InputError)
        if not isinstance(table, dict):
            raise InputError(f"--endpoints {path}: expected adapter -> [{{endpoint, weight}}]")
        out: dict[int, str] = {}
        for aid, routes in p.routes.items():
            entries = table.get(aid) or []
            if not isinstance(entries, list) or len(entries) != len(routes):
                raise InputError(f"--endpoints {path}: adapter {aid!r} has {len(entries) if isinstance(entries, list) else 0} "
                                 f"endpoints, the placement routes it to {len(routes)} GPUs")
            for (g, _), e in zip(routes, entries):
                url = e.get("endpoint") if isinstance(e, dict) else None
                if not isinstance(url, str):
                    raise InputError(f"--endpoints {path}: adapter {aid!r}: an entry without an endpoint URL")
                if out.setdefault(g, url) != url:
                    raise InputError(f"--endpoints {path}: GPU {g} has two endpoints ({out[g]}, {url})")
    elif len(endpoints) == len(p.gpus):
        out = dict(enumerate(endpoints))
    elif len(endpoints) == len(used):
        out = dict(zip(used, endpoints))
    else:
        raise InputError(f"--endpoints: {len(endpoints)} URLs for a placement of {len(p.gpus)} GPUs "
                         f"({len(used)} used): give one per GPU, or one per used GPU, in GPU order")
    for g, url in out.items():
        u = urlparse(url)
        if u.scheme != "http" or not u.hostname:
            raise InputError(f"--endpoints: {url!r}: expected http://HOST:PORT[/v1] (https is not supported)")
        try:
            u.port
        except ValueError:
            raise InputError(f"--endpoints: {url!r}: bad port") from None
    missing = [g for g in used if g not in out]
    if missing:
        raise InputError(f"--endpoints: no endpoint for GPU(s) {missing} of the placement")
    return out


async def http_get(url: str, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """A small GET (``/version``, ``/metrics``): (status, body); (0, b"") when unreachable.  httpx
    here (a few requests a minute); the streaming client stays raw HTTP (lora_opt.emulate.client)."""
    import httpx  # only when validating: keeps the CLI's start-up light

    host, port, root = split_url(url)
    try:
        # trust_env=False: never route the endpoints through a proxy from the environment
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            r = await client.get(f"http://{host}:{port}{root}{path}")
    except (httpx.HTTPError, OSError, ValueError):
        return 0, b""
    return r.status_code, r.content


def endpoint_versions(urls: dict[int, str]) -> dict[int, str]:
    """GPU -> the endpoint's ``/version`` (vLLM's ``{"version": ...}``), or ``unreachable``."""
    async def one(url):
        status, body = await http_get(url, "/version")
        if status != 200:
            return "unreachable" if status == 0 else f"HTTP {status}"
        try:
            return str(json.loads(body).get("version", "?"))
        except (ValueError, AttributeError):
            return "?"

    async def all_():
        return await asyncio.gather(*(one(u) for u in urls.values()))
    return dict(zip(urls, asyncio.run(all_())))


def endpoint_prompt_tokens(urls: dict[int, str]) -> dict[int, PromptTokens]:
    """GPU -> what its endpoint accepts as a prompt (:func:`lora_opt.emulate.client.server_prompt_tokens`:
    token ids of its own ``/tokenize``, its ``max_model_len`` from ``/v1/models``)."""
    async def all_():
        return await asyncio.gather(*(server_prompt_tokens(u) for u in urls.values()))
    return dict(zip(urls, asyncio.run(all_())))


def emulator_lags(urls: dict[int, str]) -> dict[int, dict]:
    """GPU -> an emulated endpoint's own lateness (``GET /emulator/stats``, wall ms): ``lag_ms``
    (its steps behind its clock) and ``first_token_late_ms`` (streamed first tokens after their due
    time: what a client's TTFT takes from the machine); endpoints without that route (vLLM) are
    left out."""
    async def one(url):
        status, body = await http_get(url, "/emulator/stats")
        if status != 200:
            return None
        try:
            stats = json.loads(body)
        except ValueError:
            return None
        if not isinstance(stats, dict) or not isinstance(stats.get("lag_ms"), dict):
            return None
        return {"lag_ms": stats["lag_ms"], "first_token_late_ms": stats.get("first_token_late_ms", {})}

    async def all_():
        return await asyncio.gather(*(one(u) for u in urls.values()))
    return {g: lag for g, lag in zip(urls, asyncio.run(all_())) if lag is not None}


def send_lateness_ms(records: list[Record]) -> dict:
    """How late the client sent the requests it sent (wall ms after ``arrival / speed``): mean,
    p50, p99, max.  ``vllm bench serve`` times a request from its own send too, so a late send is
    not in TTFT; it shifts the request's arrival at the server instead."""
    late = np.array([r.sent - r.due for r in records if r.sent > 0 or r.status], float) * 1000.0
    if not late.size:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"mean": float(late.mean()), "p50": float(np.percentile(late, 50)), "p99": float(np.percentile(late, 99)),
            "max": float(late.max())}


@dataclass
class Scrapes:
    """Raw scrapes: per GPU, (simulated time, the kept metric lines)."""

    raw: dict[int, list] = field(default_factory=dict)


async def _scrape_loop(urls: dict[int, str], every_wall_s: float, speed: float, t0: list, out: Scrapes,
                       stop: asyncio.Event) -> None:
    async def one(g, url):
        status, body = await http_get(url, "/metrics")
        if status == 200 and t0:
            lines = [ln for ln in body.split(b"\n") if ln.startswith(SCRAPED)]
            out.raw.setdefault(g, []).append(((time.perf_counter() - t0[0]) * speed, lines))
    while not stop.is_set():
        await asyncio.gather(*(one(g, u) for g, u in urls.items()))
        try:
            await asyncio.wait_for(stop.wait(), every_wall_s)
        except asyncio.TimeoutError:
            pass


_LABEL = re.compile(rb'(\w+)="([^"]*)"')


def parse_scrape(lines: list) -> dict:
    """One scrape's kept lines -> the ``SERIES_COLUMNS`` values (sums over engines)."""
    v = {"running": 0.0, "waiting": 0.0, "kv_usage": math.nan, "running_loras": math.nan, "waiting_loras": math.nan,
         "max_lora": math.nan, "preemptions_total": 0.0, "prompt_tokens_total": 0.0, "generation_tokens_total": 0.0}
    lora_ts = -1.0
    for ln in lines:
        name = ln.split(b"{", 1)[0].split(b" ", 1)[0]
        try:
            value = float(ln.rsplit(b" ", 1)[-1])
        except ValueError:
            continue
        key = {b"vllm:num_requests_running": "running", b"vllm:num_requests_waiting": "waiting",
               b"vllm:num_preemptions_total": "preemptions_total", b"vllm:prompt_tokens_total": "prompt_tokens_total",
               b"vllm:generation_tokens_total": "generation_tokens_total"}.get(name)
        if key:
            v[key] += value
        elif name in (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"):
            v["kv_usage"] = value if math.isnan(v["kv_usage"]) else v["kv_usage"] + value
        elif name == b"vllm:lora_requests_info" and value >= lora_ts:   # the latest series
            lora_ts = value
            labels = dict(_LABEL.findall(ln))
            for col, lab in (("running_loras", b"running_lora_adapters"), ("waiting_loras", b"waiting_lora_adapters")):
                v[col] = float(len([a for a in labels.get(lab, b"").split(b",") if a]))
            try:
                v["max_lora"] = float(labels.get(b"max_lora", b"nan"))
            except ValueError:
                pass
    return v


def series_rows(scrapes: Scrapes) -> list[dict]:
    """The time series: one row per (scrape, GPU), ``SERIES_COLUMNS``."""
    rows = []
    for g in sorted(scrapes.raw):
        for t, lines in scrapes.raw[g]:
            rows.append({"time_s": t, "gpu": g, **parse_scrape(lines)})
    return rows


def replay_and_scrape(urls: dict[int, str], req, target: np.ndarray, models: list[str], *, speed: float,
                      end_s: float, scrape_s: float,
                      prompts: PromptTokens | None = None) -> tuple[list[Record], Scrapes, bool]:
    """Replay the requests against the endpoints while scraping them (``prompts``: the token ids the
    prompts are drawn from, default :func:`lora_opt.emulate.client.prompt_ids`'s range); Ctrl-C
    (SIGINT) stops the replay and keeps what was measured.  (records, scrapes, interrupted)."""
    import signal

    gpus = sorted(urls)
    url_list = [urls[g] for g in gpus]
    index = {g: i for i, g in enumerate(gpus)}
    local = np.array([index.get(int(g), -1) for g in target], np.int64)
    scrapes = Scrapes()
    interrupted = [False]

    async def main():
        stop, scrape_stop = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_sigint():
            interrupted[0] = True
            stop.set()
        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):     # not the main thread
            pass
        t0: list = []
        scraper = asyncio.ensure_future(_scrape_loop(urls, scrape_s / speed, speed, t0, scrapes, scrape_stop))
        try:
            records = await replay_routed(url_list, req, local, models, speed, end_s=end_s, stop=stop,
                                          on_start=t0.append, prompts=prompts)
        finally:
            scrape_stop.set()
            await scraper
            try:
                loop.remove_signal_handler(signal.SIGINT)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        return records
    records = asyncio.run(main())
    return records, scrapes, interrupted[0]
