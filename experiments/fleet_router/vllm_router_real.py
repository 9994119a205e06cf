"""vLLM's own router (PyPI ``vllm-router`` 0.1.17, a Rust binary) in front of K *real* vLLM instances --
the CPU build of vLLM 0.32 (the real-vLLM tier) serving the tier's probe-size model and four of its PEFT
adapters (ranks 8 and 16) -- vs the fleet twin with the CPU profile fitted to exactly that server
(``configs/profiles/probe-llama-cpu-vllm032.yaml``), on one light open-loop stream per policy.

    bash tools/vllm_tier/build.sh && LORA_OPT_VLLM_TIER_PROBE=1 bash tools/vllm_tier/build.sh
    # vllm-router 0.1.17: the tier's own (build.sh installs it in TIER/router-venv), or --router-bin /
    # $VLLM_ROUTER_BIN / on PATH (pip install vllm-router==0.1.17 in any venv)
    python experiments/fleet_router/vllm_router_real.py [--duration-s 90] [--rate 0.5]

The sibling of ``vllm_router.py`` (which puts the router in front of emulated instances and explains what
vllm-router 0.1.17 does per policy); what both share is ``router_common.py``.  The K instances start once (instance i's
forward passes bound to core i: ``VLLM_CPU_OMP_THREADS_BIND``; block size 128, ``--max-model-len 2048``,
``--enforce-eager``, no prefix caching: the settings of ``experiments/real_validation/cpu_loop.py``), are
warmed (each adapter once on each instance), and serve every policy in turn: per policy a fresh
``vllm-router --policy P`` in front of them, the stream sent to the router (``consistent_hash``: the
adapter id in ``X-Session-ID``; its adapter -> instance map probed first, one request per adapter), each
instance's served requests read from its ``vllm:request_success_total``.  Twin columns as in
``vllm_router.py``: ``twin (same policy)`` and ``twin (as routed)``.

Numbers are a 2-core CPU's (vLLM 0.32's CPU build, probe-size model with random weights, both engines and
the client on 2 cores), never an H100's.  The CPU profile's latencies are already 20-30 % off this server
on one instance (experiments/real_validation/cpu/REPORT.md): the shares are the check here; the latencies
are indicative.  Writes experiments/fleet_router/real/ (results.json, report.md).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from router_common import (POLICIES, SESSION_HEADER, VERSION, command_line, hash_map_lines, log_results, parse_args,
                           prepare_out, probe_hash_map, served, side_rows, start_router, stop, stream, twin)

from lora_opt.emulate.client import replay, summarise
from lora_opt.emulate.fleet import free_ports
from lora_opt.probe.launch import LaunchedServer, ServeCommand
from lora_opt.tracking import tracked_run


def load_by_path(name: str, path: Path):
    """A script of another experiments/ folder as a module, by its path (experiments/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the real server's tier and environment: the loop's (experiments/real_validation/cpu_tier.py), one owner
_tier = load_by_path("real_validation_cpu_tier", Path(__file__).resolve().parents[1] / "real_validation" / "cpu_tier.py")
tier_dir, load_probe_tier, server_env = _tier.tier_dir, _tier.load_probe_tier, _tier.server_env
OUT = Path(__file__).resolve().parent / "real"
PROFILE = "probe-llama-cpu-vllm032"
#: served name -> the tier's probe-size adapter (two of rank 8, two of rank 16)
ADAPTERS = [("a8", "r8-a"), ("b8", "r8-b"), ("a16", "r16-a"), ("b16", "r16-b")]
ENGINE = {"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4, "max_num_seqs": 64,
          "max_num_batched_tokens": 2048, "max_model_len": 2048}
LENGTHS = {"source": "normal", "mean_in": 192, "std_in": 48, "mean_out": 64, "std_out": 16}
HEALTH_TIMEOUT_S = 600.0


def serve_command(tier: dict, port: int, core: int) -> ServeCommand:
    """Instance ``core``'s ``vllm serve``: the tier's venv, forward passes bound to ``core``, 1 GiB of KV."""
    env = server_env(core)
    options = {"--served-model-name": [tier["served_model_name"]], "--host": ["127.0.0.1"], "--port": [str(port)],
               "--max-model-len": [str(ENGINE["max_model_len"])], "--max-num-seqs": [str(ENGINE["max_num_seqs"])],
               "--max-num-batched-tokens": [str(ENGINE["max_num_batched_tokens"])], "--enforce-eager": [],
               "--dtype": ["bfloat16"], "--block-size": ["128"], "--no-enable-prefix-caching": [],
               "--enable-lora": [], "--max-loras": [str(ENGINE["max_loras"])],
               "--max-lora-rank": [str(ENGINE["max_lora_rank"])], "--max-cpu-loras": [str(ENGINE["max_cpu_loras"])],
               "--lora-modules": [f"{aid}={tier['adapters'][src]['path']}" for aid, src in ADAPTERS]}
    return ServeCommand(env, tier["model"], options)


def launch_fleet(tier: dict, k: int, logs: Path) -> list[LaunchedServer]:
    """K real servers started together (instance i on core i mod the cores), each healthy or an error;
    the caller stops them (also those started when another failed)."""
    cores = sorted(os.sched_getaffinity(0))
    base = free_ports(k)
    servers = [LaunchedServer(serve_command(tier, base + i, cores[i % len(cores)]), server_cmd=None,
                              log_path=logs / f"vllm-{i}.log", health_timeout_s=HEALTH_TIMEOUT_S) for i in range(k)]
    with ThreadPoolExecutor(k) as pool:
        ok = list(pool.map(lambda s: s.start(), servers))
    for i, (s, good) in enumerate(zip(servers, ok)):
        if not good:
            for t in servers:
                t.stop()
            raise RuntimeError(f"real vLLM {i} did not start (exit {s.exit_code}): {s.log_tail(15)}")
    return servers


def warm(urls: list[str], ids: list[str]) -> None:
    """Each adapter once on each instance (the first request of an adapter loads it into a slot)."""
    import httpx
    with httpx.Client(timeout=300, trust_env=False) as c:
        for u in urls:
            for a in ids:
                c.post(u + "/v1/completions", json={"model": a, "prompt": [1] * 16, "max_tokens": 4,
                                                   "ignore_eos": True}).raise_for_status()


def instance_scenario(rate: float, duration_s: float, seed: int) -> dict:
    """One instance: the four adapters at ``rate`` req/s in all, the CPU profile, normal lengths."""
    return {"profile": PROFILE, "engine": dict(ENGINE),
            "adapters": [{"id": aid, "count": 1, "rank": int(src[1:].split("-")[0]), "rate": rate / len(ADAPTERS)}
                         for aid, src in ADAPTERS],
            "lengths": dict(LENGTHS), "duration_s": duration_s, "seed": seed}


def run_policy(a, policy: str, urls: list[str], one, req, ids: list[str]) -> dict:
    port = free_ports(1)
    router = f"http://127.0.0.1:{port}"
    hash_map = None
    vr = start_router(a.router_bin, port, urls, policy, a.logs / f"router_{policy}.log")
    try:
        if policy == "consistent_hash":
            hash_map = probe_hash_map(router, urls, ids)
        before = served(urls)
        t0 = time.time()
        records = asyncio.run(replay(router, req, ids, 1.0, count_token_ids=True,
                                     session_header=SESSION_HEADER if policy == "consistent_hash" else None))
        wall = time.time() - t0
        counts = served(urls) - before
    finally:
        stop(vr)
    got = summarise(records, 1.0, a.duration_s)
    late = sorted(max(0.0, (r.sent - r.due) * 1000) for r in records)
    measured = {"throughput_tok_s": got.throughput_tok_s, "ttft_mean_ms": got.ttft_mean_ms,
                "itl_mean_ms": got.itl_mean_ms, "shares": (counts / max(1, counts.sum())).round(4).tolist(),
                "served": counts.tolist(), "requests": len(records), "ok": sum(r.status == 200 for r in records),
                "errors": got.errors, "send_late_mean_ms": sum(late) / max(1, len(late)),
                "send_late_p99_ms": got.send_late_p99_ms, "send_late_max_ms": late[-1] if late else 0.0,
                "wall_s": wall}
    same = twin(one, req, ids, a.instances, a.seed, POLICIES[policy])
    if policy == "round_robin":
        as_routed = same
    elif policy == "power_of_two":              # every load reads 0 in front of vLLM: uniform random
        as_routed = twin(one, req, ids, a.instances, a.seed, "static")
    else:
        as_routed = twin(one, req, ids, a.instances, a.seed, "static",
                         routes={k: [(hash_map[aid], 1.0)] for k, aid in enumerate(ids)})
    return {"policy": policy, "twin_policy": POLICIES[policy], "vllm_router": measured, "twin_same_policy": same,
            "twin_as_routed": as_routed, "hash_map": hash_map}


def report(results: list[dict], a, command: str, n: int) -> str:
    lines = [f"# vLLM's router (vllm-router {VERSION}) in front of {a.instances} real CPU vLLM instances vs the fleet twin",
             "", f"Command: `{command}`", "",
             f"Real servers: vLLM 0.32's CPU build (the real-vLLM tier), the tier's probe-size model (hidden 1024, "
             f"4 layers, random weights) with 4 PEFT adapters (ranks 8, 8, 16, 16) on each instance, {a.instances} "
             "instances on a 2-core machine (instance i's forward passes on core i; their front ends, the router "
             f"and the client share the same 2 cores). One open-loop Poisson stream per policy: {n} requests over "
             f"{a.duration_s:g} s ({a.rate:g} req/s in all; prompts ~192, outputs ~64 tokens; seed {a.seed}). "
             f"Twin: the fleet twin with `{PROFILE}` (the profile fitted to this server), the same requests.", "",
             "**Read the shares first.** The CPU profile's latencies are already 20-30 % off this server on one "
             "instance (experiments/real_validation/cpu/REPORT.md), and here two engines and their front ends "
             "share two cores: the latency columns are indicative, not a test of the twin.", "",
             "| vllm-router policy | side | shares | throughput (tok/s) | mean TTFT (ms) | mean ITL (ms) | TTFT / vllm-router |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += side_rows(results)
    lines += ["", "| policy | requests sent / answered 200 / errors | served per instance | client send late, mean / p99 / max (ms) |",
              "|---|---|---|---|"]
    for r in results:
        m = r["vllm_router"]
        lines.append(f"| `{r['policy']}` | {m['requests']} / {m['ok']} / {m['errors']} | "
                     f"{' / '.join(str(c) for c in m['served'])} | {m['send_late_mean_ms']:.1f} / "
                     f"{m['send_late_p99_ms']:.1f} / {m['send_late_max_ms']:.1f} |")
    lines += ["", "What vllm-router 0.1.17 does per policy in front of vLLM (see ../report.md): `round_robin` a "
              "counter over requests; `power_of_two` uniformly random (its load signal is SGLang's `/get_load`, "
              "which vLLM does not serve); `consistent_hash` its own ring over the worker URLs, keyed by "
              "`X-Session-ID` (\"twin as routed\" = the map it chose, probed before the stream). `power_of_two` "
              "draws are vllm-router's own (unseeded): its shares are one draw, not the twin's.", ""]
    return "\n".join(lines + hash_map_lines(results)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=90.0, help="wall seconds of each policy's stream")
    ap.add_argument("--rate", type=float, default=0.5, help="the stream's total rate (req/s, all instances)")
    tier_router = tier_dir() / "router-venv" / "bin" / "vllm-router"
    a = parse_args(ap, os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router")
                   or (str(tier_router) if tier_router.exists() else None),
                   "the vllm-router executable (default: $VLLM_ROUTER_BIN, else on PATH, else the tier's)", OUT)
    tier = load_probe_tier()
    prepare_out(a, "fleet_router_real_")
    one, req, ids = stream(instance_scenario(a.rate / a.instances, a.duration_s, a.seed),
                           instance_scenario(a.rate, a.duration_s, a.seed))
    command = command_line("vllm_router_real.py")
    t0 = time.time()
    with tracked_run("fleet-router", run_name=f"vllm-router-{VERSION}-real-k{a.instances}",
                     tracking_uri=a.tracking_uri, track=not a.no_track):
        servers = launch_fleet(tier, a.instances, a.logs)
        try:
            urls = [f"http://127.0.0.1:{s.cmd.port}" for s in servers]
            warm(urls, ids)
            results = [run_policy(a, p, urls, one, req, ids) for p in a.policies]
        finally:
            for s in servers:
                s.stop()
        (a.out / "results.json").write_text(json.dumps({
            "vllm_router_version": VERSION, "vllm": "0.32.0 (vllm-cpu)", "model": tier["served_model_name"],
            "profile": PROFILE, "instances": a.instances, "duration_s": a.duration_s, "rate": a.rate, "seed": a.seed,
            "requests": len(req), "command": command, "wall_s": time.time() - t0, "results": results}, indent=1))
        (a.out / "report.md").write_text(report(results, a, command, len(req)))
        if not a.no_track:
            log_results(a, results, {"instances": a.instances, "duration_s": a.duration_s, "rate": a.rate, "real": True})
    print((a.out / "report.md").read_text())


if __name__ == "__main__":
    main()
