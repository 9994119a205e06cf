"""Router policies of a fleet (``twin.fleet``): at each arrival, which engine gets the request.

A policy sees what a real router sees (:class:`FleetView`): the engines' metrics as last scraped
(vLLM's ``/metrics``, refreshed every ``scrape_interval_s``) and its own count of requests it sent
each engine that have not finished (a router sees each response end, so that count is exact).
It chooses among ``candidates``: the engines that are up and can serve the request's adapter (with
static adapters: those it is placed on; on demand: every engine whose ``--max-lora-rank`` admits
it) -- never an engine outside them.  Every random draw comes from the router's seeded generator.

**Adding a policy** = one :class:`Router` subclass (``name``, ``reads_state``, ``pick``) in
:data:`ROUTERS`; ``tests/test_routers.py`` runs the contract tests over every registered policy.
Speed (``twin.fleet``): a policy that reads nothing may route all requests at once
(:meth:`Router.route_all`, vectorised for ``static``, ``round-robin``, ``consistent-hash``); one that
reads state runs in the fleet's compiled routing loop when it names its rule there (``kernel``:
``twin.engine_routing``, whose rule functions its ``pick`` calls too), else in a Python loop over
``pick``.  Random draws: ``draws`` uniforms per request from the router's seeded stream, used or
not (:meth:`Router.uniforms`), so every path makes the same choices.

=================  ==============================================================================
``static``         the placement's weights (``router.json``): each request to an engine drawn with
                   its adapter's routing weights, by :func:`weighted_pick` -- the rule
                   ``lora_opt.placement.evaluate.route_requests`` replays placements with (one
                   uniform draw per request, used or not)
``round-robin``    one counter over all requests, the next of the candidates (vLLM router's
                   ``round_robin``: ``counter % len(workers)``)
``least-requests`` fewest requests in flight (ties: a seeded draw among them)
``power-of-two``   two distinct candidates drawn at random, the one with fewer in flight (vLLM
                   router's ``power_of_two``)
``consistent-hash`` a hash ring of the engines (:data:`RING_REPLICAS` points each), the adapter id
                   hashed (SHA-256) onto it, the first candidate clockwise: an adapter stays on one
                   engine while the fleet does not change
``lora-affinity``  the Gateway API Inference Extension's endpoint picker (see :class:`LoraAffinity`)
=================  ==============================================================================
"""
from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from twin.engine_routing import (KERNEL_LEAST_REQUESTS, KERNEL_LORA_AFFINITY, KERNEL_POWER_OF_TWO,
                                 LORA_AFFINITY_THRESHOLD, QUEUING_THRESHOLD_LORA, draw_index, pick_affinity,
                                 pick_least, pick_two)
from twin.errors import ScenarioError

__all__ = ["ADAPTER_MODES", "LORA_AFFINITY_THRESHOLD", "QUEUING_THRESHOLD_LORA", "ROUTERS", "FleetView", "Router",
           "RouterSetup", "make_router", "weighted_pick"]


#: how adapters reach an instance of a fleet (``twin.fleet``; ``lora-opt evaluate --adapters``): only the
#: adapters placed on it, or any adapter, loaded on first use
ADAPTER_MODES = ("static", "on-demand")


def weighted_pick(cum_weights: np.ndarray, u):
    """Index (or indices) drawn with weights whose cumulative sums are ``cum_weights`` by the
    uniform draw(s) ``u`` in [0, 1): the one rule a static route table is replayed with."""
    return np.minimum(np.searchsorted(cum_weights / cum_weights[-1], u, side="right"), len(cum_weights) - 1)


