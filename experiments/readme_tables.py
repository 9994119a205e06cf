"""Regenerate the README's performance tables from the committed benchmark JSON.

    lora-opt bench place --out experiments/bench/place.json
    lora-opt bench twin --out experiments/bench/twin.json
    python experiments/readme_tables.py [--check]
    python experiments/readme_tables.py --growth-baseline   # re-make tests/data/bench_place_baseline.json

Rewrites only the blocks between ``<!-- bench:NAME:begin ... -->`` and ``<!-- bench:NAME:end -->``
in README.md (``lora_opt.benchmarks_readme``); ``--check`` changes nothing and exits 1 when the
README differs from what the JSON gives (``tests/test_bench_place.py`` runs the same check).
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from lora_opt.benchmarks_place import growth_case
from lora_opt.benchmarks_readme import render_readme
from lora_opt.io import atomic_write_json, atomic_write_text

PLACE_JSON = "experiments/bench/place.json"
TWIN_JSON = "experiments/bench/twin.json"
GROWTH_BASELINE = "tests/data/bench_place_baseline.json"


def rendered() -> tuple[str, str]:
    """(README as it is, README as the committed JSON makes it)."""
    readme = (ROOT / "README.md").read_text()
    place = json.loads((ROOT / PLACE_JSON).read_text()) if (ROOT / PLACE_JSON).exists() else None
    twin = json.loads((ROOT / TWIN_JSON).read_text()) if (ROOT / TWIN_JSON).exists() else None
    return readme, render_readme(readme, place, twin, PLACE_JSON, TWIN_JSON)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is not what the JSON gives")
    ap.add_argument("--growth-baseline", action="store_true",
                    help=f"measure the growth case (best of 5) and write {GROWTH_BASELINE}")
    a = ap.parse_args()
    if a.growth_baseline:
        case = growth_case(repeats=5)
        case["command"] = "python experiments/readme_tables.py --growth-baseline"
        atomic_write_json(ROOT / GROWTH_BASELINE, case, indent=1)
        print(json.dumps(case, indent=1))
        sys.exit(0)
    old, new = rendered()
    if a.check:
        print("README.md tables are up to date" if old == new else "README.md tables differ from the JSON")
        sys.exit(0 if old == new else 1)
    if old != new:
        atomic_write_text(ROOT / "README.md", new)
    print("README.md " + ("rewritten" if old != new else "already up to date"))
