"""The kernel's state: one object holding a run's inputs, its mutable state and its outputs.

``EngineState`` is a Numba *structref* (a mutable struct passed by reference, fields read and
written as attributes in compiled code).  Candidates measured with the same kernel code (CPU
seconds per simulated hour, best of 3, ``lora-opt bench twin`` scenarios 2 req/s / 10 req/s /
30 req/s / 60 req/s / papers 128 slots / papers 64 slots; 2-core machine shared with other jobs):

=============  =======================================  ===================  ==================
state          run time (s)                             first compile (CPU)  next process
=============  =======================================  ===================  ==================
old kernel     .041 / .153 / .541 / .578 / .119 / .572  11.2 s               0.8 s (cache)
structref      .038 / .139 / .385 / .420 / .119 / .450  14.0 s               0.8 s (cache)
jitclass       .036 / .131 / .345 / .380 / .112 / .423  15-19 s (wall)       15 s (no cache)
=============  =======================================  ===================  ==================

The jitclass runs ~5-10 % faster than the structref but cannot be cached (its instance type
carries a per-process id, so every function taking it misses the cache: ~15 s of compilation in
every process, every Ray worker and every ``bench`` child), so the structref is kept.  Named
tuples of arrays were not kept either: every mutable scalar (clock, counters, list heads) would
live in a slot of a shared array, indexed by name constants.

Immutable inputs are named tuples (``Config``, ``Latency``, ``EarlyStop``); everything the engine
changes is a field of the state.  Per-request arrays have a *capacity* >= ``n_req``: requests can
be appended to a live state (:func:`add_request`), which is how an online engine (requests arriving
over HTTP) drives the same step function (``twin.engine.step``) one step at a time.
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit, types
from numba.experimental import structref

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.engine_queues import NONE
from twin.flags import KERNEL_FLAGS, flag_type

Config = namedtuple("Config", [
    *KERNEL_FLAGS, "kv_blocks", "block_size", "lora_set_rule", "reserve_full_prompt", "chunked_prefill",
    "cache_policy", "duration", "max_inflight", "drop_overflow", "ts_interval"])
"""Engine configuration: the engine flags the kernel reads (``twin.flags.KERNEL_FLAGS``, the one
list), then the rest (ints, switches, seconds)."""
_CONFIG_TYPES = ([types.float64 if flag_type(name) is float else types.int64 for name in KERNEL_FLAGS]
                 + [types.int64] * 3 + [types.boolean, types.boolean, types.int64, types.float64, types.int64,
                                        types.boolean, types.float64])

Latency = namedtuple("Latency", [
    "base_ms", "per_seq_ms", "per_token_ms", "per_ctx_ktoken_ms", "lora_jump", "lora_slope",
    "lora_nsat", "lora_prefill_share", "sched_base_ms", "sched_per_running_ms", "sched_per_waiting_ms",
    "lora_prefill_knee", "lora_prefill_share_above", "lora_token_ms", "lora_token_ms_above", "lora_step_ms",
    "lora_adapter_ms", "lora_seq_ms"])
"""The profile's step-time estimators (ms); see ``twin.engine_cost``."""

EarlyStop = namedtuple("EarlyStop", [
    "target", "cap_tok_s", "token_factor", "kv_tokens",
    "req_bucket", "req_cost_s", "bucket_cost_s", "bucket_tokens", "bucket_ratio"])
"""Early stop of certain starvation (off when ``target <= 0``) and its per-request work bound
(``twin.simulate.work_buckets``; empty bucket arrays = unused)."""
_EARLY_STOP_TYPES = [types.float64, types.float64, types.float64, types.int64, types.int32[::1],
                     types.float64[::1], types.float64[::1], types.int64[::1], types.float64[::1]]

_i1, _i4, _i8, _f8 = types.int8[::1], types.int32[::1], types.int64[::1], types.float64[::1]
_PER_REQUEST = [
    # inputs, sorted by arrival
    ("arrival", _f8), ("in_len", _i4), ("out_len", _i4), ("req_adapter", _i4),
    # progress
    ("computed", _i4), ("generated", _i4), ("held", _i4), ("sched_tok", _i4), ("started", _i1),
    # outputs
    ("first_t", _f8), ("first_running", _i4), ("last_t", _f8), ("finish_t", _f8), ("dropped", _i1),
    # WAITING lists (global FCFS, per adapter) and their order keys; RUNNING and this step's batch
    ("gnext", _i4), ("gprev", _i4), ("anext", _i4), ("aprev", _i4), ("key", _i4),
    ("running", _i4), ("batch", _i4),
]
PER_REQUEST = tuple(name for name, _ in _PER_REQUEST)
"""Fields indexed by request (grown together by :func:`add_request`)."""