@dataclass
class FleetView:
    """What a router sees at one arrival (arrays indexed by engine; dead engines read 0 / empty)."""

    in_flight: np.ndarray
    """Requests the router sent each engine that have not finished yet (exact)."""
    waiting: np.ndarray
    """``vllm:num_requests_waiting`` as last scraped."""
    running: np.ndarray
    """``vllm:num_requests_running`` as last scraped."""
    kv_usage: np.ndarray
    """``vllm:kv_cache_usage_perc`` (a fraction) as last scraped."""
    running_adapters: list
    """``vllm:lora_requests_info`` ``running_lora_adapters`` (a set of adapter indices) as last scraped."""
    waiting_adapters: list
    """... and ``waiting_lora_adapters``."""
    max_loras: np.ndarray
    """``vllm:lora_requests_info`` ``max_lora`` (each engine's ``--max-loras``)."""


@dataclass(frozen=True)
class RouterSetup:
    """What a router knows of its fleet before the first request."""

    n_engines: int
    adapter_ids: Sequence[str]
    """Adapter id of each adapter index (what the clients name in ``model``)."""
    seed: object = 0
    """Anything ``numpy.random.default_rng`` takes (an int, a ``SeedSequence``)."""
    routes: dict | None = None
    """``static``: adapter index -> [(engine, weight)] (the placement's routing table)."""


class Router:
    """A router policy: ``pick`` one of ``candidates`` for request ``request`` of ``adapter``."""

    name: ClassVar[str] = ""
    reads_state: ClassVar[str] = ""
    """What ``pick`` reads of :class:`FleetView`: "" nothing (the fleet need not advance the engines
    at each arrival), "in_flight" the router's own counts, "metrics" the scraped metrics too."""

    draws: ClassVar[int] = 0
    """Uniforms each request takes from the router's stream, used or not (:meth:`uniforms`)."""
    kernel: ClassVar[int] = -1
    """The policy's code in the fleet's compiled routing loop (``twin.engine_routing``); -1: none."""

    def __init__(self, setup: RouterSetup):
        self.setup = setup
        self.rng = np.random.default_rng(setup.seed)
        self._u = np.zeros(0)

    def uniforms(self, requests: int) -> np.ndarray:
        """The draws of requests ``0 .. requests - 1`` (``draws`` each, request-major): the seeded
        stream, extended in chunks (a chunk boundary changes no value)."""
        need = requests * self.draws
        if need > self._u.shape[0]:
            self._u = np.concatenate([self._u, self.rng.random(max(need - self._u.shape[0], 4096,
                                                                   self._u.shape[0]))])
        return self._u[:need]

    def uniform(self, request: int, k: int = 0) -> float:
        """Draw ``k`` of request ``request``."""
        return float(self.uniforms(request + 1)[request * self.draws + k])

    def pick(self, request: int, adapter: int, candidates: np.ndarray, view: FleetView | None) -> int:
        """The engine for the request (one of ``candidates``: sorted, non-empty).  Called for every
        request in arrival order; ``view`` is None when ``reads_state`` is ""."""
        raise NotImplementedError

    def skip(self, request: int) -> None:
        """Request ``request`` has no candidate (nobody can serve it): it is not routed."""

    def route_all(self, adapter: np.ndarray, candidates: list[np.ndarray]) -> np.ndarray:
        """The engine of every request of ``adapter`` (an array, arrival order; -1: no candidate),
        ``candidates[a]`` the engines of adapter ``a``: exactly what :meth:`pick` (and :meth:`skip`)
        called for each request in turn give.  Only for policies that read nothing
        (``reads_state`` ""); subclasses vectorise it."""
        out = np.full(adapter.shape[0], -1, np.int64)
        for i, a in enumerate(adapter.tolist()):
            if len(candidates[a]) == 0:
                self.skip(i)
            else:
                out[i] = self.pick(i, a, candidates[a], None)
        return out


