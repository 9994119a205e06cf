"""``simulate(scenario) -> Result``: requests, start-up memory check, engine loop, metrics.

Metric definitions follow vLLM's ``benchmark_serving`` as used for the real runs: tokens and
latencies of requests completed within ``duration_s``; throughput = (input + output tokens of
completed requests) / duration; TTFT = first token - arrival; TPOT = (finish - first token) /
(output - 1) for requests with more than one output token; ITL = every gap between consecutive
output tokens of a request (a preempted request's gap spans its recomputation).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twin.adapter_cache import POLICIES
from twin.engine import LORA_SET_RUNNING, LORA_SET_SCHEDULED, run_engine
from twin.errors import ScenarioError
from twin.flags import KERNEL_FLAGS
from twin.engine_state import Config, EarlyStop, EngineState, KernelRun, Latency, make_state
from twin.profile import Profile
from twin.scenario import EngineConfig, Scenario
from twin.weighted_sort import sorted_pairs
from twin.workload import Requests, generate_requests

RESULT_KEYS = (
    "status", "duration_s", "completed", "total_input_tokens", "total_output_tokens",
    "throughput_tok_s", "input_throughput", "output_throughput", "incoming_token_rate", "starving",
    "ttft_ms", "itl_ms", "tpot_ms", "running_mean", "waiting_mean", "preemptions",
    "adapter_loads_cpu", "adapter_loads_disk", "kv_cache_tokens", "stopped_early_s", "throughput_span_s",
)


def _stats(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": float(values.mean()), "median": float(np.median(values)),
            "p99": float(np.percentile(values, 99))}


def weighted_stats(values: np.ndarray, counts: np.ndarray) -> dict[str, float | None]:
    """mean/median/p99 of ``values`` repeated ``counts`` times, equal to numpy's (linear)
    percentile of the expanded sample without expanding it."""
    total = int(counts.sum())
    if total == 0:
        return {"mean": None, "median": None, "p99": None}
    v, c, vc_sum = sorted_pairs(values, counts)      # values[order], counts[order], (v * c).sum()
    cum = np.cumsum(c)

    def at(k: int) -> float:             # k-th smallest (0-based) of the expanded sample
        return float(v[np.searchsorted(cum, k, side="right")])

    def pct(q: float) -> float:
        pos = q / 100.0 * (total - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return at(lo) + (at(hi) - at(lo)) * (pos - lo)

    return {"mean": float(vc_sum / total), "median": pct(50), "p99": pct(99)}


@dataclass
class Result:
    """Outcome of one simulation. ``to_dict()`` gives exactly the documented JSON keys."""

    status: str
    duration_s: float
    completed: int
    total_input_tokens: int
    total_output_tokens: int
    throughput_tok_s: float
    input_throughput: float
    output_throughput: float
    incoming_token_rate: float
    starving: bool
    ttft_ms: dict
    itl_ms: dict
    tpot_ms: dict
    running_mean: float
    waiting_mean: float
    preemptions: int
    adapter_loads_cpu: int
    adapter_loads_disk: int
    kv_cache_tokens: int
    stopped_early_s: float | None
    # not part of the JSON result
    oom_reason: str = ""
    steps: int = 0
    arrived: int = 0
    dropped: int = 0
    wall_s: float = 0.0
    engine: EngineConfig | None = None
    """The flags the instance ran with, every default filled in (``Scenario.resolved_engine``)."""
    timeseries: dict[str, np.ndarray] | None = None
    samples: dict[str, np.ndarray] | None = None
    """Raw latencies, so results of several GPUs combine exactly: ``ttft_ms`` (per completed
    request), ``itl_ms`` / ``itl_count`` (inter-token gaps and how many tokens saw each), and per
    request ``arrival_s``, ``tokens`` (prompt + output) and ``done`` (completed in the window)."""

    @property
    def throughput_span_s(self) -> float:
        """The span every rate is averaged over: the whole window, ``duration_s``, also when the
        run stopped early (tokens not served by the stop count as not served, so an early-stopped
        run's throughput is a lower bound of the full run's and the starving verdict -- throughput
        < rho x incoming, both over this span -- is the full run's)."""
        return self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RESULT_KEYS}


