"""A study's parameter space: a trial's parameters <-> the placement they stand for, per deployment.

- ``placement`` (``lora_opt.search.study``'s module docstring says why): ``gpus`` = k contiguous parts of
  the priority order, part g a share ``share_g`` of the adapters and an integer A_max ``amax_g``;
- ``every-gpu``: ``gpus`` identical instances with every adapter, one A_max ``amax_0``;
- ``hybrid``: the ``hot`` adapters with the highest rates on every GPU, the others (the tail, in the same
  priority order) split into k contiguous parts as ``placement`` splits all of them; ``hot`` is searched on a
  log scale up to ``HYBRID_HOT_MAX``, so the study chooses the split (``lora-opt place --deployment hybrid``
  tries a fixed grid of it instead).

Every deployment's space has fixed ranges (a trial's ``gpus`` range does not depend on its ``hot``): the
multivariate TPE models the joint space of the parameters every trial has."""
from __future__ import annotations

from typing import Any

import numpy as np

from lora_opt.placement.plan import Placement
from lora_opt.placement.policies.base import gpu_config
from lora_opt.search.deployments import every_gpu_placement, hottest, hybrid_placement
from twin.profile import load_profile

#: A_max searched up to this (clipped per GPU to its adapters and its memory)
AMAX_MAX = 1024
#: the most hot adapters a hybrid trial may put on every GPU
HYBRID_HOT_MAX = 100
#: the hot count a hybrid study's greedy seeds start from (their split applied to the tail)
HYBRID_SEED_HOT = 10


def suggest(trial, setup) -> dict:
    """The trial's parameters (``gpus``, ``share_g``, ``amax_g`` for g < gpus; ``every-gpu``: ``gpus`` and
    one ``amax_0``; ``hybrid``: also ``hot``)."""
    n = len(setup.order)
    if setup.deployment == "every-gpu":
        return {"gpus": trial.suggest_int("gpus", 1, setup.pool), "amax_0": trial.suggest_int("amax_0", 1, AMAX_MAX)}
    params: dict[str, Any] = {}
    if setup.deployment == "hybrid":       # n >= 2 (SearchSetup.build): at least one adapter in the tail
        params["hot"] = trial.suggest_int("hot", 1, min(HYBRID_HOT_MAX, n - 1), log=True)
        n -= 1
    k = trial.suggest_int("gpus", 1, min(setup.pool, n))
    params["gpus"] = k
    for g in range(k):
        params[f"share_{g}"] = trial.suggest_float(f"share_{g}", 0.001, 1.0)
        params[f"amax_{g}"] = trial.suggest_int(f"amax_{g}", 1, AMAX_MAX)
    return params


def part_sizes(shares, n: int) -> list[int]:
    """Largest-remainder rounding of n x shares / sum(shares), every part >= 1."""
    w = np.asarray(shares, float)
    exact = n * w / w.sum()
    sizes = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - sizes), kind="stable")[: n - sizes.sum()]:
        sizes[i] += 1
    while (sizes == 0).any():                 # an empty part takes one adapter from the largest
        sizes[int(np.argmax(sizes))] -= 1
        sizes[int(np.flatnonzero(sizes == 0)[0])] += 1
    return sizes.tolist()


def decode(params: dict, setup, label: str = "search") -> Placement:
    """The placement a parameter set stands for."""
    wl, order = setup.workload, setup.order
    k = int(params["gpus"])
    if setup.deployment == "every-gpu":
        cap = max(setup.mem_caps[int(max(a.rank for a in wl.adapters))], 1)
        p = every_gpu_placement(wl, load_profile(wl.profile), k, int(min(max(1, params["amax_0"]), cap)), label)
        p.meta["params"] = params
        return p
    if setup.deployment == "hybrid":
        hot = hottest(wl, int(params["hot"]))
        hot_set = set(hot)
        tail = [i for i in order if wl.adapters[i].id not in hot_set]
        p = hybrid_placement(wl, load_profile(wl.profile), _parts(params, setup, tail, min(k, len(tail)), label),
                             hot, 0, label)
        p.meta["params"] = params
        return p
    return _parts(params, setup, order, k, label)


def _parts(params: dict, setup, order, k: int, label: str) -> Placement:
    """``order`` (adapter indices) in k contiguous parts, part g on GPU g with A_max ``amax_g``."""
    wl = setup.workload
    sizes = part_sizes([params[f"share_{g}"] for g in range(k)], len(order))
    gpus, routes, s = [], {}, 0
    prof = load_profile(wl.profile)
    for g, n in enumerate(sizes):
        idx = order[s:s + n]
        ranks = [wl.adapters[i].rank for i in idx]
        cap = setup.mem_caps[int(max(ranks))]
        amax = int(min(max(1, params[f"amax_{g}"]), n, max(cap, 1)))
        gpus.append(gpu_config(wl, prof, ranks, n, amax))
        for i in idx:
            routes[wl.adapters[i].id] = [(g, 1.0)]
        s += n
    return Placement(profile=wl.profile, adapters=list(wl.adapters), gpus=gpus, routes=routes, policy=label,
                     meta={"rho": wl.rho, "params": params, "workload": wl.name})


def encode(p: Placement, setup) -> dict | None:
    """Parameters of a placement made of contiguous parts of the priority order (None if not)."""
    pos = {setup.workload.adapters[i].id: k for k, i in enumerate(setup.order)}
    params: dict[str, Any] = {"gpus": len(p.gpus)}
    if len(p.gpus) > setup.pool:
        return None
    expect = 0
    on_gpu = p.by_gpu()
    for g, cfg in enumerate(p.gpus):
        ids = [p.adapters[k] for k, _ in on_gpu[g]]
        ks = sorted(pos[a.id] for a in ids)
        if any(len(p.routes[a.id]) != 1 for a in ids) or ks != list(range(expect, expect + len(ks))):
            return None
        expect += len(ks)
        params[f"share_{g}"] = len(ks) / len(setup.order)
        params[f"amax_{g}"] = int(min(cfg.max_loras, AMAX_MAX))
    return params if expect == len(setup.order) else None


def seed_params(p: Placement, setup) -> dict | None:
    """A greedy placement as a trial of ``setup``'s deployment: its own parameters (``placement``); as many
    GPUs at the largest A_max that starts (``every-gpu``); its split applied to the tail of the
    ``HYBRID_SEED_HOT`` hottest (``hybrid``); None where it is no point of the space."""
    if setup.deployment == "every-gpu":
        return {"gpus": min(len(p.gpus), setup.pool), "amax_0": AMAX_MAX}
    params = encode(p, setup)
    if params is None or setup.deployment != "hybrid":
        return params
    n_tail = len(setup.order) - min(HYBRID_SEED_HOT, len(setup.order) - 1)
    if params["gpus"] > n_tail:
        return None
    return {"hot": len(setup.order) - n_tail, **params}
