"""vLLM's own router (PyPI ``vllm-router`` 0.1.17, a Rust binary) in front of K emulated vLLM
instances vs the fleet twin's same policy, on one open-loop stream: each instance's share of the
requests, throughput, mean TTFT and mean ITL (tracked in MLflow).

    pip install 'lora-opt[router]'          # or: pip install vllm-router==0.1.17 (any venv; --router-bin)
    python experiments/fleet_router/vllm_router.py [--instances 3] [--duration-s 60] [--speed 2]

For each of vllm-router's ``round_robin``, ``power_of_two`` and ``consistent_hash``: ``lora-opt emulate
--scenario S --instances K`` (no front of its own), ``vllm-router --worker-urls ... --policy P`` on
127.0.0.1, the stream sent to the router by the open-loop client (``lora_opt.emulate.client.replay``;
``consistent_hash``: the adapter id in ``X-Session-ID``, the first key the router hashes), each
instance's served requests read from its ``vllm:request_success_total``.  Twin columns:

* ``twin (same policy)``: ``twin.fleet.simulate_fleet`` with the policy of the same name;
* ``twin (as routed)``: the fleet twin with what vllm-router 0.1.17 was seen to do in front of
  vLLM-compatible workers -- ``round_robin``: the same; ``power_of_two``: uniform random (its load
  signal is the SGLang endpoint ``GET /get_load``, polled every 5 s, which vLLM does not serve, plus
  a local counter it increments for ``cache_aware`` only: every load reads 0, the first of two
  random workers wins); ``consistent_hash``: the adapter -> instance map the router chose (probed
  before the run, one request per adapter), as a static route table.

Writes experiments/fleet_router/ (results.json, report.md; the routers' logs go to a temporary directory).  Reproducible up to vllm-router's own
unseeded draws (``power_of_two``) and the machine's timing (client send lateness and engine lag are
reported).  Runs with lora-opt installed (``pip install -e .``): it imports the installed package.
"""
import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml
from router_common import (POLICIES, SESSION_HEADER, VERSION, command_line, hash_map_lines, log_results, parse_args,
                           prepare_out, probe_hash_map, served, side_rows, start_router, stop, stream, twin)

from lora_opt.emulate.client import replay, summarise
from lora_opt.emulate.fleet import free_ports
from lora_opt.tracking import tracked_run

OUT = Path(__file__).resolve().parent


def instance_scenario(duration_s: float) -> dict:
    """One instance: 10 adapters (ranks 8 and 16) over 2 LoRA slots and 8 sequences, 7 req/s -- a
    queue (mean TTFT ~1 s), so a router's choices show in the latencies."""
    return {"profile": "llama-3.1-8b-h100-64gb",
            "engine": {"max_loras": 2, "max_lora_rank": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512},
            "adapters": [{"count": 6, "rank": 8, "rate": 0.5}, {"count": 4, "rank": 16, "rate": 1.0}],
            "lengths": {"source": "mean", "mean_in": 200, "mean_out": 40}, "duration_s": duration_s, "seed": 1}


def start_emulator(scenario: Path, base: int, k: int, speed: float, seed: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", "--scenario", str(scenario),
                             "--instances", str(k), "--port", str(base), "--speed", str(speed), "--seed", str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"emulator exited: {proc.wait()} {proc.stderr.read()}")


def stats(urls: list[str]) -> float:
    """The instances' worst engine lag p99 (wall ms)."""
    import httpx
    with httpx.Client(timeout=10, trust_env=False) as c:
        return max(c.get(u + "/emulator/stats").json()["lag_ms"]["p99"] for u in urls)


def warm_up(scenario: Path, a, model: str) -> None:
    """One throwaway emulator and a request to each instance: the first fleet of a fresh machine
    (cold file cache, the kernel's compiled functions loaded on first use) stepped late by up to
    1.5 s at p99 when it went first."""
    import httpx
    base = free_ports(a.instances)
    emu = start_emulator(scenario, base, a.instances, a.speed, a.seed)
    try:
        with httpx.Client(timeout=60, trust_env=False) as c:
            for i in range(a.instances):
                c.post(f"http://127.0.0.1:{base + i}/v1/completions",
                       json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}).raise_for_status()
    finally:
        stop(emu)