def _initial_residency(n_ad: int, max_loras: int, max_cpu_loras: int, preloaded: np.ndarray | None = None):
    """vLLM loads ``--lora-modules`` in order at start-up, each into the CPU cache and a GPU slot,
    so the last ``max_cpu_loras`` stay in CPU and the last ``max_loras`` in GPU slots.
    ``preloaded``: the adapters (indices) given as ``--lora-modules``, in order; default all of
    them in table order (an on-demand engine of a fleet also serves adapters it did not preload)."""
    order = np.arange(n_ad) if preloaded is None else np.asarray(preloaded, np.int64)
    pos = np.arange(order.shape[0])
    gpu = np.zeros(n_ad, np.int64)
    cpu = np.zeros(n_ad, np.int64)
    gpu[order[pos >= order.shape[0] - max_loras]] = 1
    cpu[order[pos >= order.shape[0] - max_cpu_loras]] = 1
    stamp = np.zeros(n_ad, np.int64)
    stamp[order] = pos + 1
    return gpu, cpu, stamp * gpu, stamp * cpu


def max_token_rate(profile: Profile, max_num_batched_tokens: int, max_lora_rank: int, max_loras: int) -> float:
    """Sound upper bound on tokens/s the engine can process under the profile's step model:
    the cheapest full step (one adapter, all tokens in one sequence or all in decodes)."""
    lat = profile.latency
    n = max_num_batched_tokens
    cheapest = min(lat.model_ms(1, n, 0, 1, max_lora_rank, max_loras),
                   lat.model_ms(n, n, 0, 1, max_lora_rank, max_loras))
    return n / ((lat.sched_base_ms + cheapest) / 1000.0)


#: buckets of the early stop's work bound (geometric in tokens per second of least work)
WORK_BUCKETS = 128


def kernel_latency(lat, max_lora_rank: int, max_loras: int) -> Latency:
    """The kernel's step-time coefficients (``twin.engine_cost.step_seconds``) for an engine with these
    flags: the one mapping from ``LatencySpec`` to them."""
    lora = lat.lora_for_rank(max_lora_rank)
    return Latency(
        lat.base_ms, lat.per_seq_ms, lat.per_token_ms, lat.per_ctx_ktoken_ms, lora.jump_at(max_loras),
        0.0 if lora.additive else lora.slope, lora.n_sat, lora.prefill_share, lat.sched_base_ms, lat.sched_per_running_ms,
        lat.sched_per_waiting_ms, lora.prefill_knee_tokens, lora.share_above, lora.token_ms, lora.token_above,
        lora.fixed_ms_at(max_loras), lora.adapter_ms, lora.seq_ms)


def least_work_s(lat, eng: EngineConfig, in_len: np.ndarray, out_len: np.ndarray) -> np.ndarray | None:
    """Least engine time (s) any schedule spends on each request under the profile's step model,
    or None when a negative coefficient makes a lower bound from it unsafe.  Every step runs
    >= 1 adapter (LoRA factor >= the one-adapter extra e), so a request costs at least: its
    sequence slots (>= out_len: one prefill chunk, out_len - 1 decodes) and its other tokens at
    the cheaper of the per-slot and per-token prices; the context its decodes read (the k-th decode
    reads in_len + k - 1 tokens); and its share of the fixed cost of steps that carry at most
    max_num_batched_tokens tokens (LoRA's fixed ms a step among them); and the per-token LoRA cost of every
    token it puts in a step.
    Adapter loads, scheduler terms per request and preemptions only add."""
    lora = lat.lora_for_rank(eng.max_lora_rank)
    coefs = (lat.base_ms, lat.per_seq_ms, lat.per_token_ms, lat.per_ctx_ktoken_ms, lat.sched_base_ms,
             lat.sched_per_running_ms, lat.sched_per_waiting_ms, lora.jump, lora.slope, lora.prefill_share,
             lora.share_above, lora.token_ms, lora.token_above, lora.step_ms, lora.slot_ms, lora.adapter_ms, lora.seq_ms)
    if min(coefs) < 0 or not (0.0 <= lora.slot_share <= 1.0):
        return None
    e = lora.extra(1, eng.max_loras)
    slot = lat.per_seq_ms * (1.0 + e) + lora.seq_ms
    # a step's prefill tokens pay one of two shares (the knee): the smaller one bounds from below
    tok = lat.per_token_ms * (1.0 + min(lora.prefill_share, lora.share_above) * e)
    i = in_len.astype(np.float64)
    o = out_len.astype(np.float64)
    dec = o - 1.0
    processed = i + dec
    ms = (slot * o + tok * (i - 1.0)) if slot >= tok else slot * processed
    ms = ms + (1.0 + e) * lat.per_ctx_ktoken_ms / 1000.0 * (dec * i + dec * (dec - 1.0) / 2.0)
    # a step's fixed LoRA ms, and at least one adapter's
    lora_fixed = lora.fixed_ms_at(eng.max_loras) + lora.adapter_ms
    ms = ms + (lat.base_ms * (1.0 + e) + lat.sched_base_ms + lora_fixed) * processed / eng.max_num_batched_tokens
    # every token it puts in a step pays the per-token LoRA cost (the cheaper side of the knee)
    ms = ms + min(lora.token_ms, lora.token_above) * processed
    return ms / 1000.0


