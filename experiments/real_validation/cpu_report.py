"""The real-vLLM loop's report (``cpu_loop.py --stages report``): ``OUT/REPORT.md`` from the stages' files
(``validation.json``, ``maxpack.json``, ``recalibrate/``) and the MLflow run ``real_validation_cpu``.

SMAPE is the BRIEF's (full scale, ``lora_opt.smape``), per workload over its one instance; "overall" is the
SMAPE over every report-half run together.  Targets (issue 24): throughput <= 5 %, mean ITL <= 10 %,
mean TTFT <= 25 %, running mean <= 10 %.
"""
from __future__ import annotations

import json
from pathlib import Path

from lora_opt.io import atomic_write_text
from lora_opt.smape import smape

METRICS = (("throughput_tok_s", "throughput", 5.0), ("itl_mean_ms", "mean ITL", 10.0),
           ("ttft_mean_ms", "mean TTFT", 25.0), ("running_mean", "running mean", 10.0),
           ("itl_p99_ms", "p99 ITL", None), ("ttft_p99_ms", "p99 TTFT", None), ("waiting_mean", "waiting mean", None),
           ("kv_usage_mean", "KV usage mean", None))


def _pairs(runs: dict, half: str) -> dict[str, tuple[dict, dict]]:
    return {k: (r["comparison"]["real"]["0"], r["comparison"]["twin"]["0"]) for k, r in runs.items()
            if r.get("half") == half and "comparison" in r and "0" in r["comparison"]["real"]}


def validation_table(runs: dict, half: str) -> tuple[list[str], dict]:
    pairs = _pairs(runs, half)
    head = "| run | rate (req/s) | " + " | ".join(f"{label} real / twin (SMAPE)" for _, label, _ in METRICS[:6]) + " |"
    lines = [head, "|" + "---|" * (2 + 6)]
    for name, (real, twin) in pairs.items():
        cells = []
        for key, _, _ in METRICS[:6]:
            s = smape([twin[key]], [real[key]])
            cells.append(f"{real[key]:.4g} / {twin[key]:.4g} ({s:.1f} %)")
        lines.append(f"| {name} | {runs[name]['rate']:.3f} | " + " | ".join(cells) + " |")
    overall = {key: smape([t[key] for _, t in pairs.values()], [r[key] for r, _ in pairs.values()])
               for key, _, _ in METRICS}
    lines.append("| **overall** | | " + " | ".join(f"**{overall[k]:.1f} %**" for k, _, _ in METRICS[:6]) + " |")
    return lines, overall


def targets(overall: dict) -> list[str]:
    return [f"- {label}: {overall[key]:.1f} % (target <= {goal:g} %): {'met' if overall[key] <= goal else 'MISSED'}"
            for key, label, goal in METRICS if goal is not None]


def lateness(out: Path, runs: dict) -> list[str]:
    """The client's send lateness per run (validate's ``client_send_late_wall_ms``): how late the open-loop
    client sent requests behind their arrival times (it shares core 1 with vLLM's front end)."""
    lines = ["| run | client send late, mean / p99 / max (ms) |", "|---|---|"]
    for name in runs:
        f = out / "validation" / name / "out" / "real.json"
        if f.exists():
            late = json.loads(f.read_text())["info"].get("client_send_late_wall_ms") or {}
            if late:
                lines.append(f"| {name} | {late['mean']:.1f} / {late['p99']:.1f} / {late['max']:.1f} |")
    return lines


#: step-cost coefficients the drift table compares (profile latency keys) and, per rank, the LoRA ones
DRIFT_KEYS = ("base_ms", "per_seq_ms", "per_token_ms", "per_ctx_ktoken_ms")
DRIFT_LORA_KEYS = ("jump", "prefill_share", "token_ms", "token_ms_above", "step_ms")