def run_policy(a, policy: str, scenario: Path, one, req, ids: list[str]) -> dict:
    base = free_ports(a.instances)
    port = free_ports(1)
    while base <= port < base + a.instances:
        port = free_ports(1)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(a.instances)]
    router = f"http://127.0.0.1:{port}"
    hash_map = None
    if policy == "consistent_hash":          # the router's own ring, probed on a fleet of its own
        emu = start_emulator(scenario, base, a.instances, a.speed, a.seed)
        try:
            vr = start_router(a.router_bin, port, urls, policy, a.logs / f"router_{policy}_probe.log")
            try:
                hash_map = probe_hash_map(router, urls, ids)
            finally:
                stop(vr)
        finally:
            stop(emu)
    emu = start_emulator(scenario, base, a.instances, a.speed, a.seed)
    try:
        vr = start_router(a.router_bin, port, urls, policy, a.logs / f"router_{policy}.log")
        try:
            before = served(urls)
            records = asyncio.run(replay(router, req, ids, a.speed,
                                         session_header=SESSION_HEADER if policy == "consistent_hash" else None))
            counts = served(urls) - before
            lag = stats(urls)
        finally:
            stop(vr)
    finally:
        stop(emu)
    got = summarise(records, a.speed, a.duration_s)
    measured = {"throughput_tok_s": got.throughput_tok_s, "ttft_mean_ms": got.ttft_mean_ms,
                "itl_mean_ms": got.itl_mean_ms, "shares": (counts / max(1, counts.sum())).round(4).tolist(),
                "requests": int(counts.sum()), "errors": got.errors, "send_late_p99_ms": got.send_late_p99_ms,
                "engine_lag_p99_ms": lag}
    same = twin(one, req, ids, a.instances, a.seed, POLICIES[policy])
    if policy == "round_robin":
        as_routed = same
    elif policy == "power_of_two":              # every load reads 0: uniform random
        as_routed = twin(one, req, ids, a.instances, a.seed, "static")
    else:
        as_routed = twin(one, req, ids, a.instances, a.seed, "static",
                         routes={k: [(hash_map[aid], 1.0)] for k, aid in enumerate(ids)})
    return {"policy": policy, "twin_policy": POLICIES[policy], "vllm_router": measured, "twin_same_policy": same,
            "twin_as_routed": as_routed, "hash_map": hash_map}


def report(results: list[dict], a, command: str) -> str:
    lines = [f"# vLLM's router (vllm-router {VERSION}) in front of {a.instances} emulated instances vs the fleet twin",
             "", f"Command: `{command}`", "",
             f"One open-loop stream ({results[0]['vllm_router']['requests'] if results else 0} requests, "
             f"{a.duration_s:g} simulated s at speed {a.speed:g}; seed {a.seed}); latencies in simulated ms; "
             "throughput in tok/s; shares = each instance's fraction of the requests.", "",
             "| vllm-router policy | side | shares | throughput | mean TTFT | mean ITL | TTFT / vllm-router |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += side_rows(results)
    lines += ["", "Machine: client send lateness p99 / engine lag p99 (wall ms): " +
              ", ".join(f"{r['policy']} {r['vllm_router']['send_late_p99_ms']:.1f} / "
                        f"{r['vllm_router']['engine_lag_p99_ms']:.1f}" for r in results), "",
              "What differs (vllm-router 0.1.17 vs the fleet twin's policies):", "",
              "* `round_robin`: the same rule (a counter over requests, modulo the healthy workers).",
              "* `power_of_two`: the twin compares the router's own requests in flight; vllm-router compares "
              "`GET /get_load`'s `load` (an SGLang endpoint, polled every 5 s) plus a local in-flight counter "
              "it increments only for `cache_aware` -- in front of vLLM (which has no `/get_load`) every load "
              "is 0 and the pick is uniformly random (\"twin as routed\" = equal static weights).",
              "* `consistent_hash`: the twin hashes the adapter id (SHA-256, 160 points per engine named "
              "`engine-<i>#<k>`); vllm-router hashes `X-Session-ID` (then `X-User-ID`, ..., the body's `user`, "
              "else the whole body: a different key per request) with mcrouter's furc hash onto 160 points per "
              "worker URL (`http://host:port`: the map changes with the instances' ports) -- the same idea, a "
              "different ring, so adapters land on different instances (\"twin as routed\" = vllm-router's map, "
              "probed).",
              "* `round_robin` \"as routed\" is the twin's counter from instance 0; vllm-router's starts at the "
              "first worker of its own (unsorted) list, so the same requests may go to other instances (the "
              "shares agree; the instances' request sets, hence their queues, differ).", ""]
    return "\n".join(lines + hash_map_lines(results)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--duration-s", type=float, default=60.0, help="simulated seconds of the stream")
    ap.add_argument("--speed", type=float, default=2.0, help="emulator speed (simulated s per wall s)")
    a = parse_args(ap, os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router"),
                   "the vllm-router executable (default: $VLLM_ROUTER_BIN, else on PATH)", OUT)
    prepare_out(a, "fleet_router_")     # a.logs: the routers' logs and the instance scenario
    inst = instance_scenario(a.duration_s)
    scenario = a.logs / "instance.yaml"
    scenario.write_text(yaml.safe_dump(inst))
    one, req, ids = stream(inst, {**inst, "adapters": [{**g, "rate": g["rate"] * a.instances}
                                                       for g in inst["adapters"]]})
    command = command_line("vllm_router.py")
    t0 = time.time()
    with tracked_run("fleet-router", run_name=f"vllm-router-{VERSION}-k{a.instances}", tracking_uri=a.tracking_uri,
                     track=not a.no_track):
        warm_up(scenario, a, ids[0])
        results = [run_policy(a, p, scenario, one, req, ids) for p in a.policies]
        (a.out / "results.json").write_text(json.dumps({"vllm_router_version": VERSION, "instances": a.instances,
                                                        "duration_s": a.duration_s, "speed": a.speed, "seed": a.seed,
                                                        "requests": len(req), "command": command,
                                                        "wall_s": time.time() - t0, "results": results}, indent=1))
        (a.out / "report.md").write_text(report(results, a, command))
        if not a.no_track:
            log_results(a, results, {"instances": a.instances, "duration_s": a.duration_s, "speed": a.speed})
    print((a.out / "report.md").read_text())


if __name__ == "__main__":
    main()