#: the work bound's arrays when it is not used (the engine checks for zero buckets)
NO_WORK_BOUND = (np.zeros(0, np.int32), np.zeros(0), np.zeros(0), np.zeros(0, np.int64), np.zeros(0))


def work_buckets(lat, eng: EngineConfig, in_len: np.ndarray, out_len: np.ndarray):
    """The early stop's work bound: (bucket of each request, its least work in s, per-bucket sums of
    least work and tokens, per-bucket highest tokens per second of least work), buckets in
    decreasing order of that ratio.  Empty arrays when unsafe (see least_work_s)."""
    n = in_len.shape[0]
    cost = least_work_s(lat, eng, in_len, out_len) if n else None
    if cost is None or not np.all(cost > 0):
        return (np.zeros(n, np.int32), np.zeros(n), *NO_WORK_BOUND[2:])
    tokens = (in_len + out_len).astype(np.int64)
    ratio = tokens / cost
    lo, hi = float(ratio.min()), float(ratio.max())
    if hi > lo:
        pos = np.log(hi / ratio) / np.log(hi / lo) * WORK_BUCKETS      # 0 at the best ratio
        bucket = np.minimum(pos.astype(np.int64), WORK_BUCKETS - 1)
    else:
        bucket = np.zeros(n, np.int64)
    k = int(bucket.max()) + 1
    b_cost = np.bincount(bucket, weights=cost, minlength=k)
    b_tokens = np.bincount(bucket, weights=tokens, minlength=k).round().astype(np.int64)
    b_ratio = np.zeros(k)
    np.maximum.at(b_ratio, bucket, ratio)
    return bucket.astype(np.int32), cost, b_cost, b_tokens, b_ratio


#: pre-replay early stop: certain when the chance that the realised load is low enough not to
#: starve is below e^-CERTAIN_LOG_ODDS (1e-12)
CERTAIN_LOG_ODDS = math.log(1e12)
#: the ShareGPT model's mean length is solved by sampling (twin.workload.fit_sharegpt_locations):
#: the bound uses this share of it
SHAREGPT_MEAN_SAFETY = 0.99


