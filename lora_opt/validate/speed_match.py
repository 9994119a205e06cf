"""What the machine's speed explains, apart from what the twin's scheduling explains.

A real server on a shared machine runs faster or slower from one sitting to the next; the twin runs at
its profile's speed.  A miss in throughput or TTFT can then be the machine (every step slower or
faster by the same factor) or the twin's scheduling and cost *shape* (which requests run together,
how a step's cost grows with its batch).  The twin is replayed with its step times scaled by one
factor ``s`` -- every millisecond estimator of the profile's ``latency`` section x s, the relative
LoRA factors unchanged -- chosen so that its mean inter-token latency equals the one the server
itself reported on the run (``speed_factor``): the step time the server showed, as a single number.
With the speed matched that way, what is still outside the server's noise in throughput, TTFT,
running and waiting is not the machine's speed: it is how the twin schedules, or how its step cost
grows with the batch.  ITL itself is then fitted, not judged.

A second reading keeps the factor fitted on one run (the light workload, where a step is one or two
sequences and the step time is the machine's speed alone) and applies it to the other workloads of
the same repeat, minutes apart: if one speed explains them all, their misses close; if they stay
open, the cost of larger batches is where the twin errs.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import yaml

from lora_opt.io import atomic_write_text
from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import Workload
from lora_opt.validate.retwin import retwin
from twin.profile import load_profile, profile_to_dict

#: the latency section's millisecond estimators a speed factor scales (the LoRA entries' ``token_ms``,
#: ``token_ms_above`` and ``step_ms`` too); relative factors (LoRA jump, slope, shares) are unchanged
SCALED_LATENCY = ("base_ms", "per_seq_ms", "per_token_ms", "per_ctx_ktoken_ms", "ttft_frontend_ms",
                  "ttft_frontend_per_running_ms", "sched_base_ms", "sched_per_running_ms", "sched_per_waiting_ms")
SCALED_LORA = ("token_ms", "token_ms_above", "step_ms")
#: the bracket searched for the factor, and the bisection's steps (2^-16 of the log-bracket: ~4e-5 relative)
FACTOR_RANGE = (0.25, 4.0)
BISECTION_STEPS = 16


def scaled_profile(profile: str, factor: float, latency: dict | None = None) -> dict:
    """``profile`` (a name or file) as a dict with every step-time estimator x ``factor``; ``latency``:
    fields of the latency section set afterwards (a what-if, e.g. a term switched off)."""
    d = profile_to_dict(load_profile(profile))
    lat = d["latency"]
    for k in SCALED_LATENCY:
        if lat.get(k) is not None:
            lat[k] = float(lat[k]) * factor
    for entry in lat.get("lora", {}).values():
        for k in SCALED_LORA:
            if entry.get(k) is not None:
                entry[k] = float(entry[k]) * factor
    lat.update(latency or {})
    d["name"] = f"{d['name']}-x{factor:.4f}"
    return d


def twin_at_speed(run_dir: str | Path, p: Placement, wl: Workload, factor: float, workdir: Path,
                  latency: dict | None = None, *, summary: bool = False) -> dict:
    """The stored run's comparison with the twin whose step times are x ``factor`` (and ``latency``'s
    fields set: ``scaled_profile``); nothing written into ``run_dir``.  ``summary``: retwin's whole summary
    (with ``twin_raw``) instead of the comparison."""
    path = workdir / f"profile-x{factor:.6f}-{len(latency or {})}.yaml"
    atomic_write_text(path, yaml.safe_dump(scaled_profile(p.profile, factor, latency), sort_keys=False))
    p2 = dataclasses.replace(p, profile=str(path))
    wl2 = dataclasses.replace(wl, profile=str(path))
    out = retwin(run_dir, p2, wl2, write=False)
    return out if summary else out["comparison"]


def _itl(comparison: dict) -> float:
    g = next(iter(comparison["real"]))
    return float(comparison["twin"][g]["itl_mean_ms"]), float(comparison["real"][g]["itl_mean_ms"])


def speed_factor(run_dir: str | Path, p: Placement, wl: Workload) -> tuple[float, dict]:
    """(s, the comparison at s): the step-time factor at which the twin's mean ITL equals the run's
    measured one (bisection on log s; the twin's ITL grows with s), and the comparison there.  s is
    FACTOR_RANGE's end when even that does not reach the measured ITL."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lo, hi = (math.log(x) for x in FACTOR_RANGE)
        best = None
        for _ in range(BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            comp = twin_at_speed(run_dir, p, wl, math.exp(mid), work)
            twin_itl, real_itl = _itl(comp)
            best = (math.exp(mid), comp)
            if twin_itl < real_itl:
                lo = mid
            else:
                hi = mid
        return best
