"""Re-place a running placement for new demand: the fewest adapter moves and instance restarts, and
the plan to get there through vLLM's runtime LoRA endpoints, every intermediate state checked.

Vocabulary.  An *instance* is one vLLM server on one GPU; it keeps a stable name across replans
(``placement.meta["instances"]``, default ``gpu<i>``).  A *move* is an adapter added to or removed
from an instance (a load or an unload; an adapter going from A to B is two moves).  A *restart* is
an instance whose flags (``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``, ...) change: vLLM
reads them only at start-up.

Candidates (the cheapest by :class:`ReplanCosts` wins):

* ``incremental`` -- start from the current assignment.  Every instance keeps its flags (no
  restart).  Retired adapters are unloaded; an instance that no longer serves its adapters (the
  policy's own GPU test: ``GreedyPlus.gpu_verdict``, the twin at (1 + margin) x the load) sheds its
  hottest adapters, as few as the test allows (bisection); the shed ones, new adapters and adapters
  the current placement split over several GPUs are *pending*.  Pending adapters fill the
  instances with room (largest prefix each instance passes, priority order), then the policy
  places the rest on new instances (its own ``assign``: fresh flags, hot adapters replicated).
  Optionally (``consolidate``) the lightest instances are emptied into the others and stopped
  while that lowers the cost (how GPUs are given back when demand falls).
* ``incremental-restart`` -- the same, but an instance may restart with the flags the policy
  chooses for its adapter set (``GreedyPlus.gpu_choice``: ``--max-loras``, ``--max-lora-rank``,
  ``--max-cpu-loras`` as ``place`` sets them) where its own flags fail and that keeps its adapters
  in place: one that starves keeps all its adapters if the new flags pass (else sheds as few as
  either flags allow); pending adapters fill the instances under their own flags first, then with
  restarts (a ``--max-loras`` too small or a ``--max-lora-rank`` too low no longer forces a new
  instance); consolidation may restart the instances it fills.  A restart keeps its adapters: the
  new instance starts with them as ``--lora-modules`` beside the old one, which is drained and
  stopped -- they are not moves.
* ``from-scratch`` -- the policy's placement of the new workload, its GPUs matched to running
  instances by the adapters they share (greedy, largest overlap first); a matched GPU whose flags
  differ is a restart (the adapters it keeps are not moves).  Its cost is what ``lora-opt
  schedule`` compares against.

The transition (:func:`transition_plan`): unload retired adapters; launch new instances (their
adapters as ``--lora-modules``, no traffic yet); then, one source instance at a time (starving ones
first), load each leaving adapter where it goes (``POST /v1/load_lora_adapter``), switch its
router weights, unload it from the source (``POST /v1/unload_lora_adapter``); then adapters new to
the workload; last, instances left without traffic are drained and stopped.  A restart is a
replacement: the new instance is launched beside the old one, which is drained and stopped, so
the pool needs one spare GPU per restart during the transition (``peak_gpus``).  After every
group the instances whose routed traffic changed are judged with the same GPU test at the expected
load (margin 0: a state lasts minutes, and near the packing boundary a subset of a GPU's adapters
can fail at 1 + margin where the whole set passed, by other Poisson draws) -- or, where that one
draw fails, at the policy's 1 + margin, the test the candidate's GPUs passed (:class:`StateJudge`:
the twin's verdicts are not monotone in the load near the boundary); a state is
``ok`` if no instance starves except one the plan only relieved (its traffic a subset of what it
had when the plan began: the demand, not the plan, overloaded it) or one that carries part of its
target traffic (``within_target``: the target passed the placement test, and less of the same
traffic is less load -- the monotonicity greedy-plus's own search assumes).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from lora_opt.errors import InputError
from lora_opt.placement.plan import GPUConfig, Placement
from lora_opt.placement.policies.base import gpu_config
from lora_opt.placement.policies.greedy import GreedyPlus
from lora_opt.placement.policies.packing import priority_order
from lora_opt.replan.replan_steps import placement_order, transition_plan
from lora_opt.placement.workload_file import Workload
from twin.parsing import check_finite

#: consolidation stops after this many instances it could not empty
CONSOLIDATE_TRIES = 2


@dataclass(frozen=True)
class ReplanCosts:
    """What a move and a restart cost against a GPU; both 0 (default) = lexicographic: fewest
    GPUs first, then fewest launches (vLLM starts: restarts and new instances), then fewest moves.

    Launches, not restarts, come second because a restart keeps its adapters: it is one launch
    beside the old instance and one stop, and a candidate without a restart reaches the same state
    by launching a new instance, moving every adapter to it and stopping the old one -- the same
    launch plus two moves per adapter.  Ranked by restarts, that detour would win; ranked by
    launches, the restart does.  Each launch is a vLLM start (weights, CUDA graphs: minutes) on a
    spare GPU, more than one runtime adapter load, so launches still come before moves."""

    move_cost: float = 0.0
    """GPU-equivalents one move (one adapter loaded on or unloaded from one instance) costs, >= 0."""
    restart_cost: float = 0.0
    """GPU-equivalents one instance restart costs, >= 0."""

    def __post_init__(self):
        for name in ("move_cost", "restart_cost"):
            check_finite(getattr(self, name), name, 0.0, 1e6, InputError)

    def key(self, gpus: int, restarts: int, moves: int, launches: int) -> tuple[float, int, int]:
        """(GPU-equivalents, launches, moves): the smaller the cheaper."""
        return gpus + self.move_cost * moves + self.restart_cost * restarts, launches, moves


@dataclass
class Instance:
    """One vLLM instance of a candidate: its flags and the traffic routed to it."""

    name: str
    cfg: GPUConfig
    adapters: list[tuple[int, float]]
    """(workload adapter index, routing weight), in the instance's own order."""
    origin: int | None = None
    """Its GPU index in the current placement; None = launched by this plan."""
    replaces: str | None = None
    """A restart: the running instance this one replaces."""

    def ids(self) -> set[int]:
        return {i for i, _ in self.adapters}


