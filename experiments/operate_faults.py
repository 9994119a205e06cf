"""Issue 37 item 5: a compressed day operated by ``lora-opt operate`` on an emulated fleet under traffic, with
seeded faults (tracked in MLflow, experiment ``operate-faults``).

    python experiments/operate_faults.py [--steps 24] [--step-s 60] [--seed 0] [--out experiments/operate_faults]

The day: the drift generator's (``lora_opt.replan.drift``; 16 adapters, ranks 8/16, a cosine between 4 and
16 req/s peaking at 15:00, 10 % popularity churn a step, no arrivals or retirements -- operate's adapters are
its placement's), each hour ``--step-s`` wall seconds; requests of 200 prompt / 40 output tokens,
``--max-num-seqs 4`` (as experiments/replan_apply.py: an emulated fleet relays its tokens in real time on 2
cores).  Every process is a real one: each GPU's instance (``lora-opt emulate``, launched by operate with its
GPU's command), the router (``lora-opt emulate --routes``, its own process), Prometheus (Debian's, scraping
the router), ``lora-opt operate`` (``--interval-s`` = one step, ``--window`` = one step, reconciling every
3 s); the first placement is ``lora-opt place`` of hour 0.

Faults, one of each kind at a seeded moment of a seeded hour (none in the first three):

* ``kill-operate``: SIGKILL of operate between cycles, restarted 3 s later with the same ``--out``;
* ``kill-apply``: SIGKILL of operate while its apply runs (the first plan carried out after the hour drawn),
  restarted 3 s later;
* ``kill-instance``: SIGKILL of a running instance (operate launches it again; its requests in flight fail);
* ``kill-router``: SIGKILL of the router, restarted 2 s later, as a supervisor would, from the table file
  operate keeps (``OUT/operate/router.json``: the running placement's; ``--stale-router``: from the first
  placement's, a stale file whose routes the next reconciliation puts back -- the requests routed by the
  stale table meanwhile fail);
* ``prometheus-down``: Prometheus stopped for 1.5 steps, then started again on the same data;
* ``bad-adapter``: from the hour drawn, the first plan that loads an adapter at run time: that adapter's
  directory removed the moment the plan is written (before its load step, which then fails): the plan
  stops, the fleet is reconciled back, the adapter held from later plans.  (A launch carrying it on its
  ``--lora-modules`` does not fail on lora-opt's emulator -- real vLLM refuses to start -- so only a
  runtime load shows this fault here.)

The client sends each request once; a request refused by the router's port (the router dead: never sent) is
sent again every 0.5 s, as a client behind a load balancer would, the router itself tries a request that
reached no instance again for 30 s (``--retry-for-s``).  Judged: after every cycle the fleet equals the
placement operate runs (cycles.csv ``differences``); every failed request was in flight on a killed process
(by request id: its error names the killed instance, or the router died while it was open); no adapter
loaded twice in a plan; a plan only for a saved GPU or a starving one.  Writes OUT/ (report.md, faults.csv,
requests.csv, the operate folder, logs).
"""
import argparse
import asyncio
import calendar
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from lora_opt.bench.prometheus_server import PrometheusServer
from lora_opt.emulate.fleet import free_ports
from lora_opt.io import atomic_write_json, atomic_write_rows, atomic_write_text
from lora_opt.replan.drift import drift_from_dict, drift_workloads, write_drift
from lora_opt.placement.plan import Placement
from lora_opt.placement.vllm_launch import router_table
from lora_opt.tracking import log_command_run

OUT = Path(__file__).resolve().parent / "operate_faults"
PROFILE = "llama-3.1-8b-h100-64gb"
FAULTS = ("kill-operate", "kill-apply", "kill-instance", "kill-router", "prometheus-down", "bad-adapter")
PROMPT, ANSWER = 200, 40
ENV = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONUNBUFFERED": "1"}


