"""The papers' greedy placement (Agullo et al., arXiv 2602.24044, Algorithms 1-2) and our
``greedy-plus``.

Both walk the adapters in *priority order* -- rank descending (so an adapter never raises the slot
size of a GPU filled before it), rates zig-zagged inside each rank group (highest, lowest, second
highest, ...) -- and fill one GPU at a time, asking a surrogate whether the GPU is still served.
Because the order is rank-descending, every GPU gets a contiguous segment of it and the segment's
max rank is its first adapter's; the features of any segment come from prefix sums in O(1), and
the oracle is asked in batches: a GPU's questions a chunk of testing points at a time (only those
its walk can reach, ending at its first failed test), every GPU's starvation margin together at the
end (the paper calls the oracle one configuration at a time: 1.59 s with its RF for 1,280 adapters
on 4 GPUs).  So the questions grow with the adapters placed, not with adapters x GPUs.

``greedy`` / ``greedy-fast`` (the paper; full surrogate / distilled trees):
  testing points T = [8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384] are both the adapter counts
  at which a GPU is tested and the A_max candidates.  At each testing point the current A_max and
  the next candidate are compared by predicted throughput, the better one is checked for
  starvation; on failure the adapters added since the last passed test are rolled back to the queue
  and the next GPU opens.  A_max only moves forward along T.  (Our additions, needed to finish on
  any input: the final partial batch is tested too, A_max never exceeds the adapters served, and a
  GPU whose first batch of 8 fails retries 4, 2, 1 adapters; an adapter that starves a GPU alone
  is reported unplaceable.)  Past 384 the paper is silent; its own results (1,280 adapters served
  by 1.6 GPUs on average) need GPUs of more than 384 adapters, so testing continues every 64
  adapters, A_max staying on T and the surrogate seeing at most 384 adapters (as a forest would).

``greedy-plus`` (ours), three changes, each aimed at a weakness the BRIEF lists:
  1. A_max from every integer that fits in memory (the profile's start-up check), not 11 values,
     and chosen afresh for every candidate set (not monotone): e.g. ~144 for Llama-3.1-8B, which T
     cannot express.
  2. The GPU is filled to the largest adapter count the oracle accepts (bisection over the count),
     not only up to the last testing point passed.
  3. A starvation margin m and a latency test.  The papers' criterion (throughput >= rho x
     incoming over a window) accepts a GPU whose capacity is only rho x its load: up to 11 %
     overloaded at rho = 0.9, its queue and TTFT growing all window long (measured: a GPU that
     criterion passes at 94.6 % served had a mean TTFT of 25 s), and it cannot see requests that
     wait for an adapter slot while throughput looks fine.  greedy-plus accepts a GPU only if at
     (1 + m) x its expected load it is not starving *and* its p99 TTFT stays <= ``ttft_p99_s``
     (5 s): an overload of f grows the backlog by f x the window in time (900 s x 1 % = 9 s), so
     the bound also certifies stability.  A false "feasible" starves users while a false
     "infeasible" only costs a GPU, so the margin also absorbs rate-estimation error and
     burstiness the Poisson test does not see.
  4. Twin verification: the surrogate proposes (the largest count it calls feasible at
     (1 + m) / 0.9 x the load, the best A_max for it), the twin disposes (a ``verify_s``-second
     simulation; the count is bisected down until the twin agrees).  The surrogate's
     false-feasible answers cluster near the saturation boundary -- exactly where a packing
     policy operates -- so they never reach the placement.
  5. Decisions at a stated confidence (``confidence``): the load the twin verifies at is derived from
     the twin's measured capacity error instead of set by hand -- ``1 / bound`` with ``bound`` the
     error model's split-conformal lower bound at C (``lora_opt.placement.confidence``); every "1 +
     margin" above then reads ``verify_load``.
  Adapters too hot for one GPU get dedicated GPUs with requests split evenly.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
from tqdm import tqdm

import twin
from lora_opt.calibration.error_model import check_confidence
from lora_opt.placement.confidence import resolve_bound
from lora_opt.placement.evaluate import GRACE_S, Criterion
from lora_opt.placement.plan import GPUConfig
from lora_opt.placement.policies.base import (Assignment, GPUAssignment, PlacementContext, PlacementPolicy,
                                              gpu_config)
from lora_opt.placement.policies.packing import max_loras_that_start, priority_order
from lora_opt.placement.workload_file import Workload, scenario_adapters
from lora_opt.placement.policies.segments import SURROGATE_MAX_ADAPTERS, TESTING_POINTS, Segments
from lora_opt.surrogates.features import DEFAULT_TOKENS_PER_REQUEST
from twin.errors import ScenarioError
from twin.parsing import check_finite
from twin.scenario import build_scenario
from twin.workload import Requests

#: testing points past the last one, every this many adapters (see Greedy)
EXTRA_TESTING_STEP = 64
#: and the smallest (smaller segments are asked as this many, the extra ones idle)
MIN_ADAPTERS_PER_GPU = TESTING_POINTS[0]
#: requests/s below which an adapter is never split across GPUs (416 tok/s, a few % of any GPU)
HOT_MIN_RATE = 1.0
#: greedy-plus takes the largest A_max predicted within this fraction of the best throughput
AMAX_TOLERANCE = 0.99
#: the starvation threshold the bundled surrogates' labels use (configs/grids/*.yaml)
SURROGATE_RHO = 0.9
#: load factors at which the starvation margin is probed
MARGIN_GRID = np.round(np.arange(0.5, 3.0001, 0.025), 4)
#: load factors asked per oracle call when margins are searched (the first failure ends a GPU's
#: search; a GPU packed to its limit fails near 1.1, the 25th)
MARGIN_CHUNK = 32
#: testing points a GPU's first oracle call covers in greedy (then twice as many per call)
GPU_CHUNK_ENDS = 8


def _testing_ends(remaining: int, start: int = 0, count: int | None = None) -> list[int]:
    """``[start:start + count]`` of the adapter counts at which greedy tests a GPU when
    ``remaining`` adapters are left: the testing points, every EXTRA_TESTING_STEP past the last,
    and the last partial batch.  Computed per slice: the whole list is O(remaining) long and a
    GPU stops at its first failure."""
    T = TESTING_POINTS
    head = [t for t in T if t <= remaining]
    n_extra = max(0, (remaining - T[-1]) // EXTRA_TESTING_STEP)
    last_listed = T[-1] + EXTRA_TESTING_STEP * n_extra if n_extra else (head[-1] if head else 0)
    total = len(head) + n_extra + (remaining != last_listed)
    stop = total if count is None else min(total, start + count)
    out = []
    for i in range(start, stop):
        if i < len(head):
            out.append(head[i])
        elif i < len(head) + n_extra:
            out.append(T[-1] + EXTRA_TESTING_STEP * (i - len(head) + 1))
        else:
            out.append(remaining)         # the last, partial batch is tested too
    return out


def starvation_margins(oracle, seg: Segments, gpus) -> list[float]:
    """``starvation_margin`` of every GPU (s, n, amax), with one oracle call per MARGIN_CHUNK load
    factors for all GPUs still searching (a GPU's search ends at its first failure): the same
    numbers as one call per GPU over the whole grid, at ~1/3 of the rows and one call in all."""
    G, L = len(gpus), len(MARGIN_GRID)
    first_bad = np.full(G, L)
    todo = np.arange(G)
    lo = 0
    if G:
        s_all, n_all, a_all = (np.array(c, np.int64) for c in zip(*gpus))
    while todo.size and lo < L:
        hi = min(lo + MARGIN_CHUNK, L)
        k = hi - lo
        X = seg.rows(np.repeat(s_all[todo], k), np.repeat(n_all[todo], k), np.repeat(a_all[todo], k),
                     np.tile(MARGIN_GRID[lo:hi], todo.size), pad_to=MIN_ADAPTERS_PER_GPU)
        _, feas, _ = oracle.predict(X)
        bad = ~feas.reshape(todo.size, k)
        found = bad.any(axis=1)
        first_bad[todo[found]] = lo + bad[found].argmax(axis=1)
        todo = todo[~found]
        lo = hi
    return [float(SURROGATE_RHO * MARGIN_GRID[0] - 1.0) if k == 0 else float(SURROGATE_RHO * MARGIN_GRID[k - 1] - 1.0)
            for k in first_bad.tolist()]


def starvation_margin(oracle, seg: Segments, s: int, n: int, amax: int) -> float:
    """Capacity headroom the oracle predicts for the GPU: rho x L - 1 for the largest load factor
    L (on MARGIN_GRID, every smaller one passing too) it calls feasible; 0.1 = capacity 10 % above
    the expected load, negative = overloaded (still "not starving" while > rho - 1)."""
    X = seg.rows(s, np.full(len(MARGIN_GRID), n), amax, MARGIN_GRID, pad_to=MIN_ADAPTERS_PER_GPU)
    _, feas, _ = oracle.predict(X)
    bad = np.flatnonzero(~feas)
    k = int(bad[0]) if bad.size else len(MARGIN_GRID)
    if k == 0:
        return float(SURROGATE_RHO * MARGIN_GRID[0] - 1.0)      # at most this
    return float(SURROGATE_RHO * MARGIN_GRID[k - 1] - 1.0)


class _GreedyBase(PlacementPolicy):
    uses_oracle = True
    oracle_kind: ClassVar[str] = "full"

    def _ordered(self, wl: Workload):
        ranks = np.array([a.rank for a in wl.adapters])
        rates = np.array([a.rate for a in wl.adapters], float)
        order = priority_order(ranks, rates)
        return order, ranks[order], rates[order]


class Greedy(_GreedyBase):
    """The paper's greedy with the full surrogate as oracle."""

    name = "greedy"
    summary = "paper's greedy: testing points, two-candidate A_max, rollback; full surrogate oracle"

    def _gpu(self, oracle, seg: Segments, s: int, remaining: int):
        """(adapters committed, A_max, predicted throughput) for the GPU starting at s.

        The testing points are walked in chunks (``GPU_CHUNK_ENDS``, then doubling) and the oracle
        is asked only the (count, A_max) pairs the walk can reach in the chunk: A_max moves at most
        one testing point per end, and the walk stops at the first failed test.  Asking every pair
        up to the whole remaining order made a GPU cost O(adapters left), the placement
        O(adapters x GPUs).  The oracles answer each row on its own, so the walk is the paper's."""
        T = TESTING_POINTS
        idx, committed, amax, thr_c = 0, 0, 0, 0.0
        i0, chunk = 0, GPU_CHUNK_ENDS
        while True:
            block = _testing_ends(remaining, i0, chunk)
            if not block:
                break
            pairs = sorted({(n, min(T[m], n)) for j, n in enumerate(block)
                            for m in range(idx, min(idx + j + 2, len(T)))})
            X = seg.rows(s, np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]),
                         pad_to=MIN_ADAPTERS_PER_GPU)
            thr, feas, _ = oracle.predict(X)
            table = dict(zip(pairs, zip(thr.tolist(), feas.tolist())))
            for n in block:
                cur = min(T[idx], n)
                nxt = min(T[idx + 1], n) if idx + 1 < len(T) else cur
                take_next = table[(n, nxt)][0] > table[(n, cur)][0]
                pick = nxt if take_next else cur
                if not table[(n, pick)][1]:
                    block = None                   # roll the batch back; the next GPU opens
                    break
                committed, amax, thr_c = n, pick, table[(n, pick)][0]
                if take_next and idx + 1 < len(T) and T[idx + 1] <= n:
                    idx += 1
            if block is None:
                break
            i0 += len(block)
            chunk *= 2
        if committed == 0:                     # first batch failed: smaller first batches
            small = [k for k in (4, 2, 1) if k <= remaining]
            thr, feas, _ = oracle.predict(seg.rows(s, np.array(small), np.array(small),
                                                   pad_to=MIN_ADAPTERS_PER_GPU))
            for k, t, f in zip(small, thr, feas):
                if f:
                    return k, k, float(t)
        return committed, amax, thr_c

    def assign(self, wl: Workload, gpus: int, ctx: PlacementContext) -> Assignment:
        oracle = ctx.oracle(self.oracle_kind)
        order, ranks, rates = self._ordered(wl)
        seg = Segments(ranks, rates)
        packed, unplaceable, s, N = [], [], 0, len(order)
        while s < N:
            n, amax, thr = self._gpu(oracle, seg, s, N - s)
            if n == 0:
                unplaceable.append(int(order[s]))
                s += 1
                continue
            packed.append((s, n, int(amax), thr))
            s += n
        # the margins decide nothing above: asked for every GPU at once
        margins = starvation_margins(oracle, seg, [(s, n, amax) for s, n, amax, _ in packed])
        out = [GPUAssignment([(i, 1.0) for i in order[s:s + n].tolist()], amax, thr, margin)
               for (s, n, amax, thr), margin in zip(packed, margins)]
        return Assignment(out, unplaceable)


