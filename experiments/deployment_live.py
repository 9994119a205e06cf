"""Issue 39 item 4: the deployment ``lora-opt place --deployment best`` recommends, started as an emulated
fleet behind the router it was judged with, its workload's traffic replayed through that router; the
measured p99 TTFT, failed requests and served share against the SLO (MLflow experiment ``deployment-live``).

    python experiments/deployment_live.py [--speed 1] [--duration-s 120] [--out DIR]
    python experiments/deployment_live.py --workload example --gpus 4 --speed 0.25 --duration-s 120 \
        --out experiments/deployment_live_example

``--workload`` (a workload file or a bundled name) replaces the built-in one below, ``--gpus`` the pool (8),
``--deployment`` place's choice (best).  A pick judged behind a vllm-router policy is fronted by vllm-router
itself (the command ``place --emit-vllm`` writes, its ports moved to the fleet's; $VLLM_ROUTER_BIN, PATH or
the real-vLLM tier's), unless ``--no-vllm-router`` or none is installed.

The workload: 40 adapters (ranks 8 / 16), power-law popularity (alpha 0.8), 24 req/s, 200-token prompts and
40-token answers, ``--max-num-seqs 4`` (as experiments/replan_apply.py: small enough that an emulated fleet
relays its tokens in real time on 2 cores, busy enough to need several GPUs).  Steps, each lora-opt's own
command: ``place --deployment best`` (static, every-gpu and hybrid judged on the fleet twin, the fewest GPUs
written), ``emulate --placement`` with the judged router (``static`` weights for a static placement, the
``lora-affinity`` picker otherwise; adapters loaded on use for every-gpu), then the workload's evaluation
requests (its seed) for ``--duration-s`` simulated seconds through the router (``lora_opt.emulate.client``,
judged as ``validate`` judges requests).  The SLO: no failed request, p99 TTFT within place's bound
(5 s), and every request sent before the last 60 s finished.  Writes OUT/ (workload, placement,
requests.csv, fleet.log, router.log where vllm-router fronted the fleet, report.md, result.json)."""
import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from lora_opt.emulate.client import replay_routed, server_prompt_tokens
from lora_opt.emulate.fleet import free_ports
from lora_opt.io import atomic_write_json, atomic_write_rows, atomic_write_text
from lora_opt.placement.evaluate import workload_requests
from lora_opt.placement.plan import Placement
from lora_opt.replan.router_config import VLLM_ROUTER_POLICIES, VLLM_ROUTER_VERSION, vllm_router_command
from lora_opt.placement.workload_file import load_workload
from lora_opt.tracking import log_command_run
from lora_opt.validate.measure import REQUEST_COLUMNS, request_rows

OUT = Path(__file__).resolve().parent / "deployment_live"
PROFILE = "llama-3.1-8b-h100-64gb"
#: the SLO's p99 TTFT bound (place --deployment's default) and the tail whose requests may still run at the end
SLO_TTFT_P99_S, TAIL_S = 5.0, 60.0


def workload() -> dict:
    ads = [(f"t{i}", 8 if i % 2 == 0 else 16) for i in range(40)]
    w = np.arange(1, len(ads) + 1, dtype=float) ** -0.8
    rates = 24.0 * w / w.sum()
    return {"profile": PROFILE, "name": "deployment-live", "rho": 0.9,
            "adapters": [{"id": a, "rank": r, "rate": round(float(q), 6)} for (a, r), q in zip(ads, rates)],
            "engine": {"max_num_seqs": 4},
            "evaluation": {"lengths": {"source": "mean", "mean_in": 200, "mean_out": 40}, "duration_s": 900, "seed": 0}}


def lora_opt(*argv: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"lora-opt {' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


def start_fleet(placement: Path, router: str | None, adapters: str, speed: float, log: Path) -> tuple[subprocess.Popen, str, int]:
    """``lora-opt emulate --placement`` with the router and adapter mode the deployment was judged with (``router``
    None: the instances alone, another router fronts them); (process, router URL or None, base port)."""
    base, router_port = free_ports(16), free_ports(1)
    f = open(log, "w")
    front = [] if router is None else ["--router-port", str(router_port), "--router", router]
    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", "--placement", str(placement),
                             "--base-port", str(base), *front, "--adapters", adapters, "--speed", str(speed)],
                            stdout=subprocess.PIPE, stderr=f, text=True, env=dict(os.environ))
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc, None if router is None else f"http://127.0.0.1:{router_port}", base
    raise SystemExit(f"the emulated fleet did not start (log: {log})")


