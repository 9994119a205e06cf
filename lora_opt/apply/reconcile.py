"""The fleet brought back to the placement it should run: what ``lora-opt operate`` does before every cycle
and between cycles, so that an instance that died, a router restarted from an old file, or a plan cut short
(``operate`` or ``apply`` killed, a load that failed) leaves no lasting difference.

* **Observed**: each instance of the placement's GPUs and each other address lora-opt has run an instance
  on (``known``: the stray ones a plan cut short may have left) -- ``/health`` and ``/v1/models`` --, and
  the router's table (``GET /router/routes``).
* **Desired**: the placement -- GPU g's instance at :func:`~lora_opt.placement.vllm_launch.instance_urls`'s
  address serving exactly ``adapters_on(g)``, the router routing as
  :func:`~lora_opt.placement.vllm_launch.router_table` says, no other instance serving.
* **Repair**: a plan of the executor's own steps, run by :class:`~lora_opt.apply.executor.PlanExecutor`
  (each step read against the fleet first, done ones not repeated): a dead instance of the placement is
  launched again with its GPU's command (its adapters come with it), then the router's table put back,
  missing adapters loaded, adapters the placement does not put there unloaded (after the switch: nothing
  is routed to them), stray instances drained and stopped (an emulated one shut down; a real vLLM not
  launched here is left to its operator, said).

Only for static placements (``replan``'s): an instance serving every adapter on demand has no fixed set.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from lora_opt.apply.executor import ApplyOptions, PlanExecutor, route_shares
from lora_opt.errors import InputError
from lora_opt.http_pool import instance_client
from lora_opt.placement.plan import Placement
from lora_opt.replan.replan_steps import load_request, unload_request
from lora_opt.placement.vllm_launch import instance_urls, router_table

#: wall seconds an observation's HTTP call may take
OBSERVE_TIMEOUT_S = 5.0


@dataclass
class Observed:
    """The fleet as read: per address, the model ids it serves (None: it does not answer); the router's
    table (None: the router does not answer)."""

    instances: dict = field(default_factory=dict)
    routes: dict | None = None
    router_endpoints: tuple = ()


def desired(p: Placement, *, host: str, base_port: int) -> dict[str, set[str]]:
    """Address -> the adapter ids its instance serves, for every GPU the placement uses."""
    urls = instance_urls(p, host=host, base_port=base_port)
    return {urls[g]: {a.id for a in p.adapters_on(g)} for g in range(len(p.gpus)) if p.adapters_on(g)}


async def _served(client, url: str) -> set | None:
    try:
        if (await client.get(f"{url}/health", timeout=OBSERVE_TIMEOUT_S)).status_code != 200:
            return None
        r = await client.get(f"{url}/v1/models", timeout=OBSERVE_TIMEOUT_S)
        return {m["id"] for m in r.json()["data"] if m.get("parent")} if r.status_code == 200 else None
    except Exception:                   # noqa: BLE001 - any failure to answer is "not serving"
        return None


async def observe(client, urls, router: str | None) -> Observed:
    """Every address of ``urls`` and the router's table, read now (the adapters an instance serves: the
    ``/v1/models`` cards with a parent -- the base model's card has none)."""
    urls = sorted(set(urls))
    served = await asyncio.gather(*(_served(client, u) for u in urls))
    obs = Observed(dict(zip(urls, served)))
    if router:
        try:
            r = await client.get(f"{router.rstrip('/')}/router/routes", timeout=OBSERVE_TIMEOUT_S)
            if r.status_code == 200:
                doc = r.json()
                obs.routes, obs.router_endpoints = doc.get("routes", {}), tuple(doc.get("endpoints", ()))
        except Exception:               # noqa: BLE001 - a router that does not answer: reported as such
            pass
    return obs


def differences(p: Placement, obs: Observed, *, host: str, base_port: int, router: str | None) -> list[str]:
    """What differs between the observed fleet and the placement, one line each ([] : the same)."""
    want = desired(p, host=host, base_port=base_port)
    out = []
    for url, ids in sorted(want.items()):
        have = obs.instances.get(url)
        if have is None:
            out.append(f"{url}: not answering (serves {len(ids)} adapter(s) in the placement)")
            continue
        if ids - have:
            out.append(f"{url}: missing {', '.join(sorted(ids - have)[:5])}")
        if have - ids:
            out.append(f"{url}: serves {', '.join(sorted(have - ids)[:5])}, not placed there")
    for url, have in sorted(obs.instances.items()):
        if url not in want and have is not None:
            out.append(f"{url}: answering, but no GPU of the placement runs there")
    if router:
        if obs.routes is None:
            out.append(f"router {router}: not answering")
        else:
            table = router_table(p, host=host, base_port=base_port)
            wrong = sorted(a for a, es in table.items() if route_shares(obs.routes.get(a, [])) != route_shares(es))
            extra = sorted(a for a, es in obs.routes.items() if es and a not in table)
            if wrong:
                out.append(f"router: {len(wrong)} adapter(s) routed otherwise ({', '.join(wrong[:5])})")
            if extra:
                out.append(f"router: routes {', '.join(extra[:5])}, which the placement does not")
    return out


