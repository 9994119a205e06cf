"""What a validation run measured, in two shapes:

* per request, as ``vllm bench serve`` computes it (``vllm/benchmarks/serve.py``,
  ``calculate_metrics``): a request succeeded when it got a 2xx status and at least one content
  chunk (here also: the stream ended with ``data: [DONE]``; a broken stream is a failure);
  TTFT = first content chunk - send; ITL = gaps between consecutive content chunks; e2e = last
  chunk - send; TPOT = (e2e - TTFT) / (output tokens - 1) for more than one output token (the
  usage chunk's count, else the chunks); failed requests are counted and left out of every
  latency statistic.  Requests still running at the end of the window are ``unfinished``.
* per GPU, in the dict shape the twin's results have (``lora_opt.placement.evaluate``), with
  the twin's definitions (tokens of requests finished by T / T; TTFT of those; every gap of a
  content chunk by T), so ``evaluation_from_results`` builds the evaluate schema of the real run.

Times are simulated seconds: wall seconds x ``speed`` (1 against a real vLLM)."""
from __future__ import annotations

import math

import numpy as np

from lora_opt.emulate.client import NOT_SENT, Record
from twin.admission import Admission
from twin.simulate import weighted_stats

#: the per-request CSV's columns
REQUEST_COLUMNS = ("request", "gpu", "endpoint", "adapter", "arrival_s", "sent_s", "input_tokens", "output_tokens",
                   "admission", "output_tokens_admitted", "output_tokens_received", "status", "http_status", "error", "ttft_ms", "itl_mean_ms", "tpot_ms",
                   "e2e_ms", "chunks")


def outcome(r: Record) -> str:
    """``ok``, ``failed``, ``unfinished`` (still running at the window's end) or ``not_sent``
    (Ctrl-C came first)."""
    if r.error == "unfinished":
        return "unfinished"
    if r.error == NOT_SENT:
        return "not_sent"
    if r.error or not 200 <= r.status < 300 or not r.token_times or not r.done_marker:
        return "failed"
    return "ok"


def failure_reason(r: Record) -> str:
    if r.error:
        return r.error
    if not 200 <= r.status < 300:
        return f"HTTP {r.status}"
    if not r.token_times:
        return "no content chunk (vllm bench serve: never received a valid chunk)"
    if not r.done_marker:
        return "broken stream (ended before data: [DONE])"
    return ""


def request_rows(records: list[Record], req, target: np.ndarray, urls: list[str], models: list[str],
                 speed: float, admission: Admission | None = None) -> list[dict]:
    """One row per request (``REQUEST_COLUMNS``), latencies in simulated ms; ``admission``: what
    the endpoints were expected to do with each request's lengths (``admitted``, ``clamped`` to
    ``output_tokens_admitted``, ``refused``; :mod:`twin.admission`)."""
    rows = []
    for k, r in enumerate(records):
        verdict = ("admitted" if admission is None else "refused" if admission.refused[k] else
                   "clamped" if admission.clamped[k] else "admitted")
        admitted_out = r.out_len if admission is None or admission.refused[k] else int(admission.out_len[k])
        st = outcome(r)
        t = np.asarray(r.token_times, float) * speed
        sent = r.sent * speed
        n_out = r.usage_tokens or len(r.token_times)
        ok = st == "ok"
        ttft = (t[0] - sent) * 1000 if ok else math.nan
        e2e = (t[-1] - sent) * 1000 if ok else math.nan
        g = int(target[k])
        rows.append({
            "request": k, "gpu": g, "endpoint": urls[g] if g >= 0 else "", "adapter": models[int(req.adapter[k])],
            "arrival_s": float(req.arrival[k]), "sent_s": sent, "input_tokens": r.in_len, "output_tokens": r.out_len,
            "admission": verdict, "output_tokens_admitted": admitted_out, "output_tokens_received": n_out, "status": st, "http_status": r.status,
            "error": failure_reason(r) if st == "failed" else "", "ttft_ms": ttft,
            "itl_mean_ms": float(np.diff(t).mean() * 1000) if ok and len(t) > 1 else math.nan,
            "tpot_ms": (e2e - ttft) / (n_out - 1) if ok and n_out > 1 else math.nan, "e2e_ms": e2e,
            "chunks": len(r.token_times)})
    return rows


