"""The real-validation runbook in one script: place -> probe --quick -> launch the placement's vllm serve
commands -> validate -> ingest -> calibrate, everything logged to MLflow, and a bundle of the files to
send back (see README.md next to this file).

    python experiments/real_validation/run.py --gpus 4 --gpu-name H100-80GB [--out DIR]
    # a dry run on one CPU machine: lora-opt emulate stands in for vllm serve
    python experiments/real_validation/run.py --gpus 4 --server-cmd "lora-opt emulate --profile llama-3.1-8b-h100-64gb --speed 10" --speed 10
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from lora_opt.io import atomic_write_json, atomic_write_text
from lora_opt.probe.launch import LaunchedServer, read_launch
from lora_opt.tracking import log_dir, tracked_run

WORKLOAD = ROOT / "configs" / "workloads" / "example.yaml"


def lora_opt(*args: str, log: Path) -> int:
    """One lora-opt command (as a user runs it), its output teed to ``log``; its exit status."""
    argv = [sys.executable, "-m", "lora_opt.cli", *args]
    print("$ lora-opt " + " ".join(args), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    atomic_write_text(log, proc.stdout)
    tail = [ln for ln in proc.stdout.splitlines() if ln.strip() and "\r" not in ln][-6:]
    print("\n".join("  " + ln for ln in tail) + f"\n  ({time.perf_counter() - t0:.0f} s, exit {proc.returncode})",
          flush=True)
    return proc.returncode


def environment(out: Path, server_cmd: str | None) -> dict:
    """What the machine is (sent back with the measurements)."""
    info = {"server_cmd": server_cmd or "vllm serve"}
    for name, cmd in (("vllm", [sys.executable, "-c", "import vllm; print(vllm.__version__)"]),
                      ("nvidia_smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"])):
        try:
            info[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info[name] = "unavailable"
    atomic_write_json(out / "environment.json", info, indent=1)
    return info


def launch_fleet(commands: Path, n: int, server_cmd: str | None, out: Path, timeout_s: float) -> list[LaunchedServer]:
    servers = []
    for g in range(n):
        srv = LaunchedServer(read_launch(str(commands), g), server_cmd=server_cmd, log_path=out / "logs" / f"gpu{g}.log",
                             health_timeout_s=timeout_s)
        servers.append(srv)
        if not srv.start():
            raise SystemExit(f"GPU {g}'s server did not start (exit {srv.exit_code}): {srv.log_tail()}")
        print(f"  GPU {g}: {srv.url} healthy after {srv.startup_s:.0f} s", flush=True)
    return servers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=4, help="GPUs to place the example workload on (default 4)")
    ap.add_argument("--gpu-name", default="", help="the GPU's name, recorded with the runs (e.g. H100-80GB)")
    ap.add_argument("--workload", default=str(WORKLOAD), help="workload file (default: the example)")
    ap.add_argument("--profile", help="profile calibrate keeps model dimensions from (default: the workload's)")
    ap.add_argument("--duration", type=float, default=300.0, help="validate: replayed seconds (default 300)")
    ap.add_argument("--plan", default="quick", choices=("quick", "full", "smoke"), help="probe plan (default quick)")
    ap.add_argument("--server-cmd", default=os.environ.get("LORA_OPT_SERVER_CMD"),
                    help="replaces 'vllm serve MODEL' (env LORA_OPT_SERVER_CMD): lora-opt emulate for a dry run")
    ap.add_argument("--speed", type=float, default=1.0, help="the servers' simulated s per wall s (emulate's --speed)")
    ap.add_argument("--adapter-path", default="adapters/r{rank}", help="probe: a rank-{rank} adapter directory")
    ap.add_argument("--health-timeout", type=float, default=900.0, help="wall s a server may take to start")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "real_validation"), help="output directory")
    ap.add_argument("--tracking-uri", help="MLflow tracking URI (default: the local store under mlruns/)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    track = ["--tracking-uri", a.tracking_uri] if a.tracking_uri else []
    speed = ["--speed", f"{a.speed:g}"]
    server = ["--server-cmd", a.server_cmd] if a.server_cmd else []
    import yaml
    profile = a.profile or yaml.safe_load(Path(a.workload).read_text())["profile"]
    steps: dict[str, float] = {}

    def step(name, *args):
        t0 = time.perf_counter()
        rc = lora_opt(*args, log=out / "logs" / f"{name}.txt")
        steps[name] = time.perf_counter() - t0
        return rc

    env = environment(out, a.server_cmd)
    if step("place", "place", "--workload", a.workload, "--gpus", str(a.gpus), "--emit-vllm", "--out",
            str(out / "placement")) != 0:
        raise SystemExit("place failed (see logs/place.txt)")
    commands = out / "placement" / "vllm" / "serve_commands.txt"
    n_gpus = len([ln for ln in commands.read_text().splitlines() if ln.strip()])
    # the probe first: it relaunches GPU 0's command per family, on GPU 0's port
    rc_probe = step("probe", "probe", "--launch", str(commands), "--gpu-index", "0", "--plan", a.plan, "--model", profile,
                    "--adapter-path", a.adapter_path, "--health-timeout", f"{a.health_timeout:g}", "--out",
                    str(out / "probe"), *speed, *server, *track)
    t0 = time.perf_counter()
    servers = launch_fleet(commands, n_gpus, a.server_cmd, out, a.health_timeout)
    steps["launch"] = time.perf_counter() - t0
    try:
        rc_val = step("validate", "validate", str(out / "placement" / "placement.json"), "--endpoints",
                      str(out / "placement" / "router.json"), "--workload", a.workload, "--duration", f"{a.duration:g}",
                      "--gpu", a.gpu_name, "--out", str(out / "validation"), *speed, *track)
    finally:
        for s in servers:
            s.stop()
    step("ingest", "ingest", str(out / "validation"), "--out", str(out / "ingested_rows.csv"), "--label", "real_validation")
    rc_cal = -1
    if (out / "probe" / "rows.csv").exists():
        rc_cal = step("calibrate", "calibrate", "--runs", str(out / "probe" / "rows.csv"), "--model", profile,
                      "--out", str(out / "fitted_profile.yaml"), *track)
        if rc_cal == 0:
            cmp = subprocess.run([sys.executable, "-m", "lora_opt.probe.compare", profile,
                                  str(out / "fitted_profile.yaml"), "--max-loras", "16"], cwd=ROOT,
                                 capture_output=True, text=True)
            atomic_write_text(out / "profile_vs_probe.txt", cmp.stdout + cmp.stderr)
    summary = {"gpus": n_gpus, "gpu_name": a.gpu_name, "profile": profile, "environment": env, "step_s": steps,
               "exit": {"probe": rc_probe, "validate": rc_val, "calibrate": rc_cal}}
    atomic_write_json(out / "summary.json", summary, indent=1)
    with tracked_run("real_validation", run_name=f"{a.gpu_name or 'machine'} {n_gpus} GPUs",
                     tracking_uri=a.tracking_uri):
        import mlflow
        mlflow.log_params({"gpus": n_gpus, "gpu_name": a.gpu_name, "profile": profile, "plan": a.plan,
                           "server_cmd": (a.server_cmd or "vllm serve")[:500], "vllm": str(env.get("vllm"))[:200]})
        mlflow.log_metrics({f"step_s.{k}": v for k, v in steps.items()})
        log_dir(out)
    archive = shutil.make_archive(str(out) + "_send_back", "gztar", root_dir=out.parent, base_dir=out.name)
    print("\nsteps (wall s): " + ", ".join(f"{k} {v:.0f}" for k, v in steps.items()))
    print(f"send back: {archive}  (everything under {out}: probe/rows.csv, probe/summary.json, probe/logs/, "
          "validation/, ingested_rows.csv, fitted_profile.yaml, profile_vs_probe.txt, environment.json, logs/)")
    return 0 if rc_probe in (0, 3) and rc_val in (0, 3) and rc_cal == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