def drift(out: Path, profile: Path) -> tuple[list[str], dict]:
    """The loop's profile (probe before the measurements) against ``OUT/probe-after/profile.yaml`` (the same
    probe after them): the table's lines (each coefficient before / after / change) and the changes in %."""
    import yaml
    after_path = out / "probe-after" / "profile.yaml"
    if not (after_path.exists() and profile.exists()):
        return [], {}
    whole = [yaml.safe_load(p.read_text()) for p in (profile, after_path)]
    before, after = (w["latency"] for w in whole)
    rows = [(k, before.get(k), after.get(k)) for k in DRIFT_KEYS]
    for rank in sorted(set(before.get("lora") or {}) & set(after.get("lora") or {}), key=int):
        rows += [(f"LoRA r{rank} {k}", before["lora"][rank].get(k), after["lora"][rank].get(k)) for k in DRIFT_LORA_KEYS]
    for table in ("cpu_to_gpu_ms", "disk_to_cpu_ms"):        # adapter loads (0: not resolved above the noise)
        b_t, a_t = ((w.get("loading") or {}).get(table) or {} for w in whole)
        rows += [(f"load r{rank} {table}", b_t[rank], a_t.get(rank)) for rank in sorted(b_t, key=int)]
    lines = ["| coefficient | before | after | change |", "|---|---|---|---|"]
    changes = {}
    for name, b, a in rows:
        if not b or a is None:          # unset, or 0 in this LoRA form (jump and prefill_share per token)
            continue
        change = (a - b) / b * 100
        changes[name] = change
        lines.append(f"| {name} | {b:.4g} | {a:.4g} | {change:+.1f} % |")
    return lines, changes


def revalidated(out: Path, runs: dict, summary: dict) -> list[str]:
    """The report half request for request before (the probe's profile: the first table) and after the
    recalibration (``recalibrate/after-validate``): the targets' SMAPEs, overall."""
    after_dir = out / "recalibrate" / "after-validate"
    after = {}
    for name in runs:
        f = after_dir / name / "out" / "comparison.json"
        if f.exists() and runs[name].get("half") == "report":
            after[name] = {**runs[name], "comparison": json.loads(f.read_text())}
    if not after:
        return []
    _, before_overall = validation_table({k: runs[k] for k in after}, "report")
    _, after_overall = validation_table(after, "report")
    keys = [(k, label) for k, label, goal in METRICS if goal is not None]
    summary["recalibrate_request_for_request"] = {"before": {k: before_overall[k] for k, _ in keys},
                                                  "after": {k: after_overall[k] for k, _ in keys}}
    lines = ["### The report half request for request, before and after the recalibration", "",
             ("The same held-apart runs as the first table, their twin side replayed again with the recalibrated "
              "profile (`validate --twin-only`, files in `recalibrate/after-validate/`); overall SMAPE."), "",
             "| profile | " + " | ".join(label for _, label in keys) + " |", "|---|" + "---|" * len(keys)]
    for tag, o in (("probe only (before)", before_overall), ("recalibrated (after)", after_overall)):
        lines.append(f"| {tag} | " + " | ".join(f"{o[k]:.1f} %" for k, _ in keys) + " |")
    return lines + [""]


