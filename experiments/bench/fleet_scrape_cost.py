"""Where lora-affinity's extra CPU time goes in the fleet twin (issue 25's open speed target): N engines
with on-demand adapters on ``lora-opt bench fleet``'s workload (the Azure conversation trace superposed N
times), timed per (router, scrape interval) pair -- a longer interval means fewer scrape ticks, at each of
which every engine is advanced to the tick and its running requests are read.

    python experiments/bench/fleet_scrape_cost.py --window-s 1200 lora-affinity 0.1 lora-affinity 1 \
        lora-affinity 10 round-robin 0.1

Prints CPU seconds per pair (one run each, after a warm-up that compiles every path; this 2-core VM's run-to-run
noise is about +-15 %).  Exploratory: the numbers in the issue's note, not a benchmark of record
(``lora-opt bench fleet`` is that)."""
from __future__ import annotations

import argparse
import time

from lora_opt.bench.fleet import PER_ENGINE, fleet_engines, fleet_requests
from twin.fleet import simulate_fleet
from twin.routers import RouterSetup, make_router


def router_setup(n: int) -> RouterSetup:
    return RouterSetup(n, [f"a{k}" for k in range(n * PER_ENGINE)], 0, {k: [(k % n, 1.0)] for k in range(n * PER_ENGINE)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=100)
    ap.add_argument("--window-s", type=float, default=1200.0, help="simulated seconds of the trace")
    ap.add_argument("pairs", nargs="+", help="ROUTER SCRAPE_INTERVAL_S pairs")
    a = ap.parse_args()
    if len(a.pairs) % 2:
        ap.error("pairs: ROUTER SCRAPE_INTERVAL_S, repeated")
    routers = sorted(set(a.pairs[::2]))
    for r in routers:               # compile every path before timing
        simulate_fleet(fleet_engines(2, 60.0, True), fleet_requests(2, 60.0), make_router(r, router_setup(2)))
    req = fleet_requests(a.engines, a.window_s)
    for router, interval in zip(a.pairs[::2], map(float, a.pairs[1::2])):
        engines = fleet_engines(a.engines, a.window_s, True)
        t = time.process_time()
        simulate_fleet(engines, req, make_router(router, router_setup(a.engines)), scrape_interval_s=interval)
        cpu = time.process_time() - t
        print(f"{router} scrape {interval:g} s: {cpu:.2f} CPU s ({a.engines} engines on demand, {a.window_s:g} s, "
              f"{len(req):,} requests)", flush=True)


if __name__ == "__main__":
    main()