def vllm_router_binary() -> str | None:
    """vLLM's router: $VLLM_ROUTER_BIN, PATH, or the real-vLLM tier's (tools/vllm_tier/build.sh)."""
    tier = Path(__file__).resolve().parents[1] / ".vllm-tier" / "router-venv" / "bin" / "vllm-router"
    return os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router") or (str(tier) if tier.exists() else None)


def start_vllm_router(binary: str, p: Placement, policy: str, base: int, log: Path) -> tuple[subprocess.Popen, str]:
    """The command ``place --emit-vllm`` writes to router/vllm-router.sh for ``p`` (only the ports moved to the
    emulated fleet's), run; (process, URL) once its /health answers."""
    import httpx
    port = free_ports(1)
    argv = [binary, *vllm_router_command(p, policy, base_port=base, port=port)[1:]]
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    with httpx.Client(timeout=2, trust_env=False) as c:
        while time.time() < deadline and proc.poll() is None:
            try:
                if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return proc, f"http://127.0.0.1:{port}"
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"vllm-router did not become ready (log: {log})")


async def replay(router: str, wl, p: Placement, speed: float, duration_s: float, tokenizer: str | None = None,
                 session_header: str | None = None):
    req = workload_requests(wl, min(g.max_model_len for g in p.gpus))
    keep = req.arrival < duration_s
    req = type(req)(req.arrival[keep], req.adapter[keep], req.in_len[keep], req.out_len[keep])
    models = [a.id for a in wl.adapters]
    target = np.zeros(len(req), np.int64)
    prompts = await server_prompt_tokens((tokenizer or router) + "/v1")
    records = await replay_routed([router + "/v1"], req, target, models, speed, end_s=duration_s + TAIL_S,
                                  prompts=prompts, session_header=session_header)
    return req, request_rows(records, req, target, [router + "/v1"], models, speed)


def judge(rows: list[dict], duration_s: float) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok" and r["error"] != "unfinished"]
    late = [r for r in rows if r["error"] == "unfinished" and r["arrival_s"] < duration_s]
    ttft = np.array([r["ttft_ms"] for r in ok], float)
    p99 = float(np.percentile(ttft, 99)) if len(ttft) else float("nan")
    return {"requests": len(rows), "ok": len(ok), "failed": len(failed), "unfinished": len(late),
            "ttft_p99_ms": p99, "ttft_mean_ms": float(ttft.mean()) if len(ttft) else float("nan"),
            "slo_met": bool(not failed and not late and p99 <= SLO_TTFT_P99_S * 1000),
            "errors": sorted({r["error"] for r in failed})[:5]}


