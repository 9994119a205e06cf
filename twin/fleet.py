"""The fleet twin: N vLLM instances advanced together in simulated time, a router deciding at each
arrival which instance serves the request (``twin.routers``).

Each instance is the single-engine kernel (``twin.engine``), fed its requests as the router sends
them (``twin.engine_state.add_request``) and advanced to each arrival by
``twin.engine_fleet.advance_to`` -- so an instance that receives exactly the requests of a
single-engine run gets that run's numbers, bit for bit (``tests/test_fleet.py``).

What the router sees (``twin.routers.FleetView``): its own count of requests in flight per instance
(exact), and each instance's metrics as scraped every ``scrape_interval_s`` (0: at every arrival):
running and waiting requests, KV-cache usage, the adapters of running and of waiting requests.
Engines are advanced only as far as the router needs: not at all for a router that reads nothing
(``static``, ``round-robin``, ``consistent-hash``: then each instance simply runs its requests).

Adapters per instance (:class:`FleetEngine`): ``serves`` maps each adapter to the instance's
adapter table (-1: the instance cannot serve it).  *Static* adapters: the instance's table holds
the adapters placed on it (today's ``lora-opt evaluate``).  *On demand*: every adapter the
instance's ``--max-lora-rank`` admits is in its table; one not resident is loaded on first use --
from disk into the CPU cache (``--max-cpu-loras``), from there into a GPU slot (``--max-loras``),
both LRU, at the profile's load costs (``twin.adapter_cache``, the kernel's own cache; vLLM's
runtime LoRA loading / LoRA resolver).  ``preloaded``: the adapters given as ``--lora-modules``
(resident at start-up, in order).

Not modelled: the router's own latency and the HTTP hops (the TTFT of the profile's front end is
each instance's), retries, instances failing during the run (an instance that does not start is
down from the beginning and never chosen), autoscaling, the time a step in flight at a scrape
still needs (an instance is scraped after every step that started before the scrape).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
from numba import typed

from twin.engine import run_engine
from twin.engine_fleet import advance_all, finish, in_flight, scrape
from twin.engine_routing import route_fleet
from twin.engine_state import add_request
from twin.errors import ScenarioError
from twin.profile import Profile
from twin.routers import ADAPTER_MODES, FleetView, Router
from twin.scenario import Scenario
from twin.simulate import Result, engine_state, run_result, simulate
from twin.workload import Requests

#: the router's default metrics refresh (s)
SCRAPE_INTERVAL_S = 0.1


@dataclass(frozen=True)
class FleetEngine:
    """One instance: its scenario (engine flags, adapter table -- the rates are not used --,
    duration, rho) and which adapters it serves."""

    scenario: Scenario
    serves: np.ndarray
    """Adapter index -> index in this instance's adapter table, -1 when it cannot serve it."""
    preloaded: np.ndarray | None = None
    """Table indices loaded at start-up (``--lora-modules``), in order; None: the whole table."""


@dataclass
class FleetResult:
    """One run of a fleet: per instance a twin ``Result`` (its ``samples`` hold its requests),
    the instance of every request (-1: none could serve it) and the router's decisions' cost."""

    engines: list[Result]
    engine_of: np.ndarray
    scrapes: int = 0
    wall_s: float = 0.0


def check_adapter_mode(mode: str) -> str:
    if mode not in ADAPTER_MODES:
        raise ScenarioError(f"adapters: unknown mode {mode!r}; allowed: {', '.join(ADAPTER_MODES)}")
    return mode


def _empty() -> Requests:
    return Requests(np.zeros(0), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))


def _subset(req: Requests, sel: np.ndarray, local: np.ndarray) -> Requests:
    return Requests(arrival=np.ascontiguousarray(req.arrival[sel], np.float64),
                    adapter=np.ascontiguousarray(local[req.adapter[sel]], np.int32),
                    in_len=np.ascontiguousarray(req.in_len[sel], np.int32),
                    out_len=np.ascontiguousarray(req.out_len[sel], np.int32))


class _Scraper:
    """The metrics the router last scraped (the Python reference loop's view)."""

    def __init__(self, n: int, max_loras: np.ndarray, adapters_of: list[np.ndarray]):
        self.view = FleetView(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n),
                              [frozenset()] * n, [frozenset()] * n, max_loras)
        self.adapters_of = adapters_of          # per engine: table index -> adapter index
        self.count = 0

    def scrape(self, states, live: list[int]) -> None:
        v = self.view
        for k, e in enumerate(live):
            v.running[e], v.waiting[e], v.kv_usage[e], run, wait = scrape(states[k])
            v.running_adapters[e] = frozenset(self.adapters_of[e][run].tolist())
            v.waiting_adapters[e] = frozenset(self.adapters_of[e][wait].tolist())
        self.count += 1


