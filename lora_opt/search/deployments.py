"""Deployments a study (or the fleet comparison) can search: how adapters are spread over GPUs.

- ``placement``: lora-opt's parametrised placement (``lora_opt.search.study``: k contiguous parts of
  the priority order, an A_max per part) -- each adapter on its GPU(s), routed by ``--router``
  (``static``: the placement's weights; ``lora-affinity`` etc.: among the GPUs holding it).
- ``every-gpu``: what many operators run instead -- N identical vLLM instances, every adapter
  registered on every one (loaded on first use with ``--adapters on-demand``), one A_max for all,
  a router choosing the instance per request.  Its parameters: ``gpus`` and ``amax_0``.

A deployment is a *fixed* property of a study (one study per deployment and router, their fronts
merged by ``lora_opt.search.study.merge_fronts``), not a categorical parameter inside one study: the two parameter spaces
share only the GPU count, and the study's multivariate TPE models the joint space of the
parameters every trial has -- a categorical branch would leave the conditional ones to independent
sampling -- and a study with fixed meaning keeps its greedy seeds exact points and its stored
trials comparable when it resumes.
"""
from __future__ import annotations

from lora_opt.placement.plan import Placement
from lora_opt.placement.policies.base import gpu_config
from lora_opt.placement.workload_file import Workload
from twin.errors import ScenarioError
from twin.profile import Profile

#: deployment -> what it is (``lora-opt search --deployment``)
DEPLOYMENTS = {"placement": "lora-opt's placement: each adapter on its GPU(s)",
               "every-gpu": "every adapter on every GPU, one A_max, the router picks the GPU"}
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


def study_suffix(deployment: str, router: str, adapters: str) -> str:
    """What a study's default name adds for a deployment / fleet other than today's (placement,
    static routing, static adapters) -- so today's study names, and their stored studies, are kept."""
    if (deployment, router, adapters) == (DEFAULT_DEPLOYMENT, "static", "static"):
        return ""
    return f"-{deployment}-{router}-{adapters}"

