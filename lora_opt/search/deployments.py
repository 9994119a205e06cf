"""Deployments a study (or the fleet comparison) can search: how adapters are spread over GPUs.

- ``placement``: lora-opt's parametrised placement (``lora_opt.search.study``: k contiguous parts of
  the priority order, an A_max per part) -- each adapter on its GPU(s), routed by ``--router``
  (``static``: the placement's weights; ``lora-affinity`` etc.: among the GPUs holding it).
- ``every-gpu``: what many operators run instead -- N identical vLLM instances, every adapter
  registered on every one (loaded on first use with ``--adapters on-demand``), one A_max for all,
  a router choosing the instance per request.  Its parameters: ``gpus`` and ``amax_0``.

- ``hybrid`` (:func:`hybrid_placement`; the fleet comparison's row (d), ``lora-opt place --deployment``'s third):
  the hottest adapters registered on every GPU, the long tail kept where a placement put it; a study's
  parameters add the hot count to the placement's (``lora_opt.search.space``).

A deployment is a *fixed* property of a study (one study per deployment and router, their fronts
merged by ``lora_opt.search.study.merge_fronts``), not a categorical parameter inside one study: the two parameter spaces
share only the GPU count, and the study's multivariate TPE models the joint space of the
parameters every trial has -- a categorical branch would leave the conditional ones to independent
sampling -- and a study with fixed meaning keeps its greedy seeds exact points and its stored
trials comparable when it resumes.
"""
from __future__ import annotations

import dataclasses

from lora_opt.placement.plan import Placement
from lora_opt.placement.policies.base import gpu_config
from lora_opt.placement.workload_file import Workload
from twin.errors import ScenarioError
from twin.profile import Profile

#: deployment -> what it is (``lora-opt search --deployment``)
DEPLOYMENTS = {"placement": "lora-opt's placement: each adapter on its GPU(s)",
               "every-gpu": "every adapter on every GPU, one A_max, the router picks the GPU",
               "hybrid": "the hottest adapters on every GPU (the router picks), the tail placed"}
DEFAULT_DEPLOYMENT = "placement"


def check_deployment(name: str) -> str:
    if name not in DEPLOYMENTS:
        raise ScenarioError(f"deployment: {name!r} not allowed; allowed values: {', '.join(DEPLOYMENTS)}")
    return name


def every_gpu_placement(wl: Workload, profile: Profile, gpus: int, amax: int, label: str = "every-gpu") -> Placement:
    """``gpus`` identical instances, each registering every adapter of ``wl`` (``--max-lora-rank``
    the largest rank, ``--max-cpu-loras`` all of them, A_max ``amax``); every adapter routed to every
    instance with equal weights (the ``static`` router then spreads each adapter's requests
    uniformly).  The instances start warm, as a placement's do: every adapter registered
    (``--lora-modules``), so in the CPU cache -- on demand, an adapter swaps into a GPU slot when
    used; disk loads come only with a CPU cache smaller than the adapters."""
    if gpus < 1 or amax < 1:
        raise ScenarioError(f"every-gpu deployment: gpus and A_max must be >= 1, got {gpus} and {amax}")
    ranks = [a.rank for a in wl.adapters]
    cfg = gpu_config(wl, profile, ranks, len(ranks), min(amax, len(ranks)))
    share = 1.0 / gpus
    return Placement(profile=wl.profile, adapters=list(wl.adapters), gpus=[cfg] * gpus,
                     routes={a.id: [(g, share) for g in range(gpus)] for a in wl.adapters}, policy=label,
                     meta={"rho": wl.rho, "workload": wl.name, "deployment": "every-gpu", "feasible": True})


def hottest(wl: Workload, k: int) -> list[str]:
    """The ids of ``wl``'s ``k`` adapters with the highest rates (ties: the workload's order)."""
    order = sorted(range(len(wl.adapters)), key=lambda i: (-wl.adapters[i].rate, i))
    return [wl.adapters[i].id for i in order[:max(0, k)]]


