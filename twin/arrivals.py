"""Synthetic arrival processes: one function per process, one registry entry each.

Each process draws the arrival times of ONE adapter's requests at ``rate`` req/s over ``[0, T)``
from ``rng`` (the scenario's arrival stream; adapters are drawn one after another in table order,
so a process must consume the stream deterministically).  ``arrivals`` is the scenario's
``ArrivalConfig`` (the process reads its own knobs from it: ``cv``, ``window_s``, ...).

To add a process: write ``def my_process(rng, rate, T, arrivals) -> np.ndarray`` (sorted or not:
the caller sorts all requests by time), add it to ``PROCESSES``, and document its knobs on
``twin.scenario.ArrivalConfig``.  ``trace`` (replaying a request trace) is not per adapter and
lives in ``twin.workload``.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


def poisson_times(rng, rate, t0, t1):
    """A Poisson process at ``rate`` on ``[t0, t1)``: a Poisson count, then uniform times."""
    n = rng.poisson(rate * (t1 - t0))
    return np.sort(rng.uniform(t0, t1, n))


def lognormal_times(rng, rate, t0, t1, cv):
    """A renewal process with log-normal gaps of mean ``1 / rate`` and coefficient of variation ``cv``."""
    sigma2 = np.log1p(cv * cv)
    mu = np.log(1.0 / rate) - sigma2 / 2.0
    sigma = np.sqrt(sigma2)
    out, t = [], t0
    # the first gap is drawn like the others, started at a uniform phase of one mean gap
    t += rng.uniform(0, 1.0 / rate)
    while t < t1:
        m = int(rate * (t1 - t) * 1.2) + 16
        times = t + np.concatenate([[0.0], np.cumsum(rng.lognormal(mu, sigma, m))])
        out.append(times[times < t1])
        t = times[-1]
    return np.concatenate(out) if out else np.empty(0)


def poisson(rng, rate, T, arrivals):
    return poisson_times(rng, rate, 0.0, T)


def lognormal(rng, rate, T, arrivals):
    return lognormal_times(rng, rate, 0.0, T, arrivals.cv)


def nonstationary(rng, rate, T, arrivals):
    """Every ``window_s``: the rate doubles or halves (within its min/max factors) and the process
    is re-drawn between Poisson and log-normal -- bursts a stationary fit does not expect."""
    parts, r = [], rate
    w0 = 0.0
    while w0 < T:
        w1 = min(T, w0 + arrivals.window_s)
        r = r * (2.0 if rng.random() < 0.5 else 0.5)
        r = min(max(r, rate * arrivals.rate_min_factor), rate * arrivals.rate_max_factor)
        if rng.random() < 0.5:
            parts.append(poisson_times(rng, r, w0, w1))
        else:
            parts.append(lognormal_times(rng, r, w0, w1, arrivals.cv))
        w0 = w1
    return np.concatenate(parts)


#: name -> per-adapter draw; ``twin.scenario.ARRIVAL_PROCESSES`` is these names plus "trace"
PROCESSES: dict[str, Callable] = {"poisson": poisson, "lognormal": lognormal, "nonstationary": nonstationary}
