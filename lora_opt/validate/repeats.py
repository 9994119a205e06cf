"""The server measured against itself: ``validate --repeats K`` replays the same requests K times and
judges the twin against the server's own spread.

A noisy machine is a fact to measure.  For each GPU and metric the K real values give the server's
**real-vs-real spread** -- the median over pairs of repeats of their SMAPE (:func:`lora_opt.smape.smape`),
and the min-max -- and the twin is compared with the **median** of the real values.  The one rule for
the verdict used wherever a fidelity verdict is printed:

    within the server's noise  <=>  SMAPE(twin, real median) <= NOISE_FACTOR x median real-vs-real SMAPE

(``NOISE_FACTOR`` = 1.25: the twin may be a quarter further from the real median than two real runs are
from each other.)  A metric the server reproduces exactly (real-vs-real 0) leaves no room: the twin must
match it.  Between repeats the endpoints are drained (no running or waiting request, read on /metrics);
a restart between repeats -- a fresh server state, adapters unloaded -- is the launcher's job
(``experiments/real_validation/cpu_loop.py`` restarts the real server per run).
"""
from __future__ import annotations

import itertools
import math
import time

import numpy as np

from lora_opt.smape import smape
from lora_opt.validate.live import SCRAPED, parse_scrape

#: the twin is within the server's noise when its SMAPE to the real median is at most this x the
#: median SMAPE between two real repeats
NOISE_FACTOR = 1.25
#: the fewest repeats that show a spread
MIN_REPEATS = 2


def _pairwise(values: list[float]) -> list[float]:
    return [smape([a], [b]) for a, b in itertools.combinations(values, 2)
            if math.isfinite(a) and math.isfinite(b)]


def verdict(twin_smape: float, real_vs_real: float) -> bool | None:
    """The rule: within the server's noise (None when either number is missing)."""
    if not (math.isfinite(twin_smape) and math.isfinite(real_vs_real)):
        return None
    return twin_smape <= NOISE_FACTOR * real_vs_real + 1e-9


def noise_table(comparisons: list[dict]) -> dict:
    """Per metric (over the GPUs every repeat measured) and per GPU: the real values of each repeat,
    their median, the real-vs-real spread, the twin's SMAPE to the real median and the verdict.
    ``comparisons``: each repeat's ``comparison`` (``lora_opt.validate.report.compare``'s dict)."""
    if len(comparisons) < MIN_REPEATS:
        raise ValueError(f"noise_table: {len(comparisons)} repeat(s); at least {MIN_REPEATS} show a spread")
    gpus = sorted(set.intersection(*(set(c["real"]) for c in comparisons)), key=int)
    metrics = list(comparisons[0]["real"][gpus[0]]) if gpus else []
    per_gpu: dict = {}
    per_metric: dict = {}
    for m in metrics:
        reals, twins, medians = [], [], []
        for g in gpus:
            vals = [float(c["real"][g][m]) for c in comparisons]
            twin = float(np.nanmedian([float(c["twin"][g][m]) for c in comparisons]))
            finite = [v for v in vals if math.isfinite(v)]
            med = float(np.median(finite)) if finite else math.nan
            pairs = _pairwise(vals)
            rvr = float(np.median(pairs)) if pairs else math.nan
            tvr = smape([twin], [med])
            per_gpu.setdefault(g, {})[m] = {"real": vals, "real_median": med, "real_min": min(finite, default=math.nan),
                                            "real_max": max(finite, default=math.nan), "real_vs_real_smape": rvr,
                                            "twin": twin, "twin_vs_real_smape": tvr, "within_noise": verdict(tvr, rvr)}
            reals.append(vals)
            twins.append(twin)
            medians.append(med)
        # over the GPUs, as validate's smape_per_metric: real repeats against each other, the twin against the medians
        pairs = [smape([r[i] for r in reals], [r[j] for r in reals])
                 for i, j in itertools.combinations(range(len(comparisons)), 2)]
        pairs = [p for p in pairs if math.isfinite(p)]
        rvr = float(np.median(pairs)) if pairs else math.nan
        tvr = smape(twins, medians)
        per_metric[m] = {"real_vs_real_smape": rvr, "real_vs_real_min": min(pairs, default=math.nan),
                         "real_vs_real_max": max(pairs, default=math.nan), "twin_vs_real_median_smape": tvr,
                         "within_noise": verdict(tvr, rvr)}
    return {"repeats": len(comparisons), "noise_factor": NOISE_FACTOR, "gpus": gpus, "per_metric": per_metric,
            "per_gpu": per_gpu}


def noise_lines(table: dict) -> list[str]:
    """The per-metric table as text: real-vs-real beside twin-vs-real and the verdict."""
    lines = [f"{'metric':<18} {'real vs real %':>15} {'(min-max)':>15} {'twin vs real median %':>22} {'verdict':>22}"]
    for m, e in table["per_metric"].items():
        v = e["within_noise"]
        word = "-" if v is None else ("within the noise" if v else "outside the noise")
        span = f"({e['real_vs_real_min']:.1f}-{e['real_vs_real_max']:.1f})"
        lines.append(f"{m:<18} {e['real_vs_real_smape']:>15.1f} {span:>15} "
                     f"{e['twin_vs_real_median_smape']:>22.1f} {word:>22}")
    return lines


def wait_idle(urls: dict[int, str], timeout_s: float = 600.0, poll_s: float = 0.5) -> bool:
    """Wait until no endpoint has a running or waiting request (read on /metrics); False on timeout."""
    import httpx  # only when repeats are run

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            busy = 0.0
            for url in urls.values():
                base = url.rstrip("/").removesuffix("/v1")
                try:
                    r = client.get(base + "/metrics")
                except httpx.HTTPError:
                    continue
                lines = [ln for ln in r.content.split(b"\n") if ln.startswith(SCRAPED)]
                v = parse_scrape(lines)
                busy += v["running"] + v["waiting"]
            if busy == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
