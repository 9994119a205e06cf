"""Numba's cache for the engine kernel, kept fresh across its modules.

Numba's cache checks only the source file of the function it caches, not the files of the
functions that function calls: the kernel, split over ``twin/engine*.py`` and
``twin/adapter_cache.py`` (and the cost rules it compiles from ``twin/profile.py``, its ``Config``'s
flags from ``twin/flags.py``), could load a stale compiled ``run_engine`` after an edit to one of its
callees.  Importing this module installs a cache locator whose source stamp is the hash of *every*
kernel module, so an edit to any of them recompiles all of them.  Every kernel module imports it
before its first ``@njit(cache=True)``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core import caching

_TWIN = Path(__file__).resolve().parent
# profile.py: the step-cost rules the kernel compiles from it (lora_prefill_share, lora_token_cost, lora_extra);
# flags.py: the engine flags of the kernel's Config (KERNEL_FLAGS)
KERNEL_FILES = tuple(sorted([*map(str, _TWIN.glob("engine*.py")), str(_TWIN / "adapter_cache.py"),
                             str(_TWIN / "profile.py"), str(_TWIN / "flags.py")]))


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
    locators = caching.CacheImpl._locator_classes
    if _KernelInTreeLocator not in locators:
        locators[:0] = [_KernelUserProvidedLocator, _KernelInTreeLocator]


_install()
