"""A placement's GPUs as twin instances: each GPU's scenario, its result as an evaluation combines
it, the routing draws' seed -- and the GPUs replayed as one fleet (``twin.fleet``), a router
policy choosing each request's GPU as it arrives, adapters static (placed) or loaded on demand.

``lora_opt.placement.evaluate`` replays the GPUs one by one (``evaluate_placement``, on Ray) or as
a fleet (``evaluate_on_fleet``: ``lora-opt evaluate --router POLICY --adapters MODE``); with the
``static`` router and static adapters both give the same numbers (``tests/test_fleet.py``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import Workload, evaluation_scenario
from twin.fleet import SCRAPE_INTERVAL_S, FleetEngine, check_adapter_mode, simulate_fleet
from twin.routers import RouterSetup, make_router
from twin.scenario import scenario_from_dict
from twin.workload import Requests

#: the routing generator's stream, spawned from the evaluation seed apart from the workload's
ROUTING_STREAM = 7


@dataclass(frozen=True)
class FleetOptions:
    """How a placement's GPUs run as a fleet."""

    router: str = "static"
    """A ``twin.routers.ROUTERS`` policy."""
    adapters: str = "static"
    """``static`` (placed adapters only) or ``on-demand`` (any adapter, loaded on first use)."""
    scrape_interval_s: float = SCRAPE_INTERVAL_S
    """Seconds between the router's reads of the GPUs' metrics (0: exact at every arrival)."""


def routing_seed(seed: int) -> np.random.SeedSequence:
    """The routing draws' seed (per-GPU replay and the fleet's ``static`` router: the same stream)."""
    return np.random.SeedSequence([seed, ROUTING_STREAM])


def gpu_scenario(p: Placement, wl: Workload, g: int, on: list, duration_s: float,
                 timeseries_s: float | None = None) -> tuple[dict, np.ndarray]:
    """GPU ``g``'s scenario (the adapters ``on`` it, ``p.by_gpu()[g]``, their rates x weights) and each
    workload adapter's index in its adapter table (-1: not on it)."""
    on = sorted(on)
    local = np.full(len(p.adapters), -1, np.int64)
    for j, (k, _) in enumerate(on):
        local[k] = j
    adapters = [dataclasses.replace(p.adapters[k], rate=p.adapters[k].rate * w) for k, w in on]
    sc = evaluation_scenario(wl, adapters, engine=p.gpus[g], duration_s=duration_s)
    if timeseries_s:
        sc["timeseries_interval_s"] = timeseries_s
    return sc, local


def gpu_result(g: int, res) -> dict:
    """GPU ``g``'s twin ``Result`` as the result dict an evaluation combines."""
    d = res.to_dict()
    d.update(gpu=g, arrived=res.arrived, wall_s=res.wall_s, oom_reason=res.oom_reason,
             samples=res.samples or {}, timeseries=res.timeseries)
    return d


def fleet_engines(p: Placement, wl: Workload, duration_s: float, adapters: str,
                  timeseries_s: float | None = None) -> list[FleetEngine]:
    """Each GPU of ``p`` as a fleet instance.  ``static``: its table is the adapters placed on it
    (the per-GPU replay's scenario).  ``on-demand``: every adapter of the workload whose rank its
    ``--max-lora-rank`` admits, those placed on it preloaded (``--lora-modules``, in table order)."""
    check_adapter_mode(adapters)
    out = []
    for g, on in enumerate(p.by_gpu()):
        if adapters == "static":
            sc, local = gpu_scenario(p, wl, g, on, duration_s, timeseries_s)
            out.append(FleetEngine(scenario_from_dict(sc, f"gpu {g}"), local))
            continue
        cfg = p.gpus[g]
        table = [k for k, a in enumerate(p.adapters) if a.rank <= cfg.max_lora_rank]     # vLLM rejects the others
        serves = np.full(len(p.adapters), -1, np.int64)
        serves[table] = np.arange(len(table))
        sc = evaluation_scenario(wl, [p.adapters[k] for k in table], engine=cfg, duration_s=duration_s)
        if timeseries_s:
            sc["timeseries_interval_s"] = timeseries_s
        placed = serves[sorted(k for k, _ in on)]
        out.append(FleetEngine(scenario_from_dict(sc, f"gpu {g}"), serves, placed[placed >= 0]))
    return out


def fleet_routes(p: Placement) -> dict[int, list[tuple[int, float]]]:
    """The placement's routing table by adapter index (the ``static`` router's)."""
    index = {a.id: k for k, a in enumerate(p.adapters)}
    return {index[aid]: list(rs) for aid, rs in p.routes.items() if aid in index and rs}


def replay_on_fleet(p: Placement, wl: Workload, req: Requests, T: float, fleet: FleetOptions,
                    timeseries_s: float | None = None) -> tuple[list[dict], int, float]:
    """(per-GPU result dicts, requests no GPU could serve, their tokens) of ``req`` on the fleet."""
    engines = fleet_engines(p, wl, T, fleet.adapters, timeseries_s)
    setup = RouterSetup(n_engines=len(engines), adapter_ids=[a.id for a in p.adapters],
                        seed=routing_seed(wl.evaluation.seed), routes=fleet_routes(p))
    fr = simulate_fleet(engines, req, make_router(fleet.router, setup), scrape_interval_s=fleet.scrape_interval_s,
                        timeseries=timeseries_s is not None)
    lost = fr.engine_of < 0
    lost_tokens = float((req.in_len[lost].astype(np.int64) + req.out_len[lost]).sum())
    return [gpu_result(g, r) for g, r in enumerate(fr.engines)], int(lost.sum()), lost_tokens
