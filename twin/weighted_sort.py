"""Sorting (value, count) pairs by value in linear time, for ``twin.simulate.weighted_stats``.

The ITL sample of a simulated hour is one (duration, count) pair per step -- 10^5..10^6 pairs --
and sorting them by value was the largest cost of a light-load run after the engine loop.  An LSD
radix sort over the IEEE bits (non-negative finite doubles order as their bits do) sorts them in
a few linear passes.  It orders ties differently from ``numpy.argsort`` (whose tie order is the
implementation's: quicksort, SIMD-dispatched by CPU), so its output is used only when every run
of equal values carries equal counts: then the sorted (value, count) sequence is unique and every
statistic computed from it is the argsort's, bit for bit.  Otherwise (and for negative, -0.0 or
non-finite values, or other dtypes) the caller falls back to argsort."""
from __future__ import annotations

import numpy as np
from numba import njit

MAX_DIGIT_BITS = 14           # 16k buckets: counters and write heads stay in L2
#: below this many pairs argsort is as fast and the kernel's call overhead is not worth it
MIN_PAIRS = 2048


@njit(cache=True)
def _radix_sort_pairs(keys, counts):
    """(sorted keys, their counts, ok): ``keys`` are the int64 views of the values; ok False when
    a key is negative (sign bit) or non-finite, or equal keys carry different counts.  Sorts
    ``key - min key`` over just the bits that range needs, in as few passes as digits of at most
    MAX_DIGIT_BITS allow."""
    n = keys.shape[0]
    lo, hi = keys[0], keys[0]
    for i in range(n):
        k = keys[i]
        if k < 0 or (k >> 52) == 0x7FF:
            return keys[:0], counts[:0], False
        lo = min(lo, k)
        hi = max(hi, k)
    bits = 0
    while (hi - lo) >> bits:
        bits += 1
    passes = max(1, (bits + MAX_DIGIT_BITS - 1) // MAX_DIGIT_BITS)
    digit = max(1, (bits + passes - 1) // passes)
    nb = 1 << digit
    mask = nb - 1
    hist = np.zeros((passes, nb), np.int64)
    for i in range(n):
        k = keys[i] - lo
        for p in range(passes):
            hist[p, (k >> (p * digit)) & mask] += 1
    src_k, src_c = keys, counts
    dst_k, dst_c = np.empty_like(keys), np.empty_like(counts)
    offset = np.empty(nb, np.int64)
    copied = False
    for p in range(passes):
        h = hist[p]
        if h.max() == n:                 # every key has the same digit here: nothing to do
            continue
        acc = 0
        for b in range(nb):
            offset[b] = acc
            acc += h[b]
        shift = p * digit
        for i in range(n):
            k = src_k[i]
            b = ((k - lo) >> shift) & mask
            j = offset[b]
            dst_k[j] = k
            dst_c[j] = src_c[i]
            offset[b] = j + 1
        if not copied:                   # never write into the caller's arrays
            src_k, src_c = dst_k, dst_c
            dst_k, dst_c = np.empty_like(keys), np.empty_like(counts)
            copied = True
        else:
            src_k, src_c, dst_k, dst_c = dst_k, dst_c, src_k, src_c
    for i in range(1, n):
        if src_k[i] == src_k[i - 1] and src_c[i] != src_c[i - 1]:
            return keys[:0], counts[:0], False
    return src_k, src_c, True


def sorted_pairs(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` and ``counts`` ordered by value -- exactly ``values[order], counts[order]`` for
    ``order = np.argsort(values)`` (see the module docstring for why the radix result is)."""
    if (values.dtype == np.float64 and counts.dtype == np.int64 and values.ndim == 1
            and values.shape == counts.shape and values.shape[0] >= MIN_PAIRS):
        keys, c, ok = _radix_sort_pairs(np.ascontiguousarray(values).view(np.int64), np.ascontiguousarray(counts))
        if ok:
            return keys.view(np.float64), c
    order = np.argsort(values)
    return values[order], counts[order]
