"""The engine kernel's pieces (Numba, ``cache=True``); ``twin.engine`` assembles them into one step.

=====================  ==========================================================================
``state``              the kernel's state object (inputs, mutable state, outputs), its constructor,
                       ``add_request`` (append a request to a live state) and ``results``
``queues``             WAITING: the global FCFS list and one FIFO per adapter; arrivals
``kv``                 KV blocks: blocks for a token count, recompute preemption
``schedule``           one step's batch: RUNNING loop, LoRA set, WAITING (admission) loop
``cost``               step time (the profile's estimators)
``record``             advancing the batch (tokens, finishes), ITL samples, time series, areas
``early_stop``         certain starvation (token cap and least-work bound)
``fast_forward``       skipping identical decode-only steps in one go
``invariants``         the per-step invariants checked by the property tests
``twin.adapter_cache``  GPU slots over the CPU cache over disk; eviction policies and their registry
=====================  ==========================================================================

Numba's cache checks only the source file of the function it caches, not the files of the
functions that function calls; a kernel split over modules could load a stale compiled kernel
after one of its modules changes.  Importing this package installs a cache locator whose source
stamp is the hash of *every* kernel module, so editing any of them recompiles all of them.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core import caching

_TWIN = Path(__file__).resolve().parent.parent
KERNEL_FILES = tuple(sorted([*map(str, Path(__file__).resolve().parent.glob("*.py")),
                             str(_TWIN / "engine.py"), str(_TWIN / "adapter_cache.py")]))


def kernel_stamp() -> str:
    """Hash of the sources of every kernel module (the cache's freshness stamp)."""
    h = hashlib.sha256()
    for path in KERNEL_FILES:
        h.update(Path(path).read_bytes())
    return h.hexdigest()


class _KernelStamp:
    """Mixin for numba's source-file locators: the stamp covers all kernel modules."""

    def get_source_stamp(self):
        return kernel_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if str(Path(py_file).resolve()) not in KERNEL_FILES:
            return None
        return super().from_function(py_func, py_file)


class _KernelUserProvidedLocator(_KernelStamp, caching.UserProvidedCacheLocator):
    """``NUMBA_CACHE_DIR`` set."""


class _KernelInTreeLocator(_KernelStamp, caching.InTreeCacheLocator):
    """``__pycache__`` next to the sources (the default)."""


def _install() -> None:
    impl = caching.CacheImpl
    if _KernelInTreeLocator not in impl._locator_classes:
        impl._locator_classes[:0] = [_KernelUserProvidedLocator, _KernelInTreeLocator]


_install()
