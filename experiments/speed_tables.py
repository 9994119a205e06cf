"""The README's performance tables, generated from the benchmarks' ``--out`` JSON.

Each table lives in README.md between two HTML comments, ``<!-- bench:NAME:begin ... -->`` and
``<!-- bench:NAME:end -->``; ``rewrite_readme`` replaces only what is between them, so the numbers
in the README are always the ones a committed JSON holds (``experiments/bench/*.json``) and
``tests/test_bench_place.py`` fails when they drift apart.  The command:
``python experiments/readme_tables.py`` (after ``lora-opt bench place --out experiments/bench/place.json``
and ``lora-opt bench twin --out experiments/bench/twin.json``).
"""
from __future__ import annotations

import math
import re

import generated_blocks

BEGIN = "<!-- bench:{name}:begin (generated from {source} by python experiments/readme_tables.py; do not edit) -->"
END = "<!-- bench:{name}:end -->"


def _t(x) -> str:
    """A CPU time for a table: ms below a second."""
    if x is None:
        return "-"
    return f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s"


def place_cases_table(doc: dict) -> str:
    """The papers' setting: every oracle policy, CPU time, the paper's and our target."""
    lines = ["| case | policy | algorithm (`assign`) | whole `place` | GPUs | target | paper |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["cases"]:
        lines.append(f"| {r['case']} | {r['policy']} | {_t(r['assign_cpu_s'])} | {_t(r['place_cpu_s'])} | {r['gpus']} | "
                     f"{'<= ' + _t(r['target_s']) if r['target_s'] else '-'} | {_t(r['paper_s'])} |")
    return "\n".join(lines)


def place_scaling_table(doc: dict) -> str:
    """1k-1M adapters: ``place`` CPU time per policy, targets, oracle questions, exponents."""
    s = doc["scaling"]
    policies = list(s["exponents"])
    by = {(r["policy"], r["adapters"]): r for r in s["rows"]}
    sizes = sorted({r["adapters"] for r in s["rows"]})
    head = "| adapters / pool GPUs | " + " | ".join(f"{p}: `place` (target)" for p in policies) + \
        " | " + " | ".join(f"{p}: GPUs used, oracle rows per adapter" for p in policies) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(policies))]
    for n in sizes:
        cells, work = [], []
        for p in policies:
            r = by.get((p, n))
            if r is None:
                cells.append("not run (see below)")
                work.append("-")
                continue
            cells.append(_t(r["place_cpu_s"]) + (f" (<= {_t(r['target_s'])})" if r["target_s"] else ""))
            work.append(f"{r['gpus']:,}, {r['oracle_rows'] / r['adapters']:.2f}")
        pool = next(r["pool"] for r in s["rows"] if r["adapters"] == n)
        lines.append(f"| {n:,} / {pool:,} | " + " | ".join(cells) + " | " + " | ".join(work) + " |")
    exps = "; ".join(f"{p} {e['place']:.2f} (between sizes: {', '.join(f'{x:.2f}' for x in e['place_steps'])})"
                     for p, e in s["exponents"].items())
    lines += ["", f"Growth exponent of `place` (least squares of log CPU time on log adapters): {exps}; "
                  f"target <= {s['max_exponent']}."]
    if s.get("peak_rss_mb") is not None:
        lines.append(f"Peak RSS of the whole bench process after greedy-fast at {s['largest']:,} adapters: "
                     f"{s['peak_rss_mb']:,.0f} MB (target <= {s['rss_target_mb']:,} MB).")
    lines += [f"Not run: {n}." for n in s["notes"]]
    lines.append(f"CPU time (`time.process_time`), best of {doc['repeats']} (one run at 1M adapters); "
                 f"the bench took {doc['bench_wall_s']:.0f} s wall, {doc.get('bench_cpu_s', math.nan):.0f} s CPU"
                 + (f" (load average {m['load_average_1min_at_start']:.1f} at its start, {m['load_average_1min_at_end']:.1f} "
                    f"at its end, on {m['cpus']} CPUs)." if (m := doc.get("machine", {})).get("cpus") else "."))
    return "\n".join(lines)


