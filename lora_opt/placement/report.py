"""A placement as ``lora-opt place`` reports it: a per-GPU table, a verdict (exit status and
message), and its files -- ``placement.json`` and, for a deployable placement, one ``vllm serve``
command per GPU and a router table.

Exit status (``verdict``): 0 a deployable placement; 3 the pool is too small (the table says how
many GPUs the policy needs) or an adapter cannot be served at all; 4 the policy's placement has
instances that would not start (written for inspection, no launch commands).
"""
from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

from lora_opt.errors import EXIT_NOT_ACCEPTABLE, EXIT_NOT_DEPLOYABLE, EXIT_OK
from lora_opt.io import atomic_write_text
from lora_opt.placement.plan import Placement, PlacementError, check_placement
from lora_opt.placement.policies.greedy import MARGIN_GRID, SURROGATE_RHO
from lora_opt.placement.vllm_launch import check_serve_args, resolve_vllm_version, router_table, serve_command

# The starvation margin is rho x L - 1 for the largest load factor L on MARGIN_GRID (0.5x .. 3x) the
# surrogate calls not starving: at the grid's ends it is a bound, not a value.
#: the lowest margin shown (-55 %): at most this (the surrogate rejects even half the load)
MARGIN_FLOOR = float(SURROGATE_RHO * MARGIN_GRID[0] - 1.0)
#: the highest margin shown (+170 %): at least this (the surrogate accepts even 3x the load)
MARGIN_CEILING = float(SURROGATE_RHO * MARGIN_GRID[-1] - 1.0)
#: below this (-10 %) the surrogate calls the GPU starving at its expected load (throughput < rho x incoming)
MARGIN_STARVING = float(SURROGATE_RHO - 1.0)
_EPS = 1e-9


def margin_cell(margin: float | None) -> str:
    """The margin as the table shows it: ``+30 %``, ``>= +170 %`` / ``<= -55 %`` at the bounds, ``-``."""
    if margin is None:
        return "-"
    if margin >= MARGIN_CEILING - _EPS:
        return f">= {MARGIN_CEILING:+.0%}".replace("%", " %")
    if margin <= MARGIN_FLOOR + _EPS:
        return f"<= {MARGIN_FLOOR:+.0%}".replace("%", " %")
    return f"{margin:+.0%}".replace("%", " %")


def _ranks(adapters) -> str:
    c = Counter(a.rank for a in adapters)
    return " ".join(f"r{r}x{n}" for r, n in sorted(c.items(), reverse=True))


#: the columns every placement table starts with
_HEAD = f"{'GPU':>3} {'adapters':>8} {'ranks':<22} {'A_max':>5} {'max_rank':>8}"


def _gpu_cells(p: Placement):
    """(GPU index, its _HEAD cells) for every GPU of ``p``."""
    on_gpu = p.by_gpu()
    for i, g in enumerate(p.gpus):
        ads = [p.adapters[k] for k, _ in on_gpu[i]]
        yield i, f"{i:>3} {len(ads):>8} {_ranks(ads):<22} {g.max_loras:>5} {g.max_lora_rank:>8}"


def _risk_cell(risk: float | None, exact: bool) -> str:
    if risk is None:
        return "-"
    return ("" if exact else "<= ") + (f"{risk:.1%}" if risk < 0.1 else f"{risk:.0%}").replace("%", " %")


def confidence_table(p: Placement) -> str:
    """GPU, adapters, ranks, A_max, max rank, incoming rate, the twin's capacity, margin at C, P(starve)."""
    m = p.meta
    c = m["confidence"]["confidence"]
    head_m, head_p = f"margin@{c:g}", "P(starve)"
    lines = [f"{_HEAD} {'req/s':>7} {'cap tok/s':>10} {head_m:>11} {head_p:>10}"]
    failing = set(m.get("gpus_failing_startup", []))
    for i, cells in _gpu_cells(p):
        cap, exact = m["twin_capacity_tok_s"][i], m["twin_capacity_exact"][i]
        mar = m["margin_at_confidence"][i]
        cap_cell = "-" if cap is None else ("" if exact else ">=") + f"{cap:.0f}"
        mar_cell = "-" if mar is None else ("" if exact else ">= ") + f"{mar:+.0%}".replace("%", " %")
        lines.append(f"{cells} {m['incoming_rate_req_s'][i]:>7.2f} {cap_cell:>10} {mar_cell:>11} "
                     f"{_risk_cell(m['p_starve'][i], exact):>10}" + ("   would not start (OOM)" if i in failing else ""))
    return "\n".join(lines)