_FIELDS = [
    ("cfg", types.NamedTuple(_CONFIG_TYPES, Config)),
    ("lat", types.NamedUniTuple(types.float64, len(Latency._fields), Latency)),
    ("stop", types.NamedTuple(_EARLY_STOP_TYPES, EarlyStop)),
    ("n_req", types.int64), *_PER_REQUEST,
    # adapters: load costs; WAITING per adapter; this step's LoRA set and batch adapters
    ("cpu_load_ms", _f8), ("disk_load_ms", _f8),
    ("ahead", _i8), ("atail", _i8), ("a_wait", _i8),
    ("set_stamp", _i8), ("set_list", _i8), ("batch_stamp", _i8),
    # adapter cache: per tier resident flag, clock at load, clock at last use, count
    ("gpu_res", _i8), ("gpu_loaded", _i8), ("gpu_used", _i8), ("n_gpu", types.int64),
    ("cpu_res", _i8), ("cpu_loaded", _i8), ("cpu_used", _i8), ("n_cpu", types.int64),
    ("clock", types.int64),
    # queues and KV
    ("ghead", types.int64), ("gtail", types.int64), ("n_waiting", types.int64),
    ("head_key", types.int64), ("tail_key", types.int64), ("n_running", types.int64),
    ("free_blocks", types.int64), ("next_arr", types.int64),
    # time and counters
    ("t", types.float64), ("step", types.int64), ("preemptions", types.int64),
    ("loads_cpu", types.int64), ("loads_disk", types.int64), ("n_dropped", types.int64),
    ("n_finished", types.int64), ("completed_tokens", types.int64),
    ("running_area", types.float64), ("waiting_area", types.float64),
    # early stop
    ("stopped_at", types.float64), ("next_stop_check", types.float64),
    ("inflight_tokens", types.int64), ("pool_cost", _f8), ("pool_tokens", _i8),
    # a fleet's driver: requests not routed yet may arrive from this time on (twin.engine_fleet)
    ("horizon", types.float64),
    # the current step
    ("budget", types.int64), ("n_batch", types.int64), ("n_set", types.int64),
    ("n_tokens", types.int64), ("ctx", types.int64), ("admitted", types.int64),
    ("scanned", types.int64), ("preempted", types.boolean), ("load_ms", types.float64),
    ("n_distinct", types.int64), ("finished_now", types.int64), ("blocks_at", _i8),
    # a fast forward a fleet's horizon stopped, its requests not caught up yet (twin.engine_fast_forward)
    ("ff_done", types.int64), ("ff_until", types.int64),
    # ITL samples: regular gaps are whole steps (duration, count); irregular ones listed
    ("step_dur", _f8), ("step_cnt", _i8), ("n_steps_rec", types.int64),
    ("irr", _f8), ("n_irr", types.int64),
    # time series (every ts_interval: the state the last step left, before the arrivals since)
    ("ts_running", _i8), ("ts_waiting", _i8), ("ts_kv", _i8), ("ts_loaded", _i8),
    ("n_ts", types.int64), ("ts_next", types.int64),
]


@structref.register
class EngineStateType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


class EngineState(structref.StructRefProxy):
    """Python handle of a kernel state: pass it to the njit functions, read the outputs with
    :func:`results`; a few scalars are readable here (for a driver stepping it from Python)."""

    @property
    def t(self) -> float:
        """The clock (s)."""
        return _get_t(self)

    @property
    def n_req(self) -> int:
        """Requests in the state."""
        return _get_n_req(self)

    @property
    def next_arr(self) -> int:
        """Requests let in so far (arrived, or dropped at the client's cap)."""
        return _get_next_arr(self)


@njit(cache=True)
def _get_t(s):
    return s.t


@njit(cache=True)
def _get_n_req(s):
    return s.n_req


@njit(cache=True)
def _get_next_arr(s):
    return s.next_arr


structref.define_boxing(EngineStateType, EngineState)
STATE_TYPE = EngineStateType(_FIELDS)


@njit(cache=True)
def _full(n, value, dtype):
    a = np.empty(n, dtype)
    a[:] = value
    return a


@njit(cache=True)
def _init_requests(s, arrival, in_len, out_len, adapter):
    n = arrival.shape[0]
    s.n_req = n
    s.arrival, s.in_len, s.out_len, s.req_adapter = arrival, in_len, out_len, adapter
    s.computed, s.generated, s.held = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
    s.sched_tok, s.started = np.zeros(n, np.int32), np.zeros(n, np.int8)
    s.first_t, s.first_running = _full(n, np.nan, np.float64), np.zeros(n, np.int32)
    s.last_t, s.finish_t = _full(n, np.nan, np.float64), _full(n, np.nan, np.float64)
    s.dropped = np.zeros(n, np.int8)
    s.gnext, s.gprev = _full(n, NONE, np.int32), _full(n, NONE, np.int32)
    s.anext, s.aprev = _full(n, NONE, np.int32), _full(n, NONE, np.int32)
    s.key, s.running, s.batch = np.zeros(n, np.int32), np.empty(n, np.int32), np.empty(n, np.int32)


