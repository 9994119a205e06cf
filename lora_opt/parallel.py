"""Run many twin simulations in parallel on Ray (a local instance by default).

``run_scenarios`` is the one place where lora-opt fans simulations out: the fidelity report, the
dataset generator and the search all call it.  Scenarios travel as plain dicts (validated again in
the worker), results come back as dicts, in input order, so a serial and a Ray run give the same
rows.  Work is sent in batches so per-task overhead stays small next to the simulations.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lora_opt import settings  # noqa: F401  (no-network environment before Ray starts)


def simulate_dict(scenario: dict, extra: Callable[[Any], dict] | None = None) -> dict:
    """Simulate one scenario dict; the result dict plus ``wall_s`` and ``steps``.
    A scenario that cannot be simulated returns ``{"status": "error", "error": message}``."""
    import twin
    from twin.scenario import scenario_from_dict

    try:
        res = twin.simulate(scenario_from_dict(scenario))
    except twin.ScenarioError as exc:
        return {"status": "error", "error": str(exc)}
    out = res.to_dict()
    out["wall_s"] = res.wall_s
    out["steps"] = res.steps
    out["arrived"] = res.arrived
    return out


def _simulate_batch(scenarios: list[dict]) -> list[dict]:
    return [simulate_dict(s) for s in scenarios]


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Start (or connect to) Ray quietly, on loopback, without usage reporting or dashboard."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                                  configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (lora_opt.settings) keeps the local node on 127.0.0.1
        ray.init(num_cpus=num_cpus or os.cpu_count(), object_store_memory=200 * 1024**2, **kwargs)


def _batches(items: Sequence, size: int) -> Iterable[tuple[int, list]]:
    for i in range(0, len(items), size):
        yield i, list(items[i:i + size])


def run_scenarios(scenarios: Sequence[dict], *, workers: int | None = None, ray_address: str | None = None,
                  batch_size: int | None = None, desc: str = "simulating", progress: bool = True) -> list[dict]:
    """Simulate every scenario; results in input order.

    ``workers=1`` runs serially in this process (no Ray).  Otherwise tasks go to Ray: a local
    instance with ``workers`` CPUs, or the cluster at ``ray_address`` / ``RAY_ADDRESS``.
    """
    from tqdm import tqdm

    n = len(scenarios)
    if n == 0:
        return []
    bar = tqdm(total=n, desc=desc, unit="sim", disable=not progress, smoothing=0.1)
    if workers == 1 and not (ray_address or os.environ.get("RAY_ADDRESS")):
        out = []
        for s in scenarios:
            out.append(simulate_dict(s))
            bar.update(1)
        bar.close()
        return out

    import ray

    init_ray(ray_address, workers)
    remote = ray.remote(num_cpus=1)(_simulate_batch)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    size = batch_size or max(1, min(16, n // (4 * cpus) or 1))
    pending = {remote.remote(batch): start for start, batch in _batches(scenarios, size)}
    results: list[dict | None] = [None] * n
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            start = pending.pop(ref)
            rows = ray.get(ref)
            results[start:start + len(rows)] = rows
            bar.update(len(rows))
    bar.close()
    return results  # type: ignore[return-value]