def _certain_without_replay(sc: Scenario, profile: Profile, eng: EngineConfig, starts: bool, grace_s: float = 0.0):
    """(expected requests, expected tokens) when the outcome is certain before any request is
    drawn, else None.  Only for ``early_stop`` scenarios with Poisson arrivals, no client cap and a
    length model of known mean and maximum whose requests fit ``max_model_len`` unshortened.  An
    OOM needs no replay at all.  A starting engine serves at most ``cap`` tokens/s (its cheapest
    full step, :func:`max_token_rate`), so it starves whenever the tokens S of the requests that
    count exceed cap x T / rho.  S is a compound-Poisson sum (N ~ Poisson(L), lengths in [1, m]
    with mean mu); for 0 < d < 1, P(S <= (1 - d) L mu) <= exp(-L d^2 mu / (2 m)) (Chernoff with
    e^-x <= 1 - x + x^2/2 and E[len^2] <= m mu).  The run is certain when that bound, at the d
    that cap x T / rho leaves, is below 1e-12.  Such a run would stop at t = 0 anyway, after
    drawing up to millions of requests.  The result reports the *expected* incoming rate and
    request count.  With a grace (see ``simulate``), the requests that count are those arriving
    before T - grace."""
    from twin.workload import SHAREGPT_TARGET_MEANS, TOTAL_MAX

    a, ln = sc.arrivals, sc.lengths
    if a.process != "poisson" or sc.client.max_inflight is not None:
        return None
    if ln.source == "sharegpt":
        mean_tokens, max_tokens = sum(SHAREGPT_TARGET_MEANS), float(TOTAL_MAX)
        bound_mean = SHAREGPT_MEAN_SAFETY * mean_tokens
    elif ln.source == "mean":
        # every request has round(mean_in) + round(mean_out) tokens (twin.workload.draw_lengths)
        mi = ln.mean_in if ln.mean_in is not None else SHAREGPT_TARGET_MEANS[0]
        mo = ln.mean_out if ln.mean_out is not None else SHAREGPT_TARGET_MEANS[1]
        mean_tokens = max_tokens = bound_mean = float(max(1, round(mi)) + max(1, round(mo)))
    else:
        return None
    _, _, rates = sc.adapter_table()
    n_req = float(sum(rates)) * sc.duration_s
    tokens = n_req * mean_tokens
    if not starts:
        return int(round(n_req)), tokens
    if max_tokens > eng.max_model_len:          # requests would be shortened: lengths unknown
        return None
    cap = max_token_rate(profile, eng.max_num_batched_tokens, eng.max_lora_rank, eng.max_loras)
    due = max(0.0, 1.0 - grace_s / sc.duration_s)       # share of the window whose requests count
    expected = n_req * due                               # L
    if expected <= 0:
        return None
    d = 1.0 - cap * sc.duration_s / sc.rho / (expected * bound_mean)
    if d > 0 and expected * d * d * bound_mean / (2.0 * max_tokens) >= CERTAIN_LOG_ODDS:
        return int(round(n_req)), tokens
    return None


def _unserved(status: str, T: float, incoming: float, starving: bool, kv_tokens, stopped_early_s, reason: str,
              arrived: int, t_wall: float, eng: EngineConfig) -> Result:
    """The result of a run in which nothing is served: an OOM at start-up, or starvation certain
    before the first step."""
    null = {"mean": None, "median": None, "p99": None}
    return Result(
        status=status, duration_s=T, completed=0, total_input_tokens=0, total_output_tokens=0,
        throughput_tok_s=0.0, input_throughput=0.0, output_throughput=0.0, incoming_token_rate=incoming,
        starving=starving, ttft_ms=null, itl_ms=null, tpot_ms=null, running_mean=0.0, waiting_mean=0.0,
        preemptions=0, adapter_loads_cpu=0, adapter_loads_disk=0, kv_cache_tokens=int(kv_tokens),
        stopped_early_s=stopped_early_s, oom_reason=reason, arrived=arrived,
        wall_s=time.perf_counter() - t_wall, engine=eng)


#: the engine's in-flight cap when the client has none (never reached)
NO_CLIENT_CAP = 2**62


def _early_stop(sc: Scenario, profile: Profile, eng: EngineConfig, req: Requests, kv_tokens: int,
                stop_grace_s: float) -> EarlyStop:
    """The kernel's early-stop inputs (target 0 = off; see ``simulate``'s ``stop_grace_s``)."""
    if not (sc.early_stop and len(req)):
        return EarlyStop(0.0, 0.0, 1.0, kv_tokens, *NO_WORK_BOUND)
    tok = req.in_len + req.out_len
    factor = float((tok / np.maximum(tok - 1, 1)).max())
    # with a grace, certain that the tokens of requests arriving before T - grace are served
    # below rho (completed tokens of all requests bound those of the early ones)
    T = sc.duration_s
    stop_target = sc.rho * (int(tok.sum()) if stop_grace_s <= 0 else
                            int(tok[req.arrival < T - stop_grace_s].sum()))
    cap = max_token_rate(profile, eng.max_num_batched_tokens, eng.max_lora_rank, eng.max_loras)
    return EarlyStop(stop_target, cap, factor, kv_tokens, *work_buckets(profile.latency, eng, req.in_len, req.out_len))


