"""A time-free comparison of a validation run: the order in which the server and the twin gave the same
requests their first token, and the TTFT per adapter, so that a scheduling difference (who is admitted
when, which adapter waits for a LoRA slot) cannot hide in the machine's speed.  The order is judged by
Kendall's tau between the real and the twin's first-token instants of the requests both finished (1: the
same order); the per-adapter table says whether a TTFT difference is one adapter's (a rank, a slot) or
every request's (a cost paid by all)."""
from __future__ import annotations

import numpy as np


def first_token_order(real_rows: list[dict], twin_raw: dict) -> dict:
    """``real_rows``: the run's ``requests.csv`` rows (one per request, in request order, as validate wrote
    them); ``twin_raw``: one GPU's raw twin result (its ``samples``: arrivals, TTFTs of the finished
    requests).  Requests are matched by arrival time on the GPU.  (``{"requests", "kendall_tau",
    "ttft_mean_ms": {"real", "twin"}, "per_adapter": {adapter: {"requests", "real_ms", "twin_ms"}}}``)"""
    from scipy.stats import kendalltau
    s = twin_raw["samples"]
    finished = np.asarray(s["arrival_s"], float)[np.asarray(s["done"], bool)]     # ttft_ms: of these, in order
    twin_by_arrival = {round(float(a), 6): float(t) for a, t in zip(finished, s["ttft_ms"])}
    matched = []
    for r in real_rows:
        twin = twin_by_arrival.get(round(float(r["arrival_s"]), 6))
        if r["status"] == "ok" and twin is not None:
            matched.append((float(r["arrival_s"]), float(r["ttft_ms"]), twin, r["adapter"]))
    if len(matched) < 2:
        return {"requests": len(matched), "kendall_tau": float("nan"), "ttft_mean_ms": {}, "per_adapter": {}}
    a, real, twin = (np.array([m[i] for m in matched]) for i in range(3))
    adapters = [m[3] for m in matched]
    per = {}
    for name in sorted(set(adapters)):
        sel = np.array([x == name for x in adapters])
        per[name] = {"requests": int(sel.sum()), "real_ms": float(real[sel].mean()), "twin_ms": float(twin[sel].mean())}
    return {"requests": len(matched), "kendall_tau": float(kendalltau(a + real / 1e3, a + twin / 1e3).statistic),
            "ttft_mean_ms": {"real": float(real.mean()), "twin": float(twin.mean())}, "per_adapter": per}