@njit(cache=True)
def _init_adapters(s, cpu_load_ms, disk_load_ms, residency):
    """``residency``: (GPU resident, CPU resident, GPU stamp, CPU stamp) at start-up."""
    n = cpu_load_ms.shape[0]
    s.cpu_load_ms, s.disk_load_ms = cpu_load_ms, disk_load_ms
    s.ahead, s.atail, s.a_wait = _full(n, NONE, np.int64), _full(n, NONE, np.int64), np.zeros(n, np.int64)
    s.set_stamp, s.set_list, s.batch_stamp = _full(n, -1, np.int64), np.empty(n, np.int64), _full(n, -1, np.int64)
    gpu, cpu, gpu_stamp, cpu_stamp = residency
    s.gpu_res, s.gpu_loaded, s.gpu_used = gpu.copy(), gpu_stamp.copy(), gpu_stamp.copy()
    s.cpu_res, s.cpu_loaded, s.cpu_used = cpu.copy(), cpu_stamp.copy(), cpu_stamp.copy()
    s.n_gpu, s.n_cpu, s.clock = 0, 0, 0
    for a in range(n):
        s.n_gpu += gpu[a]
        s.n_cpu += cpu[a]
    for a in range(n):
        s.clock = max(s.clock, gpu_stamp[a], cpu_stamp[a])


@njit(cache=True)
def _init_counters(s):
    s.ghead, s.gtail, s.n_waiting, s.head_key, s.tail_key = NONE, NONE, 0, -1, 0
    s.n_running, s.free_blocks, s.next_arr = 0, s.cfg.kv_blocks, 0
    s.t, s.step, s.preemptions, s.loads_cpu, s.loads_disk = 0.0, 0, 0, 0, 0
    s.n_dropped, s.n_finished, s.completed_tokens = 0, 0, 0
    s.running_area, s.waiting_area = 0.0, 0.0
    s.stopped_at, s.next_stop_check, s.inflight_tokens = -1.0, 0.0, 0
    s.pool_cost, s.pool_tokens = s.stop.bucket_cost_s.copy(), s.stop.bucket_tokens.copy()
    s.horizon = np.inf
    s.budget, s.n_batch, s.n_set, s.n_tokens, s.ctx = 0, 0, 0, 0, 0
    s.admitted, s.scanned, s.preempted, s.load_ms = 0, 0, False, 0.0
    s.n_distinct, s.finished_now = 0, 0
    s.blocks_at = np.zeros(s.cfg.block_size, np.int64)
    s.ff_done, s.ff_until = 0, 0
    s.step_dur, s.step_cnt, s.n_steps_rec = np.empty(1024, np.float64), np.empty(1024, np.int64), 0
    s.irr, s.n_irr = np.empty(256, np.float64), 0
    n_ts = int(s.cfg.duration / s.cfg.ts_interval) + 1
    s.ts_running, s.ts_waiting = np.zeros(n_ts, np.int64), np.zeros(n_ts, np.int64)
    s.ts_kv, s.ts_loaded = np.zeros(n_ts, np.int64), np.zeros(n_ts, np.int64)
    s.n_ts, s.ts_next = n_ts, 0


@njit(cache=True)
def new_state(requests, cpu_load_ms, disk_load_ms, residency, cfg, lat, stop):
    """A state at t = 0.  ``requests``: (arrival, in_len, out_len, adapter), sorted by arrival;
    ``residency``: (GPU resident, CPU resident, GPU stamp, CPU stamp) of each adapter at start-up."""
    s = structref.new(STATE_TYPE)
    s.cfg, s.lat, s.stop = cfg, lat, stop
    _init_requests(s, *requests)
    _init_adapters(s, cpu_load_ms, disk_load_ms, residency)
    _init_counters(s)
    return s


def make_state(requests, cpu_load_ms, disk_load_ms, residency, cfg: Config, lat: Latency,
               stop: EarlyStop) -> EngineState:
    """:func:`new_state` with every input coerced to the types of the state's fields."""
    arrival, in_len, out_len, adapter = requests
    req = (np.ascontiguousarray(arrival, np.float64), np.ascontiguousarray(in_len, np.int32),
           np.ascontiguousarray(out_len, np.int32), np.ascontiguousarray(adapter, np.int32))
    res = tuple(np.ascontiguousarray(x, np.int64) for x in residency)
    cfg = Config(*(bool(v) if t == types.boolean else float(v) if t == types.float64 else int(v)
                   for v, t in zip(cfg, _CONFIG_TYPES)))
    lat = Latency(*map(float, lat))
    stop = EarlyStop(float(stop.target), float(stop.cap_tok_s), float(stop.token_factor), int(stop.kv_tokens),
                     *(np.ascontiguousarray(x, t.dtype.name) for x, t in zip(stop[4:], _EARLY_STOP_TYPES[4:])))
    return new_state(req, np.ascontiguousarray(cpu_load_ms, np.float64),
                     np.ascontiguousarray(disk_load_ms, np.float64), res, cfg, lat, stop)