def tail_workload(wl: Workload, hot: list[str]) -> Workload:
    """``wl`` without the ``hot`` adapters: what a hybrid's tail placement places."""
    hot_set = set(hot)
    return dataclasses.replace(wl, adapters=tuple(a for a in wl.adapters if a.id not in hot_set))


def hybrid_placement(wl: Workload, profile: Profile, tail: Placement, hot: list[str], extra_gpus: int = 0,
                     label: str = "hybrid") -> Placement:
    """The ``hot`` adapters on every GPU, the others where ``tail`` (a placement of them alone) put them:
    ``tail``'s GPUs plus ``extra_gpus`` that serve only the hot ones.  Each GPU registers what it is routed
    (its A_max kept where it still starts, ``--max-cpu-loras`` all it registers, ``--max-lora-rank`` the
    largest); a hot adapter's requests are split equally over every GPU (a load-aware router, e.g. the fleet
    twin's lora-affinity, then picks among them); an extra GPU's A_max is at most the tail's largest.
    ``tail`` must route no hot adapter."""
    both = sorted(set(hot) & set(tail.routes))
    if both:
        raise ScenarioError(f"hybrid deployment: the tail placement routes hot adapters: {', '.join(both[:5])}")
    if extra_gpus < 0 or (not tail.gpus and extra_gpus < 1):
        raise ScenarioError(f"hybrid deployment: extra_gpus must be >= 0 (>= 1 without tail GPUs), got {extra_gpus}")
    rank = {a.id: a.rank for a in wl.adapters}
    n = len(tail.gpus) + extra_gpus
    on: list[list[str]] = [[] for _ in range(n)]
    for a, routes in tail.routes.items():
        for g, _ in routes:
            on[g].append(a)
    gpus = []
    for g in range(n):
        here = on[g] + list(hot)
        # a GPU of its own serves the hot adapters only: at most the tail's largest A_max (one that starts)
        amax = tail.gpus[g].max_loras if g < len(tail.gpus) else max([c.max_loras for c in tail.gpus] or [len(hot)])
        gpus.append(_starting_config(wl, profile, [rank[a] for a in here], len(here), min(amax, len(here))))
    routes = {**tail.routes, **{a: [(g, 1.0 / n) for g in range(n)] for a in hot}}
    return Placement(profile=wl.profile, adapters=list(wl.adapters), gpus=gpus, routes=routes, policy=label,
                     meta={"rho": wl.rho, "workload": wl.name, "deployment": "hybrid", "hot_adapters": len(hot),
                           "feasible": True})


def _starting_config(wl: Workload, profile: Profile, ranks: list[int], n: int, amax: int):
    """``gpu_config`` with the largest A_max <= ``amax`` that starts -- the config the start-up check passed,
    not made again (A_max 1 when none does): a hot adapter of a larger rank raises ``--max-lora-rank``, and
    the slots the tail's A_max fitted at its own rank may no longer fit."""
    cfg = gpu_config(wl, profile, ranks, n, amax)
    if cfg.startup_check(profile)[0] or amax <= 1:
        return cfg
    lo, hi = 1, amax                  # lo: starts (or the floor), hi: does not
    started = None                    # lo's config once one started (mid > 1: the floor is never checked)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cfg = gpu_config(wl, profile, ranks, n, mid)
        if cfg.startup_check(profile)[0]:
            lo, started = mid, cfg
        else:
            hi = mid
    return started if started is not None else gpu_config(wl, profile, ranks, n, 1)


def study_suffix(deployment: str, router: str, adapters: str) -> str:
    """What a study's default name adds for a deployment / fleet other than today's (placement,
    static routing, static adapters) -- so today's study names, and their stored studies, are kept."""
    if (deployment, router, adapters) == (DEFAULT_DEPLOYMENT, "static", "static"):
        return ""
    return f"-{deployment}-{router}-{adapters}"

