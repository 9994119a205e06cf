"""Where lora-affinity's extra CPU time goes in the fleet twin (issue 25's open speed target): N engines
with on-demand adapters on ``lora-opt bench fleet``'s workload (the Azure conversation trace superposed N
times), timed per (router, scrape interval) pair -- a longer interval means fewer scrape ticks, at each of
which every engine is advanced to the tick and its running requests are read.

    python experiments/bench/fleet_scrape_cost.py --window-s 1200 lora-affinity 0.1 lora-affinity 1 \
        lora-affinity 10 round-robin 0.1

Prints CPU seconds per pair (one run each, after a warm-up that compiles every path; this 2-core VM's run-to-run
noise is about +-15 %).  ``--replay``: each fleet's per-engine streams (the engine the router chose for each
request) also simulated with the routing done up front, which isolates the routing loop's own cost from the
engines' (the engines' work is the same, their results equal):

    python experiments/bench/fleet_scrape_cost.py --window-s 3600 --replay lora-affinity 0.1 least-requests 0.1

Exploratory: the numbers in the issue's note, not a benchmark of record (``lora-opt bench fleet`` is that)."""
from __future__ import annotations

import argparse
import time

from lora_opt.bench.fleet import PER_ENGINE, fleet_engines, fleet_requests
from twin.fleet import simulate_fleet
from twin.routers import Router, RouterSetup, make_router


class Replay(Router):
    """Routes every request to the engine a recorded fleet run chose for it (reads nothing)."""

    name = "replay"

    def __init__(self, setup: RouterSetup, engine_of):
        super().__init__(setup)
        self.engine_of = engine_of

    def route_all(self, adapter, candidates):
        return self.engine_of


def router_setup(n: int) -> RouterSetup:
    return RouterSetup(n, [f"a{k}" for k in range(n * PER_ENGINE)], 0, {k: [(k % n, 1.0)] for k in range(n * PER_ENGINE)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=100)
    ap.add_argument("--window-s", type=float, default=1200.0, help="simulated seconds of the trace")
    ap.add_argument("--replay", action="store_true", help="also time each fleet's per-engine streams routed up front")
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
        res = simulate_fleet(engines, req, make_router(router, router_setup(a.engines)), scrape_interval_s=interval)
        cpu = time.process_time() - t
        print(f"{router} scrape {interval:g} s: {cpu:.2f} CPU s ({a.engines} engines on demand, {a.window_s:g} s, "
              f"{len(req):,} requests)", flush=True)
        if a.replay:
            t = time.process_time()
            again = simulate_fleet(engines, req, Replay(router_setup(a.engines), res.engine_of))
            replay = time.process_time() - t
            same = all(x.completed == y.completed for x, y in zip(res.engines, again.engines))
            print(f"  the same per-engine streams routed up front: {replay:.2f} CPU s -> routing loop {cpu / replay:.2f}x "
                  f"the engines' own cost ({'same' if same else 'DIFFERENT'} completions)", flush=True)


if __name__ == "__main__":
    main()