def kernel_config(sc: Scenario, profile: Profile, eng: EngineConfig, kv_tokens: int) -> Config:
    """The kernel's ``Config``: the resolved flags it reads (``twin.flags.KERNEL_FLAGS``), then the KV
    cache, the profile's engine rules and the scenario's window and client."""
    block = profile.memory.block_size
    return Config(
        *(getattr(eng, name) for name in KERNEL_FLAGS), kv_blocks=kv_tokens // block, block_size=block,
        lora_set_rule=LORA_SET_SCHEDULED if profile.lora_set_rule == "scheduled" else LORA_SET_RUNNING,
        reserve_full_prompt=profile.reserve_full_prompt, chunked_prefill=profile.chunked_prefill,
        cache_policy=POLICIES[eng.adapter_cache_policy].code, duration=float(sc.duration_s),
        max_inflight=sc.client.max_inflight if sc.client.max_inflight is not None else NO_CLIENT_CAP,
        drop_overflow=sc.client.overflow == "drop", ts_interval=sc.timeseries_interval_s)


def engine_state(sc: Scenario, profile: Profile, eng: EngineConfig, req: Requests, kv_tokens: int,
                 stop_grace_s: float = 0.0, preloaded: np.ndarray | None = None) -> EngineState:
    """The engine kernel's state at t = 0 for ``req`` (see ``twin.engine``: ``run_engine`` runs it
    to the end, ``step`` one scheduler step at a time; an online engine starts from no requests
    and appends them with ``twin.engine_state.add_request``).  ``preloaded``: the adapters loaded
    at start-up, in order (default: all, see ``_initial_residency``)."""
    _, ranks, _ = sc.adapter_table()
    # per distinct rank, not per adapter: a fleet's on-demand tables hold every adapter of the fleet
    distinct, of_rank = np.unique(np.asarray(ranks, np.int64), return_inverse=True)
    cpu_ms = np.array([profile.loading.cpu_ms(int(r)) for r in distinct], np.float64)[of_rank]
    disk_ms = np.array([profile.loading.disk_ms(int(r)) for r in distinct], np.float64)[of_rank]
    residency = _initial_residency(len(ranks), eng.max_loras, eng.max_cpu_loras, preloaded)
    cfg = kernel_config(sc, profile, eng, kv_tokens)
    return make_state((req.arrival, req.in_len, req.out_len, req.adapter), cpu_ms, disk_ms, residency, cfg,
                      kernel_latency(profile.latency, eng.max_lora_rank, eng.max_loras),
                      _early_stop(sc, profile, eng, req, kv_tokens, stop_grace_s))


def simulate(sc: Scenario, profile: Profile | None = None, *, timeseries: bool = False,
             requests: Requests | None = None, check_invariants: bool = False,
             fast_forward: bool = True, stop_grace_s: float = 0.0) -> Result:
    """Simulate the scenario on one vLLM instance (``check_invariants``: assert the simulator's
    invariants at every step -- slower, for tests).  ``stop_grace_s``: with ``early_stop``, stop
    only when the requests arriving before T - stop_grace_s certainly get < rho of their tokens
    served by T -- the graced verdict of ``lora_opt.evaluate`` -- instead of the whole window's
    (which a graced judge may pass: the last requests need not finish)."""
    t_wall = time.perf_counter()
    profile = profile or sc.load_profile()
    eng = sc.resolved_engine(profile)
    starts, kv_tokens, reason = profile.startup_check(eng)
    if not profile.chunked_prefill and eng.max_num_batched_tokens < eng.max_model_len:
        raise ScenarioError(
            f"engine.max_num_batched_tokens: {eng.max_num_batched_tokens} < max_model_len "
            f"{eng.max_model_len}; vLLM {profile.vllm_version} without chunked prefill requires "
            "max_num_batched_tokens >= max_model_len")
    T = sc.duration_s
    if requests is None and sc.early_stop:
        certain = _certain_without_replay(sc, profile, eng, starts, stop_grace_s)
        if certain is not None:        # starvation (or OOM) certain before a request is drawn
            n_req, tokens = certain
            return _unserved("ok" if starts else "oom", T, tokens / T, True, kv_tokens,
                             0.0 if starts else None, reason, n_req, t_wall, eng)
    req = requests if requests is not None else generate_requests(sc, eng.max_model_len)
    tok = req.in_len + req.out_len
    if len(req) and int(tok.max()) > eng.max_model_len:
        raise ScenarioError(f"requests: a request of {int(tok.max())} tokens exceeds "
                            f"max_model_len {eng.max_model_len}")
    arrived_tokens = int(tok.sum())
    incoming = arrived_tokens / T
    if not starts:
        return _unserved("oom", T, incoming, incoming > 0, kv_tokens, None, reason, len(req), t_wall, eng)

    state = engine_state(sc, profile, eng, req, kv_tokens, stop_grace_s)
    out = run_engine(state, check_invariants, fast_forward)
    return run_result(sc, profile, eng, req, out, kv_tokens, timeseries=timeseries, t_wall=t_wall)


