"""``lora-opt apply``'s work: read a replan's output, carry out its plan (with the new demand's
traffic flowing when a workload is given), write what happened, log one MLflow run.

Outputs (``out``): ``apply.json`` (every step with its wall times and answer, the windows, the
verdict, the settings), ``steps.csv``, and with traffic ``requests.csv`` (one row per request:
``lora_opt.validate.measure``'s columns + ``window``), ``transition.png`` (TTFT of every request
against its send time, the steps shaded) and ``report.md``."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path

from lora_opt.apply.executor import SUCCESS, ApplyOptions, PlanExecutor
from lora_opt.apply.transition import WINDOWS, TrafficOptions, measure
from lora_opt.errors import EXIT_INTERRUPTED, EXIT_NOT_ACCEPTABLE, EXIT_OK, InputError
from lora_opt.http_pool import instance_client
from lora_opt.io import atomic_write_figure, atomic_write_json, atomic_write_rows, atomic_write_text
from lora_opt.placement.plan import Placement
from lora_opt.replan.replan_steps import step_counts
from lora_opt.tracking import log_command_run
from lora_opt.validate.live import emulator_lags
from twin.parsing import read_json_file

log = logging.getLogger(__name__)

#: MLflow experiment of apply runs
EXPERIMENT = "replan-apply"


def read_plan(path: str | Path) -> tuple[dict, Placement, Path]:
    """(plan, the placement it leads to, its folder) from ``plan.json`` or the folder replan wrote."""
    p = Path(path)
    plan_path = p / "plan.json" if p.is_dir() else p
    if not plan_path.is_file():
        raise InputError(f"PLAN: {plan_path} not found (give plan.json or the folder lora-opt replan wrote)")
    try:
        plan = read_json_file(plan_path, "replan plan", InputError, allow_nan=True)
    except InputError as exc:
        raise InputError(f"PLAN: {exc}") from None
    if not isinstance(plan, dict) or "steps" not in plan:
        raise InputError(f"PLAN: {plan_path} is not a replan plan (no 'steps')")
    placement_path = plan_path.parent / "placement.json"
    try:
        placement = Placement.load(placement_path)
    except (OSError, ValueError) as exc:
        raise InputError(f"PLAN: the new placement {placement_path} cannot be read: {exc}") from None
    return plan, placement, plan_path.parent


def _log_step(res) -> None:
    log.info("step %3d %-6s %-10s %-7s %s", res.step, res.action, res.instance, res.status, res.detail[:120])


def _journal(ex: PlanExecutor, plan_path, out: Path):
    """``on_step``: log the step, and write every step's outcome so far to ``out/progress.json`` (a run
    that dies leaves what it did; applying the plan again finds those steps in effect)."""
    previous = out / "progress.json"
    if previous.is_file():
        try:
            last = read_json_file(previous, "progress", InputError, allow_nan=True)
            ran = [s for s in last.get("steps", []) if s.get("status") != "skipped"]
            if last.get("plan") == str(plan_path) and ran:
                log.info("a previous run of this plan got to step %d (%s): steps in effect are marked done",
                         ran[-1]["step"], ran[-1]["status"])
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def on_step(res) -> None:
        _log_step(res)
        atomic_write_json(out / "progress.json", {"plan": str(plan_path), "steps": [asdict(r) for r in ex.results]},
                          indent=1)
    return on_step


def apply_plan(plan_path: str | Path, *, opts: ApplyOptions, out: str | Path, workload=None,
               traffic: TrafficOptions = TrafficOptions(), keep_launched: bool = False,
               tracking_uri: str | None = None, track: bool = True) -> tuple[dict, int]:
    """Carry out the plan (measuring the transition under ``workload``'s traffic when given);
    write the outputs; (summary, exit status: ``EXIT_OK``, or ``EXIT_NOT_ACCEPTABLE`` when a step
    failed, a request failed or the p99 TTFT during the steps broke the plan's bound)."""
    t_start = time.time()
    plan, placement, _ = read_plan(plan_path)
    out = Path(out)
    opts = dataclasses.replace(opts, log_dir=out / "logs")
    ex = PlanExecutor(plan, placement, opts)
    on_step = _journal(ex, plan_path, out)
    interrupted = False
    try:
        try:
            if workload is not None:
                if not opts.router:
                    raise InputError("--router: traffic flows through the router; give its URL")
                got = asyncio.run(measure(ex, workload, opts.router.rstrip("/") + "/v1", traffic, on_step=on_step))
            else:
                got = asyncio.run(_steps_only(ex, on_step))
        except KeyboardInterrupt:       # the steps done so far are written; the requests are not kept
            interrupted = True
            got = {"steps": ex.results, "verdict": {"ok": False, "steps_ok": False, "interrupted": True}}
        if "info" in got:               # the emulator's own lateness (its machine, not its schedule)
            got["info"]["emulator_late_wall_ms"] = emulator_lags(ex.live())
    finally:
        if not keep_launched:
            ex.close()
    steps = [asdict(s) for s in got["steps"]]
    summary = {"plan": str(plan_path), "workload": getattr(workload, "name", None), "verdict": got["verdict"],
               "windows": got.get("windows"), "steps": steps, "info": got.get("info", {}),
               "launched": {n: {"url": ex.endpoints.get(n), "pid": s.proc.pid if s.proc else None,
                                "running": keep_launched} for n, s in ex.launched.items()},
               "options": {k: str(v) for k, v in asdict(opts).items()}, "traffic": asdict(traffic)}
    written = [atomic_write_json(out / "apply.json", summary, indent=1),
               atomic_write_rows(out / "steps.csv", steps, ("step", "action", "instance", "started_s", "ended_s",
                                                            "status", "tries", "detail"))]
    if "rows" in got:
        cols = list(got["rows"][0]) if got["rows"] else ["request"]
        written.append(atomic_write_rows(out / "requests.csv", got["rows"], cols))
        written.append(write_plot(got["rows"], got["steps"], traffic.speed, out / "transition.png",
                                  got["verdict"]["slo_ttft_p99_ms"]))
        written.append(atomic_write_text(out / "report.md", report_md(summary)))
    log_command_run(EXPERIMENT, Path(str(plan_path)).parent.name or None,
                    params={"plan": str(plan_path), "router": opts.router, "server_cmd": opts.server_cmd,
                            "speed": traffic.speed, "start_after_s": traffic.start_after_s,
                            "workload": getattr(workload, "name", None)},
                    metrics={"verdict": got["verdict"], "windows": {w: (got.get("windows") or {}).get(w) for w in WINDOWS}},
                    artifacts=[p for p in written if p is not None], tracking_uri=tracking_uri, track=track,
                    wall_s=time.time() - t_start)
    summary["written"] = [str(p) for p in written if p is not None]
    if interrupted:
        return summary, EXIT_INTERRUPTED
    return summary, EXIT_OK if got["verdict"]["ok"] else EXIT_NOT_ACCEPTABLE


def fleet_diff(plan_path: str | Path, router: str | None) -> list[dict]:
    """``apply --dry-run``: each step of the plan read against the fleet as it is (to do, in effect, DEAD);
    nothing is acted on."""
    plan, placement, _ = read_plan(plan_path)
    ex = PlanExecutor(plan, placement, ApplyOptions(router=router))

    async def read():
        async with instance_client() as client:
            return await ex.diff(client)
    return asyncio.run(read())


async def _steps_only(ex: PlanExecutor, on_step=_log_step) -> dict:
    async with instance_client() as client:
        await ex.preflight(client)
        steps = await ex.run(client, on_step=on_step)
    ok = all(s.status in SUCCESS for s in steps)
    return {"steps": steps, "verdict": {"ok": ok, "steps_ok": ok}}


def write_plot(rows: list[dict], steps, speed: float, path: Path, slo_ms: float) -> Path | None:
    """TTFT of every request against its send time (failed requests marked), the steps' span
    shaded, each step a tick, the SLO a line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # heavy optional dependency: only for the plot
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    ok = [r for r in rows if r["status"] == "ok"]
    ax.scatter([r["sent_s"] for r in ok], [r["ttft_ms"] / 1000 for r in ok], s=4, alpha=0.6, label="TTFT (ok)")
    bad = [r for r in rows if r["status"] == "failed"]
    if bad:
        ax.scatter([r["sent_s"] for r in bad], [0] * len(bad), marker="x", color="red", label=f"failed ({len(bad)})")
    ran = [s for s in steps if not math.isnan(s.started_s)]
    if ran:
        ax.axvspan(ran[0].started_s * speed, ran[-1].ended_s * speed, color="orange", alpha=0.15, label="plan running")
        for s in ran:
            ax.axvline(s.started_s * speed, color="grey", lw=0.4, alpha=0.5)
    ax.axhline(slo_ms / 1000, color="red", ls="--", lw=0.8, label="p99 TTFT bound of the plan's states")
    ax.set_xlabel("send time (simulated s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("A replan applied under traffic")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    try:
        return atomic_write_figure(path, fig, dpi=110)
    finally:
        plt.close(fig)


def report_md(summary: dict) -> str:
    """The transition as a table per window and the steps' outcome."""
    v, win = summary["verdict"], summary["windows"]
    lines = [f"# Replan applied under traffic: {summary['plan']}", "",
             f"Verdict: **{'ok' if v['ok'] else 'NOT ok'}** -- failed requests {v['failed_requests']}, "
             + (f"p99 TTFT during the steps {v['ttft_p99_during_ms']:.0f} ms" if not math.isnan(v["ttft_p99_during_ms"])
                else f"no p99 TTFT during the steps ({v.get('requests_during', 0)} requests sent while they ran)")
             + f" (bound of the plan's states {v['slo_ttft_p99_ms']:.0f} ms), every step ran: {v['steps_ok']}."
             + ("" if v["slo_applies"] else f" The bound does not apply: the twin judged the running placement "
                f"starving under the new demand before any step ({', '.join(v['starving_at_start'])})."), "",
             "| window | sent | ok | failed | held | unfinished | TTFT mean ms | p50 | p99 | max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in WINDOWS:
        d = win[w]
        lines.append(f"| {w} | {d['requests']} | {d['ok']} | {d['failed']} | {d['held']} | {d['unfinished']} | "
                     f"{d['ttft_mean_ms']:.0f} | {d['ttft_p50_ms']:.0f} | {d['ttft_p99_ms']:.0f} | {d['ttft_max_ms']:.0f} |")
    lines += ["", f"Steps ({win['steps_start_s']:.1f}-{win['steps_end_s']:.1f} simulated s): "
              + step_counts(summary["steps"], status=True), "",
              "Held requests: requests of adapters new to the workload sent before their route step (not sent; no "
              "instance served them yet).", "", "![TTFT during the transition](transition.png)", ""]
    return "\n".join(lines)