class GreedyFast(Greedy):
    """The paper's greedy with the distilled trees as oracle ("ProposedFast")."""

    name = "greedy-fast"
    summary = "paper's greedy with the distilled (Numba) trees as oracle"
    oracle_kind = "distilled"


class GreedyPlus(_GreedyBase):
    """Our greedy: integer A_max, fill to the largest accepted count, starvation margin."""

    name = "greedy-plus"
    summary = "integer A_max (not monotone), fill by bisection, starvation margin, hot-adapter replicas"
    oracle_kind = "full"

    def __init__(self, margin: float = 0.10, oracle: str | None = None, verify_s: float = 900.0,
                 ttft_p99_s: float | None = 5.0, max_adapters: int = 2048, balance: bool = True,
                 criterion=None, progress: bool = False, confidence: float | None = None,
                 error_model: str | None = None):
        if not isinstance(max_adapters, int) or max_adapters < 1:
            raise ScenarioError(f"max_adapters: must be an integer >= 1, got {max_adapters!r}")
        #: adapters per GPU at most: beyond the surrogates' 384 only with twin verification
        self.max_adapters = max_adapters
        #: re-cut the GPUs the packing needs into parts of equal load (see _balanced)
        self.balance = balance
        #: what the twin verification demands of a GPU (``lora_opt.placement.evaluate.Criterion``; default:
        #: the workload's rho); the p99 TTFT bound applies on top of it
        self.criterion = criterion
        #: a progress bar (stderr) over the adapters placed: twin verification takes seconds
        self.progress = progress
        for name, value in (("margin", margin), ("verify_s", verify_s), ("ttft_p99_s", ttft_p99_s)):
            if value is not None:             # NaN passes every comparison below
                check_finite(value, name)
        if not 0 <= margin <= 1:
            raise ScenarioError(f"margin: must be in [0, 1], got {margin}")
        if verify_s < 0:
            raise ScenarioError(f"verify_s: must be >= 0 (0 = no twin verification), got {verify_s}")
        if 0 < verify_s <= GRACE_S:       # the verdict ignores the last GRACE_S s: nothing would be judged
            raise ScenarioError(f"verify_s: {verify_s:g} s must be above the starvation verdict's grace "
                                f"{GRACE_S:g} s (or 0 = no twin verification)")
        if oracle is not None and oracle not in ("full", "distilled"):
            raise ScenarioError(f"oracle: {oracle!r} not allowed; allowed values: full, distilled")
        if ttft_p99_s is not None and ttft_p99_s <= 0:
            raise ScenarioError(f"ttft_p99_s: must be > 0 (or None), got {ttft_p99_s}")
        self.ttft_p99_s = ttft_p99_s
        #: twin simulations run (place and replan report them)
        self.twin_calls = 0
        self.margin = margin
        self.verify_s = verify_s
        #: decisions at a stated confidence (``lora_opt.placement.confidence``): the twin verifies each
        #: GPU at 1 / (the error model's capacity-ratio bound at C) x its load instead of 1 + margin;
        #: resolved against the profile on first use (``prepare``).  None: the fixed margin.
        self.confidence = None if confidence is None else check_confidence(confidence, "confidence")
        #: the error model file behind ``confidence`` (default: the profile's bundled one)
        self.error_model = error_model
        #: what ``prepare`` resolved (``ConfidenceSetting``), None before it ran or without a confidence
        self.confidence_setting = None
        self._set_verify_load(1.0 + margin)
        if oracle is not None:
            self.oracle_kind = oracle

    def _set_verify_load(self, load: float) -> None:
        #: the twin verifies a GPU at this x its expected load (1 + margin, or derived from the confidence)
        self.verify_load = float(load)
        #: the oracle is asked at this x the expected load: capacity >= verify_load x load
        self.load_factor = self.verify_load / SURROGATE_RHO

    def prepare(self, ctx: PlacementContext) -> None:
        """Resolves ``confidence`` against the context's profile into the verification load (once)."""
        if self.confidence is None or self.confidence_setting is not None:
            return
        setting = resolve_bound(ctx.profile, self.confidence, self.error_model)
        self.confidence_setting = setting
        self._set_verify_load(setting.bound.verification_load)

    def _twin_ok(self, wl: Workload, ctx: PlacementContext, idx, amax: int, cfg=None) -> bool:
        """The twin's verdict on one GPU at (1 + margin) x its load: it starts, does not starve and
        keeps p99 TTFT <= ttft_p99_s (requests waiting for an adapter slot starve while throughput
        looks fine).  The traffic: the observed requests of its adapters (``ctx.history``) with
        time compressed by 1 + margin -- bursts included -- or, without history, Poisson arrivals
        at the expected rates for ``verify_s`` seconds with the workload's lengths.  ``cfg``: the
        instance's flags when they are given (a running instance keeps its own), else the policy's."""
        ads = [wl.adapters[i] for i in idx]
        cfg = cfg or self._config(wl, ctx, idx, amax)
        criterion = self.criterion or Criterion(rho=wl.rho)
        self.prepare(ctx)
        f = self.verify_load
        duration_s, requests = self.verify_s, None
        if ctx.history is not None:
            h = ctx.history
            local = np.full(len(wl.adapters), -1, np.int64)
            local[np.asarray(idx)] = np.arange(len(ads))
            sel = np.flatnonzero(local[h.adapter] >= 0)
            requests = Requests(arrival=np.ascontiguousarray(h.arrival[sel] / f),
                                adapter=local[h.adapter[sel]].astype(np.int32),
                                in_len=h.in_len[sel], out_len=h.out_len[sel])
            duration_s = ctx.history_s / f
        # early stop only certifies a served fraction below rho (graced like the judge below); a
        # latency-only criterion needs the whole run
        sc = build_scenario(wl.profile, scenario_adapters(ads, f), engine=cfg, arrivals={"process": "poisson"},
                            lengths=wl.evaluation.lengths, duration_s=duration_s,
                            rho=criterion.rho if criterion.rho is not None else wl.rho, seed=wl.evaluation.seed,
                            early_stop=criterion.rho is not None, where="greedy-plus verification")
        res = twin.simulate(sc, requests=requests, stop_grace_s=GRACE_S)
        self.twin_calls += 1
        if res.status != "ok":
            return False
        if not criterion.check(res, res.duration_s, GRACE_S)["ok"]:
            return False
        p99 = res.ttft_ms["p99"]
        return self.ttft_p99_s is None or p99 is None or p99 <= self.ttft_p99_s * 1000.0

    def _best(self, oracle, seg: Segments, s: int, n: int, amax_cap: int):
        """(feasible?, A_max, predicted throughput, None) of segment [s, s+n) over every A_max (the
        last: the GPU's flags, none made here; :meth:`_verified` gives the flags the twin verified)."""
        hi = min(n, amax_cap)
        lo = min(TESTING_POINTS[0], hi)
        if hi < 1:
            return False, 0, 0.0, None
        a = np.arange(lo, hi + 1)
        nn = np.full(a.shape, n)
        P = MIN_ADAPTERS_PER_GPU
        X = np.concatenate([seg.rows(s, nn, a, pad_to=P), seg.rows(s, nn, a, self.load_factor, pad_to=P)])
        thr, feas, _ = oracle.predict(X)
        k = a.size
        ok = feas[:k] & feas[k:]
        if not ok.any():
            return False, 0, 0.0, None
        # below saturation every A_max serves the load (equal throughput); the largest of the
        # near-best keeps the most adapters resident, so fewest requests wait for a slot
        best = np.max(np.where(ok, thr[:k], -np.inf))
        j = int(np.flatnonzero(ok & (thr[:k] >= AMAX_TOLERANCE * best))[-1])
        return True, int(a[j]), float(thr[j]), None

    def _alone_ok(self, oracle, ranks, rates) -> np.ndarray:
        """Does one GPU serve each adapter (with margin)?  Asked as a GPU of 8 adapters, this one
        and 7 idle ones (the surrogates never saw fewer than 8), at A_max 8."""
        q = np.asarray(rates, float)
        r = np.asarray(ranks, float)
        if q.size == 0:
            return np.zeros(0, bool)
        n = 8.0
        rows = []
        for load in (1.0, self.load_factor):
            ql = q * load
            rows.append(np.stack([np.full_like(q, n), ql, ql * np.sqrt(n - 1) / n, r, r, np.zeros_like(q),
                                  np.full_like(q, 8.0), ql * DEFAULT_TOKENS_PER_REQUEST], 1))
        _, feas, _ = oracle.predict(np.concatenate(rows))
        return feas[:q.size] & feas[q.size:]

    def _hot_replicas(self, oracle, ranks, rates) -> np.ndarray:
        """Replicas per adapter: 1, or the smallest power of 2 (<= 64) at which one GPU serves
        rate / m with margin; 0 where even 64 do not suffice."""
        m = np.ones(len(rates), np.int64)
        # only adapters with real load are candidates: below HOT_MIN_RATE the surrogates' low-load
        # region (few requests, end effects) is not evidence that one GPU is too small
        hot = np.flatnonzero(rates >= HOT_MIN_RATE)
        todo = hot[~self._alone_ok(oracle, ranks[hot], rates[hot])]
        while todo.size and m[todo].max() < 64:
            m[todo] *= 2
            todo = todo[~self._alone_ok(oracle, ranks[todo], rates[todo] / m[todo])]
        m[todo] = 0
        return m

    def assign(self, wl: Workload, gpus: int, ctx: PlacementContext) -> Assignment:
        self.prepare(ctx)
        oracle = ctx.oracle(self.oracle_kind)
        ranks_all = np.array([a.rank for a in wl.adapters])
        rates_all = np.array([a.rate for a in wl.adapters], float)
        m = self._hot_replicas(oracle, ranks_all, rates_all)
        out, notes = [], []
        # an adapter with more load than one GPU serves gets m dedicated GPUs, requests split evenly
        for i in np.flatnonzero(m > 1):
            notes.append(f"adapter {wl.adapters[i].id}: {rates_all[i]:g} req/s is more than one GPU serves; "
                         f"{m[i]} dedicated GPUs, requests split evenly")
            seg = Segments([ranks_all[i]] * 8, [rates_all[i] / m[i]] + [0.0] * 7)
            margin = starvation_margin(oracle, seg, 0, 8, 8)
            thr = float(oracle.predict(seg.rows(0, np.array([8]), np.array([8])))[0][0])
            out += [GPUAssignment([(int(i), 1.0 / m[i])], 1, thr, margin) for _ in range(m[i])]
        unplaceable = [int(i) for i in np.flatnonzero(m == 0)]
        rest = np.flatnonzero(m == 1)
        order = rest[priority_order(ranks_all[rest], rates_all[rest])]
        ranks, rates = ranks_all[order], rates_all[order]
        seg = Segments(ranks, rates)
        prof = ctx.profile
        e = wl.resolved_engine(prof)
        limit = self.max_adapters if self.verify_s > 0 else min(self.max_adapters, SURROGATE_MAX_ADAPTERS)
        mem_caps = {int(r): max_loras_that_start(prof, int(r), e, limit) for r in set(ranks.tolist())}
        s, N = 0, len(order)
        self.twin_calls = 0
        packed: list[tuple[int, int, int, float | None, GPUConfig | None]] = []
        bar = tqdm(total=N, desc="placing", unit="adapter", disable=not self.progress, leave=False)
        while s < N:
            mem_cap = mem_caps[int(ranks[s])]
            cap = min(mem_cap, SURROGATE_MAX_ADAPTERS)      # A_max values the surrogate knows
            nmax = min(N - s, limit)
            found = self._largest(lambda n: self._best(oracle, seg, s, n, cap), nmax)
            if self.verify_s > 0 and mem_cap > 0:
                # the twin is the judge; the surrogate bounds the search and picks A_max.  Where the
                # surrogate accepts nothing (it is unreliable at very low load, where its training
                # data is sparse) the twin searches from the full segment with every adapter resident.
                found = self._largest(lambda n: self._verified(wl, ctx, oracle, seg, order, s, n, mem_cap),
                                      found[0] if found is not None else nmax)
            if found is None:
                unplaceable.append(int(order[s]))
                s += 1
                bar.update(1)
                continue
            n, (ok, amax, thr, cfg) = found
            packed.append((s, n, amax, thr, cfg))
            s += n
            bar.update(n)
        bar.close()
        if self.balance and len(packed) >= 2 and not unplaceable:
            # equal parts serve more than full GPUs plus a light one: try one GPU fewer first
            for k in (len(packed) - 1, len(packed)):
                parts = self._balanced(k, wl, ctx, oracle, seg, order, mem_caps, ranks, notes)
                if parts:
                    packed = parts
                    break
        verified = self.verify_load if self.verify_s > 0 else None
        margins = starvation_margins(oracle, seg, [(s, n, amax) for s, n, amax, _, _ in packed])
        for (s, n, amax, thr, cfg), margin in zip(packed, margins):
            out.append(GPUAssignment([(int(i), 1.0) for i in order[s:s + n]], amax, thr, margin, verified, cfg))
        if self.verify_s > 0:
            what = (f"the observed {ctx.history_s:g} s of traffic" if ctx.history is not None
                    else f"{self.verify_s:g} s of Poisson traffic")
            how = (f"{self.verify_load:.3f}x load, derived from the confidence: "
                   + self.confidence_setting.bound.describe() if self.confidence_setting is not None
                   else f"{self.verify_load:g}x load (the fixed margin {self.margin:g})")
            notes.append(f"twin verification: {self.twin_calls} simulations of {what} at {how}")
        return Assignment(out, sorted(unplaceable), notes)

    def _verified(self, wl, ctx, oracle, seg, order, s: int, n: int, mem_cap: int):
        """(ok, A_max, predicted throughput or None, the GPU's flags the twin verified) for adapters
        s..s+n-1 of the order on one GPU, the twin deciding: the surrogate's A_max if the surrogate
        accepts it and the twin agrees; else every adapter resident, as far as memory allows (no
        waits for a slot)."""
        if mem_cap <= 0:
            return False, 0, 0.0, None
        idx = order[s:s + n]
        r = self._best(oracle, seg, s, n, min(mem_cap, SURROGATE_MAX_ADAPTERS))
        if r[0]:
            cfg = self._config(wl, ctx, idx, r[1])
            if self._twin_ok(wl, ctx, idx, r[1], cfg):
                return True, r[1], r[2], cfg
        alt = min(n, mem_cap)
        if not r[0] or alt != r[1]:
            cfg = self._config(wl, ctx, idx, alt)
            if self._twin_ok(wl, ctx, idx, alt, cfg):
                return True, alt, None, cfg
        return False, 0, 0.0, None

    @staticmethod
    def _config(wl: Workload, ctx: PlacementContext, idx, amax: int) -> GPUConfig:
        """The flags of one GPU serving the adapters ``idx`` at A_max ``amax`` (``gpu_config``)."""
        return gpu_config(wl, ctx.profile, [wl.adapters[i].rank for i in idx], len(idx), amax)

    def gpu_verdict(self, wl: Workload, ctx: PlacementContext, idx, cfg=None) -> bool:
        """Does one GPU serve the adapters ``idx`` (workload indices, in the GPU's own order)?  The
        test every GPU of a greedy-plus placement passed, for any set: with ``cfg`` (a running
        instance's flags, kept) the twin at ``cfg.max_loras`` (the surrogate at that A_max without
        twin verification); without, A_max chosen as ``place`` chooses it.  ``lora-opt replan``
        judges kept GPUs and every transition state with it."""
        ads = [wl.adapters[i] for i in idx]
        if not ads:
            return True
        self.prepare(ctx)
        if cfg is not None and max(a.rank for a in ads) > cfg.max_lora_rank:
            return False                  # vLLM refuses to load it
        if cfg is not None and self.verify_s > 0:
            return self._twin_ok(wl, ctx, idx, cfg.max_loras, cfg)
        if cfg is None:
            return self.gpu_choice(wl, ctx, idx) is not None
        ranks, rates = np.array([a.rank for a in ads]), np.array([a.rate for a in ads], float)
        order = np.asarray(idx)[priority_order(ranks, rates)]
        seg = Segments([wl.adapters[i].rank for i in order], [wl.adapters[i].rate for i in order])
        n, a = np.array([len(ads)]), np.array([cfg.max_loras])
        X = np.concatenate([seg.rows(0, n, a, pad_to=MIN_ADAPTERS_PER_GPU),
                            seg.rows(0, n, a, self.load_factor, pad_to=MIN_ADAPTERS_PER_GPU)])
        return bool(ctx.oracle(self.oracle_kind).predict(X)[1].all())

    def gpu_choice(self, wl: Workload, ctx: PlacementContext, idx) -> int | None:
        """The A_max (``--max-loras``) ``place`` chooses for one GPU serving the adapters ``idx``
        (non-empty), its own test passed; None if the GPU fails it at every A_max."""
        self.prepare(ctx)
        ranks = np.array([wl.adapters[i].rank for i in idx])
        order = np.asarray(idx)[priority_order(ranks, np.array([wl.adapters[i].rate for i in idx], float))]
        seg = Segments([wl.adapters[i].rank for i in order], [wl.adapters[i].rate for i in order])
        oracle, e = ctx.oracle(self.oracle_kind), wl.resolved_engine(ctx.profile)
        mem_cap = max_loras_that_start(ctx.profile, int(ranks.max()), e, self.max_adapters)
        if self.verify_s > 0:
            r = self._verified(wl, ctx, oracle, seg, order, 0, len(idx), mem_cap)
        else:
            r = self._best(oracle, seg, 0, len(idx), min(mem_cap, SURROGATE_MAX_ADAPTERS))
        return r[1] if r[0] else None

    def _balanced(self, K, wl, ctx, oracle, seg, order, mem_caps, ranks, notes):
        """K GPUs with the priority order cut into parts of equal weight (half load, half adapter
        count) instead of full GPUs and a light last one: lower latency, sometimes one GPU fewer.
        Kept only if every part passes the same tests; None otherwise."""
        N = seg.ranks.size
        total = seg.q1[N]
        w = (seg.rates / total if total > 0 else 0.0) + 1.0 / N
        cum = np.cumsum(w)
        cuts = np.searchsorted(cum, cum[-1] * np.arange(1, K) / K) + 1
        bounds = [0, *np.clip(cuts, 1, N - 1).tolist(), N]
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            n = b - a
            if n < 1 or n > self.max_adapters:
                return None
            mem_cap = mem_caps[int(ranks[a])]
            if self.verify_s > 0:
                r = self._verified(wl, ctx, oracle, seg, order, a, n, mem_cap)
            elif n > SURROGATE_MAX_ADAPTERS:
                return None
            else:
                r = self._best(oracle, seg, a, n, min(mem_cap, SURROGATE_MAX_ADAPTERS))
            if not r[0]:
                return None
            parts.append((a, n, r[1], r[2], r[3]))
        notes.append(f"balanced: the order re-cut into {K} parts of equal load and adapter count")
        return parts

    @staticmethod
    def _largest(test, nmax: int):
        """(n, test(n)) for the largest n in 1..nmax that passes, assuming passing is monotone
        in n (more adapters = more load); nmax is tried first.  None if even 1 fails."""
        r = test(nmax)
        if r[0]:
            return nmax, r
        lo, hi, best = 0, nmax, None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = test(mid)
            if r[0]:
                lo, best = mid, r
            else:
                hi = mid
        return (lo, best) if best is not None else None


