"""``lora-opt bench fleet``: the fleet twin's CPU cost against N independent engines on the same
requests (the best of ``--repeats`` rounds, in this process, the kernel compiled before timing).

The traffic: the bundled Azure conversation trace (one hour, ~5.4 req/s) scaled to the fleet --
N cyclically shifted copies superposed (``lora_opt.placement.trace_split.scaled_arrivals``), so
each engine gets one trace's load -- over 8 rank-16 adapters per engine (each request's adapter
drawn uniformly), ShareGPT lengths, ``max_loras`` 8.  The adapters are placed round-robin.
Timed, for each N: (a) the N engines simulated one by one on the requests the placement sends each
(today's per-GPU evaluation, serial: "independent"); the fleet under every router policy with
static adapters (the placement's instances; a router that reads nothing routes all requests at
once, one that reads state runs the compiled routing loop); every router but ``static`` with
on-demand adapters (every adapter on every engine, its own 8 preloaded, 16 in the CPU cache;
``lora-affinity`` scrapes every engine every 0.1 s).
Reported: CPU seconds (``time.process_time``, the least of ``--repeats`` rounds, each round timing (a) and
every fleet once) and each fleet's ratio to (a); N = 1,000 runs a
shorter window (:data:`WINDOWS_S`).  On demand every engine's table holds every adapter of the
fleet (8,000 at N = 1,000: ~2.7 GB peak with the engines sharing one scenario)."""
from __future__ import annotations

import math
import time

import numpy as np
from tqdm import tqdm

from lora_opt.io import atomic_write_json
from lora_opt.placement.trace_split import scaled_arrivals
from twin.fleet import FleetEngine, simulate_fleet
from twin.routers import ROUTERS, RouterSetup, make_router
from twin.scenario import scenario_from_dict
from twin.simulate import simulate
from twin.workload import Requests, draw_lengths, load_trace

PROFILE = "llama-3.1-8b-h100-64gb"
TRACE = "azure-conv"
#: adapters per engine
PER_ENGINE = 8
ENGINE = {"max_loras": 8, "max_cpu_loras": 8, "max_lora_rank": 16, "max_num_seqs": 2048,
          "max_num_batched_tokens": 2048}
#: simulated window per fleet size (s): the trace's hour, shorter for 1,000 engines (memory, time)
WINDOWS_S = {1: 3600.0, 10: 3600.0, 100: 3600.0, 1000: 600.0}
#: largest fleet run with on-demand adapters (each engine's table holds every adapter of the fleet:
#: 1,000 engines x 8,000 adapters peak at ~2.7 GB)
ON_DEMAND_MAX_ENGINES = 1000
#: issue 25's targets for 100 engines over the hour
TARGET_RATIO, TARGET_CPU_S = 2.0, 60.0
#: the fleets timed: (key, router, adapters)
FLEETS = [*((r, r, "static") for r in ROUTERS), *((f"{r}+on-demand", r, "on-demand") for r in ROUTERS if r != "static")]


def _scenario(adapters: list[int], duration_s: float, engine: dict) -> dict:
    return {"profile": PROFILE, "duration_s": duration_s, "seed": 1, "engine": engine,
            "adapters": [{"count": 1, "rank": 16, "rate": 0.1, "id": f"a{k}"} for k in adapters]}


def fleet_requests(n: int, duration_s: float, seed: int = 1) -> Requests:
    """The trace superposed ``n`` times within its span, cut to ``duration_s``, each request's adapter
    drawn uniformly among ``n`` x :data:`PER_ENGINE`, ShareGPT lengths."""
    t = load_trace(TRACE)["t"].to_numpy(np.float64)
    rng_scale, rng_map, rng_len = (np.random.default_rng(x) for x in np.random.SeedSequence([seed, 25]).spawn(3))
    arrival, _, _ = scaled_arrivals(t, float(t.max()), float(n), "superpose", rng_scale)
    arrival = np.sort(arrival[arrival < duration_s], kind="stable")
    sc = scenario_from_dict(_scenario([0], duration_s, ENGINE), "fleet workload")
    in_len, out_len = draw_lengths(sc, rng_len, arrival.size, 131072)
    return Requests(np.ascontiguousarray(arrival), rng_map.integers(0, n * PER_ENGINE, arrival.size).astype(np.int32),
                    np.asarray(in_len, np.int32), np.asarray(out_len, np.int32))


def fleet_engines(n: int, duration_s: float, on_demand: bool) -> list[FleetEngine]:
    """N engines, adapter k placed on engine k mod N; on demand: every adapter in every table, each
    engine's own preloaded, twice as many in the CPU cache as GPU slots."""
    n_all = n * PER_ENGINE
    out = []
    # on demand every engine has the same flags and table: one scenario (and one table of every
    # adapter, twin.scenario caches it) for all, not N of them
    shared = scenario_from_dict(_scenario(list(range(n_all)), duration_s, {**ENGINE, "max_cpu_loras": 2 * PER_ENGINE}),
                                "engines") if on_demand else None
    serves_all = np.arange(n_all)
    for e in range(n):
        mine = list(range(e, n_all, n))
        if on_demand:
            out.append(FleetEngine(shared, serves_all, np.array(mine)))
        else:
            serves = np.full(n_all, -1, np.int64)
            serves[mine] = np.arange(len(mine))
            out.append(FleetEngine(scenario_from_dict(_scenario(mine, duration_s, ENGINE), f"engine {e}"), serves))
    return out


