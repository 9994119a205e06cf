"""What the two vllm-router experiments share (``vllm_router.py``: the router in front of emulated instances;
``vllm_router_real.py``: in front of real vLLM instances): the router's version and policies, starting and
stopping it, reading each instance's served requests, probing its ``consistent_hash`` map, the fleet twin's
side, the report's rows, the options both take and their MLflow run.

A module of its own name beside the scripts (their folder is on the path when they run): the ``vllm-router``
wheel installs a package named ``vllm_router``, which shadows the script of that name as a module.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lora_opt.placement.instances import routing_seed
from lora_opt.tracking import log_dir, log_flat_metrics
from twin.fleet import FleetEngine, simulate_fleet
from twin.routers import RouterSetup, make_router
from twin.scenario import scenario_from_dict
from twin.workload import generate_requests

VERSION = "0.1.17"
#: vllm-router policy -> the fleet twin's policy of the same name
POLICIES = {"round_robin": "round-robin", "power_of_two": "power-of-two", "consistent_hash": "consistent-hash"}
#: the header the client puts the adapter id in (vllm-router's consistent_hash hashes it first)
SESSION_HEADER = "X-Session-ID"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_router(binary: str, port: int, urls: list[str], policy: str, log: Path) -> subprocess.Popen:
    import httpx
    with log.open("w") as f:
        proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                 "--policy", policy, "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    with httpx.Client(timeout=2, trust_env=False) as c:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    stop(proc)
    raise RuntimeError("vllm-router did not become ready in 60 s")


def served(urls: list[str]) -> np.ndarray:
    """Requests each instance finished (``vllm:request_success_total``, every reason)."""
    import httpx
    out = []
    with httpx.Client(timeout=10, trust_env=False) as c:
        for u in urls:
            text = c.get(u + "/metrics").text
            out.append(sum(float(line.split()[-1]) for line in text.splitlines()
                           if line.startswith("vllm:request_success_total{")))
    return np.array(out, np.int64)


def probe_hash_map(router: str, urls: list[str], ids: list[str]) -> dict[str, int]:
    """Which instance vllm-router's consistent_hash sends each adapter to: one request per adapter
    (its id in ``X-Session-ID``), the instance whose served count moved."""
    import httpx
    out = {}
    with httpx.Client(timeout=60, trust_env=False) as c:
        for a in ids:
            before = served(urls)
            r = c.post(router + "/v1/completions", headers={SESSION_HEADER: a},
                       json={"model": a, "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True})
            r.raise_for_status()
            moved = np.flatnonzero(served(urls) - before)
            if len(moved) != 1:
                raise RuntimeError(f"probe of {a}: instances {moved.tolist()} moved")
            out[a] = int(moved[0])
    return out


def fleet_numbers(fr) -> dict:
    res = [r for r in fr.engines if r.samples]
    ttft = np.concatenate([r.samples["ttft_ms"] for r in res])
    itl = sum(float((r.samples["itl_ms"] * r.samples["itl_count"]).sum()) for r in res)
    count = sum(int(r.samples["itl_count"].sum()) for r in res)
    k = len(fr.engines)
    shares = np.bincount(fr.engine_of[fr.engine_of >= 0], minlength=k) / max(1, int((fr.engine_of >= 0).sum()))
    return {"throughput_tok_s": sum(r.throughput_tok_s for r in fr.engines), "ttft_mean_ms": float(ttft.mean()),
            "itl_mean_ms": itl / count, "shares": shares.round(4).tolist()}


def twin(one, req, ids: list[str], k: int, seed: int, policy: str, routes: dict | None = None) -> dict:
    n = len(ids)
    engines = [FleetEngine(one, np.arange(n)) for _ in range(k)]
    setup = RouterSetup(k, ids, seed=routing_seed(seed),
                        routes=routes or {a: [(e, 1.0) for e in range(k)] for a in range(n)})
    return fleet_numbers(simulate_fleet(engines, req, make_router(policy, setup)))


def ratio(x: dict, y: dict, key: str) -> float:
    return x[key] / y[key] if y[key] else float("nan")


def side_rows(results: list[dict]) -> list[str]:
    """The shares table's rows: per policy, vllm-router as measured,
    the twin with the same policy, the twin as routed."""
    rows = []
    for r in results:
        m = r["vllm_router"]
        for side, d in (("vllm-router (measured)", m), (f"twin `{r['twin_policy']}`", r["twin_same_policy"]),
                        ("twin as routed", r["twin_as_routed"])):
            rows.append(f"| `{r['policy']}` | {side} | {' / '.join(f'{s:.2f}' for s in d['shares'])} | "
                        f"{d['throughput_tok_s']:.0f} | {d['ttft_mean_ms']:.0f} | {d['itl_mean_ms']:.1f} | "
                        f"{ratio(d, m, 'ttft_mean_ms'):.2f} |")
    return rows


def common_args(ap, router_default: str | None, router_help: str, out: Path) -> None:
    """The options both scripts take beside their own: seed, policies, the router binary, out (default ``out``),
    tracking."""
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--router-bin", default=router_default, help=router_help)
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--tracking-uri")
    ap.add_argument("--no-track", action="store_true", help="no MLflow run")


def log_results(a, results: list[dict], params: dict) -> None:
    """The MLflow run's params (``params``, the policies) and every side's numbers per policy; ``a.out``'s files."""
    import mlflow
    mlflow.log_params({"vllm_router_version": VERSION, **params, "seed": a.seed, "policies": ",".join(a.policies)})
    for r in results:
        log_flat_metrics(r["policy"], {k: {m: v for m, v in d.items() if m not in ("shares", "served")}
                                       for k, d in r.items() if isinstance(d, dict) and k != "hash_map"})
    log_dir(a.out)


def parse_args(ap: argparse.ArgumentParser, router_default: str | None, router_help: str, out: Path):
    """The script's options (:func:`common_args` added: ``router_default`` / ``router_help`` for
    ``--router-bin``, ``out`` the default ``--out``); exits when no vllm-router executable is found."""
    common_args(ap, router_default, router_help, out)
    a = ap.parse_args()
    if not a.router_bin:
        sys.exit("vllm-router not found: pip install 'lora-opt[router]' (or set VLLM_ROUTER_BIN)")
    return a


def prepare_out(a, logs_prefix: str) -> None:
    """``a.out`` made (a Path), ``a.logs`` a fresh temporary directory (the routers' logs)."""
    a.out = Path(a.out)
    a.out.mkdir(parents=True, exist_ok=True)
    a.logs = Path(tempfile.mkdtemp(prefix=logs_prefix))


def stream(instance: dict, fleet: dict) -> tuple:
    """(the one-instance scenario of ``instance``, the fleet's requests -- ``fleet``'s arrivals and lengths --,
    the adapter ids)."""
    one = scenario_from_dict(instance)
    whole = scenario_from_dict(fleet)
    req = generate_requests(whole, whole.resolved_engine(whole.load_profile()).max_model_len)
    return one, req, list(one.adapter_table()[0])


def command_line(script: str) -> str:
    """How this run was started (``python experiments/fleet_router/SCRIPT ...``), for the report."""
    return f"python experiments/fleet_router/{script} " + shlex.join(sys.argv[1:])


def hash_map_lines(results: list[dict]) -> list[str]:
    """The report's closing lines: vllm-router's consistent_hash map of each policy that probed one."""
    return [f"vllm-router's consistent_hash map (adapter -> instance): {r['hash_map']}"
            for r in results if r["hash_map"]]