def day(seed: int, steps: int) -> list:
    cfg = drift_from_dict({"profile": PROFILE, "adapters": 16, "ranks": [{"rank": 8, "share": 0.5},
                                                                         {"rank": 16, "share": 0.5}],
                           "peak_rate": 16, "trough_fraction": 0.25, "peak_hour": 15, "steps": steps,
                           "churn": 0.1, "arrivals_per_step": 0, "retirements_per_step": 0, "seed": seed,
                           "engine": {"max_num_seqs": 4},
                           "evaluation": {"lengths": {"source": "mean", "mean_in": PROMPT, "mean_out": ANSWER},
                                          "duration_s": 300}})
    return drift_workloads(cfg)


def fault_schedule(rng, steps: int, step_s: float) -> list[dict]:
    hours = rng.choice(np.arange(3, steps - 2), size=len(FAULTS), replace=False)
    return sorted(({"fault": f, "step": int(h), "at_s": float(h * step_s + rng.uniform(0.2, 0.8) * step_s)}
                   for f, h in zip(FAULTS, hours)), key=lambda f: f["at_s"])


class Client:
    """Poisson arrivals of each step's rates, each request's outcome by id."""

    def __init__(self, url: str, workloads, step_s: float, seed: int):
        self.url, self.workloads, self.step_s = url, workloads, step_s
        self.rng = np.random.default_rng(seed)
        self.rows: list[dict] = []

    async def one(self, client, rid: int, adapter: str, t0: float):
        row = {"id": rid, "adapter": adapter, "sent_s": round(time.monotonic() - t0, 3), "status": None,
               "http": None, "error": "", "tries": 0, "end_s": None}
        self.rows.append(row)
        import httpx
        give_up = time.monotonic() + 60
        while True:
            row["tries"] += 1
            try:
                r = await client.post(self.url + "/v1/completions", json={
                    "model": adapter, "prompt": [1] * PROMPT, "max_tokens": ANSWER, "ignore_eos": True})
                row["http"], row["status"] = r.status_code, "ok" if r.status_code == 200 else "failed"
                if r.status_code != 200:
                    row["error"] = r.text[:300]
                break
            except httpx.ConnectError as exc:          # the router's port refused it: never sent
                if time.monotonic() > give_up:
                    row["status"], row["error"] = "failed", f"ConnectError: {exc}"
                    break
                await asyncio.sleep(0.5)
            except httpx.HTTPError as exc:
                row["status"], row["error"] = "failed", f"{type(exc).__name__}: {exc}"
                break
        row["end_s"] = round(time.monotonic() - t0, 3)

    async def run(self, t0: float):
        import httpx
        tasks, rid = [], 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=5), trust_env=False,
                                     limits=httpx.Limits(max_connections=None)) as client:
            for k, wl in enumerate(self.workloads):
                ids = [a.id for a in wl.adapters]
                rates = np.array([a.rate for a in wl.adapters])
                t = k * self.step_s
                while True:
                    t += self.rng.exponential(1 / rates.sum())
                    if t >= (k + 1) * self.step_s:
                        break
                    adapter = ids[self.rng.choice(len(ids), p=rates / rates.sum())]
                    await asyncio.sleep(max(0.0, t - (time.monotonic() - t0)))
                    tasks.append(asyncio.ensure_future(self.one(client, rid, adapter, t0)))
                    rid += 1
            await asyncio.gather(*tasks)


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def start_router(routes: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", "--routes", str(routes), "--router-port",
                             str(port), "--retry-for-s", "30"], stdout=subprocess.PIPE,
                            stderr=open(log, "a"), text=True, env=ENV, start_new_session=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise SystemExit(f"the router did not start (log: {log})")


