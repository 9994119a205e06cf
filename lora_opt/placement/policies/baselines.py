"""The two baselines of the paper, reimplemented from their descriptions
(``shared/reference/vllm_lora_internals.md`` section 5).  Both set A_max to the adapters served per
GPU, as the paper does for them -- which is what makes their instances OOM at start-up when many
large-rank adapters share a GPU.  Neither consults the surrogates.

Each also has an operator variant (``dlora-capped``, ``loraserve-capped``): the same routing rules,
but A_max capped to the largest value whose instance starts under the workload's ``max_model_len``
by the profile's memory model -- the baseline as a competent operator would deploy it.
"""
from __future__ import annotations

import functools
import math
from typing import ClassVar

import numpy as np

import twin
from lora_opt.placement.policies.base import Assignment, GPUAssignment, PlacementContext, PlacementPolicy
from lora_opt.placement.policies.packing import max_loras_that_start
from lora_opt.placement.workload_file import Workload
from lora_opt.surrogates.features import DEFAULT_TOKENS_PER_REQUEST
from twin.flags import max_lora_rank_for
from twin.profile import Profile
from twin.scenario import build_scenario


class StartableCap:
    """A_max for a GPU of the operator variants: the adapters it serves, capped to the largest
    value that starts by the memory model (``max_loras_that_start``) for its ``--max-lora-rank``,
    under the workload's ``max_model_len`` (the model's when the workload states none).  Never
    below 1: a GPU where even one adapter slot does not start is reported as failing to start."""

    def __init__(self, wl: Workload, profile: Profile):
        self._flags = wl.resolved_engine(profile)
        self._profile, self._limit, self._caps = profile, max(1, len(wl.adapters)), {}

    def cap(self, lora_rank: int) -> int:
        """Largest startable A_max for this ``--max-lora-rank`` (up to the workload's adapters)."""
        if lora_rank not in self._caps:
            self._caps[lora_rank] = max_loras_that_start(self._profile, lora_rank, self._flags, self._limit)
        return self._caps[lora_rank]

    def __call__(self, ranks, n_adapters: int) -> int:
        return max(1, min(int(n_adapters), self.cap(max_lora_rank_for(ranks))))


class DLoRA(PlacementPolicy):
    """dLoRA's proactive placement (``find_best_lora_weight_schedule``): round-robin start, then
    greedy replica addition while the burst tolerance ``BT = min_k sum_{j hosts k} mem_j / p_k``
    does not decrease; replicated adapters' requests are spread uniformly.  Uses every GPU of the
    pool and has no throughput limit per GPU (as in the paper's comparison)."""

    name = "dlora"
    summary = "dLoRA proactive placement: round-robin + burst-tolerance replicas, A_max = adapters/GPU"
    fractional = True
    fills_any_pool = True
    #: cap A_max to what starts (the operator variant); the paper's A_max = adapters/GPU otherwise
    capped: ClassVar[bool] = False

    def assign(self, wl: Workload, gpus: int, ctx: PlacementContext) -> Assignment:
        N, K = len(wl.adapters), gpus
        prof, e = ctx.profile, wl.engine
        startable = StartableCap(wl, prof) if self.capped else None

        def a_max(j: int) -> int:
            ranks = [wl.adapters[k].rank for k in members[j]]
            return startable(ranks, len(ranks)) if startable and ranks else len(ranks)
        rates = np.array([a.rate for a in wl.adapters], float)
        p = rates / rates.sum() if rates.sum() > 0 else np.full(N, 1.0 / N)
        hosts: list[set[int]] = [{k % K} for k in range(N)]
        members: list[set[int]] = [set() for _ in range(K)]
        for k in range(N):
            members[k % K].add(k)

        def avail(j: int) -> float:
            """KV memory (tokens) of engine j with its A_max (the adapter count, or its startable cap)."""
            if not members[j]:
                return 0.0
            lr = max_lora_rank_for([wl.adapters[k].rank for k in members[j]])
            kv = prof.kv_capacity_tokens(a_max(j), lr, e.gpu_memory_utilization, e.max_num_batched_tokens,
                                         max_num_seqs=e.max_num_seqs)
            return float(kv)

        def burst_tolerance(av: list[float]) -> float:
            return min((sum(av[j] for j in hosts[k]) / p[k] for k in range(N) if p[k] > 0), default=math.inf)

        av = [avail(j) for j in range(K)]
        bt = burst_tolerance(av)
        for _ in range(N * K):
            total = sum(len(h) for h in hosts)
            share = np.array([len(h) / total for h in hosts]) - p
            k = int(np.argmin(share))
            accepted = False
            for j in sorted((j for j in range(K) if j not in hosts[k]), key=lambda j: len(members[j])):
                members[j].add(k)
                hosts[k].add(j)
                av_j = avail(j)
                new_av = av[:j] + [av_j] + av[j + 1:]
                new_bt = burst_tolerance(new_av)
                if av_j > 0 and new_bt >= bt:      # the replica must fit in the engine's memory
                    av, bt, accepted = new_av, new_bt, True
                    break
                members[j].discard(k)
                hosts[k].discard(j)
            if not accepted:
                break
        out = [GPUAssignment([(k, 1.0 / len(hosts[k])) for k in sorted(members[j])], a_max(j))
               for j in range(K)]
        return Assignment(out)


