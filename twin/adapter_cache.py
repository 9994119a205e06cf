"""Adapter-cache eviction policies (GPU slots over the CPU cache).

The engine kernel keeps, per adapter, a resident flag and a stamp, and evicts the resident adapter
with the smallest stamp.  A policy is defined by *when the stamp is refreshed*: LRU (vLLM's
``LRUCacheWorkerLoRAManager``) refreshes it at every use, FIFO only when the adapter is loaded.
New policies subclass :class:`AdapterCachePolicy`, get a kernel code, and are covered by the
contract tests in ``tests/test_adapter_cache.py``.
"""
from __future__ import annotations

from twin.engine import POLICY_FIFO, POLICY_LRU


class AdapterCachePolicy:
    """Base class: a name, the kernel code, and a pure-Python reference of the eviction rule."""

    name: str = ""
    code: int = -1
    refresh_on_hit: bool = True

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

    name, code, refresh_on_hit = "lru", POLICY_LRU, True


class FIFO(AdapterCachePolicy):
    """Evict the adapter loaded longest ago, whatever its use since."""

    name, code, refresh_on_hit = "fifo", POLICY_FIFO, False


POLICIES: dict[str, AdapterCachePolicy] = {p.name: p for p in (LRU(), FIFO())}
