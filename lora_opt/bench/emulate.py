"""``lora-opt bench emulate``: start-up time, capacity (concurrent streams, streamed tokens/s at
speed 1 with the server pinned to one core) and the engine's lag behind the wall clock.

Start-up: wall time from launching ``lora-opt emulate`` to its first ``/health`` answer (Numba's
cache warm: one launch first, not timed).  Capacity: a closed-loop client (its own process, on
another core when there is one) keeps ``concurrency`` streams open -- each a request of
``in_len`` prompt tokens and ``out_len`` output tokens with ``ignore_eos``, replaced by a new one
when it ends -- for ``duration_s``; tokens are counted as they reach the client, after a warm-up.
Lag: per engine step, the wall time between when the step was due to start and when it ran
(``GET /emulator/stats``); the engine keeps real time when the lag stays at scheduling noise.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

from lora_opt.emulate.client import replay, summarise
from lora_opt.emulate.fleet import free_ports
from lora_opt.emulate.launch import loop_factory
from lora_opt.emulate.wall_timer import WallTimer
from lora_opt.io import atomic_write_json
from twin.scenario import scenario_from_dict
from twin.simulate import simulate
from twin.workload import generate_requests

ROOT = Path(__file__).resolve().parents[2]

#: one instance that can hold every stream at once (max_num_seqs above the concurrency)
CAPACITY_SCENARIO = {
    "profile": "llama-3.1-8b-h100-64gb",
    "engine": {"max_loras": 8, "max_lora_rank": 16, "max_num_seqs": 1024, "max_num_batched_tokens": 4096,
               "max_model_len": 4096},
    "adapters": [{"count": 16, "rank": 16, "rate": 1.0}],
    "lengths": {"source": "mean", "mean_in": 100, "mean_out": 300},
}


def _get(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return json.loads(r.read() or b"{}")


def _launch(scenario_path: str, port: int, speed: float, cpu: int | None):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def pin():
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", "--scenario", scenario_path,
                             "--port", str(port), "--speed", str(speed)], env=env, preexec_fn=pin,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_health(proc, port: int, timeout: float = 60.0) -> float:
    # not lora_opt.probe.launch.LaunchedServer: start-up is what is timed here (polled every 20 ms,
    # not 0.2 s) and the server may be pinned to one core (preexec_fn), which LaunchedServer does not do
    t0 = time.perf_counter()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("emulator did not answer /health")


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr:
        proc.stderr.close()


async def _stream_worker(port: int, model: str, in_len: int, out_len: int, deadline: float, counter: list,
                         open_streams: list) -> None:
    body = json.dumps({"model": model, "prompt": [1] * in_len, "max_tokens": out_len, "ignore_eos": True,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    while time.perf_counter() < deadline:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        open_streams[0] += 1
        try:
            writer.write(head + body)
            tail = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                buf = tail + data
                counter[0] += buf.count(b'"text":') - tail.count(b'"text":')
                tail = buf[-8:]
        finally:
            open_streams[0] -= 1
            writer.close()


async def _capacity(port: int, concurrency: int, duration_s: float, warmup_s: float, in_len: int, out_len: int,
                    models: list[str]) -> dict:
    counter, open_streams = [0], [0]
    t_start = time.perf_counter()
    deadline = t_start + warmup_s + duration_s
    workers = [asyncio.ensure_future(_stream_worker(port, models[k % len(models)], in_len, out_len, deadline,
                                                    counter, open_streams)) for k in range(concurrency)]
    await asyncio.sleep(warmup_s)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, _get, f"http://127.0.0.1:{port}/emulator/stats?reset=1")
    tok0, t0 = counter[0], time.perf_counter()
    samples = []
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.5)
        samples.append(open_streams[0])
    tokens, elapsed = counter[0] - tok0, time.perf_counter() - t0
    stats = await loop.run_in_executor(None, _get, f"http://127.0.0.1:{port}/emulator/stats")
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return {"tokens_per_s": tokens / elapsed, "streams_mean": sum(samples) / max(1, len(samples)),
            "streams_min": min(samples) if samples else 0, "stats": stats}


#: the consistency stream (the test's): max_loras 2 of 10 adapters, 8 sequences, 60 s
CONSISTENCY_SCENARIO = {
    "profile": "llama-3.1-8b-h100-64gb",
    "engine": {"max_loras": 2, "max_lora_rank": 16, "max_num_seqs": 8, "max_num_batched_tokens": 512},
    "adapters": [{"count": 6, "rank": 8, "rate": 0.5}, {"count": 4, "rank": 16, "rate": 1.0}],
    "lengths": {"source": "mean", "mean_in": 200, "mean_out": 40}, "duration_s": 60, "seed": 1,
}


def consistency(speed: float, scenario: dict = CONSISTENCY_SCENARIO) -> dict:
    """The scenario's requests replayed open-loop against a fresh emulator at ``speed``, next to
    ``twin.simulate`` on the same requests: (twin, emulator, emulator / twin) for throughput, mean
    TTFT and mean ITL."""
    sc = scenario_from_dict(scenario)
    req = generate_requests(sc, sc.resolved_engine(sc.load_profile()).max_model_len)
    twin = simulate(sc, requests=req)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "consistency.yaml")
        Path(path).write_text(yaml.safe_dump(scenario))
        port = free_ports(1)
        proc = _launch(path, port, speed, None)
        try:
            _wait_health(proc, port)
            ids, _, _ = sc.adapter_table()
            got = summarise(asyncio.run(replay(f"http://127.0.0.1:{port}", req, ids, speed)), speed, sc.duration_s)
        finally:
            _stop(proc)
    want = {"throughput_tok_s": twin.throughput_tok_s, "ttft_mean_ms": twin.ttft_ms["mean"],
            "itl_mean_ms": twin.itl_ms["mean"]}
    have = {k: getattr(got, k) for k in want}
    return {"speed": speed, "twin": want, "emulator": have, "ratio": {k: have[k] / want[k] for k in want},
            "errors": got.errors}


async def _wake_up_errors(n: int, wall_timer: bool) -> list[float]:
    """Error (ms, + late) of ``n`` wake-ups set 1-20 ms ahead at fractions of a millisecond spread evenly:
    the loop's own timer (``call_at``) or the engine's (:class:`~lora_opt.emulate.wall_timer.WallTimer`)."""
    loop = asyncio.get_running_loop()
    timer = WallTimer(loop) if wall_timer else None
    errors = []
    for k in range(n):
        ahead = 0.001 + (k * 0.6180339887498949 % 1.0) * 0.019
        when, woke = time.perf_counter() + ahead, loop.create_future()
        if timer is not None:
            timer.set(when, lambda f=woke: f.set_result(time.perf_counter()))
        else:
            loop.call_at(loop.time() + ahead, lambda f=woke: f.set_result(time.perf_counter()))
        errors.append((await woke - when) * 1000.0)
    if timer is not None:
        timer.close()
    return errors


def wake_up_errors(n: int = 400) -> dict[str, list[float]]:
    """:func:`_wake_up_errors` on the emulator's own event loop, both timers."""
    out = {}
    for name, wall in (("loop call_at", False), ("wall timer", True)):
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            out[name] = runner.run(_wake_up_errors(n, wall))
    return out


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def bench_emulate(out: str | None = None, concurrency: int = 600, duration_s: float = 30.0,
                  warmup_s: float = 8.0, startups: int = 3, pin: bool = False) -> list[str]:
    """Measure (and with ``out`` write as JSON) start-up, capacity and lag of one instance; the
    report's lines (``lora-opt bench emulate`` prints them).  The
    server is one single-threaded process (one asyncio loop): it uses at most one core; ``pin``
    also pins it to one CPU and the client to the others (only meaningful on an idle machine:
    on a shared one the pinned core's other jobs starve it)."""
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = cpus[0] if pin and len(cpus) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "capacity.yaml")
        Path(path).write_text(yaml.safe_dump(CAPACITY_SCENARIO))
        startup = []
        for k in range(startups + 1):               # the first launch warms Numba's cache
            port = free_ports(1)
            t0 = time.perf_counter()
            proc = _launch(path, port, 1.0, server_cpu)
            try:
                _wait_health(proc, port)
                if k:
                    startup.append(time.perf_counter() - t0)
            finally:
                _stop(proc)
        port = free_ports(1)
        proc = _launch(path, port, 1.0, server_cpu)
        try:
            _wait_health(proc, port)
            if server_cpu is not None:
                os.sched_setaffinity(0, set(cpus[1:]))
            cpu0, w0 = _cpu_s(proc.pid), time.perf_counter()
            models = [f"a{i}" for i in range(CAPACITY_SCENARIO["adapters"][0]["count"])]
            cap = asyncio.run(_capacity(port, concurrency, duration_s, warmup_s, 100, 300, models))
            cpu_share = (_cpu_s(proc.pid) - cpu0) / (time.perf_counter() - w0)
        finally:
            os.sched_setaffinity(0, set(cpus))
            _stop(proc)
    cons = [consistency(s) for s in (10.0, 1.0)]
    wake = wake_up_errors()
    st = cap["stats"]
    rows = [("start-up (launch -> /health), s", f"{min(startup):.2f} best, {max(startup):.2f} worst", "<= 3"),
            ("concurrent streams (mean / min)", f"{cap['streams_mean']:.0f} / {cap['streams_min']}", ">= 500"),
            ("streamed tokens/s (client)", f"{cap['tokens_per_s']:,.0f}", ">= 5,000"),
            ("engine lag p50 / p90 / p99 / max, ms",
             " / ".join(f"{st['lag_ms'][k]:.1f}" for k in ("p50", "p90", "p99", "max")), "real time"),
            ("engine clock behind wall at end, s", f"{st['sim_now_s'] - st['engine_clock_s']:.3f}", "~0"),
            ("server CPU (of one core)", f"{cpu_share:.0%}", "< 100%"),
            *[(f"wake-up error, {name}: p5 / p50 / p95, ms",
               " / ".join(f"{v:+.2f}" for v in np.percentile(errs, [5, 50, 95])), "p95 - p5 < 0.5")
              for name, errs in wake.items()],
            ("machine load average (1 min)", f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", "")]
    lines: list[str] = []          # the report: lora-opt bench prints it
    lines.append(f"lora-opt emulate, speed 1, {concurrency} closed-loop streams of 100+300 tokens, {duration_s:.0f} s "
          f"after {warmup_s:.0f} s warm-up; server " + (f"pinned to CPU {server_cpu}" if server_cpu is not None
                                                         else "one process, not pinned"))
    lines.append(f"{'metric':42s} {'measured':32s} target")
    for name, value, target in rows:
        lines.append(f"{name:42s} {value:32s} {target}")
    lines.append("\nconsistency with twin.simulate (10 adapters, max_loras 2, 8 sequences, 60 s, open loop)")
    lines.append(f"{'speed':>6s} {'throughput tok/s twin/emu':>28s} {'mean TTFT ms twin/emu':>26s} {'mean ITL ms twin/emu':>24s}")
    for c in cons:
        tw, em, r = c["twin"], c["emulator"], c["ratio"]
        cells = [f"{tw[k]:,.1f} / {em[k]:,.1f} ({r[k] - 1:+.1%})" for k in ("throughput_tok_s", "ttft_mean_ms",
                                                                           "itl_mean_ms")]
        lines.append(f"{c['speed']:6g} {cells[0]:>28s} {cells[1]:>26s} {cells[2]:>24s}")
    if out:
        atomic_write_json(out, {"startup_s": startup, "capacity": cap, "cpu_share": cpu_share, "consistency": cons,
                                "wake_up_error_ms_p5_p50_p95": {k: [float(np.percentile(v, q)) for q in (5, 50, 95)]
                                                                for k, v in wake.items()},
                                "concurrency": concurrency, "duration_s": duration_s}, indent=2)
    return lines
