"""``lora-opt operate``: the closed loop -- every interval, the demand Prometheus saw over the last window
(:mod:`lora_opt.placement.prometheus_demand`) -> ``replan`` of the placement the fleet runs -> ``apply`` of
the plan (:mod:`lora_opt.apply.run`), with hysteresis: a new plan is carried out only when it saves a GPU or
a GPU of the running placement would starve under the demand, so noise in the demand does not flap the
fleet.

Before each cycle, and every ``reconcile_s`` between cycles, the fleet is reconciled to the placement it
should run (:mod:`lora_opt.apply.reconcile`): a dead instance launched again, a router restarted from an
old file given its table back, what a plan cut short left (adapters loaded, instances launched) undone.
An adapter whose load failed in a plan (its path does not load) is held: later replans keep it where it
runs (``replan``'s ``pinned``), and a plan that would still load it is not carried out (said in the cycle's
row).  After each
cycle the fleet is observed again and what still differs is written (``differences``; empty when it is
the placement).  ``router.json`` in the output folder is the running placement's router table, rewritten
when it changes: a router restarted from it (``lora-opt emulate --routes OUT/router.json``) routes as the
fleet runs from its first request.  Each cycle is one MLflow run (experiment ``operate``) and one line of ``cycles.csv``; ``operate-state.json``
(atomic, after every cycle) holds the placement the fleet runs and the cycle count, so an ``operate``
restarted with the same ``--out`` continues from there.  A cycle whose demand cannot be read (Prometheus
down, no series) changes nothing and says why; the loop goes on.  Ctrl-C stops it between steps: the
state file says what the fleet runs (an apply cut short is resumed by the next cycle's plan, whose steps
are read against the fleet as it is -- :class:`~lora_opt.apply.executor.PlanExecutor`)."""
from __future__ import annotations

import asyncio
import csv
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from lora_opt.apply.executor import ApplyOptions
from lora_opt.apply.reconcile import desired, differences, observe, reconcile
from lora_opt.apply.run import apply_plan
from lora_opt.errors import EXIT_INTERRUPTED, EXIT_OK, InputError
from lora_opt.http_pool import instance_client
from lora_opt.io import atomic_write_json, atomic_write_rows
from lora_opt.placement.evaluate import workload_from_placement
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.prometheus_demand import read_demand, workload_from_demand
from lora_opt.replan.replan import ReplanCosts, replan
from lora_opt.placement.report import write_outputs
from lora_opt.placement.vllm_launch import instance_urls, router_table
from lora_opt.tracking import log_command_run
from twin.parsing import read_json_file

log = logging.getLogger(__name__)

#: MLflow experiment of operate's cycles
EXPERIMENT = "operate"
STATE_FILE = "operate-state.json"
#: the running placement's router table, rewritten whenever it changes: the file a router restarts from
ROUTER_FILE = "router.json"
CYCLE_COLUMNS = ("cycle", "started", "repaired", "router_fixed", "demand_requests", "gpus_running", "gpus_planned",
                 "decision", "why", "steps", "apply_exit", "differences", "wall_s")
RECONCILE_COLUMNS = ("time", "cycle", "differed", "steps", "after", "error")
#: reconciliations more, ``reconcile_s`` apart, while the fleet still differs before a cycle plans
SETTLE_TRIES = 3


@dataclass(frozen=True)
class OperateConfig:
    """How ``operate`` reads demand and reaches the fleet."""

    prometheus: str
    """The Prometheus server that scrapes the gateway (``--prometheus``)."""
    router: str
    """The router's URL (route steps; ``lora-opt emulate --router-port``)."""
    window: str = "5m"
    """The demand window ending at each cycle's start (a Prometheus duration)."""
    interval_s: float = 60.0
    """Wall seconds from one cycle's start to the next."""
    reconcile_s: float = 5.0
    """Wall seconds between two reconciliations of the fleet to its placement between cycles (0: only at
    each cycle's start)."""
    cycles: int | None = None
    """Cycles to run (None: until Ctrl-C)."""
    host: str = "127.0.0.1"
    """Host of the instances (the plan's URLs)."""
    base_port: int = 8000
    """GPU i's instance listens on ``base_port + i``."""
    costs: ReplanCosts = field(default_factory=ReplanCosts)
    """replan's move and restart costs."""
    apply: ApplyOptions = field(default_factory=ApplyOptions)
    """How each plan is carried out (``router`` is set from :attr:`router`)."""

    def __post_init__(self):
        if not self.interval_s > 0:
            raise InputError(f"--interval-s: must be > 0, got {self.interval_s}")
        if not self.reconcile_s >= 0:
            raise InputError(f"--reconcile-s: must be >= 0, got {self.reconcile_s}")
        if self.cycles is not None and self.cycles < 1:
            raise InputError(f"--cycles: must be >= 1, got {self.cycles}")


