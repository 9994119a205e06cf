"""The papers' central claim on a real vLLM (``cpu_loop.py --stages maxpack``): served adapters swept on the
real CPU server at a fixed per-adapter rate and fixed ``--max-loras``; each point is a ``lora-opt validate``
run, so the twin (the CPU profile) replays exactly the requests the real server got.

Max_pack (the papers' definition, as ``lora_opt.calibration.fidelity.max_pack_table``): the served-adapter
count with the highest throughput among the non-starving runs (throughput >= rho 0.9 x incoming tokens).
Regret: the real throughput lost by deploying the twin's pick instead of the real optimum, in % of the
real optimum's throughput (0 when they agree; the twin's pick starving on the real server is reported
as such).
"""
from __future__ import annotations

import json
from pathlib import Path

from cpu_workloads import WORKLOADS, capacity_rate, retwin_run, validate_one

from lora_opt.io import atomic_write_json

RHO = 0.9
SERVED = (2, 4, 6, 8, 10, 12)
#: the names of the sweep's adapters over the tier's rank-8 and rank-16 checkpoints, in the order they are added
NAMES = [(f"{c}{r}-{k}", f"r{r}-{c}") for k in range(4) for r in (8, 16) for c in "ab"]
MAX_LORAS = 4
SIZE_FOR_RATE = 8        # the per-adapter rate: the twin's capacity with this many adapters, shared by them


def sweep_workload(n: int) -> str:
    name = f"maxpack_n{n}"
    WORKLOADS[name] = {"adapters": NAMES[:n], "flags": {"max_loras": MAX_LORAS, "max_lora_rank": 16,
                                                       "max_cpu_loras": max(n, MAX_LORAS)},
                       "load": None, "what": f"Max_pack sweep: {n} served adapters"}
    return name


def _gpu0(path: Path) -> dict | None:
    if not path.exists():
        return None
    ev = json.loads(path.read_text())
    g = ev["per_gpu"][0]
    return {"throughput_tok_s": g["throughput_tok_s"], "incoming_tok_s": g["incoming_token_rate"],
            "status": g.get("status", "ok")}


def max_pack(points: list[dict], side: str) -> int | None:
    ok = [p for p in points if p[side] and p[side]["status"] == "ok"
          and p[side]["throughput_tok_s"] >= RHO * p[side]["incoming_tok_s"]]
    return max(ok, key=lambda p: p[side]["throughput_tok_s"])["n"] if ok else None


def stage_maxpack(tier: dict, out: Path, duration: float) -> int:
    per_adapter = capacity_rate(sweep_workload(SIZE_FOR_RATE), tier) / SIZE_FOR_RATE
    points = []
    for n in SERVED:
        name = sweep_workload(n)
        print(f"-- Max_pack sweep: {n} adapters at {per_adapter:.4f} req/s each", flush=True)
        r = validate_one(name, "fit", tier, per_adapter * n, out / "maxpack", duration)
        run = out / "maxpack" / "validation" / f"{name}-fit" / "out"
        points.append({"n": n, "exit": r.get("exit"), "error": r.get("error"), "real": _gpu0(run / "real.json"),
                       "twin": _gpu0(run / "twin.json")})
        atomic_write_json(out / "maxpack.json", {"per_adapter_rate": per_adapter, "max_loras": MAX_LORAS,
                                                 "points": points}, indent=1)
    return _pick(out, per_adapter, points)


def stage_repick(out: Path) -> int:
    """The sweep's stored runs compared again with the current profile (``validate --twin-only``) and the
    twin's pick made again; the real points stay as measured."""
    old = json.loads((out / "maxpack.json").read_text())
    points, rc = [], 0
    for p in old["points"]:
        run = out / "maxpack" / "validation" / f"maxpack_n{p['n']}-fit"
        rc |= retwin_run(run, out / "logs" / f"retwin_maxpack_n{p['n']}.txt")
        points.append({**p, "twin": _gpu0(run / "out" / "twin.json")})
    return rc | _pick(out, old["per_adapter_rate"], points)


def _pick(out: Path, per_adapter: float, points: list[dict]) -> int:
    real_n, twin_n = max_pack(points, "real"), max_pack(points, "twin")
    by_n = {p["n"]: p for p in points}
    result = {"per_adapter_rate": per_adapter, "max_loras": MAX_LORAS, "rho": RHO, "points": points,
              "real_max_pack": real_n, "twin_max_pack": twin_n}
    if real_n is not None and twin_n is not None:
        best = by_n[real_n]["real"]["throughput_tok_s"]
        picked = by_n[twin_n]["real"]
        result["twin_pick_real_throughput"] = picked["throughput_tok_s"]
        result["twin_pick_starves_on_real"] = picked["throughput_tok_s"] < RHO * picked["incoming_tok_s"]
        # a pick that starves on the real server is infeasible: its throughput is no regret's measure
        result["regret_pct"] = (None if result["twin_pick_starves_on_real"]
                                else 100.0 * (best - picked["throughput_tok_s"]) / best)
    atomic_write_json(out / "maxpack.json", result, indent=1)
    print(f"real Max_pack {real_n}, twin's pick {twin_n}, regret {result.get('regret_pct')}"
          + (" (the pick starves on the real server)" if result.get("twin_pick_starves_on_real") else ""), flush=True)
    return 0 if real_n is not None and twin_n is not None else 1