@dataclass
class _Fleet:
    """The fleet at t = 0: start-up results, live instances, who can serve what."""

    boot: list[Result]
    live: list[int]
    serves: np.ndarray
    """engine x adapter -> table index, -1: cannot serve it (or down)."""
    candidates: list[np.ndarray]
    """Per adapter: the live engines that can serve it, sorted."""


def _boot(engines: list[FleetEngine], profile: Profile, requests: Requests) -> _Fleet:
    """Start-up (and flag checks) as a single instance does them; instances that do not start are
    down.  A request longer than the ``max_model_len`` of an instance that could get it is an error."""
    n = len(engines)
    booted: dict = {}             # instances of the same flags and window start alike
    boot = []
    for fe in engines:
        sc = fe.scenario
        key = (sc.duration_s, sc.rho, sc.timeseries_interval_s, sc.resolved_engine(profile))
        if key not in booted:
            booted[key] = simulate(sc, profile, requests=_empty())
        boot.append(booted[key])
    live = [e for e in range(n) if boot[e].status == "ok"]
    alive = np.zeros(n, np.bool_)
    alive[live] = True
    serves = np.stack([np.asarray(fe.serves, np.int64) for fe in engines])        # engine x adapter
    serves[~alive] = -1
    can = serves >= 0
    tokens = (requests.in_len + requests.out_len).astype(np.int64)
    longest = np.zeros(serves.shape[1], np.int64)
    np.maximum.at(longest, requests.adapter, tokens)
    for e in live:
        mml = boot[e].engine.max_model_len
        worst = int(longest[can[e]].max(initial=0))
        if worst > mml:
            raise ScenarioError(f"requests: a request of {worst} tokens exceeds max_model_len {mml} of instance {e}")
    return _Fleet(boot, live, serves, [np.flatnonzero(can[:, a]) for a in range(serves.shape[1])])


def _live_state(fe: FleetEngine, profile: Profile, boot: Result, req: Requests):
    """An instance's kernel state at t = 0 holding ``req`` (its table's indices); no early stop."""
    sc = dataclasses.replace(fe.scenario, early_stop=False) if fe.scenario.early_stop else fe.scenario
    return engine_state(sc, profile, sc.resolved_engine(profile), req, boot.kv_cache_tokens, preloaded=fe.preloaded)


def _empty_states(fleet: _Fleet, engines, profile: Profile):
    """The live instances' kernel states at t = 0, no request yet (a router feeds them), and each
    engine's position among them (-1: down)."""
    states = typed.List()
    for e in fleet.live:
        states.append(_live_state(engines[e], profile, fleet.boot[e], _empty()))
    slot = np.full(len(engines), -1, np.int64)
    slot[fleet.live] = np.arange(len(fleet.live))
    return states, slot


def _route_in_python(fleet: _Fleet, engines, requests: Requests, router: Router, profile: Profile,
                     scrape_interval_s: float, check_invariants: bool):
    """The reference loop: ``router.pick`` at each arrival, engines advanced to it (all of them,
    for a router that reads state) and scraped at each tick followed by an arrival."""
    live, serves, candidates = fleet.live, fleet.serves, fleet.candidates
    n = len(engines)
    states, slot = _empty_states(fleet, engines, profile)
    adapters_of = []
    for e in range(n):
        inv = np.full(max(1, int(serves[e].max(initial=-1)) + 1), -1, np.int64)
        inv[serves[e][serves[e] >= 0]] = np.flatnonzero(serves[e] >= 0)
        adapters_of.append(inv)
    scraper = _Scraper(n, np.array([b.engine.max_loras for b in fleet.boot], np.int64), adapters_of)
    view = scraper.view
    live_mask = np.ones(len(live), np.bool_)
    engine_of = np.full(len(requests), -1, np.int64)
    last_tick = -1.0
    reads = router.reads_state
    for i in range(len(requests)):
        a = int(requests.adapter[i])
        cands = candidates[a]
        if len(cands) == 0:
            router.skip(i)
            continue
        t = float(requests.arrival[i])
        if reads:
            if reads == "metrics":
                tick = math.floor(t / scrape_interval_s) * scrape_interval_s if scrape_interval_s > 0 else t
                if tick > last_tick or scrape_interval_s == 0:
                    advance_all(states, live_mask, tick, check_invariants)
                    scraper.scrape(states, live)
                    last_tick = tick
            advance_all(states, live_mask, t, check_invariants)
            view.in_flight[live] = in_flight(states, live_mask)
        e = router.pick(i, a, cands, view if reads else None)
        if serves[e, a] < 0:
            raise AssertionError(f"router {router.name} chose instance {e}, which cannot serve adapter {a}")
        engine_of[i] = e
        add_request(states[slot[e]], t, int(requests.in_len[i]), int(requests.out_len[i]), int(serves[e, a]))
    return engine_of, {e: states[slot[e]] for e in live}, scraper.count


