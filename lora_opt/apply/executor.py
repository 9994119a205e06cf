"""Carrying out a replan's ``plan.json`` on a running fleet, step by step, while it serves.

Each step is what ``lora_opt.replan.replan_steps`` wrote, done the way vLLM takes it:

* ``unload`` / ``load``: the step's HTTP call to the instance (vLLM's runtime LoRA endpoints:
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); ``--adapter-dir`` replaces the adapter path;
* ``launch``: the new placement's own ``vllm serve`` command for that GPU (as ``lora-opt place
  --emit-vllm`` writes it), started as a subprocess and waited for on ``/health``; ``server_cmd``
  replaces ``vllm serve MODEL`` (``lora-opt emulate --profile P --speed S`` for an emulated fleet,
  as ``lora-opt probe --launch`` does);
* ``route``: ``POST /router/routes`` on the router (lora-opt's emulate router; another router's
  table is the operator's to switch, and the step fails saying so);
* ``drain``: with a router, first ``POST /router/retire`` (it sends the instance nothing more, routed or
  not) and ``GET /router/routes`` polled until its ``in_flight`` to the instance is 0 -- a request the
  router picked it for may not have reached it yet, which ``/metrics`` cannot see --; then ``/metrics``
  polled until ``vllm:num_requests_running + vllm:num_requests_waiting`` is 0 on two reads in a row;
* ``stop``: an instance this executor launched is terminated; an emulated one gets ``POST
  /emulator/shutdown``; any other is left running for its operator (it has no traffic now).

After ``route`` and before the unloads that follow it, the executor waits until the router has
no request for the old instance still on its way (``GET /router/routes`` ``connecting``: picked
before the switch, not yet answered -- it may name the adapter about to go), then
``unload_grace_s`` more.

A reconciler, not a script: before each step the executor reads whether the step's effect is already in
place on the fleet (the adapter loaded or gone per the instance's ``/v1/models``, the router's table as the
step's, the instance answering ``/health`` or not) and then marks it ``done`` without acting -- so applying
a half-applied plan again resumes it.  A step that fails is tried again (``retries``, after ``retry_wait_s``),
each time after reading the fleet again; an instance the new placement keeps that no longer answers is
launched again first, with the new placement's command for its GPU (its adapters the final ones: the
steps that load them are then ``done``) -- before any step (preflight) and before a retry.  The first
step that still fails stops the run (later steps are ``skipped``): the fleet stays in the last state the
plan judged, never in one it did not.  ``progress.json`` in the output folder holds every step's outcome
as it happens (a crash leaves it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement
from lora_opt.replan.replan_steps import RUNTIME_LORA_ENV
from lora_opt.placement.vllm_launch import resolve_vllm_version, serve_command
from lora_opt.probe.launch import LaunchedServer, ServeCommand, parse_serve_command
from lora_opt.validate.live import parse_scrape
from twin.profile import load_profile

#: the actions a plan's steps take
ACTIONS = ("unload", "load", "launch", "route", "drain", "stop")
#: wall seconds an HTTP call of a step may take
CALL_TIMEOUT_S = 30.0
def step_routes(s: dict) -> dict:
    """A route step's table in the router's shape: adapter id -> [{endpoint, weight}]."""
    return {aid: [{"endpoint": url.rstrip("/") + "/v1", "weight": w} for _, url, w in dests]
            for aid, dests in s["weights"].items()}


def route_shares(entries: list) -> dict:
    """Endpoint -> its share of an adapter's routes: two tables route alike when these are equal."""
    total = sum(float(e["weight"]) for e in entries) or 1.0
    return {e["endpoint"].rstrip("/"): round(float(e["weight"]) / total, 9) for e in entries}


#: the statuses of a step that leave the plan going: done by this run, found in effect, left to the operator
SUCCESS = ("ok", "done", "left")


@dataclass(frozen=True)
class ApplyOptions:
    """How the executor reaches the fleet."""

    router: str | None = None
    """The router's base URL (``http://host:port``): route steps ``POST /router/routes`` there."""
    model: str | None = None
    """``vllm serve MODEL`` of launches (default: the profile's model name)."""
    server_cmd: str | None = None
    """Replaces ``vllm serve MODEL`` in launches (e.g. ``lora-opt emulate --profile P --speed S``)."""
    adapter_dir: str | None = None
    """Adapters load from ``ADAPTER_DIR/<id>`` instead of their placement path."""
    log_dir: Path = Path("apply-logs")
    """Where launched servers write their logs."""
    unload_grace_s: float = 0.5
    """Wall seconds between a route switch and the unloads that follow it."""
    drain_timeout_s: float = 600.0
    """Wall seconds a drain may take before the step fails."""
    poll_s: float = 0.25
    """Wall seconds between a drain's reads of ``/metrics``."""
    health_timeout_s: float = 900.0
    """Wall seconds a launched server has to answer ``/health``."""
    retries: int = 2
    """Times a failed step is tried again (after reading the fleet again, and launching a kept instance
    that no longer answers)."""
    retry_wait_s: float = 1.0
    """Wall seconds before a failed step is tried again."""