def report(placed: dict, result: dict, args, wall_s: float, wl) -> str:
    f = (lambda x: "-" if x is None else f"{x:,.0f}")
    what = ("40 adapters, 24 req/s, 200/40-token requests, --max-num-seqs 4" if args.workload is None else
            f"{args.workload}: {len(wl.adapters)} adapters, {wl.total_rate:.1f} req/s")
    extra = "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("workload", args.workload), ("gpus", args.gpus),
                                                                  ("deployment", args.deployment))
                    if v is not None and (k, v) not in (("gpus", 8), ("deployment", "best")))
    if args.out != str(OUT):
        extra += f" --out {os.path.relpath(args.out, OUT.parent.parent)}"
    lines = ["# The recommended deployment, live on an emulated fleet", "",
             f"Command: `python experiments/deployment_live.py{extra} --speed {args.speed:g} --duration-s "
             f"{args.duration_s:g}` ({wall_s / 60:.1f} min). Workload: {what}.", "",
             f"`lora-opt place --deployment {args.deployment}` (the fleet twin at the confidence's verification load):",
             "",
             "| deployment | GPUs | meets SLO | p99 TTFT ms | note |", "|---|---|---|---|---|"]
    for c in placed["deployments"]:
        lines.append(f"| {c['deployment']} | {c['gpus'] or '-'} | {'yes' if c['ok'] else 'no'} | "
                     f"{f(c['ttft_p99_ms'])} | {c['detail']} |")
    r = result
    lines += ["", f"Recommended: **{placed['meta']['deployment']}** on {len(placed['gpus'])} GPUs. Live (emulated fleet "
              f"behind the {r['router']} router, {args.duration_s:g} s of the workload's requests, simulated ms):", "",
              "| requests | ok | failed | unfinished | p99 TTFT ms | mean TTFT ms | SLO (0 failed, p99 <= 5 s) |",
              "|---|---|---|---|---|---|---|",
              f"| {r['requests']} | {r['ok']} | {r['failed']} | {r['unfinished']} | {f(r['ttft_p99_ms'])} | "
              f"{f(r['ttft_mean_ms'])} | {'met' if r['slo_met'] else '**not met**'} |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tracking-uri")
    ap.add_argument("--workload", help="a workload file or bundled name (default: the built-in 40-adapter one)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--deployment", default="best", choices=("best", "static", "every-gpu", "hybrid"))
    ap.add_argument("--no-vllm-router", action="store_true",
                    help="front a pick judged behind a vllm-router policy with lora-opt's router, not vllm-router")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    wl_path = out / "workload.yaml"
    text = (yaml.safe_dump(workload(), sort_keys=False) if args.workload is None else
            yaml.safe_dump(load_workload(args.workload).to_dict(), sort_keys=False))
    atomic_write_text(wl_path, text)
    r = lora_opt("place", "--workload", str(wl_path), "--gpus", str(args.gpus), "--deployment", args.deployment,
                 "--out", str(out / "placement"), "--emit-vllm", "--json")
    placed = json.loads(r.stdout)
    deployment = placed["meta"]["deployment"]
    judged = placed["deployments"][0]                 # the recommended one: served as it was judged
    p = Placement.load(out / "placement" / "placement.json")
    binary = None if args.no_vllm_router else vllm_router_binary()
    real_router = judged["router"] in VLLM_ROUTER_POLICIES and binary is not None
    proc, router, base = start_fleet(out / "placement" / "placement.json", None if real_router else judged["router"],
                                     judged["adapters"], args.speed, out / "fleet.log")
    front, served_by = None, judged["router"]
    try:
        if real_router:         # vllm-router where it applies: the command place writes, in front of the fleet
            front, router = start_vllm_router(binary, p, judged["router"], base, out / "router.log")
            served_by = f"vllm-router {VLLM_ROUTER_VERSION} --policy {VLLM_ROUTER_POLICIES[judged['router']]}" + (
                " (clients send X-Session-ID = the adapter)" if judged["router"] == "consistent-hash" else "")
        req, rows = asyncio.run(replay(router, load_workload(str(wl_path)), p, args.speed, args.duration_s,
                                       tokenizer=f"http://127.0.0.1:{base}" if real_router else None,
                                       # what the emitted vllm-router.sh asks of clients (CONSISTENT_HASH_NOTE)
                                       session_header="X-Session-ID" if real_router and judged["router"] == "consistent-hash"
                                       else None))
    finally:
        for pr in (front, proc):
            if pr is None:
                continue
            pr.terminate()
            try:
                pr.wait(15)
            except subprocess.TimeoutExpired:
                pr.kill()
        if front is not None:   # vllm-router colours its log: kept as plain text
            log = out / "router.log"
            log.write_text(re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()))
    atomic_write_rows(out / "requests.csv", rows, REQUEST_COLUMNS)
    result = {**judge(rows, args.duration_s), "deployment": deployment, "gpus": len(p.gpus),
              "router": served_by, "speed": args.speed,
              "duration_s": args.duration_s}
    wall = time.perf_counter() - t0
    atomic_write_json(out / "result.json", {"placed": {k: placed[k] for k in ("deployments", "meta")}, "live": result},
                      indent=1, default=str)
    atomic_write_text(out / "report.md", report(placed, result, args, wall, load_workload(str(wl_path))))
    log_command_run("deployment-live", f"place --deployment {args.deployment}, live", params={
                    "speed": args.speed, "duration_s": args.duration_s, "workload": args.workload or "built-in",
                    "gpus": args.gpus}, metrics={"live": {k: v for k, v in result.items()
                                                                       if isinstance(v, (int, float))}},
                    artifacts=[out], wall_s=wall, tracking_uri=args.tracking_uri)
    print((out / "report.md").read_text())


if __name__ == "__main__":
    main()