def repair_plan(p: Placement, obs: Observed, *, host: str, base_port: int, router: str | None) -> dict:
    """The executor's plan from ``obs`` to ``p`` (see the module's docstring for the order)."""
    urls = instance_urls(p, host=host, base_port=base_port)
    want = desired(p, host=host, base_port=base_port)
    name = {u: f"gpu{g}" for g, u in enumerate(urls)}
    strays = sorted(u for u, have in obs.instances.items() if u not in want and have is not None)
    name.update({u: f"stray{k}" for k, u in enumerate(strays)})
    instances = [{"instance": name[urls[g]], "current_gpu": g, "new_gpu": g, "action": "keep"}
                 for g in range(len(p.gpus)) if urls[g] in want]
    instances += [{"instance": name[u], "current_gpu": -1, "new_gpu": None, "action": "stop"} for u in strays]
    steps = []
    table = router_table(p, host=host, base_port=base_port)
    if router and obs.routes is not None:
        stale = {a: [] for a, es in obs.routes.items() if es and a not in table}
        wrong = {a: es for a, es in table.items() if route_shares(obs.routes.get(a, [])) != route_shares(es)}
        if wrong or stale:
            by_url = {f"{u}/v1": u for u in urls}
            weights = {a: [[name[by_url[e["endpoint"]]], by_url[e["endpoint"]], e["weight"]] for e in es]
                       for a, es in {**stale, **wrong}.items()}
            steps.append({"action": "route", "weights": weights, "why": "the router's table back to the placement's"})
    adapters = {a.id: a for a in p.adapters}
    for url, ids in sorted(want.items()):
        have = obs.instances.get(url)
        if have is None:
            continue                    # launched again by the executor's preflight, with its adapters
        steps += [{"action": "load", "instance": name[url], "adapter": a, "request": load_request(adapters[a], url),
                   "why": "placed here, not served"} for a in sorted(ids - have)]
        steps += [{"action": "unload", "instance": name[url], "adapter": a, "request": unload_request(a, url),
                   "why": "served here, not placed here"} for a in sorted(have - ids)]
    for u in strays:
        if f"{u}/v1" in obs.router_endpoints:
            steps.append({"action": "drain", "instance": name[u], "why": "no GPU of the placement runs here"})
        steps.append({"action": "stop", "instance": name[u], "why": "no GPU of the placement runs here"})
    for k, s in enumerate(steps):
        s["step"] = k + 1
    return {"endpoints": {n: u for u, n in name.items()}, "instances": instances, "steps": steps}


@dataclass
class Reconciled:
    """One reconciliation: what differed before, what was done, what differs after."""

    before: list
    steps: list
    after: list
    error: str = ""


async def reconcile(p: Placement, *, opts: ApplyOptions, host: str, base_port: int, known=()) -> Reconciled:
    """Observe, repair what differs, observe again.  ``known``: other addresses instances may run on."""
    router = opts.router
    urls = set(desired(p, host=host, base_port=base_port)) | {u.rstrip("/") for u in known}
    async with instance_client() as client:
        obs = await observe(client, urls, router)
        before = differences(p, obs, host=host, base_port=base_port, router=router)
        if not before:
            return Reconciled([], [], [])
        plan = repair_plan(p, obs, host=host, base_port=base_port, router=router)
        ex = PlanExecutor(plan, p, opts)
        error = ""
        try:
            await ex.preflight(client)
            await ex.run(client)
        except InputError as exc:
            error = str(exc)
        after = differences(p, await observe(client, urls, router), host=host, base_port=base_port, router=router)
    steps = [{"step": r.step, "action": r.action, "instance": r.instance, "status": r.status, "detail": r.detail,
              "adapters": sorted(s.get("weights") or ([s["adapter"]] if "adapter" in s else []))}
             for s, r in zip(plan["steps"], ex.results)]
    launched = list(ex.launched)
    if launched:
        steps.insert(0, {"step": 0, "action": "launch", "instance": ", ".join(launched), "status": "ok" if not error
                         else "failed", "detail": "not answering: launched again with its GPU's command"})
    return Reconciled(before, steps, after, error)