def gpus_in_use(p: Placement) -> int:
    return sum(1 for g in range(len(p.gpus)) if p.adapters_on(g))


def decide(current: Placement, planned: Placement, starving: list) -> tuple[bool, str]:
    """Hysteresis: act only for a saved GPU or a starving one."""
    if starving:
        return True, f"the running placement starves under the demand ({', '.join(map(str, starving))})"
    now, then = gpus_in_use(current), planned.meta.get("gpus_used")
    if then is not None and then < now:
        return True, f"saves {now - then} GPU(s) ({now} -> {then})"
    return False, f"no GPU saved ({now} -> {then}) and none starving: the fleet is kept"


class Operator:
    """The loop's state: the placement the fleet runs (``current``) and the cycles so far."""

    def __init__(self, start: str | Path, cfg: OperateConfig, policy, out: str | Path, *, track: bool = True,
                 tracking_uri: str | None = None):
        self.cfg, self.policy, self.out, self.track, self.tracking_uri = cfg, policy, Path(out), track, tracking_uri
        self.out.mkdir(parents=True, exist_ok=True)
        state = self.out / STATE_FILE
        self.cycle, self.rows = 0, []
        self.current_path = Path(start)
        self.known: list[str] = []          # every address a plan of this loop put an instance on
        self.held: dict[str, str] = {}      # adapter id -> why its load failed (later plans loading it are not run)
        self.repairs: list[dict] = []
        if state.is_file():                 # a restarted operate continues where the last one stopped
            try:
                saved = read_json_file(state, "operate state", InputError, allow_nan=True)
                self.current_path, self.cycle, self.rows = Path(saved["current"]), int(saved["cycle"]), saved["rows"]
                self.known, self.held = list(saved.get("known", [])), dict(saved.get("held", {}))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InputError(f"--out: {state} cannot be read ({exc}); remove it to start afresh") from None
            log.info("continuing from cycle %d: the fleet runs %s", self.cycle, self.current_path)
            if (self.out / "reconcile.csv").is_file():
                with open(self.out / "reconcile.csv", newline="") as f:
                    self.repairs = list(csv.DictReader(f))
        self.current = Placement.load(self.current_path)
        self._remember(self.current)
        self._save()

    def _remember(self, p: Placement) -> None:
        for u in instance_urls(p, host=self.cfg.host, base_port=self.cfg.base_port):
            if u not in self.known:
                self.known.append(u)

    def _save(self) -> None:
        atomic_write_json(self.out / STATE_FILE, {"current": str(self.current_path), "cycle": self.cycle,
                                                  "rows": self.rows, "known": self.known, "held": self.held}, indent=1)
        table = router_table(self.current, host=self.cfg.host, base_port=self.cfg.base_port)
        router = self.out / ROUTER_FILE
        if not router.is_file() or read_json_file(router, "router table", InputError, allow_nan=True) != table:
            atomic_write_json(self.out / ROUTER_FILE, table, indent=1)

    def reconcile(self, settle: bool = False):
        """The fleet back to the running placement (:func:`lora_opt.apply.reconcile.reconcile`); a line of
        ``reconcile.csv`` when anything differed.  ``settle``: while something still differs (a router being
        restarted, an instance still starting), again after ``reconcile_s`` (1 s if 0), up to SETTLE_TRIES
        times -- before a cycle plans and after a plan that failed."""
        r = self._reconcile_once()
        for _ in range(SETTLE_TRIES if settle else 0):
            if not r.after and not r.error:
                break
            time.sleep(self.cfg.reconcile_s or 1.0)
            r = self._reconcile_once()
        return r

    def _reconcile_once(self):
        opts = dataclasses.replace(self.cfg.apply, router=self.cfg.router, log_dir=self.out / "logs")
        r = asyncio.run(reconcile(self.current, opts=opts, host=self.cfg.host, base_port=self.cfg.base_port,
                                  known=self.known))
        if r.before:
            self.repairs.append({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cycle": self.cycle,
                                 "differed": "; ".join(r.before), "after": "; ".join(r.after), "error": r.error,
                                 "steps": "; ".join(f"{s['action']} {s['instance']} {s['status']}" for s in r.steps)})
            atomic_write_rows(self.out / "reconcile.csv", self.repairs, RECONCILE_COLUMNS)
            log.info("reconciled: %s -> %s", "; ".join(r.before)[:200], "; ".join(r.after)[:200] or "the placement")
        return r

    def differences(self) -> str:
        """What differs now between the fleet and the running placement ('' : nothing)."""
        async def look():
            async with instance_client() as client:
                urls = set(desired(self.current, host=self.cfg.host, base_port=self.cfg.base_port)) | set(self.known)
                return await observe(client, urls, self.cfg.router)
        return "; ".join(differences(self.current, asyncio.run(look()), host=self.cfg.host,
                                     base_port=self.cfg.base_port, router=self.cfg.router))

    def held_back(self, plan: dict, planned: Placement) -> list[str]:
        """The held adapters ``plan`` would load (a load step, or a launch whose GPU serves them)."""
        loads = {s.get("adapter") for s in plan.get("steps", []) if s.get("action") == "load"}
        for s in plan.get("steps", []):
            if s.get("action") == "launch" and s.get("new_gpu") is not None:
                loads |= {a.id for a in planned.adapters_on(int(s["new_gpu"]))}
        return sorted(a for a in loads if a in self.held)

    def run_cycle(self) -> dict:
        """One cycle: the router's table checked -> demand -> replan -> (hysteresis) apply; the row of
        ``cycles.csv``."""
        t0 = time.time()
        self.cycle += 1
        row = {"cycle": self.cycle, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
               "demand_requests": None, "gpus_running": gpus_in_use(self.current), "gpus_planned": None,
               "decision": "keep", "why": "", "steps": 0, "apply_exit": None, "router_fixed": None, "repaired": None,
               "differences": None}
        folder = self.out / f"cycle-{self.cycle:04d}"
        fixed = self.reconcile(settle=True)
        row["repaired"] = len(fixed.steps)
        row["router_fixed"] = sum(len(s.get("adapters", [])) for s in fixed.steps if s["action"] == "route")
        down = [d for d in fixed.after if d.startswith("router ")]
        if down:                            # a router that cannot be read: nothing can change now
            row["why"] = f"the router cannot be read or set ({down[0]})"
            return self._close(row, t0, [])
        try:
            demand = read_demand(self.cfg.prometheus, self.cfg.window, at=t0)
            wl = workload_from_demand(workload_from_placement(self.current), demand)
        except InputError as exc:           # Prometheus down, no series, ...: the fleet is left as it is
            row["why"] = f"no demand read: {exc}"
            return self._close(row, t0, [])
        row["demand_requests"] = round(demand.requests, 3)
        wl = dataclasses.replace(wl, name=f"operate-{self.cycle:04d}")
        ctx = PlacementContext.for_workload(wl, None)
        # held adapters stay where they run (pinned), and no instance running one is launched anew (a restart
        # would start it with that adapter on its command line, which vLLM refuses to start with)
        r = replan(self.current, wl, self.policy, ctx, costs=self.cfg.costs, host=self.cfg.host,
                   base_port=self.cfg.base_port, pinned=frozenset(self.held), restarts=not self.held)
        row["gpus_planned"] = r.placement.meta.get("gpus_used")
        act, row["why"] = decide(self.current, r.placement, r.plan.get("starving_at_start") or [])
        written = []
        held = self.held_back(r.plan, r.placement) if act else []
        if held:
            act, row["why"] = False, (f"{row['why']}; not carried out: it loads {', '.join(held[:5])}, whose load "
                                      f"failed ({self.held[held[0]][:120]})")
        if act:
            written = write_outputs(r.placement, ctx.profile, folder, emit_vllm=False, model=None)
            plan = {"current": str(self.current_path), "workload": wl.name, **r.plan}
            written.append(atomic_write_json(folder / "plan.json", plan, indent=1))
            self.carry_out(folder, r.placement, r.plan["steps"], row)
        return self._close(row, t0, written)

    def carry_out(self, folder: Path, placement: Placement, steps: list, row: dict) -> None:
        """``apply`` of the plan in ``folder`` (leading to ``placement``); ``row``'s decision, steps and exit set.
        A plan that fails: the adapters whose load failed held, the fleet reconciled back to the running
        placement."""
        self._remember(placement)
        self._save()                        # a kill -9 during the apply: the next operate knows where it launched
        opts = dataclasses.replace(self.cfg.apply, router=self.cfg.router)
        summary, code = apply_plan(folder, opts=opts, out=folder / "apply", keep_launched=True, track=False)
        row.update(decision="applied" if code == EXIT_OK else "apply failed", steps=len(summary["steps"]),
                   apply_exit=code)
        if code == EXIT_OK:
            self.current, self.current_path = placement, folder / "placement.json"
            return
        self._hold_failed_loads(summary["steps"], steps)
        failed = [s for s in summary["steps"] if s["status"] == "failed"]
        row["why"] += (f"; step {failed[0]['step']} ({failed[0]['action']}) failed: {failed[0]['detail'][:120]}"
                       if failed else "; the plan did not finish")
        self.reconcile(settle=True)

    def _hold_failed_loads(self, results: list, steps: list) -> None:
        by_step = {s.get("step"): s for s in steps}
        for res in results:
            if res["action"] == "load" and res["status"] == "failed":
                aid = by_step.get(res["step"], {}).get("adapter")
                if aid:
                    self.held[aid] = f"cycle {self.cycle}: {res['detail']}"

    def _close(self, row: dict, t0: float, written: list) -> dict:
        row["wall_s"] = round(time.time() - t0, 3)
        self.rows.append(row)
        row["differences"] = self.differences()
        atomic_write_rows(self.out / "cycles.csv", self.rows, CYCLE_COLUMNS)
        self._save()
        log_command_run(EXPERIMENT, f"cycle-{self.cycle:04d}", params={"prometheus": self.cfg.prometheus,
                        "window": self.cfg.window, "router": self.cfg.router, "current": str(self.current_path)},
                        metrics={k: row[k] for k in ("demand_requests", "gpus_running", "gpus_planned", "steps")
                                 if isinstance(row[k], (int, float))},
                        artifacts=[p for p in written if p is not None], tracking_uri=self.tracking_uri,
                        track=self.track, wall_s=row["wall_s"])
        log.info("cycle %d: %s -- %s", row["cycle"], row["decision"], row["why"])
        return row


def operate(start: str | Path, cfg: OperateConfig, policy, out: str | Path, *, track: bool = True,
            tracking_uri: str | None = None, on_cycle=None) -> int:
    """Run cycles every ``interval_s`` until ``cycles`` are done (or Ctrl-C: EXIT_INTERRUPTED, the state
    written).  ``on_cycle(row)`` after each."""
    op = Operator(start, cfg, policy, out, track=track, tracking_uri=tracking_uri)
    done = 0
    try:
        while cfg.cycles is None or done < cfg.cycles:
            t = time.monotonic()
            row = op.run_cycle()
            done += 1
            if on_cycle is not None:
                on_cycle(row)
            if cfg.cycles is not None and done >= cfg.cycles:
                break
            while (left := cfg.interval_s - (time.monotonic() - t)) > 0:
                if cfg.reconcile_s <= 0 or left <= cfg.reconcile_s:
                    time.sleep(left)
                    break
                time.sleep(cfg.reconcile_s)
                op.reconcile()
    except KeyboardInterrupt:
        log.warning("operate: interrupted after cycle %d; the fleet runs %s (%s)", op.cycle, op.current_path,
                    op.out / STATE_FILE)
        return EXIT_INTERRUPTED
    return EXIT_OK