@dataclass
class StepResult:
    """What one step did (wall seconds from the executor's clock origin)."""

    step: int
    action: str
    instance: str
    started_s: float = float("nan")
    ended_s: float = float("nan")
    status: str = "skipped"
    """``ok``, ``done`` (its effect was in place already: not acted on), ``failed``, ``skipped`` (an earlier
    step failed) or ``left`` (a stop left to the operator)."""
    detail: str = ""
    tries: int = 0
    """Times the step was carried out (0: done already or skipped)."""


@dataclass
class PlanExecutor:
    """Runs a plan's steps in order on the live fleet; :attr:`routed` follows the router's table
    (the adapters a client may ask for now: traffic for an adapter new to the workload waits for
    its route step)."""

    plan: dict
    placement: Placement
    """The placement the plan leads to (launches use its flags and adapters)."""
    opts: ApplyOptions = field(default_factory=ApplyOptions)
    t0: float = field(default_factory=time.perf_counter)
    routed: set = field(default_factory=set)
    results: list = field(default_factory=list)
    launched: dict = field(default_factory=dict)

    def __post_init__(self):
        steps = self.plan.get("steps")
        if not isinstance(steps, list) or not all(isinstance(s, dict) and s.get("action") in ACTIONS for s in steps):
            raise InputError(f"plan: 'steps' must be a list of steps with an action in {', '.join(ACTIONS)}")
        self.endpoints = dict(self.plan.get("endpoints") or {})
        # the instances serving when the plan starts (kept or to be stopped), in the plan's order
        self.running = [it["instance"] for it in self.plan.get("instances", []) if it.get("current_gpu") is not None]
        # instance -> its GPU in the new placement, for those the plan keeps (a dead one is launched again)
        self.kept = {it["instance"]: int(it["new_gpu"]) for it in self.plan.get("instances", [])
                     if it.get("action") == "keep" and it.get("new_gpu") is not None}
        self.stopping = {it["instance"]: it.get("action") == "stop" for it in self.plan.get("instances", [])}
        self.results = [StepResult(s.get("step", k + 1), s["action"], str(s.get("instance", "")))
                        for k, s in enumerate(steps)]
        if any(s["action"] == "route" for s in steps) and not self.opts.router:
            raise InputError("--router: the plan switches routes; give the router's URL (lora-opt emulate --router-port)")

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def running_urls(self) -> list[str]:
        """The URLs of the instances running when the plan starts (kept or to be stopped)."""
        return [self.endpoints[n] for n in self.running if n in self.endpoints]

    def live(self) -> dict[str, str]:
        """Instance name -> URL of those serving now: running at the start and not stopped by a
        step that ran, and those this executor launched."""
        stopped = {r.instance for r in self.results if r.action == "stop" and r.status in ("ok", "done")}
        names = self.running + [n for n in self.launched if self.launched[n].proc is not None]
        return {n: self.endpoints[n] for n in names if n not in stopped and n in self.endpoints}

    async def preflight(self, client) -> None:
        """Every instance the plan keeps or stops answers ``/health``; the router's table is read
        (``routed``).  Raises :class:`InputError` naming what does not answer."""
        dead = []
        for name in sorted(self.running):
            url = self.endpoints.get(name)
            if url is None or await self.healthy(client, url) or self.stopping.get(name):
                continue                # a dead instance the plan stops: its drain and stop are done already
            why = await self.revive(name) if name in self.kept else "not kept on a GPU of the new placement"
            if why:
                dead.append(f"{name} ({url}; {why})")
        if dead:
            raise InputError(f"plan: instances not answering /health: {', '.join(dead)}")
        if self.opts.router:
            doc = await self._router_table(client)
            self.routed = set(doc.get("routes", {}))
            known = {u.rstrip("/") + "/v1" for u in self.endpoints.values()}
            foreign = sorted({e["endpoint"].rstrip("/") for es in doc.get("routes", {}).values() for e in es} - known)
            if foreign:
                raise InputError(f"--router: its table routes to {', '.join(foreign[:3])}, which are not the plan's "
                                 "instances (was the plan made with the fleet's --host and --base-port?)")

    async def _router_table(self, client) -> dict:
        try:
            r = await client.get(f"{self.opts.router.rstrip('/')}/router/routes", timeout=5.0)
        except Exception as exc:        # noqa: BLE001
            raise InputError(f"--router {self.opts.router}: not reachable ({type(exc).__name__})") from None
        if r.status_code != 200:
            raise InputError(f"--router {self.opts.router}: GET /router/routes answered {r.status_code}; route steps "
                             "need lora-opt's router (lora-opt emulate --router-port); switch another router's "
                             "table by hand")
        return r.json()

    async def run(self, client, on_step=None) -> list[StepResult]:
        """Every step in order, each unless its effect is in place already, tried again when it fails;
        stops at the first that still fails.  ``on_step(result)`` after each."""
        steps = self.plan["steps"]
        for k, s in enumerate(steps):
            res = self.results[k]
            res.started_s = self.now()
            await self._reconcile(client, s, steps[k - 1] if k else None, res)
            res.ended_s = self.now()
            if on_step is not None:
                on_step(res)
            if res.status == "failed":
                break
        return self.results

    async def _reconcile(self, client, s: dict, previous: dict | None, res: StepResult) -> None:
        revived = False
        for attempt in range(self.opts.retries + 1):
            try:
                found = await self.in_effect(client, s)
            except Exception:           # noqa: BLE001 - a fleet that cannot be read: act
                found = ""
            if found:
                res.status, res.detail = ("done", f"in effect already: {found}") if attempt == 0 else (
                    "ok", f"in effect after {res.tries} failed {'try' if res.tries == 1 else 'tries'}"
                          f"{' and a launch' if revived else ''}: {found}")
                if s["action"] == "route":
                    self._note_routes(s)
                return
            if attempt:
                await asyncio.sleep(self.opts.retry_wait_s)
                if s.get("instance") in self.kept and not await self.healthy(client, self.endpoints[s["instance"]]):
                    why = await self.revive(s["instance"])
                    if why:
                        res.detail += f"; launching it again failed: {why}"
                        return
                    revived = True
                    continue                # read the fleet again: the relaunch may have done the step
            res.tries += 1
            try:
                res.status, res.detail = await self._do(client, s, previous)
            except Exception as exc:    # noqa: BLE001 - a step that fails is a result, the fleet stays as it is
                res.status, res.detail = "failed", f"{type(exc).__name__}: {exc}"
            if res.status != "failed":
                if attempt:
                    res.detail += f" (try {attempt + 1})"
                return

    async def healthy(self, client, url: str) -> bool:
        try:
            return (await client.get(f"{url}/health", timeout=5.0)).status_code == 200
        except Exception:               # noqa: BLE001 - any failure to answer is "not running"
            return False

    async def _loaded(self, client, url: str) -> set | None:
        """The model ids an instance serves (``/v1/models``); None when it does not answer them."""
        try:
            r = await client.get(f"{url}/v1/models", timeout=CALL_TIMEOUT_S)
            return {m["id"] for m in r.json()["data"]} if r.status_code == 200 else None
        except Exception:               # noqa: BLE001
            return None

    async def in_effect(self, client, s: dict) -> str:
        """Why the step's effect is already in place on the fleet ('' when it is not, or cannot be read)."""
        action = s["action"]
        if action in ("load", "unload"):
            name = s["request"]["json"]["lora_name"]
            ids = await self._loaded(client, self.endpoints.get(s["instance"]) or s["request"]["url"].rsplit("/v1/", 1)[0])
            if ids is None or (name in ids) != (action == "load"):
                return ""
            return f"{name} {'is' if action == 'load' else 'is not'} loaded on {s['instance']}"
        if action == "route":
            have = (await self._router_table(client)).get("routes", {})
            if any(route_shares(have.get(aid, [])) != route_shares(es) for aid, es in step_routes(s).items()):
                return ""
            return f"the router routes {len(s['weights'])} adapter(s) so already"
        url = s.get("url") if action == "launch" else self.endpoints.get(s["instance"])
        up = url is not None and await self.healthy(client, url)
        if action == "launch" and up:
            self.endpoints[s["instance"]] = url
            return f"{s['instance']} answers /health at {url}"
        if action in ("drain", "stop") and not up:
            return f"{s['instance']} is not running"
        return ""

    async def diff(self, client) -> list[dict]:
        """What the plan would still do, acting on nothing (``apply --dry-run``): per step ``in effect``
        (and why) or ``to do``; per instance the plan keeps or stops, whether it answers.  Each step is read
        against the fleet as it is now, not as the steps before it would leave it."""
        rows = []
        for name in self.running:
            url = self.endpoints.get(name)
            up = url is not None and await self.healthy(client, url)
            fate = "stop" if self.stopping.get(name) else "keep"
            if up:
                detail = url
            else:
                detail = f"{url}: would be launched again" if name in self.kept else f"{url}: not answering"
            rows.append({"step": None, "action": fate, "instance": name, "state": "answers" if up else "DEAD",
                         "detail": detail or ""})
        for s in self.plan["steps"]:
            try:
                found = await self.in_effect(client, s)
            except Exception as exc:    # noqa: BLE001 - reported, nothing done
                found, why = "", f"cannot read the fleet: {type(exc).__name__}: {exc}"
            else:
                why = s.get("why", "")
            rows.append({"step": s.get("step"), "action": s["action"], "instance": str(s.get("instance", "")),
                         "state": "in effect" if found else "to do", "detail": found or why})
        return rows

    async def revive(self, name: str) -> str:
        """Launch a kept instance that no longer answers again, with the new placement's command for its
        GPU, on its URL; '' when it answers, else why not."""
        status, detail = await self._launch({"instance": name, "new_gpu": self.kept[name], "url": self.endpoints[name]})
        return "" if status == "ok" else detail

    def _note_routes(self, s: dict) -> None:
        self.routed |= {a for a, dests in s["weights"].items() if dests}
        self.routed -= {a for a, dests in s["weights"].items() if not dests}

    async def _do(self, client, s: dict, previous: dict | None) -> tuple[str, str]:
        action = s["action"]
        if action in ("load", "unload"):
            if action == "unload" and previous is not None and previous["action"] == "route":
                await self._settle(client, s["request"]["url"])
            req = dict(s["request"])
            body = dict(req["json"])
            if action == "load" and self.opts.adapter_dir:
                body["lora_path"] = str(Path(self.opts.adapter_dir) / body["lora_name"])
            r = await client.post(req["url"], json=body, timeout=CALL_TIMEOUT_S)
            ok = r.status_code == 200
            return ("ok" if ok else "failed"), f"HTTP {r.status_code}: {r.text.strip()[:200]}"
        if action == "route":
            table = step_routes(s)
            r = await client.post(f"{self.opts.router.rstrip('/')}/router/routes", json={"routes": table},
                                  timeout=CALL_TIMEOUT_S)
            if r.status_code != 200:
                return "failed", f"router answered HTTP {r.status_code}: {r.text.strip()[:200]}"
            self._note_routes(s)
            return "ok", f"{len(table)} adapter(s) switched"
        if action == "launch":
            return await self._launch(s)
        if action == "drain":
            return await self._drain(client, self.endpoints[s["instance"]])
        return await self._stop(client, s["instance"])

    async def _settle(self, client, unload_url: str) -> None:
        """Before the unloads that follow a route switch: wait until the router has no request
        picked for that instance still on its way (``connecting``: sent, not yet answered -- it may
        name the adapter being unloaded), then ``unload_grace_s`` more."""
        endpoint = unload_url.rsplit("/v1/", 1)[0].rstrip("/") + "/v1"
        t = time.perf_counter()
        while time.perf_counter() - t < CALL_TIMEOUT_S:
            r = await client.get(f"{self.opts.router.rstrip('/')}/router/routes", timeout=CALL_TIMEOUT_S)
            if r.status_code != 200 or not r.json().get("connecting", {}).get(endpoint, 0):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(self.opts.unload_grace_s)

    def launch_command(self, s: dict) -> ServeCommand:
        """The ``vllm serve`` command of a launch step: the new placement's flags and adapters for
        its GPU (``new_gpu``), on the step's URL, with the step's environment (runtime LoRA
        updating on) -- the command ``lora-opt place --emit-vllm`` writes for that GPU."""
        g = int(s["new_gpu"])
        p = self.placement
        adapters = p.adapters_on(g)
        if self.opts.adapter_dir:
            adapters = [dataclasses.replace(a, path=str(Path(self.opts.adapter_dir) / a.id)) for a in adapters]
        prof = load_profile(p.profile)
        u = urlparse(s["url"])
        argv = serve_command(p, g, self.opts.model or prof.model.name, host=u.hostname or "127.0.0.1",
                             port=u.port or 80, adapters=adapters, block_size=prof.memory.block_size,
                             vllm_version=resolve_vllm_version(None, getattr(prof, "vllm_version", None), InputError))
        return parse_serve_command(f"{s.get('env', RUNTIME_LORA_ENV)} {shlex.join(argv)}")

    async def _launch(self, s: dict) -> tuple[str, str]:
        cmd = self.launch_command(s)
        srv = LaunchedServer(cmd, server_cmd=self.opts.server_cmd, log_path=self.opts.log_dir / f"{s['instance']}.log",
                             health_timeout_s=self.opts.health_timeout_s)
        self.launched[s["instance"]] = srv
        self.endpoints[s["instance"]] = s["url"]
        started = await asyncio.to_thread(srv.start)
        if not started:
            return "failed", f"exited with {srv.exit_code} before /health answered: {srv.log_tail()}"
        return "ok", f"healthy after {srv.startup_s:.1f} s: {shlex.join(cmd.argv(self.opts.server_cmd))[:300]}"

    async def _drain(self, client, url: str) -> tuple[str, str]:
        t = time.perf_counter()
        if self.opts.router:
            why = await self._retire(client, url, t)
            if why:
                return "failed", why
        zero_reads = 0
        while time.perf_counter() - t < self.opts.drain_timeout_s:
            r = await client.get(f"{url}/metrics", timeout=CALL_TIMEOUT_S)
            if r.status_code != 200:
                return "failed", f"/metrics answered HTTP {r.status_code}"
            v = parse_scrape([ln for ln in r.content.split(b"\n") if ln.startswith(b"vllm:num_requests")])
            zero_reads = zero_reads + 1 if v["running"] + v["waiting"] == 0 else 0
            if zero_reads >= 2:
                return "ok", f"empty after {time.perf_counter() - t:.2f} s"
            await asyncio.sleep(self.opts.poll_s)
        return "failed", f"still serving after {self.opts.drain_timeout_s:g} s"

    async def _retire(self, client, url: str, t: float) -> str:
        """The router sends nothing more to ``url`` (``POST /router/retire``) and every request it sent there
        has ended (``in_flight`` 0): only then can ``/metrics`` say the instance is empty -- a request the
        router picked it for may not have reached it yet.  '' when done, else why not."""
        router = self.opts.router.rstrip("/")
        endpoint = url.rstrip("/") + "/v1"
        r = await client.post(f"{router}/router/retire", json={"endpoint": endpoint}, timeout=CALL_TIMEOUT_S)
        if r.status_code != 200:
            return f"the router would not retire {endpoint}: HTTP {r.status_code}: {r.text.strip()[:200]}"
        # adapters only it served: fine for tenants the new placement dropped, a wrong plan for any it keeps
        kept = sorted(set(r.json().get("unrouted", [])) & {a.id for a in self.placement.adapters})
        if kept:
            return (f"{endpoint} was the router's only instance of {', '.join(kept[:5])}, which the new placement "
                    "keeps: their requests have nowhere to go")
        while time.perf_counter() - t < self.opts.drain_timeout_s:
            r = await client.get(f"{router}/router/routes", timeout=CALL_TIMEOUT_S)
            if r.status_code == 200 and not r.json().get("in_flight", {}).get(endpoint, 0):
                return ""
            await asyncio.sleep(self.opts.poll_s)
        return f"the router still had requests in flight to {endpoint} after {self.opts.drain_timeout_s:g} s"

    async def _stop(self, client, name: str) -> tuple[str, str]:
        srv = self.launched.get(name)
        if srv is not None:
            await asyncio.to_thread(srv.stop)
            return "ok", "terminated (launched by this run)"
        url = self.endpoints[name]
        r = await client.post(f"{url}/emulator/shutdown", timeout=CALL_TIMEOUT_S)
        if r.status_code == 200:        # it exits at its next tick: the step is done once it answers no more
            t = time.perf_counter()
            while await self.healthy(client, url):
                if time.perf_counter() - t > CALL_TIMEOUT_S:
                    return "failed", f"still answering /health {CALL_TIMEOUT_S:g} s after POST /emulator/shutdown"
                await asyncio.sleep(0.05)
            return "ok", "emulated instance shut down"
        return "left", (f"not started by lora-opt (POST /emulator/shutdown: HTTP {r.status_code}): it has no traffic "
                        "now; stop its vLLM process")

    def close(self) -> None:
        """Stop every server this executor launched (they end with it)."""
        for srv in self.launched.values():
            srv.stop()
