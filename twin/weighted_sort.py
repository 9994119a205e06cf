"""Sorting (value, count) pairs by value in linear time, for ``twin.simulate.weighted_stats``.

The ITL sample of a simulated hour is one (duration, count) pair per step -- 10^5..10^6 pairs --
and sorting them by value was the largest cost of a light-load run after the engine loop.  An LSD
radix sort over the IEEE bits (non-negative finite doubles order as their bits do) sorts them in
a few linear passes.  It orders ties differently from ``numpy.argsort`` (whose tie order is the
implementation's: quicksort, SIMD-dispatched by CPU), so its output is used only when every run
of equal values carries equal counts: then the sorted (value, count) sequence is unique and every
statistic computed from it is the argsort's, bit for bit.  Runs of equal values with different
counts (rare: two steps of the same duration, different numbers of requests sampling) leave the
percentiles alone (the cumulative count where the value changes is the same in any order) but
not the mean, a pairwise sum of value x count in sorted order: when every order of those counts
gives the same sum (tried while there are at most MAX_ORDERS), that is the argsort's sum too;
otherwise (and for negative, -0.0 or non-finite values, or other dtypes) it falls back to argsort."""
from __future__ import annotations

import itertools
import math

import numpy as np
from numba import njit

MAX_DIGIT_BITS = 14           # 16k buckets: counters and write heads stay in L2
#: most orders of the counts within runs of equal values tried before falling back to argsort
MAX_ORDERS = 16
#: below this many pairs argsort is as fast and the kernel's call overhead is not worth it
MIN_PAIRS = 2048


@njit(cache=True)
def _radix_sort_pairs(keys, counts):
    """(sorted keys, their counts, ok, mixed): ``keys`` are the int64 views of the values; ok False
    when a key is negative (sign bit) or non-finite; ``mixed``: start and length of each run of
    equal keys whose counts are not all equal (their order is the sort's).  Sorts
    ``key - min key`` over just the bits that range needs, in as few passes as digits of at most
    MAX_DIGIT_BITS allow."""
    n = keys.shape[0]
    lo, hi = keys[0], keys[0]
    for i in range(n):
        k = keys[i]
        if k < 0 or (k >> 52) == 0x7FF:
            return keys[:0], counts[:0], False, np.zeros((0, 2), np.int64)
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
    mixed = []
    start = 0
    for i in range(1, n + 1):
        if i == n or src_k[i] != src_k[start]:
            for j in range(start + 1, i):
                if src_c[j] != src_c[start]:
                    mixed.append((start, i - start))
                    break
            start = i
    out = np.zeros((len(mixed), 2), np.int64)
    for g in range(len(mixed)):
        out[g, 0], out[g, 1] = mixed[g]
    return src_k, src_c, True, out


def _tie_free_sum(v: np.ndarray, c: np.ndarray, mixed: np.ndarray) -> float | None:
    """``(v * c).sum()`` when it is the same for every order of the counts within the ``mixed``
    runs (then it is the argsort order's too), else None.  Tries every order while there are at
    most MAX_ORDERS of them."""
    groups = [(int(a), int(g)) for a, g in mixed]
    if math.prod(math.factorial(g) for _, g in groups) > MAX_ORDERS:
        return None
    prod = v * c
    sums = set()
    for orders in itertools.product(*(itertools.permutations(c[a:a + g]) for a, g in groups)):
        for (a, g), order in zip(groups, orders):
            prod[a:a + g] = v[a:a + g] * np.array(order, dtype=c.dtype)
        sums.add(prod.sum())
        if len(sums) > 1:
            return None
    return sums.pop()


def sorted_pairs(values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(v, c, sum): ``values`` and ``counts`` ordered by value, and ``(v * c).sum()`` -- exactly what
    ``order = np.argsort(values)``; ``v, c = values[order], counts[order]`` gives, except that the
    counts of equal values may be in another order (which changes no cumulative count at a change
    of value, so no percentile; see the module docstring for why the sum is the argsort's)."""
    if (values.dtype == np.float64 and counts.dtype == np.int64 and values.ndim == 1
            and values.shape == counts.shape and values.shape[0] >= MIN_PAIRS):
        keys, c, ok, mixed = _radix_sort_pairs(np.ascontiguousarray(values).view(np.int64),
                                               np.ascontiguousarray(counts))
        if ok:
            v = keys.view(np.float64)
            total = (v * c).sum() if mixed.shape[0] == 0 else _tie_free_sum(v, c, mixed)
            if total is not None:
                return v, c, total
    order = np.argsort(values)
    v, c = values[order], counts[order]
    return v, c, (v * c).sum()
