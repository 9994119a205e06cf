"""The validation workloads of the real-vLLM loop (``cpu_loop.py``) and its validate and recalibrate stages.

Each workload is one instance (one "GPU": the CPU server) with its flags fixed (what it tests needs them:
``max_loras`` below the active adapters for the slot-bound one), its adapters (names over the tier's six
PEFT adapters: two per rank 8/16/32; several names may share one checkpoint -- vLLM loads each name as its
own adapter), a total rate as a share of the instance's capacity by the CPU profile (the twin's highest
non-starving rate, :func:`capacity_rate`), and normal lengths that fit ``max_model_len`` 2,048.

Every workload runs twice with different seeds: ``fit`` (seed 1: feeds the recalibration) and ``report``
(seed 2: held apart; the targets are judged on it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from cpu_tier import (
    MAX_MODEL_LEN,
    MODEL_ENTRY,
    PROFILE,
    PROFILE_PATH,
    lora_opt,
    rel,
    server_env,
)

from lora_opt.io import atomic_write_json, atomic_write_text

LENGTHS = {"source": "normal", "mean_in": 192, "std_in": 48, "mean_out": 96, "std_out": 24}
SEEDS = {"fit": 1, "report": 2}

#: name -> adapters ((id, tier adapter)), flags, share of capacity, what it tests
WORKLOADS: dict[str, dict] = {
    "light": {"adapters": [("a8", "r8-a"), ("b8", "r8-b"), ("a16", "r16-a"), ("b16", "r16-b")],
              "flags": {"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4}, "load": 0.3,
              "what": "light load: a few running, no queue"},
    "near_saturation": {"adapters": [("a8", "r8-a"), ("b8", "r8-b"), ("a16", "r16-a"), ("b16", "r16-b")],
                        "flags": {"max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 4}, "load": 0.85,
                        "what": "near saturation"},
    "slot_bound": {"adapters": [(f"{c}{k}", f"r{r}-{c}") for r in (8, 16) for c in "ab" for k in (r, r + 100)],
                   "flags": {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 8}, "load": 0.5,
                   "what": "8 active adapters over 2 LoRA slots: vLLM's LRU swaps (CPU -> slot)"},
    "mixed_ranks": {"adapters": [(f"{c}{r}", f"r{r}-{c}") for r in (8, 16, 32) for c in "ab"],
                    "flags": {"max_loras": 6, "max_lora_rank": 32, "max_cpu_loras": 6}, "load": 0.6,
                    "what": "ranks 8, 16 and 32 on one instance (max_lora_rank 32)"},
}
ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9,
          "max_model_len": MAX_MODEL_LEN}


def placement(name: str, tier: dict, total_rate: float):
    """The workload's one-instance placement (lora-opt's own types: what place writes)."""
    from lora_opt.placement.plan import Adapter, GPUConfig, Placement
    spec = WORKLOADS[name]
    adapters = [Adapter(id=aid, rank=tier["adapters"][src]["rank"], rate=total_rate / len(spec["adapters"]),
                        path=tier["adapters"][src]["path"]) for aid, src in spec["adapters"]]
    gpu = GPUConfig(**spec["flags"], **ENGINE)
    return Placement(profile=PROFILE, adapters=adapters, gpus=[gpu], routes={a.id: [(0, 1.0)] for a in adapters},
                     policy="fixed (experiments/real_validation/cpu_workloads.py)", meta={"workload": name})


def workload_file(name: str, tier: dict, total_rate: float, seed: int, duration: float) -> dict:
    spec = WORKLOADS[name]
    return {"profile": PROFILE, "rho": 0.9,
            "adapters": [{"id": aid, "rank": tier["adapters"][src]["rank"], "rate": total_rate / len(spec["adapters"]),
                          "path": tier["adapters"][src]["path"]} for aid, src in spec["adapters"]],
            "engine": ENGINE, "evaluation": {"arrivals": {"process": "poisson"}, "lengths": LENGTHS,
                                             "duration_s": duration, "seed": seed}}


def capacity_rate(name: str, tier: dict, duration: float = 600.0) -> float:
    """The highest total rate (req/s) the twin serves without starving (rho 0.9) on the workload's instance,
    by bisection on the CPU profile."""
    from lora_opt.placement.evaluate import evaluate_placement
    from lora_opt.placement.workload_file import workload_from_dict
    lo, hi = 0.05, 20.0
    for _ in range(12):
        mid = (lo * hi) ** 0.5
        wl = workload_from_dict(workload_file(name, tier, mid, 0, duration))
        ev = evaluate_placement(placement(name, tier, mid), wl, duration_s=duration, workers=1, progress=False)
        if ev["gpus_starving"]:
            hi = mid
        else:
            lo = mid
    return lo


def validate_one(name: str, half: str, tier: dict, total_rate: float, out: Path, duration: float,
                 around=None) -> dict:
    """Place, launch the emitted command on the real server, validate; the comparison (or why not).
    ``around(url)``, when given, runs on the live server just before and just after the replay (the
    speed checks of ``cpu_checked.py``); what it returns is kept as ``checks`` {before, after}."""
    from lora_opt.placement.report import write_outputs
    from lora_opt.probe.launch import LaunchedServer, read_launch
    from twin.profile import load_profile
    run = out / "validation" / f"{name}-{half}"
    if run.exists():
        shutil.rmtree(run)
    wl_path = run / "workload.yaml"
    run.mkdir(parents=True)
    atomic_write_text(wl_path, yaml.safe_dump(workload_file(name, tier, total_rate, SEEDS[half], duration),
                                              sort_keys=False))
    p = placement(name, tier, total_rate)
    write_outputs(p, load_profile(PROFILE), run / "placement", emit_vllm=True, model=tier["model"],
                  vllm_version="0.32", base_port=18600)
    cmd = read_launch(str(run / "placement" / "vllm" / "serve_commands.txt"), 0)
    cmd.env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd.env.update(server_env())         # the launcher expands $PATH as a shell would
    server = LaunchedServer(cmd, server_cmd=None, log_path=run / "server.log", health_timeout_s=420)
    if not server.start():
        return {"error": f"server did not start (exit {server.exit_code}): {server.log_tail(5)}"}
    checks: dict = {}
    try:
        if around is not None:
            checks["before"] = around(server.url)
        rc = lora_opt("validate", str(run / "placement" / "placement.json"), "--endpoints",
                      str(run / "placement" / "router.json"), "--workload", str(wl_path), "--duration", f"{duration:g}",
                      "--gpu", "CPU-2core", "--out", str(run / "out"), "--workers", "1", log=run / "validate.txt")
        if around is not None:
            checks["after"] = around(server.url)
    finally:
        server.stop()
    result = {"exit": rc, "startup_s": server.startup_s, **({"checks": checks} if checks else {})}
    comp = run / "out" / "comparison.json"
    if comp.exists():
        result["comparison"] = json.loads(comp.read_text())
    return result


def stage_validate(tier: dict, out: Path, duration: float, only: list[str] | None) -> int:
    results = json.loads((out / "validation.json").read_text()) if (out / "validation.json").exists() else {}
    for name in only or list(WORKLOADS):
        cap = capacity_rate(name, tier)
        rate = WORKLOADS[name]["load"] * cap
        for half in SEEDS:
            print(f"-- {name} ({half}): {rate:.3f} req/s = {WORKLOADS[name]['load']:.0%} of the twin's capacity "
                  f"{cap:.3f}", flush=True)
            r = validate_one(name, half, tier, rate, out, duration)
            results[f"{name}-{half}"] = {"workload": name, "half": half, "rate": rate, "capacity_rate": cap, **r}
            atomic_write_json(out / "validation.json", results, indent=1)
    return 0 if all(r.get("exit") in (0, 3) for r in results.values()) else 1


def retwin_run(run: Path, log: Path) -> int:
    """The twin side of one stored run again, with the profile as it is now (``validate --twin-only``)."""
    return lora_opt("validate", rel(run / "placement" / "placement.json"), "--workload", rel(run / "workload.yaml"),
                    "--twin-only", rel(run / "out"), "--workers", "1", log=log)


def stage_retwin(out: Path) -> int:
    """Every stored validation run compared again with the current profile (after ``calibrate``): the
    measurements stay, the twin's files and ``validation.json``'s comparisons are rewritten."""
    results = json.loads((out / "validation.json").read_text())
    rc = 0
    for key, r in results.items():
        run = out / "validation" / key
        rc |= retwin_run(run, out / "logs" / f"retwin_{key}.txt")
        if (run / "out" / "comparison.json").exists():
            r["comparison"] = json.loads((run / "out" / "comparison.json").read_text())
    atomic_write_json(out / "validation.json", results, indent=1)
    return rc


def stage_recalibrate(out: Path, duration: float) -> int:
    """``ingest`` the validation runs (labels ``cpu-fit`` / ``cpu-report``), ``fidelity`` of the report half
    with the profile as calibrated from the probe, ``calibrate-e2e`` on the fit half (the front-end TTFT
    terms, the LoRA shares: rewrites the profile), ``fidelity`` of the report half again, and the report
    half compared again request for request (:func:`revalidate_report_half`)."""
    import pandas as pd
    (out / "recalibrate").mkdir(parents=True, exist_ok=True)
    rows = {}
    for half in SEEDS:
        dirs = sorted(rel(d / "out") for d in (out / "validation").glob(f"*-{half}") if (d / "out" / "real.json").exists())
        if not dirs:
            raise SystemExit(f"recalibrate: no {half}-half validation runs under {out / 'validation'}: run --stages validate")
        rows[half] = out / "recalibrate" / f"ingested_{half}.csv"
        if lora_opt("ingest", *dirs, "--out", rel(rows[half]), "--label", f"cpu-{half}", "--model", MODEL_ENTRY,
                    log=out / "logs" / f"ingest_{half}.txt") != 0:
            return 1
    both = out / "recalibrate" / "ingested.csv"
    pd.concat([pd.read_csv(rows[h]) for h in SEEDS]).to_csv(both, index=False)
    shutil.copy(PROFILE_PATH, out / "recalibrate" / "profile_before.yaml")
    rc = lora_opt("fidelity", "--runs", rel(both), "--family", "cpu-report", "--out", rel(out / "recalibrate" / "before"),
                  "--workers", "1", log=out / "logs" / "fidelity_before.txt")
    rc |= lora_opt("calibrate-e2e", "--model", MODEL_ENTRY, "--runs", rel(both), "--workers", "1",
                   log=out / "logs" / "calibrate_e2e.txt")
    rc |= lora_opt("fidelity", "--runs", rel(both), "--family", "cpu-report", "--out", rel(out / "recalibrate" / "after"),
                   "--workers", "1", log=out / "logs" / "fidelity_after.txt")
    return rc | revalidate_report_half(out)


def revalidate_report_half(out: Path) -> int:
    """The report-half runs compared again request for request (``validate --twin-only``) with the
    recalibrated profile, as the report's tables compare them: the measurements copied into
    ``recalibrate/after-validate/RUN`` (nothing sent again), the twin's side rewritten there."""
    rc = 0
    for run in sorted((out / "validation").glob("*-report")):
        if (run / "out" / "real.json").exists():
            rc |= retwin_copy(run, out / "recalibrate" / "after-validate" / run.name, None,
                              out / "logs" / f"revalidate_{run.name}.txt")
    return rc


def retwin_copy(run: Path, dst: Path, profile: str | None, log: Path) -> int:
    """The stored run's measurements copied into ``dst`` (nothing sent again) and its twin side replayed
    there (``validate --twin-only``) with ``profile`` (a profile file: written into the copy's placement
    and workload) or, when None, the placement's profile as it is now."""
    if dst.exists():
        shutil.rmtree(dst)
    (dst / "out").mkdir(parents=True)
    shutil.copytree(run / "placement", dst / "placement")
    shutil.copy(run / "workload.yaml", dst / "workload.yaml")
    for name in ("real.json", "requests.csv", "timeseries.csv", "bench.json"):
        if (run / "out" / name).exists():
            shutil.copy(run / "out" / name, dst / "out" / name)
    if profile is not None:
        pl = json.loads((dst / "placement" / "placement.json").read_text())
        wl = yaml.safe_load((dst / "workload.yaml").read_text())
        pl["profile"] = wl["profile"] = profile
        atomic_write_json(dst / "placement" / "placement.json", pl, indent=1)
        atomic_write_text(dst / "workload.yaml", yaml.safe_dump(wl, sort_keys=False))
    return retwin_run(dst, log)