@dataclass
class Candidate:
    name: str
    instances: list[Instance]
    unplaceable: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loads: int = 0
    unloads: int = 0
    restarts: int = 0
    restart_kept: int = 0
    """Adapters the restarted instances keep (not moves; a restart that moved them would be
    ``2 x restart_kept`` moves more)."""
    launches: int = 0
    """vLLM instances the transition starts: restarts and new instances."""

    @property
    def moves(self) -> int:
        return self.loads + self.unloads

    def key(self, costs: ReplanCosts) -> tuple[float, int, int]:
        return costs.key(len(self.instances), self.restarts, self.moves, self.launches)

    def summary(self, costs: ReplanCosts) -> dict:
        return {"name": self.name, "gpus": len(self.instances), "moves": self.moves, "loads": self.loads,
                "unloads": self.unloads, "restarts": self.restarts, "restart_kept": self.restart_kept,
                "launches": self.launches, "feasible": not self.unplaceable,
                "cost_gpu_equivalents": self.key(costs)[0]}


class GPUJudge:
    """The policy's GPU test on a subset of a workload's traffic, with a cache (a transition asks
    about the same instance states again and again)."""

    def __init__(self, wl: Workload, policy: GreedyPlus, ctx):
        self.wl, self.policy, self.ctx = wl, policy, ctx
        self._cache: dict = {}
        self.calls = 0

    def _sub(self, pairs: list[tuple[int, float]]) -> Workload:
        # a fractional route carries weight x the adapter's rate: judged as its own adapter
        ads = tuple(self.wl.adapters[i] if w == 1.0 else dataclasses.replace(self.wl.adapters[i],
                                                                            rate=self.wl.adapters[i].rate * w)
                    for i, w in pairs)
        return dataclasses.replace(self.wl, adapters=ads)

    def ok(self, pairs: list[tuple[int, float]], cfg: GPUConfig | None) -> bool:
        key = (tuple(pairs), cfg)
        if key not in self._cache:
            self.calls += 1
            self._cache[key] = self.policy.gpu_verdict(self._sub(pairs), self.ctx, list(range(len(pairs))), cfg)
        return self._cache[key]

    def fresh(self, pairs: list[tuple[int, float]]) -> GPUConfig | None:
        """The flags the policy chooses for one instance serving ``pairs`` (non-empty), None if
        no flags serve them."""
        key = ("fresh", tuple(pairs))
        if key not in self._cache:
            self.calls += 1
            sub = self._sub(pairs)
            amax = self.policy.gpu_choice(sub, self.ctx, list(range(len(pairs))))
            self._cache[key] = None if amax is None else gpu_config(
                sub, self.ctx.profile, [a.rank for a in sub.adapters], len(pairs), amax)
        return self._cache[key]

    def flags(self, pairs: list[tuple[int, float]], cfg: GPUConfig, restart: bool) -> GPUConfig | None:
        """The flags under which an instance running with ``cfg`` serves ``pairs``: ``cfg`` if it
        passes, else (``restart``) the policy's own choice for the set, else None."""
        if self.ok(pairs, cfg):
            return cfg
        return self.fresh(pairs) if restart and pairs else None