@njit(cache=True)
def _grown(arr, n):
    """``arr`` with room for ``n`` entries (at least doubled), the new tail uninitialised."""
    new = np.empty(max(n, 2 * arr.shape[0], 16), arr.dtype)
    new[: arr.shape[0]] = arr
    return new


@njit(cache=True)
def _grow_requests(s, n):
    s.arrival, s.in_len, s.out_len, s.req_adapter = (_grown(s.arrival, n), _grown(s.in_len, n),
                                                     _grown(s.out_len, n), _grown(s.req_adapter, n))
    s.computed, s.generated, s.held = _grown(s.computed, n), _grown(s.generated, n), _grown(s.held, n)
    s.sched_tok, s.started = _grown(s.sched_tok, n), _grown(s.started, n)
    s.first_t, s.first_running = _grown(s.first_t, n), _grown(s.first_running, n)
    s.last_t, s.finish_t, s.dropped = _grown(s.last_t, n), _grown(s.finish_t, n), _grown(s.dropped, n)
    s.gnext, s.gprev, s.anext, s.aprev = _grown(s.gnext, n), _grown(s.gprev, n), _grown(s.anext, n), _grown(s.aprev, n)
    s.key, s.running, s.batch = _grown(s.key, n), _grown(s.running, n), _grown(s.batch, n)


@njit(cache=True)
def add_request(s, arrival, in_len, out_len, adapter):
    """Append a request to a live state (an online engine: a request arriving at ``arrival`` >= the
    last one's, usually the current clock ``s.t``); returns its index.  The next ``step`` lets it
    in.  Not with the early stop's work bound (its per-request arrays are not grown)."""
    r = s.n_req
    if r >= s.arrival.shape[0]:
        _grow_requests(s, r + 1)
    s.arrival[r], s.in_len[r], s.out_len[r], s.req_adapter[r] = arrival, in_len, out_len, adapter
    s.computed[r], s.generated[r], s.held[r], s.sched_tok[r], s.started[r] = 0, 0, 0, 0, 0
    s.first_t[r], s.first_running[r], s.last_t[r], s.finish_t[r], s.dropped[r] = np.nan, 0, np.nan, np.nan, 0
    s.gnext[r], s.gprev[r], s.anext[r], s.aprev[r], s.key[r] = NONE, NONE, NONE, NONE, 0
    s.n_req = r + 1
    return r


#: A run's outputs (:func:`results`).  Per request (the state's order, ``n_req`` long): first-token time,
#: running requests at the first token, finish time (NaN: unfinished), dropped flag.  ITL samples: step
#: durations and how many tokens each gave, irregular gaps (one token each).  Time series (every
#: ``timeseries_interval``, ``n_samples`` long): running, waiting, KV blocks used, GPU-resident adapters.
#: Counters: scheduler steps, preemptions, adapter loads from CPU and from disk, samples, dropped requests.
#: Areas under running and waiting (request-seconds), the clock at the end (at most the duration), the early
#: stop's time (-1: none).
KernelRun = namedtuple("KernelRun", [
    "first_token_s", "running_at_first_token", "finish_s", "dropped",
    "step_dur_s", "step_tokens", "irregular_gap_s",
    "ts_running", "ts_waiting", "ts_kv_blocks", "ts_loaded",
    "steps", "preemptions", "loads_cpu", "loads_disk", "n_samples", "n_dropped",
    "running_area", "waiting_area", "t_end", "stopped_at"])


@njit(cache=True)
def results(s):
    """The run's outputs, a :data:`KernelRun`."""
    n = s.n_req
    return KernelRun(s.first_t[:n], s.first_running[:n], s.finish_t[:n], s.dropped[:n], s.step_dur[: s.n_steps_rec],
                     s.step_cnt[: s.n_steps_rec], s.irr[: s.n_irr], s.ts_running, s.ts_waiting, s.ts_kv, s.ts_loaded,
                     np.int64(s.step), np.int64(s.preemptions), np.int64(s.loads_cpu), np.int64(s.loads_disk),
                     np.int64(s.ts_next), np.int64(s.n_dropped), np.float64(s.running_area),
                     np.float64(s.waiting_area), np.float64(min(s.t, s.cfg.duration)), np.float64(s.stopped_at))