class DLoRACapped(DLoRA):
    """dLoRA as an operator would deploy it: the same placement and routing rules, with each
    engine's A_max (in the burst tolerance's memory as on the GPU) capped to the largest that starts
    under the workload's ``max_model_len``."""

    name = "dlora-capped"
    summary = "dLoRA's placement and routing, A_max capped to the largest that starts (operator variant)"
    capped = True


@functools.lru_cache(maxsize=64)
def single_adapter_capacity(profile_name: str, rank: int, mnbt: int, mns: int, util: float, mml: int | None,
                            duration_s: float = 120.0, rate: float = 40.0) -> float:
    """The twin's throughput (tok/s) for one adapter of this rank at a saturating rate: LoRAServe's
    per-rank operating point ("the maximum profiled throughput for a single adapter")."""
    eng = {"max_loras": 1, "max_lora_rank": max_lora_rank_for([rank]), "max_num_batched_tokens": mnbt,
           "max_num_seqs": mns, "gpu_memory_utilization": util}
    if mml:
        eng["max_model_len"] = mml
    sc = build_scenario(profile_name, [{"count": 1, "rank": rank, "rate": rate}], engine=eng,
                        duration_s=duration_s, seed=0)
    return float(twin.simulate(sc).throughput_tok_s)


class LoRAServe(PlacementPolicy):
    """LoRAServe's rank-aware placement: servers split between ranks in proportion to their demand
    (in units of the rank's operating point), each rank's adapters filled in descending demand up to
    the common target utilisation with fractional splits (routing probabilities), leftovers to
    servers of sufficient rank with spare capacity.  Needs ``ceil(sum of demands)`` servers."""

    name = "loraserve"
    summary = "LoRAServe rank-aware fill to a target utilisation, fractional routing, A_max = adapters/GPU"
    fractional = True
    #: cap A_max to what starts (the operator variant); the paper's A_max = adapters/GPU otherwise
    capped: ClassVar[bool] = False

    def assign(self, wl: Workload, gpus: int, ctx: PlacementContext) -> Assignment:
        e = wl.engine
        ranks = np.array([a.rank for a in wl.adapters])
        tps = np.array([a.rate for a in wl.adapters], float) * DEFAULT_TOKENS_PER_REQUEST
        cap = {int(r): single_adapter_capacity(wl.profile, int(r), e.max_num_batched_tokens, e.max_num_seqs,
                                               e.gpu_memory_utilization, e.max_model_len)
               for r in sorted(set(ranks.tolist()))}
        # a rank whose lone adapter gets no throughput (the engine does not start) cannot be served
        dead = [i for i, r in enumerate(ranks) if not cap[int(r)] > 0]
        cap = {r: c for r, c in cap.items() if c > 0}
        if not cap:
            return Assignment([], unplaceable=dead)
        util = np.array([t / cap[int(r)] if int(r) in cap else 0.0 for t, r in zip(tps, ranks)])
        d = {r: float(util[ranks == r].sum()) for r in cap}
        total = sum(d.values())
        S = max(gpus, math.ceil(total - 1e-9)) if total > 0 else gpus
        target = max(total / S, 1e-12)
        notes = [] if S <= gpus else [f"demand is {total:.2f} servers at the per-rank operating points"]
        servers, leftovers = fill_by_rank(servers_per_rank(d, S, target), ranks, tps, util, target)
        place_leftovers(servers, leftovers, ranks, target)
        out = [GPUAssignment(items, len(items)) for items in routing_weights(servers, util)]
        _fix_weights(out, len(wl.adapters))
        if self.capped:
            startable = StartableCap(wl, ctx.profile)
            for g in out:
                if g.adapters:
                    g.max_loras = startable([wl.adapters[i].rank for i, _ in g.adapters], len(g.adapters))
        return Assignment(out, unplaceable=dead, notes=notes)


class LoRAServeCapped(LoRAServe):
    """LoRAServe as an operator would deploy it: the same placement and routing, with each
    server's A_max capped to the largest that starts under the workload's ``max_model_len``."""

    name = "loraserve-capped"
    summary = "LoRAServe's placement and routing, A_max capped to the largest that starts (operator variant)"
    capped = True


