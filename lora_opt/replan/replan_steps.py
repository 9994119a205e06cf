"""The transition of a replan: the ordered steps (vLLM runtime LoRA calls, router switches, launches,
drains, stops) from the running instances to a candidate, every intermediate state judged.

The order and the state rule are described in ``lora_opt.replan.replan``; this module builds
``plan.json``'s ``steps``, ``states`` and ``instances``.  The instance objects (``replan.Instance``)
and the judge (``replan.GPUJudge``) come from there; nothing here decides a placement.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from urllib.parse import urlparse

from lora_opt.placement.vllm_launch import adapter_path, instance_urls

#: the environment variable a vLLM instance needs for the runtime load/unload endpoints
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
#: the source key of adapters new to the workload (no running instance has them)
NEW = "(new adapters)"
#: how a plan's states are judged and its endpoints chosen (``plan.json``'s ``notes``)
TRANSITION_NOTES = (
    "every state is judged with the placement policy's own GPU test (the twin at each instance's "
    "routed load, margin 0: a state lasts minutes -- or, where that one Poisson draw fails, at the "
    "policy's 1 + margin, the test the candidate's GPUs passed; its own flags; the workload's "
    "criterion and the p99 TTFT bound), per instance: the fleet twin is not run on the states "
    "(first version)",
    "a state is ok when no instance starves except one the plan only relieved (its traffic a "
    "subset of what it had before the first step: the new demand overloaded it, not the plan) or "
    "one carrying part of its target traffic (within_target: the target passed the placement "
    "test, and a part of it is less load -- the monotonicity the policy's own search assumes; "
    "the twin's verdict on one draw near the boundary is not monotone)",
    "adapters new to the workload get no traffic until their switch; new instances listen on "
    "ports above the running ones (endpoints)",
)


def placement_order(instances) -> list:
    """A candidate's instances in the order its placement lists them: running ones first, in their
    current order, then those the plan launches."""
    return sorted(instances, key=lambda it: (it.origin is None, it.origin if it.origin is not None else 0))


def load_request(a, url: str) -> dict:
    """The HTTP call that loads adapter ``a`` on a running instance (runtime LoRA updating on)."""
    return {"method": "POST", "url": f"{url}/v1/load_lora_adapter",
            "json": {"lora_name": a.id, "lora_path": adapter_path(a)}}


def unload_request(aid: str, url: str) -> dict:
    """The HTTP call that unloads adapter ``aid``: vLLM drops the name from its registry, requests
    already running finish, the weights leave the GPU and CPU caches lazily (LRU)."""
    return {"method": "POST", "url": f"{url}/v1/unload_lora_adapter", "json": {"lora_name": aid}}


def step_counts(steps: list[dict], *, status: bool = False) -> str:
    """A plan's steps counted by action, in the order they first occur ("2 unload, 1 launch");
    ``status``: by action and outcome ("2 unload ok, 1 launch failed", ``lora-opt apply``'s)."""
    counts = Counter(f"{s['action']} {s['status']}" if status else s["action"] for s in steps)
    return ", ".join(f"{n} {k}" for k, n in counts.items())


class _Transition:
    """Routes as they stand during the transition, and the checks of each state."""

    def __init__(self, start, cand, wl, judge):
        self.wl, self.judge = wl, judge
        self.cfg = {it.name: it.cfg for it in start}
        self.cfg.update({it.name: it.cfg for it in cand.instances})
        self.route: dict[int, dict[str, float]] = {}
        for it in start:
            for i, w in it.adapters:
                self.route.setdefault(i, {})[it.name] = w
        self.target: dict[int, dict[str, float]] = {}
        for it in cand.instances:
            for i, w in it.adapters:
                self.target.setdefault(i, {})[it.name] = w
        # each instance's adapters in a fixed order (its current order, then its target's): the
        # same set is always asked in the same order, so the judge's cache and the twin agree
        self.order: dict[str, list[int]] = {}
        for it in list(start) + list(cand.instances):
            seen = self.order.setdefault(it.name, [])
            seen += [i for i, _ in it.adapters if i not in seen]
        self.alive = [it.name for it in start]
        self.initial = {n: {i for i, _ in self.pairs(n)} for n in self.alive}
        self.last: dict[str, tuple] = {}
        self.status: dict[str, dict] = {}
        self.states: list[dict] = []

    def pairs(self, name: str) -> list[tuple[int, float]]:
        return [(i, self.route[i][name]) for i in self.order[name] if name in self.route.get(i, {})]

    def check(self, label: str, after_step: int) -> dict:
        for name in self.alive:
            pairs = self.pairs(name)
            if self.last.get(name) != tuple(pairs):
                self.last[name] = tuple(pairs)
                ids = {i for i, _ in pairs}
                self.status[name] = {
                    "instance": name, "adapters": len(pairs),
                    "rate_req_s": sum(self.wl.adapters[i].rate * w for i, w in pairs),
                    "ok": self.judge.ok(pairs, self.cfg[name]),
                    "relieved_only": ids <= self.initial.get(name, set()),
                    "within_target": all(w <= self.target.get(i, {}).get(name, 0.0) for i, w in pairs)}
        insts = [self.status[n] for n in self.alive]
        state = {"after_step": after_step, "label": label, "instances": insts,
                 "starving": [s["instance"] for s in insts if not s["ok"]],
                 "ok": all(s["ok"] or s["relieved_only"] or s["within_target"] for s in insts)}
        self.states.append(state)
        return state


def _group_order(groups: dict[str, list[int]], tr: _Transition, source_rank: dict) -> list[str]:
    """Source groups in order: starving sources first, but a group waits while an instance it
    sends adapters to still has adapters of its own to send away (it would carry both)."""
    todo = sorted(groups, key=lambda n: source_rank.get(n, (True, len(source_rank))))
    out: list[str] = []
    while todo:
        pending_src = set(todo)
        ready = [g for g in todo if not any(d in pending_src and d != g for i in groups[g]
                                            for d in tr.target.get(i, {}) if d not in tr.route.get(i, {}))]
        pick = ready[0] if ready else todo[0]         # a cycle: the first by rank goes anyway
        out.append(pick)
        todo.remove(pick)
    return out


def endpoints(current, start, launched, host: str, base_port: int) -> dict[str, str]:
    """Each instance's URL: a running one's from ``current`` (a replanned placement's own, else
    base_port + i), a launched one's on a port above every running instance's."""
    urls = instance_urls(current, host=host, base_port=base_port)
    url = {it.name: urls[it.origin] for it in start}
    first_free = max([base_port + len(current.gpus) - 1, *(urlparse(u).port or 0 for u in urls)]) + 1
    for k, it in enumerate(launched):
        url[it.name] = f"http://{host}:{first_free + k}"
    return url


def transition_plan(current, start, retired, cand, wl, judge, *, host: str = "127.0.0.1",
                    base_port: int = 8000) -> dict:
    """The steps from ``start`` (the running instances under the new demand) to ``cand``, and the
    judged states (the first one: the running placement under the new demand, before any step)."""
    launched = [it for it in cand.instances if it.origin is None]
    url = endpoints(current, start, launched, host, base_port)
    names = {it.name for it in cand.instances}
    kept = {it.name for it in cand.instances if it.origin is not None}
    tr = _Transition(start, cand, wl, judge)
    steps: list[dict] = []

    def add(action: str, **kw) -> None:
        steps.append({"step": len(steps) + 1, "action": action, **kw})

    first = tr.check("the running placement under the new demand (before any step)", 0)
    for name, aid in retired:
        if name in kept:
            add("unload", instance=name, adapter=aid, why="retired", request=unload_request(aid, url[name]))
    new_index = {it.name: g for g, it in enumerate(placement_order(cand.instances))}
    for it in launched:
        add("launch", instance=it.name, new_gpu=new_index[it.name], url=url[it.name], env=RUNTIME_LORA_ENV,
            flags=dataclasses.asdict(it.cfg), lora_modules=[wl.adapters[i].id for i, _ in it.adapters],
            replaces=it.replaces, why="its adapters start loaded (--lora-modules); no traffic until switched")
        tr.alive.append(it.name)
    # adapters whose routing changes, grouped by the running instance they leave (starving ones first)
    moving = [i for i in sorted(set(tr.route) | set(tr.target)) if tr.route.get(i, {}) != tr.target.get(i, {})]
    source_rank = {s["instance"]: (s["ok"], k) for k, s in enumerate(first["instances"])}
    groups: dict[str, list[int]] = {}
    for i in moving:
        srcs = sorted(tr.route.get(i, {}), key=lambda n: source_rank[n])
        groups.setdefault(srcs[0] if srcs else NEW, []).append(i)
    for src in _group_order(groups, tr, source_rank):
        ids = groups[src]
        for i in ids:
            for dest in tr.target.get(i, {}):
                if dest not in tr.route.get(i, {}) and dest in kept:
                    add("load", instance=dest, adapter=wl.adapters[i].id, request=load_request(wl.adapters[i], url[dest]))
        add("route", adapters=[wl.adapters[i].id for i in ids],
            weights={wl.adapters[i].id: [[d, url[d], w] for d, w in tr.target.get(i, {}).items()] for i in ids},
            why="the router sends these adapters' new requests to their new instances; requests in flight finish "
                "where they run")
        left = {i: [n for n in tr.route.get(i, {}) if n not in tr.target.get(i, {})] for i in ids}
        for i in ids:
            tr.route[i] = dict(tr.target.get(i, {}))
            for old in left[i]:
                if old in names:
                    add("unload", instance=old, adapter=wl.adapters[i].id, request=unload_request(wl.adapters[i].id, url[old]))
        tr.check(f"after switching the adapters {'new to the workload' if src == NEW else 'leaving ' + src}",
                 len(steps))
    for it in start:
        if it.name not in names:
            by = next((c.name for c in launched if c.replaces == it.name), None)
            add("drain", instance=it.name, why=("no route sends it requests now; wait until its /metrics show "
                                                 "vllm:num_requests_running + vllm:num_requests_waiting = 0"))
            add("stop", instance=it.name, why=f"restarted as {by} with new flags" if by else "no longer needed")
            tr.alive.remove(it.name)
    states = tr.states
    return {
        "env": RUNTIME_LORA_ENV, "endpoints": url, "steps": steps, "states": states,
        "starving_at_start": first["starving"],
        "transition_ok": all(s["ok"] for s in states[1:]),
        "peak_gpus": len(start) + len(launched),
        "instances": [{"instance": it.name, "current_gpu": it.origin,
                       "new_gpu": new_index.get(it.name),
                       "action": "keep" if it.name in kept else "stop"} for it in start]
                     + [{"instance": it.name, "current_gpu": None, "new_gpu": new_index[it.name],
                         "action": "restart" if it.replaces else "launch", "replaces": it.replaces}
                        for it in launched],
        "notes": list(TRANSITION_NOTES),
    }