class StateJudge(GPUJudge):
    """The transition states' judge: the GPU test at the expected load (margin 0), or, where that
    fails, the policy's own test at (1 + margin) x the load -- the one every GPU of a placement
    passes.  Each verdict is one Poisson draw of the twin, and near the packing boundary the
    verdicts are not monotone in the load (a set the fill's bisection accepted at 1 + margin can
    fail at 1.0 by other draws); a state that passes at the higher load does not starve at the
    lower one."""

    def __init__(self, wl: Workload, policy: GreedyPlus, ctx, placement_judge: GPUJudge):
        super().__init__(wl, policy, ctx)
        self.placement_judge = placement_judge

    def ok(self, pairs: list[tuple[int, float]], cfg: GPUConfig | None) -> bool:
        return super().ok(pairs, cfg) or self.placement_judge.ok(pairs, cfg)


def instance_names(p: Placement) -> list[str]:
    names = p.meta.get("instances")
    if isinstance(names, list) and len(names) == len(p.gpus) and all(isinstance(n, str) for n in names) \
            and len(set(names)) == len(names):
        return names
    return [f"gpu{i}" for i in range(len(p.gpus))]


def _fresh_names(taken: set[str]):
    k = 0
    while True:
        if f"gpu{k}" not in taken:
            taken.add(f"gpu{k}")
            yield f"gpu{k}"
        k += 1


def current_state(p: Placement, wl: Workload) -> tuple[list[Instance], list[tuple[str, str]], list[int]]:
    """(the running instances with their traffic under the new workload -- adapters routed to one
    GPU, in the GPU's order --, the retired (instance, adapter id) pairs, the pending adapters:
    new ones and those the current placement splits over several GPUs)."""
    if p.profile != wl.profile:
        raise InputError(f"replan: the placement is for profile {p.profile!r}, the workload for {wl.profile!r}")
    index = {a.id: k for k, a in enumerate(wl.adapters)}
    names = instance_names(p)
    by_gpu = p.by_gpu()
    split = {aid for aid, rs in p.routes.items() if len(rs) > 1}
    insts, retired = [], []
    for g, on in enumerate(by_gpu):
        pairs = []
        for k, _ in on:
            aid = p.adapters[k].id
            if aid not in index:
                retired.append((names[g], aid))
            elif aid not in split:
                pairs.append((index[aid], 1.0))
        insts.append(Instance(names[g], p.gpus[g], pairs, origin=g))
    placed = {i for it in insts for i, _ in it.adapters}
    pending = [k for k in range(len(wl.adapters)) if k not in placed]
    return insts, retired, pending


def _largest(test, nmax: int) -> int:
    """The largest n in 0..nmax that passes (monotone), by the policy's own bisection."""
    if nmax <= 0:
        return 0
    found = GreedyPlus._largest(lambda n: (test(n),), nmax)
    return found[0] if found else 0


def _shed(it: Instance, wl: Workload, judge: GPUJudge, restart: bool = False, pinned=frozenset()) -> list[int]:
    """Make ``it`` pass by shedding its hottest adapters, as few as the test allows (under its own
    flags, or with ``restart`` under the policy's flags for what it keeps); the shed ones.  ``pinned``
    (adapter ids) are never shed: the others go first, hottest first."""
    fits = [p for p in it.adapters if wl.adapters[p[0]].rank <= it.cfg.max_lora_rank]
    out = [i for i, _ in it.adapters if wl.adapters[i].rank > it.cfg.max_lora_rank]
    it.adapters = fits
    cfg = judge.flags(fits, it.cfg, restart)
    if cfg is not None:
        it.cfg = cfg
        return out
    hottest = sorted((j for j in range(len(fits)) if wl.adapters[fits[j][0]].id not in pinned),
                     key=lambda j: -wl.adapters[fits[j][0]].rate)

    def keep(m: int) -> list[tuple[int, float]]:
        drop = set(hottest[:max(0, len(fits) - m)])
        return [p for j, p in enumerate(fits) if j not in drop]

    m = _largest(lambda m: judge.flags(keep(m), it.cfg, restart) is not None, len(fits) - 1)
    it.adapters = keep(m)
    it.cfg = judge.flags(it.adapters, it.cfg, restart) or it.cfg
    return out + [i for i in (p[0] for p in fits) if i not in it.ids()]


