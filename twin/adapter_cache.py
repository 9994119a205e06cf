"""The adapter cache: GPU slots (``max_loras``) over a CPU cache (``max_cpu_loras``) over disk, and
its eviction policies.

Each tier keeps, per adapter, a resident flag, the clock at its load and the clock at its last use
(the clock ticks once per distinct adapter of each step's batch).  A miss in a full tier evicts the
adapter its policy's ``victim(resident, loaded_at, used_at)`` chooses; evicting from the CPU cache
also frees the adapter's GPU slot.

**Adding a policy** = one small njit ``victim`` function and one :class:`AdapterCachePolicy`
subclass in :data:`POLICIES` below (``name`` for the scenario file, ``victim``, and a pure-Python
reference ``simulate`` -- the base class's is right whenever the victim is the smallest of one
stamp that a hit refreshes or not).  The kernel reaches the victim function through
:func:`evict_victim`, an if-chain on the policy's code generated from the registry, so nothing
else in the kernel changes; the contract tests in ``tests/test_adapter_cache.py`` run every
registered policy.  (Scenario files are validated against ``twin.scenario.ADAPTER_CACHE_POLICIES``,
which is derived from :data:`POLICIES`: nothing else to edit.)
"""
from __future__ import annotations

import numpy as np
from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))


@njit(cache=True)
def _oldest(resident, stamp):
    """The resident adapter with the smallest stamp."""
    best = -1
    best_stamp = np.int64(2**62)
    for a in range(resident.shape[0]):
        if resident[a] and stamp[a] < best_stamp:
            best_stamp = stamp[a]
            best = a
    return best


@njit(cache=True)
def lru_victim(resident, loaded_at, used_at):
    """Least recently used (vLLM's ``LRUCacheWorkerLoRAManager``)."""
    return _oldest(resident, used_at)


@njit(cache=True)
def fifo_victim(resident, loaded_at, used_at):
    """Loaded longest ago, whatever its use since."""
    return _oldest(resident, loaded_at)


class AdapterCachePolicy:
    """A name, the kernel's ``victim`` function, and a pure-Python reference of the policy."""

    name: str = ""
    victim = None
    refresh_on_hit: bool = True
    """Reference only: whether a hit refreshes the stamp the victim is the smallest of."""
    code: int = -1
    """Set by the registry: the policy's index, what the kernel receives."""

    def simulate(self, capacity: int, uses: list[int]) -> tuple[list[int], int]:
        """Reference implementation: (resident adapters after ``uses``, number of loads)."""
        stamp: dict[int, int] = {}
        loads = 0
        for clock, a in enumerate(uses, start=1):
            if a in stamp:
                if self.refresh_on_hit:
                    stamp[a] = clock
                continue
            loads += 1
            if len(stamp) >= capacity:
                victim = min(stamp, key=stamp.__getitem__)
                del stamp[victim]
            stamp[a] = clock
        return sorted(stamp), loads


class LRU(AdapterCachePolicy):
    """Evict the least recently used adapter (vLLM)."""

    name, victim, refresh_on_hit = "lru", staticmethod(lru_victim), True


class FIFO(AdapterCachePolicy):
    """Evict the adapter loaded longest ago, whatever its use since."""

    name, victim, refresh_on_hit = "fifo", staticmethod(fifo_victim), False


def _registry(*policies: AdapterCachePolicy) -> dict[str, AdapterCachePolicy]:
    for code, p in enumerate(policies):
        p.code = code
    return {p.name: p for p in policies}


POLICIES: dict[str, AdapterCachePolicy] = _registry(LRU(), FIFO())
"""Every policy, by name (the scenario's ``engine.adapter_cache_policy``)."""


def _dispatch(policies):
    """``f(code, resident, loaded_at, used_at)`` calling the victim function of policy ``code``:
    an if-chain built from the registry (Numba inlines it; no function pointers)."""
    if not policies:
        @njit(inline="always")
        def unknown(code, resident, loaded_at, used_at):
            raise ValueError("unknown adapter-cache policy code")
        return unknown
    code, victim, rest = policies[0].code, policies[0].victim, _dispatch(policies[1:])

    @njit(inline="always")
    def pick(code_, resident, loaded_at, used_at):
        if code_ == code:
            return victim(resident, loaded_at, used_at)
        return rest(code_, resident, loaded_at, used_at)
    return pick


evict_victim = _dispatch(list(POLICIES.values()))


@njit(cache=True)
def _insert(res, loaded, used, n, cap, a, clock, policy):
    """Load ``a`` into a tier holding ``n`` of ``cap``; returns (new count, evicted adapter or -1)."""
    v = -1
    if n >= cap:
        v = evict_victim(policy, res, loaded, used)
        res[v] = 0
        n -= 1
    res[a] = 1
    loaded[a] = clock
    used[a] = clock
    return n + 1, v


@njit(cache=True)
def use_adapter(s, a):
    """Make adapter ``a`` resident in a GPU slot for this step, adding its load time to
    ``s.load_ms``: disk to CPU on a CPU miss, CPU to GPU on a GPU miss."""
    s.clock += 1
    policy = s.cfg.cache_policy
    if not s.cpu_res[a]:
        s.load_ms += s.disk_load_ms[a]
        s.loads_disk += 1
        s.n_cpu, v = _insert(s.cpu_res, s.cpu_loaded, s.cpu_used, s.n_cpu, s.cfg.max_cpu_loras, a, s.clock, policy)
        if v >= 0 and s.gpu_res[v]:         # evicting from CPU also deactivates the GPU slot
            s.gpu_res[v] = 0
            s.n_gpu -= 1
    else:
        s.cpu_used[a] = s.clock
    if not s.gpu_res[a]:
        s.load_ms += s.cpu_load_ms[a]
        s.loads_cpu += 1
        s.n_gpu, _ = _insert(s.gpu_res, s.gpu_loaded, s.gpu_used, s.n_gpu, s.cfg.max_loras, a, s.clock, policy)
    else:
        s.gpu_used[a] = s.clock


@njit(cache=True)
def load_batch_adapters(s):
    """Adapters of the batch are made resident (misses charged at step start): sets ``s.load_ms``
    and ``s.n_distinct`` (distinct adapters in the batch)."""
    batch, req_adapter, seen, step = s.batch, s.req_adapter, s.batch_stamp, s.step
    s.load_ms = 0.0
    n_distinct = 0
    for j in range(s.n_batch):
        a = req_adapter[np.uint32(batch[j])]      # unsigned: see engine_schedule.schedule_running
        if seen[a] != step:
            seen[a] = step
            n_distinct += 1
            use_adapter(s, a)
    s.n_distinct = n_distinct
