"""Reproduce the two papers' published results, one MLflow run per result (experiment ``reproduce``).

    python experiments/reproduce.py [--only NAME ...] [--quick] [--list] [--out DIR] [--tracking-uri URI]

Each result (``experiments/reproduce/<name>.py``) computes our numbers, draws its figure and returns
a row: the paper's number, ours, the real measurement where the bundled data has one, and a verdict.
The run logs the row's params and metrics, tags the row's text (``reproduce.*``), and stores the
figure, ``table.md`` and ``row.json`` as artifacts; the same files are written under
``experiments/reproduce/results/<name>/`` (or ``--out``).  ``--quick`` runs the quick set at
reduced size (results that need long twin runs shrink or are skipped); ``python
experiments/results_section.py`` then rewrites the Results page's table (docs/results.md) from the runs.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
import time
from pathlib import Path

# `python experiments/reproduce.py` puts experiments/ first on the path, where the package reproduce/
# (the results) takes precedence over this script of the same name
from reproduce import RESULTS_DIR, Context, Row
from reproduce.registry import RESULTS, by_name
from lora_opt.io import atomic_write_json, atomic_write_text
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run

EXPERIMENT = "reproduce"
#: MLflow tag prefix of the row's text fields (read back by experiments/results_section.py)
TAG = "reproduce."
ROW_TEXT = ("title", "paper_value", "ours", "real", "verdict", "why")


def _log_row(row: Row, module, quick: bool, wall_s: float, load_before: float) -> None:
    import mlflow  # heavy optional dependency: only when tracking

    # timings in a row are only as good as the machine was quiet: record how busy it was
    params = {"result": row.name, "paper": module.PAPER, "quick": quick, "cpus": os.cpu_count(),
              "load_avg_1m_before": round(load_before, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
              **row.params}
    mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
    # MLflow allows only some characters in metric names (e.g. not the "*" of "Tree**")
    metrics = {re.sub(r"[^A-Za-z0-9_\-. :/]", "_", k): v for k, v in row.metrics.items()}
    log_flat_metrics("", dict(metrics, wall_s=wall_s))
    tags = {TAG + k: str(getattr(row, k))[:4000] for k in ROW_TEXT}
    tags.update({TAG + "name": row.name, TAG + "paper": module.PAPER, TAG + "quick": str(quick).lower(),
                 TAG + "order": str(RESULTS.index(module))})
    mlflow.set_tags(tags)


def run_result(module, out_root: Path, quick: bool, seed: int = 0, tracking_uri: str | None = None,
               track: bool = True) -> Row:
    """Run one result: compute, write its files under ``out_root/NAME``, log one MLflow run."""
    out = out_root / module.NAME
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=out, quick=quick, seed=seed)
    if not track:
        return _compute(module, ctx)
    with tracked_run(EXPERIMENT, run_name=module.NAME, tracking_uri=tracking_uri):
        t, load = time.perf_counter(), os.getloadavg()[0]
        row = _compute(module, ctx)
        _log_row(row, module, quick, time.perf_counter() - t, load)
        log_dir(out)
    return row


def _compute(module, ctx: Context) -> Row:
    t = time.perf_counter()
    row = module.run(ctx)
    row.metrics.setdefault("wall_s", time.perf_counter() - t)
    atomic_write_json(ctx.out / "row.json", row.as_dict(), indent=1, default=str)
    atomic_write_text(ctx.out / "table.md", f"# {row.title}\n\n{row.table_md}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these results (see --list)")
    ap.add_argument("--quick", action="store_true", help="the quick set, at reduced size (<= 15 min on 2 cores)")
    ap.add_argument("--list", action="store_true", help="list the results and exit")
    ap.add_argument("--out", default=str(RESULTS_DIR), help="where each result's files go (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tracking-uri", default=None, help="MLflow store (default: the repository's mlruns/)")
    ap.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    args = ap.parse_args(argv)
    if args.list:
        for m in RESULTS:
            print(f"{m.NAME:<28} {'quick' if m.QUICK else 'full ':<6} {m.TITLE}")
        return 0
    try:
        modules = [by_name(n) for n in args.only] if args.only else [
            m for m in RESULTS if m.QUICK or not args.quick]
    except KeyError as exc:
        print(f"reproduce.py: error: {exc.args[0]}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    rows, failed, t0 = [], [], time.perf_counter()
    for m in tqdm(modules, desc="reproduce", unit="result"):
        tqdm.write(f"-- {m.NAME}: {m.TITLE}")
        try:
            row = run_result(m, Path(args.out), args.quick, args.seed, args.tracking_uri, not args.no_track)
        except Exception:  # one broken result must not hide the others: report it, go on, exit 1
            failed.append(m.NAME)
            tqdm.write(f"   FAILED:\n{traceback.format_exc()}")
            continue
        rows.append(row)
        tqdm.write(f"   paper: {row.paper_value}\n   ours:  {row.ours}\n   {row.verdict}: {row.why}")
    print(f"\n{len(rows)} result(s) in {time.perf_counter() - t0:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
