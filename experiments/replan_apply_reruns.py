"""Issue 37's must-show: ``experiments/replan_apply.py`` rerun, summarised -- failed requests per transition
over every rerun, and the spread of the p99 TTFT while the steps ran.

    python experiments/replan_apply.py --out /tmp/ra1      # ... as many times as wanted; one beside a busy loop:
    for i in 1 2; do timeout 600 sh -c 'while :; do :; done' & done; python experiments/replan_apply.py --out /tmp/ra4
    python experiments/replan_apply_reruns.py quiet=/tmp/ra1 quiet=/tmp/ra2 busy=/tmp/ra4 ... [--out FILE]

Each argument is ``LABEL=DIR`` (a replan_apply output folder: its results.json); writes a markdown table
(default experiments/replan_apply/reruns.md)."""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

from lora_opt.io import atomic_write_text

OUT = Path(__file__).resolve().parent / "replan_apply" / "reruns.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=DIR")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    rows, p99, failed = [], {}, 0
    for k, spec in enumerate(args.runs, 1):
        label, _, folder = spec.partition("=")
        if not folder:
            ap.error(f"{spec!r}: expected LABEL=DIR")
        results = json.loads((Path(folder) / "results.json").read_text())
        cells = []
        for name, r in results.items():
            v, w = r["verdict"], r["windows"]
            p99.setdefault(name, []).append(v["ttft_p99_during_ms"])
            failed += v["failed_requests"]
            cells.append(f"{v['failed_requests']} failed of {sum(w[x]['requests'] for x in ('before', 'during', 'after'))}, "
                         f"p99 during {v['ttft_p99_during_ms']:.0f} ms, {'ok' if v['ok'] else 'NOT ok'}")
        rows.append(f"| {k} | {label} | " + " | ".join(cells) + " |")
    names = list(p99)
    lines = ["# replan_apply rerun", "", "`python experiments/replan_apply.py --out DIR`, rerun; summarised by "
             f"`python experiments/replan_apply_reruns.py {' '.join(args.runs)}`.", "",
             "| run | machine | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names), *rows, ""]
    for name in names:
        a = np.array(p99[name], float)
        lines.append(f"- {name}: p99 TTFT during the steps {np.nanmin(a):.0f}-{np.nanmax(a):.0f} ms over {len(a)} runs")
    lines += ["", f"Failed requests over every run and transition: {failed}.", ""]
    atomic_write_text(args.out, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