def write_report(out: Path, profile: Path) -> dict:
    """REPORT.md in ``out``; ``profile``: the loop's profile (``cpu_loop.PROFILE_PATH``)."""
    runs = json.loads((out / "validation.json").read_text()) if (out / "validation.json").exists() else {}
    lines = ["# The loop on a real vLLM: CPU build of vLLM 0.32, probe-size model (issue 24)", "",
             ("Generated by `python experiments/real_validation/cpu_loop.py --stages report` from this folder's files. "
              "Every number: vLLM 0.32's CPU build on a 2-core machine (engine on core 0, client and vLLM's front end "
              "on core 1), the tier's probe-size model (hidden 1024, 4 layers, random weights) -- not an H100, "
              "not vLLM 0.8.5."), ""]
    summary: dict = {}
    for half, title in (("report", "Held-apart runs (report half, seed 2): the targets"),
                        ("fit", "Fit-half runs (seed 1: what the recalibration fits on)")):
        table, overall = validation_table(runs, half)
        summary[half] = overall
        lines += [f"## {title}", "", ("The profile fitted on the probe rows only "
                  "(`configs/profiles/probe-llama-cpu-vllm032.yaml` as `calibrate` wrote it)."), "", *table, ""]
        if half == "report":
            lines += targets(overall) + [""]
    lines += ["## Client lateness", "", *lateness(out, runs), ""]
    table, changes = drift(out, profile)
    if table:
        summary["drift_pct"] = changes
        lines += ["## The server's own drift during the sitting", "",
                  ("The same probe (`--plan quick`) before the measurements (the loop's profile) and after them "
                   "(`probe-after/`, `cpu_loop.py --stages reprobe`), each fitted alone: a coefficient that moved is "
                   "the machine's, not the twin's, and bounds what any model fitted on one probe can reach here."),
                  "", *table, ""]
    mp = out / "maxpack.json"
    if mp.exists():
        m = json.loads(mp.read_text())
        summary["maxpack"] = {k: m.get(k) for k in ("real_max_pack", "twin_max_pack", "regret_pct",
                                                    "twin_pick_starves_on_real", "per_adapter_rate", "max_loras")}
        lines += ["## Max_pack on the real server", "",
                  (f"Served adapters swept at {m['per_adapter_rate']:.4f} req/s each, `--max-loras {m['max_loras']}`, "
                   "ranks 8 and 16; each point one `validate` run (the twin replays the same requests)."), "",
                  "| served | real throughput / incoming (tok/s) | twin throughput / incoming | real starving | twin starving |",
                  "|---|---|---|---|---|"]
        for p in m["points"]:
            r, t = p.get("real"), p.get("twin")
            if not r or not t:
                lines.append(f"| {p['n']} | {p.get('error') or 'no result'} | | | |")
                continue
            lines.append(f"| {p['n']} | {r['throughput_tok_s']:.1f} / {r['incoming_tok_s']:.1f} | "
                         f"{t['throughput_tok_s']:.1f} / {t['incoming_tok_s']:.1f} | "
                         f"{r['throughput_tok_s'] < 0.9 * r['incoming_tok_s']} | {t['throughput_tok_s'] < 0.9 * t['incoming_tok_s']} |")
        if m.get("twin_pick_starves_on_real"):
            verdict = (f"Real Max_pack: **{m.get('real_max_pack')}**; the twin's pick: **{m.get('twin_max_pack')}**, "
                       "which **starves on the real server** (infeasible: no regret is defined)")
        elif m.get("regret_pct") is not None:
            verdict = (f"Real Max_pack: **{m.get('real_max_pack')}**; the twin's pick: **{m.get('twin_max_pack')}**; "
                       f"regret: **{m['regret_pct']:.1f} %** of the real optimum's throughput")
        else:
            verdict = "Max_pack: not determined (see the table)"
        lines += ["", verdict, ""]
    rc = out / "recalibrate"
    halves = {tag: json.loads((rc / tag / "summary.json").read_text())["smape"]["report half"]
              for tag in ("before", "after") if (rc / tag / "summary.json").exists()}
    if len(halves) == 2:
        keys = ("throughput", "itl_mean", "ttft_mean", "running_mean")
        summary["recalibrate"] = {tag: {k: h[k]["mean"] for k in keys} for tag, h in halves.items()}
        lines += ["## Recalibration (ingest -> calibrate-e2e on the fit half -> fidelity of the report half)", "",
                  ("`lora-opt fidelity` replays the ingested report-half runs statistically (Poisson arrivals at the "
                   "runs' rates, their mean lengths), not request for request as `validate` does: its SMAPEs are "
                   "not the tables' above. `calibrate-e2e` fits what `configs/models.yaml` lets it for this setup "
                   "(`e2e_fit: [frontend]`)."), "",
                  "| report half (4 runs) | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for tag in ("before", "after"):
            lines.append(f"| {tag} | " + " | ".join(f"{summary['recalibrate'][tag][k]:.1f} %" for k in keys) + " |")
        import yaml
        e2e = ((yaml.safe_load(profile.read_text())
                .get("fit") or {}).get("e2e") or {})
        if e2e:
            lines += ["", f"Fitted on the fit half: {e2e.get('params')} (fit-half loss {e2e.get('fit_half_loss', 0):.1f} %)."]
        lines.append("")
    lines += revalidated(out, runs, summary)
    atomic_write_text(out / "REPORT.md", "\n".join(lines) + "\n")
    return summary
