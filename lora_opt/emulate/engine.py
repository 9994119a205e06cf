"""The online engine: the twin's step function driven in real time.

Clock.  Simulated time is wall-clock time since start-up x ``speed``: ``sim_now() = (perf_counter()
- t0) x speed``.  A request arriving over HTTP is appended to the live kernel state
(``twin.engine_state.add_request``) with ``arrival = sim_now()``; the engine runs one scheduler step
(``twin.engine.step``, the very function ``twin.simulate`` runs) as soon as the previous one has
ended in wall time, which moves the kernel's clock to the step's end ``t_end``; the step's tokens
are handed to their streams when the wall clock reaches ``t_end`` (+ the profile's front-end delay,
below).  A request arriving while a step is in flight has an arrival inside that step and joins the
next one -- exactly the batch kernel's rule -- so a stream sent at the batch run's arrival times
gets the batch run's schedule, up to the HTTP delays.  When the engine falls behind (a step
computed later than its start in wall time), it runs steps back to back until it catches up; the
lag (wall time between a step's scheduled start and when it ran) is recorded.

Front-end delay.  The twin's TTFT adds the profile's front-end terms (``ttft_frontend_ms`` +
``ttft_frontend_per_running_ms`` x running requests at the first token: API server, detokenizer,
streaming).  The emulator delays every token of a request by that request's term, so TTFT matches
the twin's and inter-token gaps are the engine's steps.

Everything runs on one asyncio loop: handlers append requests and abort them between steps, never
during one.  The engine's wake-ups (a step's end, tokens due) come from one sleeping thread
(:class:`lora_opt.emulate.wall_timer.WallTimer`: the loop's own timers wake on whole milliseconds,
a bias in latency differences); the callbacks run on the loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import heapq
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from twin.engine import DONE, STEPPED, step
from twin.engine_online import (
    abort_request,
    first_times,
    gauges,
    lora_usage,
    step_outputs,
)
from twin.engine_state import add_request
from twin.profile import Profile
from twin.scenario import AdapterGroup, EngineConfig, Scenario
from twin.simulate import engine_state
from twin.workload import Requests, draw_lengths

from lora_opt.emulate.wall_timer import WallTimer

#: simulated seconds an emulator's kernel state is built for (its session can last that long)
SESSION_S = 1e9
#: deliveries due within this many wall seconds of now go out together
COALESCE_WALL_S = 0.0005
#: the adapter index base-model requests run on (see :func:`online_scenario`)
BASE_ADAPTER = 0
BASE_ID = "__base_model__"
#: ids of the spare adapters runtime-loaded adapters take (see :func:`online_scenario`)
RUNTIME_ID = "__runtime_lora_"
#: steps whose lag is kept (the latest)
LAG_SAMPLES = 200_000


def online_scenario(sc: Scenario, runtime_slots: int = 0, runtime_rank: int = 16) -> Scenario:
    """The scenario an emulator's kernel runs: the same adapters after one more at index 0 for
    base-model requests (the kernel has no request without an adapter: a base-model request takes
    a LoRA slot of the smallest rank; placed first, it is not resident at start-up, so the
    adapters' start-up residency is vLLM's) and ``runtime_slots`` spare adapters of rank
    ``runtime_rank`` at indices 1..runtime_slots (the kernel's adapter table is fixed: adapters
    loaded at run time through /v1/load_lora_adapter take these), a session-long window, no early
    stop and no time series."""
    base = AdapterGroup(rank=min(g.rank for g in sc.adapters), rate=1.0, id=BASE_ID)
    spares = tuple(AdapterGroup(rank=runtime_rank, rate=1.0, id=f"{RUNTIME_ID}{k}") for k in range(runtime_slots))
    # dataclasses.replace, not twin.scenario.replace: the user's scenario was validated when it was
    # built; this session-long window draws no requests from the rates (they come over HTTP), so the
    # size limits on a window's drawn requests (twin.scenario.check_sizes) do not apply to it
    return dataclasses.replace(sc, adapters=(base, *spares, *sc.adapters), duration_s=SESSION_S, early_stop=False,
                               timeseries_interval_s=SESSION_S)


@dataclass(eq=False)
class EmuRequest:
    """One request's progress as its stream sees it (times in simulated seconds)."""

    idx: int
    prompt_tokens: int
    out_len: int
    adapter: int
    arrival: float
    event: asyncio.Event
    generated: int = 0          # tokens handed to the stream so far
    finished: bool = False
    aborted: bool = False       # the engine dropped it (client gone, or shutdown)
    gone: bool = False          # its client disconnected
    stream: bool = True         # wake its response at every token (else only at the end)
    delay: float = 0.0          # front-end delay of every token (s)
    first_t: float = float("nan")
    last_t: float = float("nan")
    scheduled_t: float = float("nan")
    finish_reason: str = "length"