class Static(Router):
    """The placement's routing weights (``router.json``), replayed as ``lora-opt evaluate`` does."""

    name = "static"
    draws = 1          # one draw per request, in request order, used or not: evaluate's stream

    def __init__(self, setup: RouterSetup):
        super().__init__(setup)
        if setup.routes is None:
            raise ScenarioError("router static: needs the placement's routes (adapter -> [(engine, weight)])")
        self.routes = {a: (np.array([e for e, _ in rs], np.int64), np.cumsum([w for _, w in rs]))
                       for a, rs in setup.routes.items() if rs}

    def _table(self, adapter: int, candidates: np.ndarray):
        """(engines, cumulative weights) of ``adapter`` among ``candidates``; None: not in the table."""
        if adapter not in self.routes:
            return None
        engines, cw = self.routes[adapter]
        ok = np.isin(engines, candidates)
        if not ok.all():             # a placed engine is down: its share goes to the others
            engines, cw = engines[ok], np.cumsum(np.diff(cw, prepend=0.0)[ok])
        return engines, cw

    def pick(self, request, adapter, candidates, view):
        u = self.uniform(request)
        table = self._table(adapter, candidates)
        if table is None:     # not in the table (on demand): any engine, as RouteTable does
            return int(candidates[draw_index(u, len(candidates))])
        engines, cw = table
        return int(engines[weighted_pick(cw, u)])

    def route_all(self, adapter, candidates):
        u = self.uniforms(adapter.shape[0])
        out = np.full(adapter.shape[0], -1, np.int64)
        order = np.argsort(adapter, kind="stable")
        bounds = np.searchsorted(adapter[order], np.arange(len(candidates) + 1))
        for a in np.flatnonzero(np.diff(bounds)).tolist():
            rows = order[bounds[a]:bounds[a + 1]]
            cands = candidates[a]
            if len(cands) == 0:
                continue
            table = self._table(a, cands)
            if table is None:
                out[rows] = cands[np.minimum((u[rows] * len(cands)).astype(np.int64), len(cands) - 1)]
            else:
                out[rows] = table[0][weighted_pick(table[1], u[rows])]
        return out


class RoundRobin(Router):
    """vLLM router's ``round_robin``: a counter over all requests, modulo the candidates."""

    name = "round-robin"

    def __init__(self, setup):
        super().__init__(setup)
        self.counter = 0

    def pick(self, request, adapter, candidates, view):
        e = int(candidates[self.counter % len(candidates)])
        self.counter += 1
        return e

    def route_all(self, adapter, candidates):
        sizes = np.array([len(c) for c in candidates], np.int64)
        flat = np.concatenate([np.asarray(c, np.int64) for c in candidates] + [np.zeros(1, np.int64)])
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        n = sizes[adapter]
        routed = n > 0
        counter = self.counter + np.cumsum(routed) - routed          # routed requests before each one
        out = np.full(adapter.shape[0], -1, np.int64)
        out[routed] = flat[start[adapter[routed]] + counter[routed] % n[routed]]
        self.counter += int(routed.sum())
        return out


class LeastRequests(Router):
    """Fewest requests in flight (the router's own counts); ties drawn at random."""

    name = "least-requests"
    reads_state = "in_flight"
    draws = 1
    kernel = KERNEL_LEAST_REQUESTS

    def pick(self, request, adapter, candidates, view):
        return int(pick_least(np.asarray(candidates, np.int64), np.asarray(view.in_flight, np.int64),
                              self.uniform(request)))


class PowerOfTwo(Router):
    """vLLM router's ``power_of_two``: two distinct candidates at random, the one with fewer in flight
    (the first drawn on a tie)."""

    name = "power-of-two"
    reads_state = "in_flight"
    draws = 2
    kernel = KERNEL_POWER_OF_TWO

    def pick(self, request, adapter, candidates, view):
        return int(pick_two(np.asarray(candidates, np.int64), np.asarray(view.in_flight, np.int64),
                            self.uniform(request, 0), self.uniform(request, 1)))


#: points per engine on the consistent-hash ring
RING_REPLICAS = 160