def pid_on_port(port: int) -> int | None:
    out = subprocess.run(["pgrep", "-f", "--", f"--port {port} "], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="hours of the day (>= 11: the six faults fall in distinct hours 3 .. steps-3)")
    ap.add_argument("--step-s", type=float, default=60.0, help="wall seconds an hour lasts (operate's interval)")
    ap.add_argument("--seed", type=int, default=0, help="the day's, the traffic's and the faults' seed")
    ap.add_argument("--out", default=str(OUT), help="output folder (default experiments/operate_faults)")
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: the local store)")
    ap.add_argument("--stale-router", action="store_true",
                    help="restart the killed router from the first placement's table, not the one operate keeps")
    ap.add_argument("--judge-only", action="store_true", help="the report again from OUT's outputs (nothing run)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.judge_only:
        return rejudge(out, args)
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    t_wall = time.time()
    wls = day(args.seed, args.steps)
    day_files = write_drift(wls, out / "day")      # the day's demand, as files (hour 0 is placed)
    adir = out / "adapters"
    for a in wls[0].adapters:
        (adir / a.id).mkdir(parents=True)
        (adir / a.id / "adapter_config.json").write_text(json.dumps({"r": a.rank}))
    lo = [sys.executable, "-m", "lora_opt.cli"]
    subprocess.run([*lo, "place", "--workload", str(day_files[0]), "--policy", "greedy-plus",
                    "--gpus", "6", "--verify-s", "300", "--out", str(out / "placed")], check=True,
                   env=ENV, stdout=subprocess.DEVNULL)
    p = Placement.load(out / "placed")
    base, front = free_ports(8), free_ports(1)
    atomic_write_json(out / "placed" / "router-start.json", router_table(p, base_port=base), indent=1)
    router = start_router(out / "placed" / "router-start.json", front, out / "logs" / "router.log")
    prom = PrometheusServer([f"127.0.0.1:{front}"], out / "prometheus", scrape_interval="2s")
    server_cmd = f"{sys.executable} -m lora_opt.cli emulate --profile {PROFILE} --speed 1"
    track = ["--tracking-uri", args.tracking_uri] if args.tracking_uri else []
    operate_argv = [*lo, "operate", str(out / "placed"), "--prometheus", prom.url, "--router",
                    f"http://127.0.0.1:{front}", "--window", f"{int(args.step_s)}s", "--interval-s", str(args.step_s),
                    "--reconcile-s", "3", "--base-port", str(base), "--server-cmd", server_cmd, "--adapter-dir",
                    str(adir), "--verify-s", "300", "--out", str(out / "operate"), *track]
    operate = start(operate_argv, out / "logs" / "operate.log")
    # the first cycle launches the fleet (every instance is dead: reconciled)
    while not (out / "operate" / "cycles.csv").exists():
        if operate.poll() is not None:
            raise SystemExit(f"operate exited {operate.returncode}: {(out / 'logs' / 'operate.log').read_text()[-3000:]}")
        time.sleep(0.5)
    rng = np.random.default_rng(args.seed + 37)
    schedule = fault_schedule(rng, args.steps, args.step_s)
    client = Client(f"http://127.0.0.1:{front}", wls, args.step_s, args.seed)
    t0 = time.monotonic()
    atomic_write_json(out / "run.json", {"t0_wall": time.time(), "base_port": base, "router_port": front,
                                         "prometheus": prom.url, "schedule": schedule}, indent=1)
    events: list[dict] = []

    watchers = []

    async def bad_adapter(ev):
        """The next plan with a runtime load: its adapter's directory removed as soon as the plan is written."""
        seen = set((out / "operate").glob("cycle-*/plan.json"))
        while time.monotonic() - t0 < args.steps * args.step_s:
            new = [d for d in (out / "operate").glob("cycle-*/plan.json") if d not in seen]
            seen |= set(new)
            loads = [st["adapter"] for d in new for st in json.loads(d.read_text())["steps"]
                     if st["action"] == "load" and (adir / st["adapter"]).exists()]
            if loads:
                shutil.rmtree(adir / loads[0])
                ev.update(target=f"{loads[0]} ({new[0].parent.name})", done_s=round(time.monotonic() - t0, 3),
                          wall=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                break
            await asyncio.sleep(0.02)
        else:
            ev["note"] = "no plan loaded an adapter at run time after its hour: not injected"
        events.append(ev)

    async def faults():
        nonlocal operate, router, prom
        for f in schedule:
            await asyncio.sleep(max(0.0, f["at_s"] - (time.monotonic() - t0)))
            ev = {**f, "done_s": None, "wall": None, "target": "", "note": ""}
            kind = f["fault"]
            if kind == "bad-adapter":           # watched on its own: it waits for a plan with a runtime load
                watchers.append(asyncio.ensure_future(bad_adapter(ev)))
                continue
            if kind == "kill-apply":            # wait for an apply to run (at most 3 steps)
                seen = set((out / "operate").glob("cycle-*/apply"))
                until = time.monotonic() + 3 * args.step_s
                while time.monotonic() < until:
                    new = [d for d in (out / "operate").glob("cycle-*/apply") if d not in seen]
                    if new and operate.poll() is None:
                        ev["target"] = str(new[0].parent.name)
                        break
                    await asyncio.sleep(0.05)
                else:
                    ev["note"] = "no plan was carried out within 3 steps: not injected"
                    events.append(ev)
                    continue
            ev["done_s"] = round(time.monotonic() - t0, 3)
            ev["wall"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if kind in ("kill-operate", "kill-apply"):
                os.killpg(operate.pid, signal.SIGKILL)
                operate.wait()
                await asyncio.sleep(3)
                operate = start(operate_argv, out / "logs" / "operate.log")
                ev["target"] = ev["target"] or "operate"
            elif kind == "kill-instance":
                running = Placement.load(json.loads((out / "operate" / "operate-state.json").read_text())["current"])
                used = [g for g in range(len(running.gpus)) if running.adapters_on(g)]
                from lora_opt.placement.vllm_launch import instance_urls
                url = instance_urls(running, base_port=base)[int(rng.choice(used))]
                pid = pid_on_port(int(url.rsplit(":", 1)[1]))
                ev["target"] = url
                if pid is None:
                    ev["note"] = "no process found on its port"
                else:
                    os.kill(pid, signal.SIGKILL)
            elif kind == "kill-router":
                os.killpg(router.pid, signal.SIGKILL)
                router.wait()
                ev["target"] = f"router :{front}"
                await asyncio.sleep(2)
                table = out / "placed" / "router-start.json" if args.stale_router else out / "operate" / "router.json"
                router = await asyncio.to_thread(start_router, table, front, out / "logs" / "router.log")
                ev["note"] = f"restarted from {table.relative_to(out)}"
            elif kind == "prometheus-down":
                prom.stop()
                ev["target"] = prom.url
                await asyncio.sleep(1.5 * args.step_s)
                prom = await asyncio.to_thread(PrometheusServer, [f"127.0.0.1:{front}"], out / "prometheus",
                                               scrape_interval="2s", port=prom.port)
                ev["note"] = f"started again after {1.5 * args.step_s:.0f} s on its data and port"
            events.append(ev)

    async def both():
        await asyncio.gather(client.run(t0), faults())
        await asyncio.gather(*watchers)
    try:
        asyncio.run(both())
        time.sleep(2 * args.step_s)     # the last cycles after the traffic
    finally:
        os.killpg(operate.pid, signal.SIGINT)
        try:
            operate.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(operate.pid, signal.SIGKILL)
        shut = []
        for port in range(base, base + 8):
            pid = pid_on_port(port)
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
                shut.append(port)
        os.killpg(router.pid, signal.SIGTERM)
        prom.stop()
    atomic_write_rows(out / "requests.csv", client.rows, REQUEST_COLUMNS)
    atomic_write_rows(out / "events.csv", events, EVENT_COLUMNS)
    judge(out, client.rows, events, args, time.time() - t_wall)


REQUEST_COLUMNS = ("id", "adapter", "sent_s", "end_s", "status", "http", "tries", "error")
EVENT_COLUMNS = ("fault", "step", "at_s", "done_s", "wall", "target", "note")


def rejudge(out: Path, args) -> None:
    """``--judge-only``: the report again from the outputs of a run (requests.csv, events.csv)."""
    def num(v):
        return None if v in ("", None) else float(v)
    rows = [{**r, "id": int(r["id"]), "sent_s": float(r["sent_s"]), "end_s": num(r["end_s"]),
             "http": None if r["http"] in ("", None) else int(r["http"])} for r in csv.DictReader(open(out / "requests.csv"))]
    events = [{**e, "step": int(e["step"]), "at_s": float(e["at_s"]), "done_s": num(e["done_s"]),
               "wall": e["wall"] or None} for e in csv.DictReader(open(out / "events.csv"))]
    wall_s = json.loads((out / "result.json").read_text()).get("wall_s", 0.0) if (out / "result.json").exists() else 0.0
    judge(out, rows, events, args, wall_s)


def demand_rows(out: Path, rows: list[dict], cycles: list[dict], window_s: float) -> list[dict]:
    """Per cycle: the requests the client sent in the window before it, and what operate read from Prometheus."""
    run = json.loads((out / "run.json").read_text())
    sent = np.array(sorted(r["sent_s"] for r in rows))
    table = []
    for c in cycles:
        if c.get("demand_requests") in ("", None):
            continue
        t = _since_t0(out, c["started"])
        n = int(np.searchsorted(sent, t) - np.searchsorted(sent, t - window_s))
        if n:
            table.append({"cycle": c["cycle"], "sent": n, "read": float(c["demand_requests"]),
                          "error_pct": 100 * (float(c["demand_requests"]) - n) / n})
    return table


def _since_t0(out: Path, iso: str) -> float:
    """Seconds from the traffic's start (run.json) to a cycle's ISO start (to the second)."""
    return calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")) - json.loads((out / "run.json").read_text())["t0_wall"]


def _plus(iso: str, seconds: float) -> str:
    t = time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(calendar.timegm(t) + seconds))


def judge(out: Path, rows: list[dict], events: list[dict], args, wall_s: float):
    cycles = list(csv.DictReader(open(out / "operate" / "cycles.csv")))
    repairs = list(csv.DictReader(open(out / "operate" / "reconcile.csv"))) if (out / "operate" / "reconcile.csv").exists() else []
    # each failed request: in flight on a killed process? (by its id: sent before the kill, ended after it, and
    # its error names the killed instance -- or the router died under it)
    killed = [e for e in events if e["done_s"] is not None and e["fault"] in ("kill-instance", "kill-router")]
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        r["cause"] = ""
        for e in killed:
            if not (r["sent_s"] <= e["done_s"] + 0.5 and (r["end_s"] or 1e9) >= e["done_s"]):
                continue
            if e["fault"] == "kill-instance" and e["target"].split("//")[1] in r["error"]:
                r["cause"] = f"in flight on {e['target']} (killed at {e['done_s']:.1f} s)"
            elif e["fault"] == "kill-router" and r["http"] is None:
                r["cause"] = f"in flight on the router (killed at {e['done_s']:.1f} s)"
    unexplained = [r for r in failed if not r["cause"]]
    # loads: no (instance, adapter) loaded twice within a plan; steps found in effect after a kill not redone
    loads_twice, done_again = 0, 0
    for steps_csv in (out / "operate").glob("cycle-*/apply/steps.csv"):
        st = list(csv.DictReader(open(steps_csv)))
        plan = json.loads((steps_csv.parent.parent / "plan.json").read_text())
        by = {s["step"]: s for s in plan["steps"]}
        seen = {}
        for s in st:
            if s["action"] == "load" and s["status"] == "ok":
                key = (s["instance"], by[int(s["step"])].get("adapter"))
                seen[key] = seen.get(key, 0) + 1
            done_again += s["status"] == "done"
        loads_twice += sum(1 for v in seen.values() if v > 1)
    applied = [c for c in cycles if c["decision"] in ("applied", "apply failed")]
    flapping = [c for c in applied if not ("saves" in c["why"] or "starves" in c["why"])]
    differing = [c for c in cycles if c.get("differences")]
    table = []
    for e in events:
        failed_here = [r for r in failed if r["cause"] and e["target"] and (e["target"].split("//")[-1] in r["cause"]
                       or (e["fault"] == "kill-router" and "router" in r["cause"]))]
        # what operate did about it: the first reconciliation after it, the cycles that said why they kept
        fixed = next((x for x in repairs if e["wall"] and x["time"] >= e["wall"]), None)
        seen = [c for c in cycles if e["wall"] and c["started"] >= e["wall"]][:3]
        after = next((c for c in cycles if e["wall"] and c["started"] >= e["wall"]), None)
        if e["fault"] in ("kill-operate", "kill-apply") and after is not None:
            did = f"restarted, continued at cycle {after['cycle']} ({after['decision']})"
            if fixed is not None and fixed["time"] <= after["started"]:
                did += f"; reconciled first: {fixed['steps'][:80]} -> {fixed['after'][:60] or 'as placed'}"
        elif e["fault"] in ("kill-instance", "kill-router") and e["wall"]:
            soon = [x for x in repairs if e["wall"] <= x["time"] <= _plus(e["wall"], 60)][:3]
            did = "; ".join(f"reconciled at {x['time'][11:]}: {x['steps'][:80] or 'nothing done'} -> "
                            f"{x['after'][:60] or 'as placed'}" for x in soon) or \
                "no difference found by the reconciliations of the next 60 s"
        elif e["fault"] == "prometheus-down":
            did = "; ".join(f"cycle {c['cycle']}: {c['decision']} ({c['why'][:90]})" for c in seen
                            if "no demand" in c["why"])
        elif e["fault"] == "bad-adapter":
            aid = e["target"].split(" ")[0]
            did = "; ".join(f"cycle {c['cycle']}: {c['decision']} ({c['why'][:160]})" for c in cycles
                            if aid and aid in c["why"])
        else:
            did = ""
        table.append({**e, "failed_requests": len(failed_here), "operate_did": did})
    atomic_write_rows(out / "faults.csv", table, ("fault", "step", "at_s", "done_s", "wall", "target", "note",
                                                  "failed_requests", "operate_did"))
    n_ok = sum(r["status"] == "ok" for r in rows)
    lines = [f"# A compressed day operated through faults ({args.steps} hours of {args.step_s:g} s)", "",
             f"Command: `python experiments/operate_faults.py --steps {args.steps} --step-s {args.step_s:g} --seed "
             f"{args.seed}` ({wall_s / 60:.0f} min on this machine).", "",
             f"Requests: {len(rows)} sent, {n_ok} ok, {len(failed)} failed -- "
             f"{len(failed) - len(unexplained)} in flight on a killed process, **{len(unexplained)} otherwise**.", "",
             f"Cycles: {len(cycles)}; plans carried out {sum(c['decision'] == 'applied' for c in cycles)}, failed "
             f"{sum(c['decision'] == 'apply failed' for c in cycles)}; a plan not for a saved or starving GPU: "
             f"{len(flapping)}; cycles after which the fleet differed from the placement: {len(differing)}; "
             f"reconciliations that changed the fleet: {len(repairs)}; adapters loaded twice in a plan: {loads_twice}; "
             f"steps found in effect (not redone): {done_again}.", "",
             "| fault | hour | at (s) | target | failed requests | what operate did | note |",
             "|---|---:|---:|---|---:|---|---|"]
    for e in table:
        lines.append(f"| {e['fault']} | {e['step']} | {e['done_s'] if e['done_s'] is not None else '-'} | "
                     f"{e['target']} | {e['failed_requests']} | {e['operate_did'] or '-'} | {e['note']} |")
    demand = demand_rows(out, rows, cycles, args.step_s)
    if demand:
        errs = np.array([d["error_pct"] for d in demand])
        lines += ["", "## Demand read from Prometheus", "",
                  f"Each cycle's requests in the window (`increase()` over {args.step_s:g} s, scraped every 2 s) against "
                  f"those the client sent in it (cycle start to the second: +-1 s of the window): median error "
                  f"{np.median(errs):+.1f} %, |error| <= {np.max(np.abs(errs)):.1f} % over {len(demand)} cycles "
                  "(`increase()` extrapolates to the window's ends).", "",
                  "| cycle | sent | read | error % |", "|---:|---:|---:|---:|"]
        lines += [f"| {d['cycle']} | {d['sent']} | {d['read']:.1f} | {d['error_pct']:+.1f} |" for d in demand]
    lines += ["", "## Latency by hour", "",
              "End-to-end latency of the requests answered (sent to last token: 200 prompt, 40 output tokens; the "
              "client does not stream, so TTFT is not measured here), by the hour they were sent, beside the hour's "
              "rate, the GPUs operate ran and what it decided:", "",
              "| hour | sent | ok | p50 s | p99 s | max s | GPUs at its cycles | decisions |",
              "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for h in range(args.steps):
        sent = [r for r in rows if h * args.step_s <= r["sent_s"] < (h + 1) * args.step_s]
        lat = np.array([r["end_s"] - r["sent_s"] for r in sent if r["status"] == "ok"])
        here = [c for c in cycles if h * args.step_s <= _since_t0(out, c["started"]) < (h + 1) * args.step_s]
        if lat.size:
            lines.append(f"| {h} | {len(sent)} | {lat.size} | {np.percentile(lat, 50):.2f} | {np.percentile(lat, 99):.2f} "
                         f"| {lat.max():.1f} | {', '.join(c['gpus_running'] for c in here) or '-'} | "
                         f"{', '.join(c['decision'] for c in here) or '-'} |")
    lines += ["", "## Cycles", "", "| cycle | decision | GPUs | repaired | differences after | why |",
              "|---:|---|---|---:|---|---|"]
    for c in cycles:
        lines.append(f"| {c['cycle']} | {c['decision']} | {c['gpus_running']} -> {c['gpus_planned'] or '-'} | "
                     f"{c.get('repaired') or 0} | {c.get('differences') or 'none'} | {c['why'][:140]} |")
    lines += ["", "## Reconciliations", "", "| time | differed | steps | after |", "|---|---|---|---|"]
    for x in repairs:
        lines.append(f"| {x['time']} | {x['differed'][:160]} | {x['steps'][:120]} | {x['after'][:80] or 'none'} |")
    if failed:
        lines += ["", "## Failed requests", "", "| id | adapter | sent s | cause | error |", "|---:|---|---:|---|---|"]
        for r in failed[:50]:
            lines.append(f"| {r['id']} | {r['adapter']} | {r['sent_s']} | {r['cause'] or 'UNEXPLAINED'} | "
                         f"{r['error'][:120]} |")
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    result = {"wall_s": round(wall_s, 1), "requests": len(rows), "ok": n_ok, "failed": len(failed), "failed_unexplained": len(unexplained),
              "cycles": len(cycles), "flapping": len(flapping), "differing_cycles": len(differing),
              "loads_twice": loads_twice, "faults": table}
    atomic_write_json(out / "result.json", result, indent=1)
    log_command_run("operate-faults", f"seed{args.seed}", params={"steps": args.steps, "step_s": args.step_s,
                    "seed": args.seed}, metrics={k: v for k, v in result.items() if isinstance(v, (int, float))},
                    artifacts=[out / "report.md", out / "result.json", out / "faults.csv"],
                    tracking_uri=args.tracking_uri, wall_s=wall_s)
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    main()
