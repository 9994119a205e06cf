"""A throwaway placement policy, router and search objective, each added the way docs/architecture.md's
"to add X, touch Y" table says -- a class (or an entry) and one registry line, nothing else -- for
``tests/test_extension_points.py``.  Also a pytest plugin (``-p throwaway_extensions``): loaded
before collection, so the contract tests that parametrize over the registries run over these too.
"""
from __future__ import annotations

from lora_opt.placement.policies import POLICIES, Assignment, PlacementPolicy
from lora_opt.placement.policies.base import GPUAssignment
from lora_opt.search.study import OBJECTIVES
from twin.routers import ROUTERS, Router

POLICY = "throwaway-round-robin"
ROUTER = "throwaway-first"
OBJECTIVE = "throwaway_median_ttft"


class RoundRobin(PlacementPolicy):
    """Adapter i on GPU i mod pool, every one of its adapters in a GPU slot (up to 8)."""

    name = POLICY
    summary = "throwaway: round-robin over the pool"
    fills_any_pool = True           # no capacity model: the contract tests ask this, not the name

    def assign(self, wl, gpus, ctx):
        on = [[(i, 1.0) for i in range(g, len(wl.adapters), gpus)] for g in range(gpus)]
        return Assignment(gpus=[GPUAssignment(adapters=a, max_loras=min(len(a), 8)) for a in on if a])


class FirstCandidate(Router):
    """Always the lowest-numbered candidate engine."""

    name = ROUTER

    def pick(self, request, adapter, candidates, view):
        return int(candidates[0])


def register() -> None:
    """The one line each registry takes (here at run time: the modules stay untouched)."""
    POLICIES[POLICY] = RoundRobin
    ROUTERS[ROUTER] = FirstCandidate
    OBJECTIVES[OBJECTIVE] = ("ttft_ms", "median")


def unregister() -> None:
    POLICIES.pop(POLICY, None)
    ROUTERS.pop(ROUTER, None)
    OBJECTIVES.pop(OBJECTIVE, None)


def pytest_configure(config):      # as a plugin: registered before the test modules are collected
    register()