def _hash64(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class ConsistentHash(Router):
    """A hash ring of the engines (:data:`RING_REPLICAS` points each); a request goes to the first
    candidate clockwise of its adapter id's hash."""

    name = "consistent-hash"

    def __init__(self, setup):
        super().__init__(setup)
        ring = sorted((_hash64(f"engine-{e}#{k}"), e) for e in range(setup.n_engines) for k in range(RING_REPLICAS))
        self.points = [h for h, _ in ring]
        self.owners = [e for _, e in ring]
        self.start = [bisect.bisect_right(self.points, _hash64(a)) for a in setup.adapter_ids]

    def pick(self, request, adapter, candidates, view):
        allowed = set(candidates.tolist())
        n = len(self.points)
        k = self.start[adapter]
        for step in range(n):
            e = self.owners[(k + step) % n]
            if e in allowed:
                return e
        raise AssertionError("no candidate on the ring")    # candidates are engines of the ring

    def route_all(self, adapter, candidates):
        # the choice depends on the adapter alone (the candidates do not change during a run)
        used = np.flatnonzero(np.bincount(adapter, minlength=len(candidates)))
        choice = np.full(len(candidates), -1, np.int64)
        for a in used.tolist():
            if len(candidates[a]):
                choice[a] = self.pick(0, a, candidates[a], None)
        return choice[adapter]


class LoraAffinity(Router):
    """The Kubernetes Gateway API Inference Extension's endpoint picker, default scheduler
    (kubernetes-sigs/gateway-api-inference-extension ``pkg/epp/scheduling/scheduler.go`` at commit
    0119af7f, filters in ``framework/plugins/filter/`` at 140e8b19 / 58d03a30), on the metrics it
    scrapes (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info``):

    * low queue: engines with waiting <= ``QUEUING_THRESHOLD_LORA`` (128).  If any:
      LoRA affinity on them, then least queue, then least KV cache;
      else: least queue on all, then LoRA affinity, then least KV cache.  A filter that leaves no
      engine passes its input on (the decision tree's failure branch).
    * LoRA affinity: engines where the adapter is running or waiting ("affinity"), and engines
      with room for another (running + waiting adapters < ``max_lora``: "available"); both
      non-empty: affinity with probability ``LORA_AFFINITY_THRESHOLD`` (0.999), else available.
    * least queue / least KV cache: engines within (max - min) / n of the minimum (integer
      division for the queue).
    * the pick: uniformly at random among what is left.

    The picker's other defaults (``KV_CACHE_THRESHOLD`` 0.8, ``QUEUE_THRESHOLD_CRITICAL`` 5) belong
    to its sheddable-request filter, not modelled: every request is critical here."""

    name = "lora-affinity"
    reads_state = "metrics"
    draws = 2             # affinity vs available; the final pick
    kernel = KERNEL_LORA_AFFINITY

    def pick(self, request, adapter, candidates, view):
        c = np.asarray(candidates, np.int64)
        n = len(view.waiting)
        affine = np.zeros(n, np.bool_)
        n_adapters = np.zeros(n, np.int64)
        for e in c.tolist():
            run, wait = view.running_adapters[e], view.waiting_adapters[e]
            affine[e] = adapter in run or adapter in wait
            n_adapters[e] = len(run) + len(wait)
        return int(pick_affinity(c, np.asarray(view.waiting, np.int64), np.asarray(view.kv_usage, np.float64), affine,
                                 n_adapters, np.asarray(view.max_loras, np.int64), self.uniform(request, 0),
                                 self.uniform(request, 1)))


def _registry(*routers: type[Router]) -> dict[str, type[Router]]:
    return {r.name: r for r in routers}


ROUTERS: dict[str, type[Router]] = _registry(Static, RoundRobin, LeastRequests, PowerOfTwo, ConsistentHash,
                                             LoraAffinity)
"""Every router policy, by name (``lora-opt evaluate --router``)."""


def make_router(name: str, setup: RouterSetup) -> Router:
    """The router ``name`` for the fleet ``setup``; an unknown name is a ``ScenarioError`` naming the
    allowed ones."""
    if name not in ROUTERS:
        raise ScenarioError(f"router: unknown policy {name!r}; allowed: {', '.join(ROUTERS)}")
    return ROUTERS[name](setup)