def twin_table(rows: list) -> str:
    """``bench twin``'s rows: CPU (and wall) seconds per simulated hour of the fastest round, the
    slowest round's CPU seconds (this machine's noise), against the targets and the published twin."""
    lines = ["| scenario | CPU s per simulated hour | slowest round | wall s | target | issue 17's target (50x published) | "
             "published twin | x published (CPU) | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = r.get("cpu_s_per_sim_hour", r["wall_s_per_sim_hour"])
        slowest = max(r.get("cpu_s_per_sim_hour_rounds") or [cpu])
        t50 = r.get("target_50x_s")
        lines.append(f"| {r['scenario']} | {cpu:.3f} | {slowest:.3f} | {r['wall_s_per_sim_hour']:.3f} | <= {r['target_s']:g} | "
                     f"{'<= ' + format(t50, '.3f') + (' met' if cpu <= t50 else ' not met') if t50 else '-'} | "
                     f"{r['published_s']:g} | {r['published_s'] / cpu:.0f}x | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def speed_table(twin_rows: list, fleet_doc: dict) -> str:
    """The README's speed table: issue 25's targets -- the single-engine kernel on the three
    reference scenarios (``bench twin``, x the published twin as measured for the issue), the fleet
    twin against independent engines and its growth in N (``bench fleet``)."""
    lines = ["| benchmark | measured (CPU, this 2-core machine) | target |", "|---|---|---|"]
    for r in twin_rows:
        t50 = r.get("target_50x_s")
        if not t50:
            continue
        cpu = r.get("cpu_s_per_sim_hour", r["wall_s_per_sim_hour"])
        lines.append(f"| twin, {r['scenario']} | {cpu:.3f} s per simulated hour = {50 * t50 / cpu:.0f}x the published twin "
                     f"({50 * t50:g} s); peak RSS {r['peak_rss_mb']:.0f} MB | >= 50x, <= 200 MB |")
    for row in fleet_doc["fleet"]:
        fleets = row["fleets"].values()
        static = [f["ratio"] for f in fleets if f["adapters"] == "static"]
        on_demand = ", ".join(f"{f['router']} {f['ratio']:.2f}x" for f in fleets if f["adapters"] == "on-demand")
        worst = max(fleets, key=lambda f: f["cpu_s"])
        n = row["engines"]
        target = "<= 2x, <= 60 s" if n == 100 and row["simulated_s"] >= 3600 else "-"
        lines.append(f"| fleet twin, {n:,} engine{'s' if n > 1 else ''}, {row['simulated_s'] / 60:g} min of "
                     f"{fleet_doc['trace']} ({row['requests']:,} requests) | vs {n:,} independent "
                     f"engine{'s' if n > 1 else ''} ({row['independent_cpu_s']:.2f} s): static adapters "
                     f"{min(static):.2f}x-{max(static):.2f}x over the {len(static)} routers; on demand: "
                     f"{on_demand or 'not run'}; slowest {worst['router']}/{worst['adapters']} {worst['cpu_s']:.2f} s "
                     f"| {target} |")
    return "\n".join(lines)


def replace_block(text: str, name: str, body: str, source: str) -> str:
    """``text`` with the block ``name`` (markers included) replaced by ``body`` between fresh
    markers; InputError if the README has no such block (or two)."""
    block = BEGIN.format(name=name, source=source) + "\n" + body.rstrip("\n") + "\n" + END.format(name=name)
    return generated_blocks.replace_block(text, f"<!-- bench:{name}:begin", END.format(name=name), block)


def render_readme(text: str, place_doc: dict | None, twin_rows: list | None, place_src: str, twin_src: str,
                  fleet_doc: dict | None = None, fleet_src: str = "") -> str:
    """README text with every block whose JSON is given regenerated (``fleet_doc`` with the twin's
    rows: the ``speed`` block instead of the ``twin`` one)."""
    if fleet_doc is not None and twin_rows is not None:
        return replace_block(text, "speed", speed_table(twin_rows, fleet_doc), f"{twin_src} and {fleet_src}")
    if place_doc is not None:
        text = replace_block(text, "place-cases", place_cases_table(place_doc), place_src)
        text = replace_block(text, "place-scaling", place_scaling_table(place_doc), place_src)
    if twin_rows is not None:
        text = replace_block(text, "twin", twin_table(twin_rows), twin_src)
    return text


def block_names(text: str) -> list[str]:
    """Names of the generated blocks in a README."""
    return re.findall(r"<!-- bench:([\w-]+):begin", text)
