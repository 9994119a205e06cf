"""Regenerate the documentation's performance tables from the committed benchmark JSON.

    lora-opt bench place --out experiments/bench/place.json
    lora-opt bench twin --out experiments/bench/twin.json
    lora-opt bench fleet --out experiments/bench/fleet.json
    python experiments/readme_tables.py [--check]
    python experiments/readme_tables.py --growth-baseline   # re-make tests/data/bench_place_baseline.json

Rewrites only the blocks between ``<!-- bench:NAME:begin ... -->`` and ``<!-- bench:NAME:end -->``
in the docs pages that hold them (``PAGES``: the place tables in docs/place.md, the twin's in
docs/concepts/twin.md, the speed table in README.md; ``speed_tables``); ``--check`` changes nothing and exits 1 when
a page differs from what the JSON gives (``tests/test_bench_place.py`` runs the same check).
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from lora_opt.bench.place import growth_case
from speed_tables import render_readme
from lora_opt.io import atomic_write_json, atomic_write_text

PLACE_JSON = "experiments/bench/place.json"
TWIN_JSON = "experiments/bench/twin.json"
FLEET_JSON = "experiments/bench/fleet.json"
GROWTH_BASELINE = "tests/data/bench_place_baseline.json"


#: the page holding each benchmark's blocks: place.json -> place-cases, place-scaling; twin.json -> twin;
#: twin.json + fleet.json -> the README's speed table
PAGES = {"place": "docs/place.md", "twin": "docs/concepts/twin.md", "speed": "README.md"}


def rendered() -> list[tuple[str, str, str]]:
    """(page, its text as it is, its text as the committed JSON makes it) for each page in PAGES."""
    place = json.loads((ROOT / PLACE_JSON).read_text()) if (ROOT / PLACE_JSON).exists() else None
    twin = json.loads((ROOT / TWIN_JSON).read_text()) if (ROOT / TWIN_JSON).exists() else None
    fleet = json.loads((ROOT / FLEET_JSON).read_text()) if (ROOT / FLEET_JSON).exists() else None
    out = []
    for bench, page in PAGES.items():
        text = (ROOT / page).read_text()
        new = render_readme(text, place if bench == "place" else None, twin if bench == "twin" or (bench == "speed" and fleet) else None,
                            PLACE_JSON, TWIN_JSON, fleet if bench == "speed" else None, FLEET_JSON)
        out.append((page, text, new))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's tables are not what the JSON gives")
    ap.add_argument("--growth-baseline", action="store_true",
                    help=f"measure the growth case (best of 5) and write {GROWTH_BASELINE}")
    a = ap.parse_args()
    if a.growth_baseline:
        case = growth_case(repeats=5)
        case["command"] = "python experiments/readme_tables.py --growth-baseline"
        atomic_write_json(ROOT / GROWTH_BASELINE, case, indent=1)
        print(json.dumps(case, indent=1))
        sys.exit(0)
    pages = rendered()
    stale = [page for page, old, new in pages if old != new]
    if a.check:
        print(f"tables differ from the JSON in {', '.join(stale)}" if stale else "docs tables are up to date")
        sys.exit(1 if stale else 0)
    for page, old, new in pages:
        if old != new:
            atomic_write_text(ROOT / page, new)
        print(f"{page} " + ("rewritten" if old != new else "already up to date"))