def _route_compiled(fleet: _Fleet, engines, requests: Requests, router: Router, profile: Profile,
                    scrape_interval_s: float, check_invariants: bool):
    """The same decisions in ``twin.engine_routing.route_fleet`` (the router's ``kernel``)."""
    live = np.array(fleet.live, np.int64)
    states, slot = _empty_states(fleet, engines, profile)
    sizes = np.array([len(c) for c in fleet.candidates], np.int64)
    cand_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    cand_idx = np.concatenate([slot[c] for c in fleet.candidates] + [np.zeros(0, np.int64)]).astype(np.int64)
    max_loras = np.array([fleet.boot[e].engine.max_loras for e in fleet.live], np.int64)
    table = (np.ascontiguousarray(fleet.serves[live]), cand_ptr, cand_idx, max_loras)
    reqs = (np.ascontiguousarray(requests.arrival, np.float64), np.ascontiguousarray(requests.adapter, np.int64),
            np.ascontiguousarray(requests.in_len, np.int64), np.ascontiguousarray(requests.out_len, np.int64))
    of_live, scrapes = route_fleet(states, router.kernel, reqs, table, router.uniforms(len(requests)), router.draws,
                                   float(scrape_interval_s), check_invariants)
    engine_of = np.where(of_live >= 0, live[np.maximum(of_live, 0)], -1)
    return engine_of, {e: states[k] for k, e in enumerate(fleet.live)}, int(scrapes)


def simulate_fleet(engines: list[FleetEngine], requests: Requests, router: Router, *, profile: Profile | None = None,
                   scrape_interval_s: float = SCRAPE_INTERVAL_S, timeseries: bool = False,
                   check_invariants: bool = False, python_routing: bool = False) -> FleetResult:
    """Serve ``requests`` (adapter indices as in every ``FleetEngine.serves``; sorted by arrival) on
    the fleet, ``router`` choosing each request's instance.  Every instance's window is its
    scenario's ``duration_s`` (give them all the same).  ``check_invariants``: assert the kernel's
    invariants at every step (tests; slower).

    How (the same numbers every way, ``tests/test_fleet.py``): a router that reads nothing routes
    every request at once (``Router.route_all``) and each instance then runs its requests as a
    single engine does; one that reads state and has a compiled rule (``Router.kernel``) routes in
    ``twin.engine_routing.route_fleet``; any other (or ``python_routing``: the reference) calls
    ``Router.pick`` at each arrival."""
    t_wall = time.perf_counter()
    if not engines:
        raise ScenarioError("fleet: no instance")
    if not (scrape_interval_s >= 0 and math.isfinite(scrape_interval_s)):
        raise ScenarioError(f"fleet: scrape_interval_s must be a finite number >= 0, got {scrape_interval_s}")
    profile = profile or engines[0].scenario.load_profile()
    fleet = _boot(engines, profile, requests)
    states: dict = {}
    scrapes = 0
    if python_routing:
        engine_of, states, scrapes = _route_in_python(fleet, engines, requests, router, profile, scrape_interval_s,
                                                      check_invariants)
    elif not router.reads_state:
        engine_of = router.route_all(np.asarray(requests.adapter, np.int64), fleet.candidates)
        routed = engine_of >= 0
        if np.any(fleet.serves[engine_of[routed], requests.adapter[routed]] < 0):
            raise AssertionError(f"router {router.name} chose an instance that cannot serve the adapter")
    elif router.kernel >= 0:
        engine_of, states, scrapes = _route_compiled(fleet, engines, requests, router, profile, scrape_interval_s,
                                                     check_invariants)
    else:
        engine_of, states, scrapes = _route_in_python(fleet, engines, requests, router, profile, scrape_interval_s,
                                                      check_invariants)
    order = np.argsort(engine_of, kind="stable")
    bounds = np.searchsorted(engine_of[order], np.arange(len(engines) + 1))
    out: list[Result] = []
    live = set(fleet.live)
    for e, fe in enumerate(engines):
        boot = fleet.boot[e]
        if e not in live:
            out.append(boot)
            continue
        mine = _subset(requests, order[bounds[e]:bounds[e + 1]], fleet.serves[e])
        s = states.get(e)
        if s is None:
            s = _live_state(fe, profile, boot, mine)
        else:
            finish(s)
        run = run_engine(s, check_invariants, not check_invariants)
        out.append(run_result(fe.scenario, profile, boot.engine, mine, run, boot.kv_cache_tokens,
                              timeseries=timeseries))
    return FleetResult(engines=out, engine_of=engine_of, scrapes=scrapes, wall_s=time.perf_counter() - t_wall)