def _cpu(fn):
    """(CPU seconds of ``fn()``, its result)."""
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def _row(n: int, duration_s: float, bar, repeats: int = 1) -> dict:
    req = fleet_requests(n, duration_s)
    static = fleet_engines(n, duration_s, False)
    setup = RouterSetup(n, [f"a{k}" for k in range(n * PER_ENGINE)], 0,
                        {k: [(k % n, 1.0)] for k in range(n * PER_ENGINE)})

    order = np.argsort(req.adapter % n, kind="stable")        # each engine's requests, split before timing
    bounds = np.searchsorted((req.adapter % n)[order], np.arange(n + 1))
    mine = []
    for e, fe in enumerate(static):
        sel = order[bounds[e]:bounds[e + 1]]
        mine.append(Requests(req.arrival[sel], fe.serves[req.adapter[sel]].astype(np.int32), req.in_len[sel],
                             req.out_len[sel]))

    def independent():
        for fe, r in zip(static, mine):
            simulate(fe.scenario, requests=r)

    # rounds, the least of each configuration's times kept: each round times the independent engines and then
    # every fleet once, so a slow spell of this shared 2-core VM (+-15 % run to run, more over minutes) costs
    # every configuration one round rather than one configuration all its repeats
    best: dict[str, float] = {}
    completed: dict[str, int] = {}
    fleets = [f for f in FLEETS if f[2] == "static" or n <= ON_DEMAND_MAX_ENGINES]
    # the instances are descriptions (flags, table, preloaded adapters): every run builds its own states
    on_demand = fleet_engines(n, duration_s, True) if any(f[2] == "on-demand" for f in fleets) else None
    for _ in range(repeats):
        best["independent"] = min(best.get("independent", math.inf), _cpu(independent)[0])
        bar.set_postfix_str(f"{n} engines: independent {best['independent']:.1f} s")
        for key, router, adapters in fleets:
            bar.update(1)
            engines = on_demand if adapters == "on-demand" else static
            cpu, res = _cpu(lambda: simulate_fleet(engines, req, make_router(router, setup)))
            best[key] = min(best.get(key, math.inf), cpu)
            completed[key] = sum(r.completed for r in res.engines)
            del res
        bar.update(len(FLEETS) - len(fleets))
    base = best["independent"]
    row = {"engines": n, "requests": len(req), "simulated_s": duration_s, "independent_cpu_s": base, "fleets": {}}
    for key, router, adapters in fleets:
        row["fleets"][key] = {"router": router, "adapters": adapters, "cpu_s": best[key],
                              "ratio": best[key] / base if base else None, "completed": completed[key]}
    return row


def bench_fleet(sizes=(1, 10, 100, 1000), window_s: float | None = None, out: str | None = None,
                repeats: int = 1) -> list[str]:
    """CPU seconds of N independent engines vs the fleet under every router, per N in ``sizes``
    (each over :data:`WINDOWS_S`, or ``window_s`` for all); each the least of ``repeats`` rounds (:func:`_row`)."""
    warm = fleet_requests(2, 60.0)                # compile every path before timing
    for key, router, adapters in FLEETS:
        setup = RouterSetup(2, [f"a{k}" for k in range(2 * PER_ENGINE)], 0, {k: [(k % 2, 1.0)] for k in range(16)})
        simulate_fleet(fleet_engines(2, 60.0, adapters == "on-demand"), warm, make_router(router, setup))
    with tqdm(total=len(sizes) * len(FLEETS) * repeats, desc="bench fleet", unit="fleet") as bar:
        rows = [_row(n, window_s or WINDOWS_S.get(n, 3600.0), bar, repeats) for n in sizes]
    keys = [k for k, *_ in FLEETS]
    lines = [f"fleet twin vs N independent engines: {TRACE} superposed N times (one trace's load per engine), "
             f"{PER_ENGINE} adapters per engine; CPU s, best of {repeats} (ratio to independent)",
             f"{'engines':>7} {'window s':>8} {'requests':>10} {'independent':>11} " + " ".join(f"{k:>24}" for k in keys)]
    for r in rows:
        lines.append(f"{r['engines']:>7} {r['simulated_s']:>8.0f} {r['requests']:>10,} {r['independent_cpu_s']:>11.2f} "
                     + " ".join(f"{r['fleets'][k]['cpu_s']:>15.2f} ({r['fleets'][k]['ratio']:5.2f})" if k in r["fleets"]
                                else f"{'not run':>24}" for k in keys))
    at100 = next((r for r in rows if r["engines"] == 100 and r["simulated_s"] >= 3600), None)
    if at100:
        worst = max(at100["fleets"].values(), key=lambda f: f["cpu_s"])
        lines.append(f"100 engines, one hour: slowest fleet {worst['router']}/{worst['adapters']} {worst['cpu_s']:.1f} CPU s, "
                     f"{worst['ratio']:.2f}x independent (targets <= {TARGET_RATIO:g}x, <= {TARGET_CPU_S:g} s)")
    if out:
        atomic_write_json(out, {"fleet": rows, "trace": TRACE, "per_engine_adapters": PER_ENGINE, "repeats": repeats,
                                "command": f"lora-opt bench fleet --repeats {repeats}"}, indent=1)
    return lines