def confidence_notes(p: Placement) -> list[str]:
    """What the confidence table's columns mean."""
    c = p.meta["confidence"]
    notes = [f"cap tok/s = the twin's capacity for the GPU (its throughput replayed at 2x-8x its load; '>=' = not "
             f"saturated even at 8x); margin@{c['confidence']:g} = the real capacity's lower bound at confidence "
             f"{c['confidence']:g} (the twin's capacity x {c['capacity_ratio_bound']:.3f}) over the GPU's expected load, "
             f"- 1: the GPU starves below {margin_cell(MARGIN_STARVING)}",
             f"P(starve) = estimated probability that the real server serves < rho x the GPU's load (conformal, from "
             f"{c['n']} held-apart real runs, {c['samples']}; never below 1/(n+1) = {1 / (c['n'] + 1):.1%})".replace("%)", " %)") + "; "
             f"error model {c['error_model']}"]
    if "starvation_margin" in p.meta:          # a policy's placement (a deployment judged on the fleet has none)
        notes.append("the surrogate's margin and the twin's verification load per GPU are in placement.json "
                     "(starvation_margin, twin_verified_at_load)")
    return notes


def placement_table(p: Placement) -> str:
    """GPU, adapters, ranks, A_max, max rank, incoming and predicted throughput, margin (or, for a
    placement judged at a confidence, the twin's capacity, margin at C and P(starve))."""
    m = p.meta
    if m.get("p_starve") is not None and m.get("confidence"):
        return confidence_table(p)
    lines = [f"{_HEAD} {'req/s':>7} {'pred tok/s':>10} {'margin':>9} {'twin':>10}"]
    failing = set(m.get("gpus_failing_startup", []))
    for i, cells in _gpu_cells(p):
        thr = (m.get("predicted_throughput") or [None] * len(p.gpus))[i]
        mar = (m.get("starvation_margin") or [None] * len(p.gpus))[i]
        rate = (m.get("incoming_rate_req_s") or [0.0] * len(p.gpus))[i]
        ver = (m.get("twin_verified_at_load") or [None] * len(p.gpus))[i]
        twin = f"ok at {ver:g}x" if ver else "-"
        lines.append(f"{cells} {rate:>7.2f} "
                     f"{(f'{thr:10.0f}' if thr is not None else f'{chr(45):>10}')} "
                     f"{margin_cell(mar):>9} {twin:>10}"
                     + ("   would not start (OOM)" if i in failing else ""))
    return "\n".join(lines)


def _per_gpu(p: Placement, key: str) -> list:
    return list(p.meta.get(key) or [None] * len(p.gpus))


def table_notes(p: Placement) -> list[str]:
    """What the table's columns mean, for the values this table shows (each note agrees with the
    signs and dashes printed above it)."""
    if p.meta.get("p_starve") is not None and p.meta.get("confidence"):
        return confidence_notes(p)
    thr, mar = _per_gpu(p, "predicted_throughput"), _per_gpu(p, "starvation_margin")
    ver = _per_gpu(p, "twin_verified_at_load")
    shown = [m for m in mar if m is not None]
    notes = []
    if not shown and all(t is None for t in thr):
        return [f"pred tok/s, margin '-': policy {p.policy} consults no surrogate; `lora-opt evaluate` "
                "replays the placement on the twin"]
    if shown:
        notes.append(f"margin = the surrogate's capacity headroom over the GPU's expected load (rho {SURROGATE_RHO:g} "
                     "x the largest load factor it calls not starving, - 1): +30 % = capacity 30 % above the load")
    if any(m >= MARGIN_CEILING - _EPS or m <= MARGIN_FLOOR + _EPS for m in shown):
        notes.append(f"{margin_cell(MARGIN_CEILING)} / {margin_cell(MARGIN_FLOOR)}: bounds -- the surrogate is asked "
                     f"at {MARGIN_GRID[0]:g}x .. {MARGIN_GRID[-1]:g}x the load, and accepts even the most / "
                     "rejects even the least")
    if any(MARGIN_STARVING - _EPS <= m < 0 for m in shown):
        notes.append(f"{margin_cell(MARGIN_STARVING)} .. 0 %: capacity below the expected load, yet not starving "
                     f"by the criterion (throughput >= rho x incoming)")
    starving = [i for i, m in enumerate(mar) if m is not None and m < MARGIN_STARVING - _EPS]
    for i in starving:
        if ver[i]:
            notes.append(f"GPU {i}: margin below {margin_cell(MARGIN_STARVING)}: the surrogate predicts starvation at "
                         f"the expected load; the twin passed the GPU at {ver[i]:g}x its load, and the twin's "
                         "verdict is the one used")
        else:
            notes.append(f"GPU {i}: margin below {margin_cell(MARGIN_STARVING)}: the surrogate predicts starvation "
                         "at the expected load")
    dash = [i for i, t in enumerate(thr) if t is None]
    if dash:
        twin_set = [i for i in dash if ver[i]]
        if twin_set:
            notes.append(f"pred tok/s '-' (GPU {', '.join(map(str, twin_set))}): no surrogate prediction at this A_max "
                         "-- the surrogate's choice was absent or failed the twin, so the twin set A_max (every "
                         "adapter resident, as memory allows) and verified it")
        rest = [i for i in dash if not ver[i]]
        if rest:
            notes.append(f"pred tok/s '-' (GPU {', '.join(map(str, rest))}): no surrogate prediction for this GPU")
    if any(ver):
        notes.append("twin 'ok at Lx' = the GPU passed the twin at L x its expected load (not starving, p99 TTFT "
                     "within bound), which overrules the surrogate; '-' = not verified on the twin")
    return notes