def run_result(sc: Scenario, profile: Profile, eng: EngineConfig, req: Requests, out: KernelRun, kv_tokens: int, *,
               timeseries: bool = False, t_wall: float | None = None) -> Result:
    """The :class:`Result` of a kernel run: ``out`` (``twin.engine_state.results``) of a state that
    held the requests ``req`` (in its order) -- ``simulate``'s engine, or one engine of a fleet
    (``twin.fleet``) whose requests were appended as its router sent them."""
    T = sc.duration_s
    lat = profile.latency
    block = profile.memory.block_size
    incoming = int((req.in_len + req.out_len).sum()) / T
    first_t, first_running, finish_t = out.first_token_s, out.running_at_first_token, out.finish_s
    n_ts, stopped_at = int(out.n_samples), float(out.stopped_at)

    done = finish_t <= T                         # NaN compares False
    in_done = int(req.in_len[done].sum())
    out_done = int(req.out_len[done].sum())
    thr_in, thr_out = in_done / T, out_done / T
    throughput = thr_in + thr_out
    # the front end (API server, detokenizer, streaming) adds to the first token's latency
    ttft = ((first_t[done] - req.arrival[done]) * 1000.0 + lat.ttft_frontend_ms
            + lat.ttft_frontend_per_running_ms * first_running[done])
    multi = done & (req.out_len > 1)
    tpot = (finish_t[multi] - first_t[multi]) / (req.out_len[multi] - 1) * 1000.0
    itl_values = np.concatenate([out.step_dur_s, out.irregular_gap_s]) * 1000.0
    itl_counts = np.concatenate([out.step_tokens, np.ones(out.irregular_gap_s.shape[0], np.int64)])
    stopped = stopped_at if stopped_at >= 0 else None
    ts = None
    if timeseries:
        ts = {"time_s": np.arange(n_ts) * sc.timeseries_interval_s, "running": out.ts_running[:n_ts],
              "waiting": out.ts_waiting[:n_ts], "kv_usage": out.ts_kv_blocks[:n_ts] / max(1, kv_tokens // block),
              "loaded_adapters": out.ts_loaded[:n_ts]}
    return Result(
        status="ok", duration_s=T, completed=int(done.sum()), total_input_tokens=in_done,
        total_output_tokens=out_done, throughput_tok_s=throughput, input_throughput=thr_in,
        output_throughput=thr_out, incoming_token_rate=incoming,
        starving=bool(throughput < sc.rho * incoming), ttft_ms=_stats(ttft),
        itl_ms=weighted_stats(itl_values, itl_counts), tpot_ms=_stats(tpot),
        running_mean=float(out.running_area) / T, waiting_mean=float(out.waiting_area) / T,
        preemptions=int(out.preemptions), adapter_loads_cpu=int(out.loads_cpu), adapter_loads_disk=int(out.loads_disk),
        kv_cache_tokens=int(kv_tokens), stopped_early_s=stopped, steps=int(out.steps), arrived=len(req),
        dropped=int(out.n_dropped),
        wall_s=time.perf_counter() - t_wall if t_wall is not None else 0.0, engine=eng, timeseries=ts,
        samples={"ttft_ms": ttft, "itl_ms": itl_values, "itl_count": itl_counts,
                 "arrival_s": req.arrival, "tokens": (req.in_len + req.out_len).astype(np.int64), "done": done})
