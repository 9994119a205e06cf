"""The papers' distributed setting from a request trace: requests spread uniformly over N adapters,
per-adapter rates estimated on the first part of the trace, the rest replayed.

The 2023 Azure traces bundled here (``azure-conv``: 19,366 requests, ``azure-code``: 8,819) are one
hour each, so the split is within the hour: the first ``estimate_fraction`` (default half) gives
each adapter's rate (its requests / that window), the placement is computed from those rates, and
the remaining part is replayed on the twin.  Load is scaled by compressing time (default: the
trace's bursts and its drift between the halves are kept -- azure-code's first half carries 1.55x
the requests of its second -- and the windows shrink: at 8x, 225 s to estimate, 225 s to replay;
``lora_opt.placement.evaluate`` judges starvation with a grace period so requests still in flight at the
window's end do not count against a GPU) or by superposing cyclically shifted copies (windows stay
30 minutes; the halves then differ at random, by up to ~20 % at 3-4 copies).  Request
lengths follow the ShareGPT model the surrogates were trained on (the papers did the same with
their Azure 2025 trace); ``lengths='trace'`` uses the trace's own token counts instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lora_opt.placement.plan import Adapter
from lora_opt.placement.workload_file import EvaluationConfig, PlacementEngine, Workload
from twin.errors import ScenarioError
from twin.flags import resolve_flags
from twin.profile import load_profile
from twin.scenario import DEFAULT_RHO, ArrivalConfig, LengthConfig, build_scenario
from twin.workload import Requests, draw_lengths, fit_context, load_trace


@dataclass
class TraceSplit:
    """A workload whose rates were estimated on one window and the requests of the next."""

    workload: Workload
    replay: Requests
    """Requests after the estimation window, times shifted so the replay starts at 0."""
    history: Requests
    """Requests of the estimation window (what the rates were estimated from)."""
    history_s: float
    """Length of the estimation window (s)."""
    duration_s: float
    """Length of the replay window (s)."""
    info: dict = field(default_factory=dict)


SCALINGS = ("superpose", "compress")


def scaled_arrivals(t: np.ndarray, span: float, factor: float, scaling: str, rng: np.random.Generator):
    """Arrival times (and the trace row of each) for ``factor`` x the trace's load.

    ``superpose``: ceil(factor) copies of the trace, each cyclically shifted by a seeded random
    offset within the span, the last one thinned to the fractional part; the window stays the
    trace's span, so replay windows stay long (end effects ~0.5 % of a 30-min window), while bursts
    of different copies no longer line up (relative burstiness falls like 1/sqrt(copies)).
    ``compress``: time divided by ``factor``: bursts kept exactly, windows shortened.
    """
    if scaling == "compress":
        # the window ends just after the last request so that every arrival is < its end
        return t / factor, np.arange(t.size), float(np.nextafter(span / factor, np.inf))
    if scaling != "superpose":
        raise ScenarioError(f"scaling: {scaling!r} is not allowed; allowed values: {', '.join(SCALINGS)}")
    copies = int(np.ceil(factor - 1e-12))
    times, rows = [], []
    for c in range(copies):
        keep = np.ones(t.size, bool)
        frac = factor - c
        if frac < 1.0:
            keep = rng.random(t.size) < frac
        shift = 0.0 if c == 0 else rng.uniform(0.0, span)
        times.append(np.mod(t[keep] + shift, span))
        rows.append(np.flatnonzero(keep))
    return np.concatenate(times), np.concatenate(rows), span


def trace_split(trace: str, *, profile: str, n_adapters: int, ranks, target_rate: float, seed: int = 0,
                estimate_fraction: float = 0.5, lengths: str = "sharegpt", rho: float = DEFAULT_RHO,
                scaling: str = "compress", max_model_len: int | None = None) -> TraceSplit:
    """Spread ``trace``'s requests uniformly over ``n_adapters`` adapters (ranks drawn uniformly from
    ``ranks``), scale it to average ``target_rate`` req/s (``scaled_arrivals``), estimate rates on
    the first ``estimate_fraction`` of it and return the rest for replay."""
    if not 0 < estimate_fraction < 1:
        raise ScenarioError(f"estimate_fraction: must be in (0, 1), got {estimate_fraction}")
    if target_rate <= 0 or n_adapters < 1:
        raise ScenarioError("target_rate must be > 0 and n_adapters >= 1")
    tr = load_trace(trace)
    t = tr["t"].to_numpy()
    span = float(t.max()) or 1.0
    base_rate = len(t) / span
    factor = target_rate / base_rate
    ss = np.random.SeedSequence([seed, 11])
    rng_rank, rng_scale, rng_map, rng_len = (np.random.default_rng(x) for x in ss.spawn(4))
    rk = rng_rank.choice(np.asarray(ranks), n_adapters)
    arr, rows, T = scaled_arrivals(t, span, factor, scaling, rng_scale)
    order = np.argsort(arr, kind="stable")
    arr, rows = arr[order], rows[order]
    adapter = rng_map.integers(0, n_adapters, arr.size)
    sc = build_scenario(profile, [{"count": 1, "rank": 8, "rate": 1.0}],
                        lengths={"source": lengths if lengths != "trace" else "sharegpt"}, seed=seed,
                        where="trace split")
    engine = PlacementEngine(max_model_len=max_model_len)
    prof = load_profile(profile)
    mml = resolve_flags(engine, prof.flag_defaults(), prof.flag_rules()).max_model_len
    if lengths == "trace":
        i_len, o_len = fit_context(tr["in_len"].to_numpy()[rows], tr["out_len"].to_numpy()[rows], mml)
    else:
        i_len, o_len = draw_lengths(sc, rng_len, arr.size, mml)
    req = Requests(arrival=np.ascontiguousarray(arr, np.float64), adapter=adapter.astype(np.int32),
                   in_len=np.asarray(i_len, np.int32), out_len=np.asarray(o_len, np.int32))
    t_split = estimate_fraction * T
    first = req.arrival < t_split
    counts = np.bincount(req.adapter[first], minlength=n_adapters)
    rates = counts / t_split
    later = ~first
    replay = Requests(arrival=np.ascontiguousarray(req.arrival[later] - t_split), adapter=req.adapter[later],
                      in_len=req.in_len[later], out_len=req.out_len[later])
    history = Requests(arrival=np.ascontiguousarray(req.arrival[first]), adapter=req.adapter[first],
                       in_len=req.in_len[first], out_len=req.out_len[first])
    adapters = tuple(Adapter(f"a{i}", int(r), float(q)) for i, (r, q) in enumerate(zip(rk, rates)))
    # for `lora-opt evaluate` without these requests: Poisson at the estimated rates
    ev = EvaluationConfig(arrivals=ArrivalConfig(process="poisson"), lengths=LengthConfig(
        source=lengths if lengths != "trace" else "sharegpt"), duration_s=T - t_split, seed=seed)
    info = {"trace": trace, "trace_requests": int(len(t)), "trace_span_s": span, "trace_rate": base_rate,
            "target_rate": target_rate, "scaling": scaling, "load_factor": factor,
            "estimate_window_s": t_split, "replay_window_s": T - t_split,
            "estimated_total_rate": float(rates.sum()), "replay_rate": float(later.sum() / (T - t_split)),
            "adapters_without_requests": int((counts == 0).sum()), "ranks": sorted({int(r) for r in ranks}),
            "seed": seed}
    wl = Workload(profile=profile, adapters=adapters, rho=rho, evaluation=ev,
                  engine=engine,
                  name=f"{trace}-{n_adapters}x{'-'.join(map(str, info['ranks']))}-{target_rate:g}rps", meta=info)
    return TraceSplit(wl, replay, history, t_split, T - t_split, info)