def _fill(insts: list[Instance], pending: list[int], wl: Workload, judge: GPUJudge,
          restart: bool = False) -> list[int]:
    """Pending adapters into the instances with room (priority order, the largest prefix each
    instance passes, lightest instance first), under their own flags; with ``restart``, then those
    left over into instances that restart with the policy's flags; those left over."""
    ranks = np.array([wl.adapters[i].rank for i in pending])
    rates = np.array([wl.adapters[i].rate for i in pending], float)
    left = [pending[j] for j in priority_order(ranks, rates)] if pending else []
    for again in (False, True) if restart else (False,):
        for it in sorted(insts, key=lambda it: sum(wl.adapters[i].rate * w for i, w in it.adapters)):
            if not left:
                break
            cand = [i for i in left if again or wl.adapters[i].rank <= it.cfg.max_lora_rank]
            m = _largest(lambda m: judge.flags(it.adapters + [(i, 1.0) for i in cand[:m]], it.cfg, again)
                         is not None, len(cand))
            if m:
                it.adapters = it.adapters + [(i, 1.0) for i in cand[:m]]
                it.cfg = judge.flags(it.adapters, it.cfg, again)
                taken = set(cand[:m])
                left = [i for i in left if i not in taken]
    return left


def _new_instances(pending: list[int], wl: Workload, policy: GreedyPlus, ctx, names) -> tuple[list[Instance], list[int], list[str]]:
    """The policy's own placement of the pending adapters on new instances."""
    if not pending:
        return [], [], []
    sub = dataclasses.replace(wl, adapters=tuple(wl.adapters[i] for i in pending))
    asg = policy.assign(sub, len(pending), ctx)
    out = []
    for g in asg.gpus:
        if g.adapters:
            cfg = gpu_config(sub, ctx.profile, [sub.adapters[i].rank for i, _ in g.adapters], len(g.adapters),
                             g.max_loras)
            out.append(Instance(next(names), cfg, [(pending[i], float(w)) for i, w in g.adapters]))
    return out, [pending[i] for i in asg.unplaceable], list(asg.notes)


def count_moves(start: list[Instance], target: list[Instance], retired: list) -> tuple[int, int, int, int, int]:
    """(loads, unloads, restarts, adapters the restarts keep, launches) from the running instances
    to the candidate's.  A restart (an instance that ``replaces`` a running one, or a running one
    whose flags change) keeps its adapters: only those it gains or loses are moves.  Launches:
    restarts and new instances."""
    before = {it.name: it for it in start}
    loads = unloads = restarts = restart_kept = new = 0
    kept = set()
    for it in target:
        prev = before.get(it.name if it.origin is not None else it.replaces)
        old = prev.ids() if prev is not None else set()
        loads += len(it.ids() - old)
        unloads += len(old - it.ids())
        new += prev is None
        if prev is not None:
            kept.add(prev.name)
            if it.replaces is not None or it.cfg != prev.cfg:
                restarts += 1
                restart_kept += len(it.ids() & old)
    unloads += sum(len(it.ids()) for name, it in before.items() if name not in kept) + len(retired)
    return loads, unloads, restarts, restart_kept, restarts + new


def incremental(start: list[Instance], pending: list[int], retired, wl: Workload, policy: GreedyPlus, ctx,
                judge: GPUJudge, costs: ReplanCosts, consolidate: bool, restart: bool = False,
                pinned=frozenset()) -> Candidate:
    """The ``incremental`` candidate, or with ``restart`` the ``incremental-restart`` one; ``pinned``
    adapters stay on the instances that run them (never shed, their instances never emptied)."""
    insts = [dataclasses.replace(it, adapters=list(it.adapters)) for it in start]
    pending = list(pending)
    for it in insts:
        pending += _shed(it, wl, judge, restart, pinned)
    insts = [it for it in insts if it.adapters]        # emptied instances stop
    pending = _fill(insts, pending, wl, judge, restart)
    names = _fresh_names({it.name for it in start})
    new, unplaceable, notes = _new_instances(pending, wl, policy, ctx, names)
    cand = Candidate("incremental-restart" if restart else "incremental", insts + new, unplaceable, notes)
    _count(cand, start, retired)
    fails = 0
    while consolidate and fails < CONSOLIDATE_TRIES and len(cand.instances) > 1:
        trial = _emptied(cand, wl, judge, fails, restart, pinned)
        if trial is None:
            fails += 1
            continue
        _count(trial, start, retired)
        if trial.key(costs) >= cand.key(costs):
            break
        cand = trial
    return _restarts_as_launches(cand, start, names)