@dataclass
class EngineStats:
    """Counters the metrics read (the kernel's gauges are read at scrape time)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})
    lag_wall_s: deque = field(default_factory=lambda: deque(maxlen=LAG_SAMPLES))
    steps: int = 0


class OnlineEngine:
    """One emulated vLLM engine: ``submit`` a request, await its ``event`` for tokens, ``abort``
    it when its client goes away.  ``observer`` (optional) gets ``first_token(req, ttft)``,
    ``token(req, itl)``, ``queued(req, queue_s)``, ``finished(req)`` in simulated seconds."""

    def __init__(self, sc: Scenario, profile: Profile, eng: EngineConfig, kv_tokens: int, *, speed: float = 1.0,
                 seed: int = 0, observer=None, runtime_slots: int = 0, preloaded: list[int] | None = None):
        """``preloaded``: indices into ``sc.adapters`` of the adapters loaded at start-up
        (``--lora-modules``, in order; the others are loaded on first use); None: all of them."""
        self.sc = online_scenario(sc, runtime_slots, eng.max_lora_rank)
        self.profile, self.eng, self.speed = profile, eng, float(speed)
        empty = Requests(arrival=np.zeros(0), adapter=np.zeros(0, np.int32), in_len=np.zeros(0, np.int32),
                         out_len=np.zeros(0, np.int32))
        if preloaded is not None:           # the kernel's table has the base adapter and the spares first
            preloaded = np.asarray(preloaded, np.int64) + 1 + runtime_slots
        self.state = engine_state(self.sc, profile, eng, empty, kv_tokens, preloaded=preloaded)
        lat = profile.latency
        self._fe = (lat.ttft_frontend_ms / 1000.0, lat.ttft_frontend_per_running_ms / 1000.0)
        self.rng = np.random.default_rng(seed)
        self.observer = observer
        self.stats = EngineStats()
        self.requests: dict[int, EmuRequest] = {}
        self._heap: list = []               # (due, seq, request index, generated count)
        self._seq = 0
        self._busy_until = 0.0              # simulated end of the step in flight
        self._idle = True
        self._pending_aborts: list[int] = []
        self._last_arrival = 0.0
        self._timer = None                  # a call_soon handle: a wake-up already due
        self._wall_timer: WallTimer | None = None
        self._loop = None
        self.t0 = time.perf_counter()

    # ---- clock -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the clock (simulated 0 = now) on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._wall_timer = WallTimer(self._loop)
        self.t0 = time.perf_counter()

    def sim_now(self) -> float:
        return (time.perf_counter() - self.t0) * self.speed

    # ---- requests --------------------------------------------------------------------------
    def draw_output_len(self, max_tokens: int) -> int:
        """An output length from the scenario's length model (the request may stop before
        ``max_tokens``: an EOS), at most ``max_tokens``."""
        _, out = draw_lengths(self.sc, self.rng, 1, self.eng.max_model_len)
        return int(min(int(out[0]), max_tokens))

    def submit(self, prompt_tokens: int, out_len: int, adapter: int, sent_wall: float | None = None) -> EmuRequest:
        """A request arriving now (``sent_wall``: the client's send instant, ``perf_counter`` seconds,
        when it is on this host -- see ``lora_opt.emulate.server``); its tokens come through its ``event``."""
        now = self.sim_now()
        at = now if sent_wall is None else min(now, max(0.0, (sent_wall - self.t0) * self.speed))
        arrival = max(at, self._last_arrival)
        self._last_arrival = arrival
        r = int(add_request(self.state, arrival, prompt_tokens, out_len, adapter))
        req = EmuRequest(r, prompt_tokens, out_len, adapter, arrival, asyncio.Event())
        self.requests[r] = req
        self.stats.prompt_tokens += prompt_tokens
        if self._idle:
            self._idle = False
            self._reschedule(0.0)
        return req

    def abort(self, req: EmuRequest) -> None:
        """The client went away: the engine drops the request (its KV blocks are freed at once,
        or when it is let in at the next step)."""
        if req.finished or req.aborted:
            return
        req.aborted = True
        req.finish_reason = "abort"
        self.stats.success["abort"] += 1
        self.requests.pop(req.idx, None)
        if req.idx < self.state.next_arr:
            abort_request(self.state, req.idx)
        else:
            self._pending_aborts.append(req.idx)

    # ---- the loop ----------------------------------------------------------------------------
    def _reschedule(self, due_sim: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if due_sim is None:
            self._wall_timer.cancel()
        elif due_sim <= self.sim_now():
            self._wall_timer.cancel()
            self._timer = self._loop.call_soon(self._tick)
        else:
            self._wall_timer.set(self.t0 + due_sim / self.speed, self._tick)

    def _tick(self) -> None:
        self._timer = None
        now = self.sim_now()
        horizon = now + COALESCE_WALL_S * self.speed
        heap = self._heap
        while heap and heap[0][0] <= horizon:
            due, _, r, gen = heapq.heappop(heap)
            self._deliver(r, gen, due)
        if not self._idle and self._busy_until <= horizon:
            self._engine_step(now)
        nxt = heap[0][0] if heap else None
        if not self._idle:
            nxt = self._busy_until if nxt is None else min(nxt, self._busy_until)
        self._reschedule(nxt)

    def _engine_step(self, now: float) -> None:
        s = self.state
        if self._pending_aborts:
            still = []
            for r in self._pending_aborts:
                if r < s.next_arr:
                    abort_request(s, r)
                else:
                    still.append(r)
            self._pending_aborts = still
        t_start = s.t
        outcome = step(s)
        if outcome == STEPPED:
            self.stats.steps += 1
            self.stats.lag_wall_s.append(max(0.0, now - t_start) / self.speed)
            self._record_step(t_start)
            self._busy_until = s.t
        elif outcome >= DONE:
            self._idle = True           # nothing to run until a request comes in
        else:
            self._busy_until = s.t      # WAITED: the clock jumped to the next arrival

    def _record_step(self, t_start: float) -> None:
        s = self.state
        tok_r, tok_gen, batch = step_outputs(s)
        reqs = self.requests
        if self.observer is not None:
            for r in batch.tolist():
                q = reqs.get(r)
                if q is not None and q.scheduled_t != q.scheduled_t:      # NaN: first time scheduled
                    q.scheduled_t = t_start
                    self.observer.queued(q, t_start - q.arrival)
        firsts = tok_r[tok_gen == 1]
        if firsts.shape[0]:
            _, running = first_times(s, firsts)
            fe0, fe1 = self._fe
            for r, n_run in zip(firsts.tolist(), running.tolist()):
                q = reqs.get(r)
                if q is not None:
                    q.delay = fe0 + fe1 * n_run
        t_end = s.t
        heap = self._heap
        seq = self._seq
        for r, gen in zip(tok_r.tolist(), tok_gen.tolist()):
            q = reqs.get(r)
            if q is not None:
                seq += 1
                heapq.heappush(heap, (t_end + q.delay, seq, r, gen))
        self._seq = seq

    def _deliver(self, r: int, gen: int, due: float) -> None:
        q = self.requests.get(r)
        if q is None:
            return                      # aborted
        obs = self.observer
        if q.generated == 0:
            q.first_t = due
            if obs is not None:
                obs.first_token(q, due - q.arrival)
        elif obs is not None:
            obs.token(q, due - q.last_t)
        self.stats.generation_tokens += gen - q.generated
        q.generated = gen
        q.last_t = due
        if gen >= q.out_len:
            q.finished = True
            del self.requests[r]
            self.stats.success[q.finish_reason] += 1
            if obs is not None:
                obs.finished(q)
            q.event.set()
        elif q.stream:
            q.event.set()

    # ---- what /metrics and the bench read ----------------------------------------------------
    def gauges(self) -> dict:
        running, waiting, kv_used, kv_blocks, preemptions, resident, t = gauges(self.state)
        return {"running": int(running), "waiting": int(waiting), "kv_usage": kv_used / max(1, kv_blocks),
                "kv_blocks": int(kv_blocks), "preemptions": int(preemptions), "resident_adapters": int(resident), "sim_t": float(t)}

    def report(self) -> dict:
        """The emulator's own numbers (``GET /emulator/stats``, not a vLLM endpoint): clocks, steps,
        and the lag of steps behind the wall clock (ms of wall time, percentiles since start or
        since the last ``reset_lag``)."""
        lag = np.asarray(self.stats.lag_wall_s) * 1000.0
        pct = {f"p{q}": float(np.percentile(lag, q)) if lag.size else 0.0 for q in (50, 90, 99)}
        return {"speed": self.speed, "sim_now_s": self.sim_now(), "engine_clock_s": float(self.state.t),
                "steps": self.stats.steps, "lag_ms": {**pct, "max": float(lag.max()) if lag.size else 0.0},
                "open_requests": len(self.requests), "generation_tokens": self.stats.generation_tokens}

    def reset_lag(self) -> None:
        self.stats.lag_wall_s.clear()

    def lora_usage(self) -> tuple[np.ndarray, np.ndarray]:
        """Per adapter index (0 = base model): running and waiting requests."""
        return lora_usage(self.state)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wall_timer is not None:
            self._wall_timer.close()
        for q in list(self.requests.values()):
            q.aborted = True
            q.event.set()
