"""Issue 26's measurement: a day of generated drift (``configs/drift/day.yaml``: a diurnal cosine;
or ``--drift traces``: the real rate shape of the Azure traces stitched, ``configs/drift/traces.yaml``)
replanned hour by hour, against re-placing from scratch every hour and against static provisioning
for the peak (tracked in MLflow, experiment ``drift-day``).

    python experiments/drift_day.py [--drift day] [--steps 24] [--tracking-uri URI]
    python experiments/drift_day.py --drift traces --out experiments/drift_traces

Runs ``lora-opt schedule`` (its totals and rows: ``lora_opt.replan.schedule``) and writes
the output folder (default experiments/drift_day/: schedule.json, schedule.csv, schedule.png,
steps/, report.md).
Runs with lora-opt installed (``pip install -e .`` in the checkout): it imports the installed package.
"""
import argparse
import json
import time
from pathlib import Path

from lora_opt.cli import main as lora_opt_main
from lora_opt.tracking import log_command_run

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "experiments" / "drift_day"


TITLES = {"day": "A day of drift", "traces": "A day shaped by the stitched Azure traces"}


def report(doc: dict, command: str, wall_s: float, title: str) -> str:
    t = doc["totals"]
    rows = doc["steps"]
    lines = [f"# {title}: replan vs from scratch vs static peak", "",
             f"Command: `{command}` ({wall_s:.0f} s on this machine).", "",
             "| | replanned | from scratch each step | static for the peak |", "|---|---:|---:|---:|",
             f"| GPU-hours | {t['gpu_hours']:.0f} | {t['gpu_hours_from_scratch']:.0f} | {t['gpu_hours_static_peak']:.0f} |",
             f"| adapter moves (loads + unloads) | {t['moves']} | {t['moves_from_scratch']} | 0 |",
             f"| instance restarts | {t['restarts']} | {t['restarts_from_scratch']} | 0 |",
             f"| adapters kept across restarts (not moves) | {t['restart_kept']} | {t['restart_kept_from_scratch']} "
             "| 0 |", "",
             "A restart keeps its adapters: the new instance starts with them (`--lora-modules`) beside the old "
             "one, which is drained and stopped. Counted as if a restart moved every adapter it keeps (unload + "
             f"load), the moves would be {t['moves'] + 2 * t['restart_kept']} replanned and "
             f"{t['moves_from_scratch'] + 2 * t['restart_kept_from_scratch']} from scratch.", "",
             f"Saved against static peak provisioning: {t['saved_vs_static_peak']:.0%}. Transitions not ok: "
             f"{t['transitions_not_ok'] or 'none'}; steps with a starving GPU on the twin replay: "
             f"{t['steps_starving'] or 'none'}; the most GPUs held during a transition: "
             f"{t['peak_gpus_during_transitions']} (a restart's new instance starts beside the old one). "
             "Candidate chosen per step (after step 0): "
             + ", ".join(f"{k} {v}" for k, v in t["candidates_chosen"].items()) + ".", "",
             "| step | adapters | req/s | GPUs | moves | restarts | chosen | scratch GPUs | scratch moves "
             "| scratch restarts | starving |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['adapters']} | {r['rate_req_s']:.1f} | {r['gpus']} | {r['moves']} | "
              f"{r['restarts']} | {r['candidate'] or '(placed)'} | {r['scratch_gpus']} | {r['scratch_moves']} | "
              f"{r['scratch_restarts']} | {r['gpus_starving']} |" for r in rows]
    return "\n".join(lines) + "\n\n![GPUs and load](schedule.png)\n"


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drift", default="day")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tracking-uri")
    args = ap.parse_args()
    argv = ["schedule", "--drift", args.drift, "--out", args.out] + (["--steps", str(args.steps)] if args.steps else [])
    t0 = time.perf_counter()
    code = lora_opt_main(argv)
    wall = time.perf_counter() - t0
    out = Path(args.out)
    doc = json.loads((out / "schedule.json").read_text())
    title = TITLES.get(args.drift, f"Drift {args.drift}")
    shown = [str(out.resolve().relative_to(ROOT)) if a == args.out and out.resolve().is_relative_to(ROOT) else a
             for a in argv]
    (out / "report.md").write_text(report(doc, "lora-opt " + " ".join(shown), wall, title))
    log_command_run("drift-day", f"{args.drift}-{doc['totals']['steps']}steps",
                    params={"drift": args.drift, "steps": doc["totals"]["steps"], "exit": code},
                    metrics=doc["totals"], artifacts=[out], wall_s=wall, tracking_uri=args.tracking_uri)
    print(f"report -> {out / 'report.md'}")


if __name__ == "__main__":
    run()