def _restarts_as_launches(cand: Candidate, start: list[Instance], names) -> Candidate:
    """Running instances whose flags changed as what the transition does: a new instance (a fresh
    name) launched with the same adapters, replacing the running one."""
    cfg = {it.name: it.cfg for it in start}
    cand.instances = [dataclasses.replace(it, name=next(names), origin=None, replaces=it.name)
                      if it.origin is not None and it.cfg != cfg[it.name] else it for it in cand.instances]
    return cand


def _emptied(cand: Candidate, wl: Workload, judge: GPUJudge, skip: int, restart: bool = False,
             pinned=frozenset()) -> Candidate | None:
    """``cand`` with its (skip+1)-th lightest instance's adapters moved into the others, or None (also for
    an instance running a ``pinned`` adapter)."""
    load = [sum(wl.adapters[i].rate * w for i, w in it.adapters) for it in cand.instances]
    j = int(np.argsort(load, kind="stable")[skip]) if skip < len(load) else None
    if j is None or any(w != 1.0 or wl.adapters[i].id in pinned for i, w in cand.instances[j].adapters):
        return None
    others = [dataclasses.replace(it, adapters=list(it.adapters)) for k, it in enumerate(cand.instances) if k != j]
    if _fill(others, [i for i, _ in cand.instances[j].adapters], wl, judge, restart):
        return None
    return Candidate(cand.name, others, cand.unplaceable, cand.notes + [f"consolidated: {cand.instances[j].name} "
                                                                        "emptied into the others and stopped"])


def _count(cand: Candidate, start, retired) -> None:
    cand.loads, cand.unloads, cand.restarts, cand.restart_kept, cand.launches = count_moves(start, cand.instances,
                                                                                          retired)


def scratch_placement(wl: Workload, policy: GreedyPlus, ctx) -> Placement:
    """The policy's placement of ``wl`` from scratch, on as many GPUs as it needs."""
    return policy.place(wl, max(1, len(wl.adapters)), ctx)


def from_scratch(start: list[Instance], retired, wl: Workload, p: Placement) -> Candidate:
    """The placement ``p`` of the new workload (made from scratch), matched to the running instances."""
    sets = [{k for k, _ in on} for on in p.by_gpu()]
    pairs = sorted(((len(sets[j] & it.ids()), j, s) for j in range(len(sets)) for s, it in enumerate(start)),
                   reverse=True)
    match: dict[int, int] = {}
    used = set()
    for overlap, j, s in pairs:
        if overlap and j not in match and s not in used:
            match[j] = s
            used.add(s)
    names = _fresh_names({it.name for it in start})
    out = []
    for j, on in enumerate(p.by_gpu()):
        adapters = [(k, float(w)) for k, w in on]
        s = match.get(j)
        if s is not None and start[s].cfg == p.gpus[j]:
            out.append(Instance(start[s].name, p.gpus[j], adapters, origin=start[s].origin))
        else:
            out.append(Instance(next(names), p.gpus[j], adapters,
                                replaces=start[s].name if s is not None else None))
    unplaceable = set(p.meta.get("unplaceable", []))
    cand = Candidate("from-scratch", out, [i for i, a in enumerate(wl.adapters) if a.id in unplaceable],
                     list(p.meta.get("notes", [])))
    _count(cand, start, retired)
    return cand


@dataclass
class Replan:
    """The chosen candidate, the alternatives, and the transition."""

    chosen: Candidate
    candidates: list[Candidate]
    placement: Placement
    plan: dict