def verdict(p: Placement) -> tuple[int, str]:
    """(exit status, one-line message) of a placement: deployable (``EXIT_OK``), infeasible
    (``EXIT_NOT_ACCEPTABLE``) or not deployable (``EXIT_NOT_DEPLOYABLE``)."""
    m = p.meta
    if m.get("unplaceable"):
        ids = m["unplaceable"]
        hint = ("; its surrogate calls even a GPU of their own starving -- greedy-plus checks such GPUs "
                "on the twin" if p.policy in ("greedy", "greedy-fast") else "")
        return EXIT_NOT_ACCEPTABLE, (f"infeasible: {len(ids)} adapter(s) cannot be served by the policy "
                                     f"({', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}){hint}")
    if not m.get("feasible"):
        return EXIT_NOT_ACCEPTABLE, (f"infeasible: the workload needs {m['gpus_needed']} GPUs with policy {p.policy}; "
                                     f"the pool has {m['gpus_pool']}. Rerun with --gpus {m['gpus_needed']}.")
    if m.get("gpus_failing_startup"):
        return EXIT_NOT_DEPLOYABLE, (f"not deployable: vLLM would not start on GPU(s) {m['gpus_failing_startup']} "
                                     "(the policy's A_max does not fit in memory)")
    return EXIT_OK, (f"{len(p.gpus)} of {m['gpus_pool']} GPUs used by {p.policy} "
                     f"({m['policy_wall_ms']:.1f} ms)")


#: the files ``lora-opt place`` owns in its --out directory (a rerun removes them first)
OWNED_FILES = ("placement.json", "router.json", "vllm/serve_commands.txt",
               "router/inference-pools.yaml", "router/vllm-router.sh")   # the last two: --emit-router
_GPU_SCRIPT = re.compile(r"gpu\d+\.sh")


def clean_outputs(out_dir: Path) -> list[Path]:
    """Remove the files a previous ``lora-opt place`` wrote into ``out_dir`` (placement.json,
    router.json, vllm/gpuN.sh, vllm/serve_commands.txt; vllm/ itself when left empty); nothing else
    is touched.  The removed paths."""
    removed = [out_dir / f for f in OWNED_FILES if (out_dir / f).is_file()]
    vdir = out_dir / "vllm"
    if vdir.is_dir():
        removed += [f for f in vdir.iterdir() if _GPU_SCRIPT.fullmatch(f.name) and f.is_file()]
    for f in removed:
        f.unlink()
    if vdir.is_dir() and not any(vdir.iterdir()):
        vdir.rmdir()
    return removed


def write_outputs(p: Placement, profile, out_dir: Path, *, emit_vllm: bool, model: str | None,
                  host: str = "127.0.0.1", base_port: int = 8000, vllm_version: str | None = None) -> list[Path]:
    """placement.json (always), and with ``emit_vllm`` a deployable placement's launch files:
    ``vllm/gpuN.sh`` per GPU, ``vllm/serve_commands.txt`` (one command per GPU, one per line) and
    ``router.json``.  Everything is checked before anything is written (a placement the checker
    refuses, or a command vLLM's parser would refuse, writes nothing); the files a previous run
    wrote into ``out_dir`` are removed first (:func:`clean_outputs`: no stale ``gpuN.sh`` beyond
    the new GPU count); each file is written atomically.  The commands are in the flags of
    ``vllm_version`` (default: the profile's release when lora-opt has its option table, else the
    newest it has: :func:`~lora_opt.placement.vllm_launch.resolve_vllm_version`)."""
    files: dict[str, tuple[str, int | None]] = {}
    if emit_vllm:
        check_placement(p, profile)
        model = model or profile.model.name
        release = resolve_vllm_version(vllm_version, getattr(profile, "vllm_version", None), PlacementError)
        lines = []
        on_gpu = p.by_gpu()
        for i in range(len(p.gpus)):
            argv = serve_command(p, i, model, host=host, port=base_port + i,
                                 adapters=[p.adapters[k] for k, _ in on_gpu[i]], vllm_version=release,
                                 block_size=profile.memory.block_size)
            check_serve_args(argv, release)
            line = f"CUDA_VISIBLE_DEVICES={i} " + shlex.join(argv)
            if "\n" in line or "\r" in line:
                raise PlacementError(f"GPU {i}: its vllm serve command would span several lines")
            lines.append(line)
            files[f"vllm/gpu{i}.sh"] = (f"#!/bin/sh\n# generated by lora-opt place; vLLM {release} flags\nexec env "
                                        + line + "\n", 0o755)
        files["vllm/serve_commands.txt"] = ("\n".join(lines) + "\n", None)
        files["router.json"] = (json.dumps(router_table(p, host=host, base_port=base_port), indent=1), None)
    clean_outputs(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "placement.json"]
    p.save(written[0])
    for name, (text, mode) in files.items():
        written.append(atomic_write_text(out_dir / name, text, mode))
    return written
