"""lora-opt's loop on a real vLLM (issue 24): the CPU build of vLLM 0.32 (the real-vLLM tier) serving the
tier's probe-size model (hidden 1024, 4 layers, random weights) with real PEFT adapters of ranks 8/16/32.

    bash tools/vllm_tier/build.sh && LORA_OPT_VLLM_TIER_PROBE=1 bash tools/vllm_tier/build.sh
    python experiments/real_validation/cpu_loop.py                       # every stage, ~60 min on 2 cores
    python experiments/real_validation/cpu_loop.py --stages validate     # one stage (the others' outputs kept)

Stages (each a lora-opt command as a user runs it, logged to MLflow by that command):

* ``probe``: ``lora-opt probe --launch`` on the real server (LoRA off, then ranks 8/16/32); rows in
  ``OUT/probe/rows.csv``;
* ``calibrate``: ``lora-opt calibrate --runs OUT/probe/rows.csv --model probe-llama`` -> the profile
  ``configs/profiles/probe-llama-cpu-vllm032.yaml`` (from the probe rows only: the configs/models.yaml entry
  gives dimensions and engine semantics, nothing measured);
* ``validate``: per workload (:data:`WORKLOADS`): a placement on one instance (``placement.json`` and the
  emitted ``vllm serve`` command, vLLM 0.32's flags), that command launched on the real server, ``lora-opt
  validate`` replaying the workload's requests on it and on the twin with the CPU profile; the seeds of the
  workloads' halves differ: ``fit`` runs feed the recalibration, ``report`` runs are held apart;
* ``maxpack``: the papers' claim measured: served adapters swept on the real server, the real Max_pack vs the
  twin's pick (:mod:`cpu_maxpack`);
* ``reprobe``: the probe again after the measurements (``OUT/probe-after``, its own profile beside it): the
  report's drift table says how far the server's costs moved during the sitting;
* ``retwin`` (only when asked: ``--stages calibrate retwin recalibrate report`` after a new probe): the stored
  validation and Max_pack runs compared again with the profile as it is now (``lora-opt validate --twin-only``:
  the same requests, nothing sent), the twin's Max_pack pick made again on the measured sweep;
* ``recalibrate``: ``lora-opt ingest`` of the fit-half validation runs, ``lora-opt calibrate-e2e`` on them, and
  the report-half runs validated again on the twin with the refitted profile (before/after).

Pinning: the engine's forward passes on core 0 (``VLLM_CPU_OMP_THREADS_BIND=0``); this script, the
clients and vLLM's API server and engine-core processes on core 1 (``os.sched_setaffinity``).  Numbers are a
CPU's (vLLM 0.32, 2 cores), never an H100's.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from cpu_maxpack import stage_maxpack, stage_repick
from cpu_tier import (CLIENT_CORE, MODEL_ENTRY, OUT, PROFILE, PROFILE_PATH, load_probe_tier, lora_opt, probe_command, rel,
                      tier_dir)
from cpu_workloads import stage_recalibrate, stage_retwin, stage_validate

from lora_opt.errors import EXIT_NOT_ACCEPTABLE
from lora_opt.io import atomic_write_json


def stage_probe(tier: dict, out: Path, name: str = "probe") -> int:
    return lora_opt("probe", "--launch", probe_command(tier), "--plan", "quick", "--ranks", "8", "16", "32",
                    "--model", MODEL_ENTRY, "--adapter-path", str(tier_dir() / "probe-adapters" / "r{rank}-a"),
                    "--health-timeout", "420", "--out", str(out / name), log=out / "logs" / f"{name}.txt")


def stage_reprobe(tier: dict, out: Path) -> int:
    """The same probe again once validate and maxpack have run (``OUT/probe-after``) and a profile fitted on
    it alone (``OUT/probe-after/profile.yaml``, not the loop's profile): how far the server's own costs
    moved during the sitting, which no model of vLLM can predict (the report's drift table)."""
    rc = stage_probe(tier, out, "probe-after")
    if rc not in (0, EXIT_NOT_ACCEPTABLE):   # noisy or failed rows: said in the rows, left out by calibrate
        return rc
    return lora_opt("calibrate", "--runs", rel(out / "probe-after" / "rows.csv"), "--model", MODEL_ENTRY,
                    "--out", rel(out / "probe-after" / "profile.yaml"), log=out / "logs" / "calibrate-after.txt")


def stage_calibrate(out: Path) -> int:
    # from the probe rows only: calibrate would carry an earlier sitting's end-to-end fit (fit.e2e) over
    PROFILE_PATH.unlink(missing_ok=True)
    return lora_opt("calibrate", "--runs", rel(out / "probe" / "rows.csv"), "--model", MODEL_ENTRY,
                    "--out", rel(PROFILE_PATH), log=out / "logs" / "calibrate.txt")


def stage_report(out: Path, tracking_uri: str | None) -> int:
    """REPORT.md from the stages' files, and one MLflow run (experiment ``real_validation_cpu``) holding them."""
    from cpu_report import write_report

    from lora_opt.tracking import log_dir, tracked_run
    summary = write_report(out, PROFILE_PATH)
    atomic_write_json(out / "summary.json", summary, indent=1)
    with tracked_run("real_validation_cpu", run_name="CPU vLLM 0.32, probe-llama", tracking_uri=tracking_uri):
        import mlflow
        mlflow.log_params({"vllm": "0.32 (vllm-cpu)", "model": MODEL_ENTRY, "profile": PROFILE})
        for half in ("report", "fit"):
            mlflow.log_metrics({f"smape.{half}.{k}": v for k, v in (summary.get(half) or {}).items() if not math.isnan(v)})
        mp = summary.get("maxpack") or {}
        mlflow.log_metrics({f"maxpack.{k}": float(v) for k, v in mp.items() if isinstance(v, (int, float))})
        log_dir(out)
    print(f"report -> {out / 'REPORT.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # retwin: the stored validation and Max_pack runs compared again with the profile as it is now (no
    # server); not in the default sequence, whose validate and maxpack stages measure afresh
    stages = ["probe", "calibrate", "validate", "maxpack", "reprobe", "retwin", "recalibrate", "report"]
    ap.add_argument("--stages", nargs="+", default=[s for s in stages if s != "retwin"], choices=stages)
    ap.add_argument("--workloads", nargs="+", help="validate: only these workloads (default all)")
    ap.add_argument("--duration", type=float, default=150.0, help="validate: replayed seconds per run (default 150)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: the local store under mlruns/)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {CLIENT_CORE})      # the children (clients, vLLM's front end) inherit it
    tier = load_probe_tier()
    t0, rcs = time.perf_counter(), {}
    for stage in a.stages:
        s0 = time.perf_counter()
        if stage == "probe":
            rcs[stage] = stage_probe(tier, out)
        elif stage == "calibrate":
            rcs[stage] = stage_calibrate(out)
        elif stage == "validate":
            rcs[stage] = stage_validate(tier, out, a.duration, a.workloads)
        elif stage == "maxpack":
            rcs[stage] = stage_maxpack(tier, out, a.duration)
        elif stage == "reprobe":
            rcs[stage] = stage_reprobe(tier, out)
        elif stage == "retwin":
            rcs[stage] = stage_retwin(out) | stage_repick(out)
        elif stage == "recalibrate":
            rcs[stage] = stage_recalibrate(out, a.duration)
        else:
            rcs[stage] = stage_report(out, a.tracking_uri)
        print(f"== {stage}: exit {rcs[stage]} ({time.perf_counter() - s0:.0f} s)", flush=True)
    atomic_write_json(out / "logs" / "last_stages.json", {"exit": rcs, "wall_s": round(time.perf_counter() - t0)})
    return 0 if all(rc == 0 for rc in rcs.values()) else 1


if __name__ == "__main__":       # run as a script: its folder is on the path (cpu_workloads, cpu_maxpack, ...)
    raise SystemExit(main())