def _stats_ms(values: list) -> dict:
    v = np.asarray(values, float)
    if v.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    return {"mean": float(v.mean()), "median": float(np.median(v)), "std": float(v.std()),
            "p99": float(np.percentile(v, 99))}


def bench_summary(records: list[Record], rows: list[dict], speed: float, duration_s: float) -> dict:
    """The result dict ``vllm bench serve --save-result`` writes (its field names), from the
    successful requests; ``duration`` = first send to last chunk (simulated s)."""
    ok = [(r, row) for r, row in zip(records, rows) if row["status"] == "ok"]
    ttfts = [row["ttft_ms"] for _, row in ok]
    e2es = [row["e2e_ms"] for _, row in ok]
    tpots = [row["tpot_ms"] for _, row in ok if row["output_tokens_received"] > 1]
    itls = [g for r, _ in ok for g in (np.diff(np.asarray(r.token_times) * speed) * 1000).tolist()]
    sent = [row["sent_s"] for row in rows if row["http_status"] or row["status"] != "failed"]
    ends = [row["sent_s"] + row["e2e_ms"] / 1000 for _, row in ok]
    dur = (max(ends) - min(sent)) if ends and sent else duration_s
    dur = dur if dur > 0 else duration_s
    total_in = sum(row["input_tokens"] for _, row in ok)
    total_out = sum(row["output_tokens_received"] for _, row in ok)
    out = {"duration": dur, "completed": len(ok), "failed": sum(row["status"] == "failed" for row in rows),
           "unfinished": sum(row["status"] == "unfinished" for row in rows),
           "not_sent": sum(row["status"] == "not_sent" for row in rows),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / dur, "request_goodput": None, "output_throughput": total_out / dur,
           "total_token_throughput": (total_in + total_out) / dur}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        s = _stats_ms(values)
        out.update({f"mean_{name}_ms": s["mean"], f"median_{name}_ms": s["median"], f"std_{name}_ms": s["std"],
                    f"p99_{name}_ms": s["p99"]})
    return out


def gpu_result(g: int, records: list[Record], req, sel: np.ndarray, speed: float, T: float,
               preemptions: int = 0, rho: float = 0.9) -> dict:
    """GPU ``g``'s measured result in the twin's result-dict shape (``sel``: its requests)."""
    arrival = req.arrival[sel]
    tokens = (req.in_len[sel].astype(np.int64) + req.out_len[sel])
    done = np.zeros(len(sel), bool)
    ttft, gaps = [], []
    for j, k in enumerate(sel):
        r = records[k]
        if outcome(r) != "ok":
            if outcome(r) == "unfinished" and r.token_times:      # its tokens by T still count as ITL
                t = np.asarray(r.token_times) * speed
                gaps.append(np.diff(t[t <= T]))
            continue
        t = np.asarray(r.token_times) * speed
        if t[-1] <= T:
            done[j] = True
            ttft.append((t[0] - r.sent * speed) * 1000)
        gaps.append(np.diff(t[t <= T]))
    itl = np.concatenate(gaps) * 1000 if gaps else np.zeros(0)
    ttft_a = np.asarray(ttft, float)
    in_done = int(req.in_len[sel][done].sum())
    out_done = int(req.out_len[sel][done].sum())
    thr = (in_done + out_done) / T
    incoming = float(tokens.sum()) / T
    failed = sum(outcome(records[k]) == "failed" for k in sel)
    reachable = not len(sel) or failed < len(sel) or any(records[k].status for k in sel)
    return {
        "gpu": g, "status": "ok" if reachable else "unreachable", "oom_reason": "" if reachable else
        failure_reason(records[sel[0]]), "arrived": int(len(sel)), "completed": int(done.sum()),
        "failed": int(failed), "duration_s": T, "total_input_tokens": in_done, "total_output_tokens": out_done,
        "throughput_tok_s": thr, "incoming_token_rate": incoming, "starving": bool(thr < rho * incoming),
        "ttft_ms": weighted_stats(ttft_a, np.ones(len(ttft_a), np.int64)),
        "itl_ms": weighted_stats(itl, np.ones(len(itl), np.int64)), "preemptions": int(preemptions),
        "adapter_loads_cpu": None, "kv_cache_tokens": None,
        "samples": {"ttft_ms": ttft_a, "itl_ms": itl, "itl_count": np.ones(len(itl), np.int64),
                    "arrival_s": arrival, "tokens": tokens, "done": done}}