def replan(current: Placement, wl: Workload, policy: GreedyPlus, ctx, *, costs: ReplanCosts = ReplanCosts(),
           consolidate: bool = True, restarts: bool = True, scratch: bool = True,
           scratch_p: Placement | None = None,
           host: str = "127.0.0.1", base_port: int = 8000, pinned=frozenset()) -> Replan:
    """Re-place ``current`` for ``wl`` (see the module docstring).  ``restarts``: also the
    ``incremental-restart`` candidate.  ``scratch_p``: the policy's placement of ``wl`` from scratch
    when the caller has it (``schedule`` compares it too).  ``pinned``: adapter ids that must stay where
    they run (``operate``'s adapters whose load failed): the incremental candidates keep them in place,
    the from-scratch one is not built."""
    if not isinstance(policy, GreedyPlus):
        raise InputError(f"replan: policy {policy.name!r} has no GPU test for a given adapter set; use greedy-plus")
    if ctx.history is not None:
        raise InputError("replan: instances are judged on Poisson traffic at the workload's rates; a request "
                         "history in the context is not supported (replan --history estimates the rates from a log)")
    t0 = time.perf_counter()
    judge = GPUJudge(wl, policy, ctx)
    # a transition state lasts minutes, not the hour the margin insures: states are judged at the
    # expected load (margin 0) with the same criterion and latency bound -- near the packing
    # boundary a subset of a GPU's adapters can fail at 1 + margin where the whole set passed
    # (different Poisson draws), which is noise in the verdict, not load the plan added
    at_load = GreedyPlus(margin=0.0, oracle=policy.oracle_kind, verify_s=policy.verify_s,
                         ttft_p99_s=policy.ttft_p99_s, max_adapters=policy.max_adapters,
                         criterion=policy.criterion)
    start, retired, pending = current_state(current, wl)
    cands = [incremental(start, pending, retired, wl, policy, ctx, judge, costs, consolidate, restart, pinned)
             for restart in ((False, True) if restarts else (False,))]
    if scratch and not pinned:
        cands.append(from_scratch(start, retired, wl, scratch_p or scratch_placement(wl, policy, ctx)))
    feasible = [c for c in cands if not c.unplaceable] or cands
    best = min(feasible, key=lambda c: c.key(costs))
    states_judge = StateJudge(wl, at_load, ctx, judge)
    plan = transition_plan(current, start, retired, best, wl, states_judge, host=host, base_port=base_port)
    plan["candidates"] = [c.summary(costs) for c in cands]
    plan["chosen"] = best.name
    plan["costs"] = dataclasses.asdict(costs)
    plan["twin_checks"] = judge.calls + states_judge.calls
    # the bound every state was judged against: what a measured transition is held to (lora-opt apply)
    plan["slo"] = {"ttft_p99_s": policy.ttft_p99_s}
    placement = target_placement(best, wl, policy, current, time.perf_counter() - t0)
    # where each instance of the new placement listens: the next replan of it (lora-opt operate) starts there
    placement.meta["endpoints"] = [plan["endpoints"].get(n) for n in placement.meta["instances"]]
    return Replan(best, cands, placement, plan)


def target_placement(c: Candidate, wl: Workload, policy: GreedyPlus, current: Placement, wall_s: float) -> Placement:
    """The candidate as a ``Placement`` (kept instances first, in their current order), with the
    meta ``lora-opt place`` writes and the instance names."""
    insts = placement_order(c.instances)
    routes: dict[str, list[tuple[int, float]]] = {}
    for g, it in enumerate(insts):
        for i, w in it.adapters:
            routes.setdefault(wl.adapters[i].id, []).append((g, w))
    n = len(insts)
    verified = policy.verify_load if policy.verify_s > 0 else None
    meta = {"workload": wl.name, "rho": wl.rho, "gpus_pool": max(n, 1), "gpus_used": n if not c.unplaceable else None,
            "gpus_needed": n, "feasible": not c.unplaceable,
            "unplaceable": [wl.adapters[i].id for i in c.unplaceable],
            "predicted_throughput": [None] * n, "starvation_margin": [None] * n,
            "twin_verified_at_load": [verified] * n,
            "incoming_rate_req_s": [sum(wl.adapters[i].rate * w for i, w in it.adapters) for it in insts],
            "policy_wall_ms": wall_s * 1e3, "notes": list(c.notes), "workload_meta": wl.meta,
            "instances": [it.name for it in insts],
            "replanned_from": {"workload": current.meta.get("workload"), "policy": current.policy}}
    return Placement(profile=wl.profile, adapters=list(wl.adapters), gpus=[it.cfg for it in insts], routes=routes,
                     policy=f"replan/{policy.name}", meta=meta)