def servers_per_rank(demand: dict, n_servers: int, target: float) -> dict:
    """LoRAServe's integer servers per rank: each rank's ``demand`` (in servers at full utilisation)
    over the ``target`` utilisation, rounded, then adjusted one server at a time until they sum to
    ``n_servers`` (taken from the rank with the least demand per server, given to the one with the most)."""
    n = {r: int(round(demand[r] / target)) for r in demand}
    while sum(n.values()) > n_servers:
        r = min((r for r in n if n[r] > 0), key=lambda r: demand[r] / n[r])
        n[r] -= 1
    while sum(n.values()) < n_servers:
        r = max(n, key=lambda r: demand[r] / n[r] if n[r] else math.inf)
        n[r] += 1
    return n


def give(srv: dict, i: int, amount: float) -> None:
    """Put ``amount`` of adapter ``i``'s utilisation on server ``srv``."""
    srv["share"][i] = srv["share"].get(i, 0.0) + amount
    srv["used"] += amount


def fill_by_rank(n: dict, ranks, tps, util, target: float) -> tuple[list[dict], list[tuple[int, float]]]:
    """LoRAServe's servers ({"rank": r, "used": util, "share": {adapter: util}}), ``n[r]`` per rank
    from the highest rank down, each rank's adapters filled onto its own servers in descending
    demand (``tps``) up to the ``target`` utilisation, an adapter split across servers where it
    overflows one.  Also returns the leftovers: (adapter, utilisation its rank's servers had no room
    for), and the zero-demand adapters of a rank without servers."""
    servers: list[dict] = []
    leftovers: list[tuple[int, float]] = []
    for r in sorted(n, reverse=True):
        mine = [len(servers) + i for i in range(n[r])]
        servers += [{"rank": r, "used": 0.0, "share": {}} for _ in range(n[r])]
        idx = [int(i) for i in np.flatnonzero(ranks == r)]
        idx.sort(key=lambda i: -tps[i])
        si = 0
        for i in idx:
            left = util[i]
            while left > 1e-15 and si < len(mine):
                srv = servers[mine[si]]
                room = target - srv["used"]
                if room <= 1e-12:
                    si += 1
                    continue
                put = min(left, room)
                give(srv, i, put)
                left -= put
            if left > 1e-15 or (util[i] == 0 and not mine):
                leftovers.append((i, left))
            elif util[i] == 0:
                servers[mine[min(si, len(mine) - 1)]]["share"].setdefault(i, 0.0)
    return servers, leftovers


def place_leftovers(servers: list[dict], leftovers: list[tuple[int, float]], ranks, target: float) -> None:
    """LoRAServe's leftovers, largest first: tiny ones round-robin over the servers; the others onto
    servers with spare capacity -- of sufficient rank below ``target``, then any below ``target``,
    then any below full -- and what still does not fit onto the least loaded server."""
    rr = 0
    for i, left in sorted(leftovers, key=lambda x: -x[1]):
        if left < 1e-3:                   # tiny leftovers: round-robin
            give(servers[rr % len(servers)], i, left)
            rr += 1
            continue
        tiers = ([s for s in servers if s["rank"] >= ranks[i] and s["used"] < target],
                 [s for s in servers if s["used"] < target], [s for s in servers if s["used"] < 1.0])
        for tier, limit in zip(tiers, (target, target, 1.0)):
            for srv in tier:
                if left <= 1e-15:
                    break
                put = min(left, limit - srv["used"])
                if put > 0:
                    give(srv, i, put)
                    left -= put
        if left > 1e-15:                   # over capacity everywhere: the least loaded server
            give(min(servers, key=lambda s: s["used"]), i, left)


def routing_weights(servers: list[dict], util) -> list[list[tuple[int, float]]]:
    """Per server: (adapter, share of the adapter's utilisation it carries) -- its routing weight
    before normalisation (1 for a zero-demand adapter)."""
    out = []
    for srv in servers:
        items = []
        for i, u in srv["share"].items():
            w = u / util[i] if util[i] > 0 else 1.0
            items.append((i, w))
        out.append(items)
    return out


def _fix_weights(gpus: list[GPUAssignment], n_adapters: int) -> None:
    """Routing weights sum to exactly 1 per adapter; zero-demand adapters keep one server."""
    total = np.zeros(n_adapters)
    for g in gpus:
        for i, w in g.adapters:
            total[i] += w
    for g in gpus:
        g.adapters = [(i, w / total[i]) for i, w in g.adapters if total[i] > 0 and w / total[i] > 1e-12]
