"""``lora-opt operate``: the closed loop -- every interval, the demand Prometheus saw over the last window
(:mod:`lora_opt.placement.prometheus_demand`) -> ``replan`` of the placement the fleet runs -> ``apply`` of
the plan (:mod:`lora_opt.apply.run`), with hysteresis: a new plan is carried out only when it saves a GPU or
a GPU of the running placement would starve under the demand, so noise in the demand does not flap the
fleet.

Each cycle first puts the router's table back to the running placement's where it differs (a router
restarted from its own file gets its table back).  Each cycle is one MLflow run (experiment ``operate``) and one line of ``cycles.csv``; ``operate-state.json``
(atomic, after every cycle) holds the placement the fleet runs and the cycle count, so an ``operate``
restarted with the same ``--out`` continues from there.  A cycle whose demand cannot be read (Prometheus
down, no series) changes nothing and says why; the loop goes on.  Ctrl-C stops it between steps: the
state file says what the fleet runs (an apply cut short is resumed by the next cycle's plan, whose steps
are read against the fleet as it is -- :class:`~lora_opt.apply.executor.PlanExecutor`)."""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from lora_opt.apply.executor import ApplyOptions, route_shares
from lora_opt.apply.run import apply_plan
from lora_opt.errors import EXIT_INTERRUPTED, EXIT_OK, InputError
from lora_opt.io import atomic_write_json, atomic_write_rows
from lora_opt.placement.evaluate import workload_from_placement
from lora_opt.placement.plan import Placement
from lora_opt.placement.policies import PlacementContext
from lora_opt.placement.prometheus_demand import read_demand, workload_from_demand
from lora_opt.placement.replan import ReplanCosts, replan
from lora_opt.placement.report import write_outputs
from lora_opt.placement.vllm_launch import router_table
from lora_opt.tracking import log_command_run

log = logging.getLogger(__name__)

#: MLflow experiment of operate's cycles
EXPERIMENT = "operate"
STATE_FILE = "operate-state.json"
CYCLE_COLUMNS = ("cycle", "started", "router_fixed", "demand_requests", "gpus_running", "gpus_planned", "decision",
                 "why", "steps", "apply_exit", "wall_s")


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
        if state.is_file():                 # a restarted operate continues where the last one stopped
            try:
                saved = json.loads(state.read_text())
                self.current_path, self.cycle, self.rows = Path(saved["current"]), int(saved["cycle"]), saved["rows"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InputError(f"--out: {state} cannot be read ({exc}); remove it to start afresh") from None
            log.info("continuing from cycle %d: the fleet runs %s", self.cycle, self.current_path)
        self.current = Placement.load(self.current_path)

    def sync_router(self) -> int:
        """The router's table back to the running placement's where it differs (a restarted router starts
        from its own file): the adapters whose routes were rewritten."""
        import httpx  # only when operating

        want = router_table(self.current, host=self.cfg.host, base_port=self.cfg.base_port)
        url = f"{self.cfg.router.rstrip('/')}/router/routes"
        with httpx.Client(timeout=30.0, trust_env=False) as c:
            have = c.get(url).raise_for_status().json().get("routes", {})
            diff = {a: es for a, es in want.items() if route_shares(have.get(a, [])) != route_shares(es)}
            if diff:
                c.post(url, json={"routes": diff}).raise_for_status()
        return len(diff)

    def run_cycle(self) -> dict:
        """One cycle: the router's table checked -> demand -> replan -> (hysteresis) apply; the row of
        ``cycles.csv``."""
        t0 = time.time()
        self.cycle += 1
        row = {"cycle": self.cycle, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
               "demand_requests": None, "gpus_running": gpus_in_use(self.current), "gpus_planned": None,
               "decision": "keep", "why": "", "steps": 0, "apply_exit": None, "router_fixed": None}
        folder = self.out / f"cycle-{self.cycle:04d}"
        try:
            row["router_fixed"] = self.sync_router()
        except Exception as exc:            # noqa: BLE001 - a router that cannot be read: nothing can change now
            row["why"] = f"the router at {self.cfg.router} cannot be read or set: {type(exc).__name__}: {exc}"
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
        r = replan(self.current, wl, self.policy, ctx, costs=self.cfg.costs, host=self.cfg.host,
                   base_port=self.cfg.base_port)
        row["gpus_planned"] = r.placement.meta.get("gpus_used")
        act, row["why"] = decide(self.current, r.placement, r.plan.get("starving_at_start") or [])
        written = []
        if act:
            written = write_outputs(r.placement, ctx.profile, folder, emit_vllm=False, model=None)
            plan = {"current": str(self.current_path), "workload": wl.name, **r.plan}
            written.append(atomic_write_json(folder / "plan.json", plan, indent=1))
            opts = dataclasses.replace(self.cfg.apply, router=self.cfg.router)
            summary, code = apply_plan(folder, opts=opts, out=folder / "apply", keep_launched=True, track=False)
            row.update(decision="applied" if code == EXIT_OK else "apply failed", steps=len(summary["steps"]),
                       apply_exit=code)
            if code == EXIT_OK:
                self.current, self.current_path = r.placement, folder / "placement.json"
        return self._close(row, t0, written)

    def _close(self, row: dict, t0: float, written: list) -> dict:
        row["wall_s"] = round(time.time() - t0, 3)
        self.rows.append(row)
        atomic_write_rows(self.out / "cycles.csv", self.rows, CYCLE_COLUMNS)
        atomic_write_json(self.out / STATE_FILE, {"current": str(self.current_path), "cycle": self.cycle,
                                                  "rows": self.rows}, indent=1)
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
            time.sleep(max(0.0, cfg.interval_s - (time.monotonic() - t)))
    except KeyboardInterrupt:
        log.warning("operate: interrupted after cycle %d; the fleet runs %s (%s)", op.cycle, op.current_path,
                    op.out / STATE_FILE)
        return EXIT_INTERRUPTED
    return EXIT_OK
