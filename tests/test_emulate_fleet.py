"""``lora-opt emulate`` as a fleet: the front router chooses through the fleet twin's policies
(``twin.routers``), instances load adapters on demand, and an open-loop stream through the router
gets the fleet twin's numbers (``twin.fleet.simulate_fleet`` on the same requests; mean TTFT within the twin's
own spread when its arrivals move by the HTTP path's few ms: a policy reading state decides by the instant),
and every request is answered.

The unit tests run the router in-process (no HTTP); the consistency tests start a
``lora-opt emulate --instances K --router-port P --router POLICY`` subprocess and replay one stream."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import yaml

from lora_opt.emulate.fleet import free_ports
from small_scenarios import small_scenario
from test_emulate import ROOT, Emulator, _env, _free_port

#: instances of the consistency fleet
K = 2
#: one instance of the consistency fleet: the single-engine consistency scenario of tests/test_emulate.py
#: (max_loras 2 of 10 adapters, 8 sequences: a queue, mean TTFT ~2 s); the fleet gets K times its rates
INSTANCE = small_scenario(engine={"max_loras": 2, "max_num_seqs": 8},
                          lengths={"source": "mean", "mean_in": 200, "mean_out": 40}, duration_s=60)
#: emulator speed of the consistency runs (each 60 simulated s = 30 wall s): the router relays every
#: token of both instances in the emulator's one process; at speed 5 this machine's shared core fell
#: behind (engine lag p99 0.3-4 s), at 2 it keeps up (lag p99 ~5 ms)
SPEED = 2.0
#: wall ms of client send lateness / engine lag (p99) above which a run measures the machine's other jobs
NOISY_MS = 10.0
SEED = 3
#: simulated ms by which the consistency runs' arrivals are jittered in the twin's own TTFT band: a quiet run's
#: client sends and router decisions within NOISY_MS wall of the twin's instants, i.e. NOISY_MS x SPEED simulated
JITTER_MS = NOISY_MS * SPEED
#: jittered twin runs in that band
BAND_RUNS = 30


# ---- the router in-process --------------------------------------------------------------------
def _table(endpoints, adapters, weights=None):
    return {a: [{"endpoint": ep, "weight": (weights or {}).get((a, ep), 1.0)} for ep in endpoints] for a in adapters}


def test_static_front_draws_as_the_fleet_twins_static_router():
    """One owner of the weighted-route rule: the front's static policy is ``twin.routers``' (the
    placement's weights through ``weighted_pick``, one draw per routed request), so the same seed
    and requests give the same instances."""
    from lora_opt.emulate.router import RouteTable
    from twin.routers import RouterSetup, make_router
    eps = ["http://h:1/v1", "http://h:2/v1", "http://h:3/v1"]
    weights = {("a", eps[0]): 0.2, ("a", eps[1]): 0.5, ("a", eps[2]): 0.3, ("b", eps[0]): 1.0, ("b", eps[1]): 3.0}
    table = _table(eps, ["a"], weights)
    table["b"] = [{"endpoint": eps[0], "weight": 1.0}, {"endpoint": eps[1], "weight": 3.0}]
    seed = np.random.SeedSequence([5, 7])
    front = RouteTable(table, seed, endpoints=eps)
    twin = make_router("static", RouterSetup(3, ["a", "b"], seed=np.random.SeedSequence([5, 7]),
                                             routes={0: [(0, 0.2), (1, 0.5), (2, 0.3)], 1: [(0, 1.0), (1, 3.0)]}))
    models = ["a", "b", "a", "a", "b", "b", "a"] * 30
    got = []
    for m in models:
        got.append(front.pick_engine(m))
        if m == "a":
            front.pick_engine("base-model")      # not routed by the policy: never shifts its draws
    want = [twin.pick(i, 0 if m == "a" else 1, np.array([0, 1, 2]) if m == "a" else np.array([0, 1]), None)
            for i, m in enumerate(models)]
    assert got == want
    shares = np.bincount([e for e, m in zip(got, models) if m == "a"], minlength=3) / models.count("a")
    assert abs(shares[1] - 0.5) < 0.15


def test_front_counts_its_requests_in_flight_and_picks_among_candidates():
    from lora_opt.emulate.router import RouteTable
    eps = ["http://h:1/v1", "http://h:2/v1"]
    front = RouteTable(_table(eps[:1], ["a"]), 0, policy="least-requests", endpoints=eps,
                       candidates={"a": eps, "b": eps[1:]})
    for _ in range(4):
        front.pick_engine("a")
    assert front.view.in_flight.tolist() == [2, 2]      # ties drawn, then the other one
    front.done(0)
    front.done(0)
    assert front.pick_engine("a") == 0                  # fewest in flight
    assert {front.pick_engine("b") for _ in range(5)} == {1}   # its only candidate
    assert front.requests == 10


def test_round_robin_and_consistent_hash_fronts_match_the_twin():
    from lora_opt.emulate.router import RouteTable
    from twin.routers import RouterSetup, make_router
    eps = [f"http://h:{p}/v1" for p in range(1, 5)]
    ids = [f"ad{k}" for k in range(12)]
    models = [ids[k % 12] for k in range(0, 300, 7)]
    for policy in ("round-robin", "consistent-hash"):
        front = RouteTable(_table(eps, ids), 1, policy=policy, endpoints=eps)
        twin = make_router(policy, RouterSetup(4, sorted(ids), seed=1))
        order = sorted(ids)
        assert [front.pick_engine(m) for m in models] == \
            [twin.pick(i, order.index(m), np.arange(4), None) for i, m in enumerate(models)], policy


def test_a_policy_reading_metrics_needs_the_emulated_engines():
    from lora_opt.emulate.router import RouteTable
    from lora_opt.errors import InputError
    with pytest.raises(InputError, match="lora-affinity: reads the instances' metrics"):
        RouteTable(_table(["http://h:1/v1"], ["a"]), 0, policy="lora-affinity")


def test_cli_refuses_a_policy_without_a_router_and_instances_with_a_placement(tmp_path):
    path = tmp_path / "sc.yaml"
    path.write_text(yaml.safe_dump(INSTANCE))
    base = ["--scenario", str(path), "--port", str(_free_port())]
    for extra, message in ((["--router", "least-requests"], "--router least-requests: needs --router-port"),
                           (["--router", "fastest"], "invalid choice: 'fastest'"),
                           (["--adapters", "lazy"], "invalid choice: 'lazy'")):
        r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "emulate", *base, *extra], capture_output=True,
                           text=True, env=_env(), cwd=ROOT, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "emulate", "--placement", str(tmp_path / "p.json"),
                        "--instances", "2"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--instances: a placement's fleet has one instance per GPU" in r.stderr


def test_neither_the_router_nor_its_clients_send_on_a_connection_being_closed():
    """Issue 38's two failed requests (``errors == 1`` in the least-requests and lora-affinity on-demand
    consistency runs, on the code of 2026-12-03 before ee86568): the router's connection pool kept an idle
    connection 5 s (httpx's default), exactly the instance's keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE):
    a request sent on a connection idle for ~5 s reached an instance closing it in the same loop turn --
    ``ReadError: connection lost``, the router's 502 (a request that reached an instance is never retried).
    The pool lets a connection go after KEEPALIVE_EXPIRY_S, well before the instance's keep-alive: one idle
    for a moment is reused, one idle for nearly the keep-alive is not.  The same race one hop earlier: the
    router keeps a client's idle connection ROUTER_KEEPALIVE_S, longer than clients' pools keep theirs (5 s),
    so a connection idle past 5 s still carries a request.  The servers are the fleet's own (their
    keep-alives); the instance's app notes which of the router's connections (client port) carried each
    request."""
    import json
    import re
    import time

    import httpx

    from lora_opt.emulate.fleet import INSTANCE_KEEPALIVE_S, _server, front_server
    from lora_opt.emulate.router import RouteTable
    from lora_opt.http_pool import KEEPALIVE_EXPIRY_S
    from lora_opt.replan.router_config import HealthChecks
    port_of = {}

    async def instance(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        port_of[json.loads(body)["prompt"]] = scope["client"][1]
        out = b'{"object": "text_completion", "choices": []}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    async def raw_post(reader, writer, prompt: str) -> int:
        """A request on one kept-alive client connection to the router; 0: the router had closed it."""
        body = json.dumps({"model": "a", "prompt": prompt}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(re.search(rb"content-length: (\d+)", head, re.I).group(1)))
        except (asyncio.IncompleteReadError, ConnectionError):
            return 0
        return int(head.split()[1])

    async def run():
        base = free_ports(2)
        inst = _server(instance, "127.0.0.1", base, "warning")
        table = RouteTable({"a": [{"endpoint": f"http://127.0.0.1:{base}/v1", "weight": 1.0}]},
                           health=HealthChecks(interval_s=0))        # no /health checks on the pool
        front = front_server(table, "127.0.0.1", base + 1)
        tasks = [asyncio.ensure_future(s.serve()) for s in (inst, front)]
        while not (inst.started and front.started):
            assert not any(t.done() for t in tasks), "a server did not start"
            await asyncio.sleep(0.01)
        statuses = []
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", base + 1)
            statuses.append(await raw_post(reader, writer, "client-1"))
            t_client = time.perf_counter()
            async with httpx.AsyncClient(trust_env=False, timeout=30,
                                         limits=httpx.Limits(max_keepalive_connections=0)) as c:
                for prompt, idle in (("a", 0.0), ("b", 0.3), ("c", INSTANCE_KEEPALIVE_S - 0.25)):
                    await asyncio.sleep(idle)
                    r = await c.post(f"http://127.0.0.1:{base + 1}/v1/completions", json={"model": "a", "prompt": prompt})
                    statuses.append(r.status_code)
            await asyncio.sleep(max(0.0, t_client + INSTANCE_KEEPALIVE_S + 0.5 - time.perf_counter()))
            statuses.append(await raw_post(reader, writer, "client-2"))
            writer.close()
        finally:
            for s in (inst, front):
                s.should_exit = True
            await asyncio.gather(*tasks)
        return statuses

    statuses = asyncio.run(run())
    assert KEEPALIVE_EXPIRY_S < INSTANCE_KEEPALIVE_S - 0.25
    assert statuses[1:4] == [200, 200, 200] and statuses[0] == 200
    assert port_of["a"] == port_of["b"], "a connection idle for 0.3 s is reused (the pool works)"
    assert port_of["c"] != port_of["b"], (f"a connection idle {INSTANCE_KEEPALIVE_S - 0.25:g} s of the instance's "
                                          f"{INSTANCE_KEEPALIVE_S:g}-s keep-alive carried a request: it may be closing")
    assert statuses[4] == 200, (f"the router closed a client's connection idle {INSTANCE_KEEPALIVE_S + 0.5:g} s: "
                                "a pooled client (5 s) would have sent on it as it closed")


def test_on_demand_placement_instances_serve_every_adapter_and_preload_their_own(tmp_path):
    """``--adapters on-demand``: each GPU's instance lists every adapter its --max-lora-rank admits;
    the placed ones are resident at start-up, the others on disk (the fleet twin's instances)."""
    import json

    from lora_opt.emulate.fleet import make_instance, specs_from_placement
    gpu = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3, "max_num_seqs": 64,
           "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}
    placement = {"profile": "llama-3.1-8b-h100-64gb", "policy": "test",
                 "adapters": [{"id": f"ad{i}", "rank": 8 if i < 4 else 16, "rate": 0.1} for i in range(5)],
                 "gpus": [gpu, {**gpu, "max_lora_rank": 16}],
                 "routes": {"ad0": [[0, 1.0]], "ad1": [[0, 1.0]], "ad2": [[1, 1.0]], "ad3": [[1, 1.0]], "ad4": [[1, 1.0]]}}
    (tmp_path / "placement.json").write_text(json.dumps(placement))
    specs = specs_from_placement(str(tmp_path / "placement.json"), base_port=9000, host=None, adapters="on-demand")
    assert [s.preloaded for s in specs] == [("ad0", "ad1"), ("ad2", "ad3", "ad4")]
    inst = [make_instance(s, speed=1.0) for s in specs]
    assert [sorted(i.adapters) for i in inst] == [["ad0", "ad1", "ad2", "ad3"], [f"ad{k}" for k in range(5)]]
    for i, want in zip(inst, (({"ad0", "ad1"}, {"ad0", "ad1"}), ({"ad3", "ad4"}, {"ad2", "ad3", "ad4"}))):
        gpu, cpu = _residency(i.engine.state)   # max_loras 2 GPU slots, max_cpu_loras 3: the last preloaded stay
        assert ({a for a, k in i.adapters.items() if gpu[k]}, {a for a, k in i.adapters.items() if cpu[k]}) == want


def test_a_malformed_router_table_or_lora_module_is_bad_input_naming_it(tmp_path):
    """router.json beside the placement and a JSON ``--lora-modules`` entry are read by twin.parsing:
    a malformed one is an InputError (exit 2) naming the file or option."""
    import json

    from lora_opt.emulate.fleet import parse_lora_modules, specs_from_placement
    from lora_opt.errors import InputError
    gpu = {"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 1, "max_num_seqs": 64,
           "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}
    (tmp_path / "placement.json").write_text(json.dumps({
        "profile": "llama-3.1-8b-h100-64gb", "policy": "test", "adapters": [{"id": "a", "rank": 8, "rate": 0.1}],
        "gpus": [gpu], "routes": {"a": [[0, 1.0]]}}))
    (tmp_path / "router.json").write_text('{"a": [')
    with pytest.raises(InputError, match=f"{tmp_path / 'router.json'}: not valid JSON"):
        specs_from_placement(str(tmp_path / "placement.json"), base_port=None, host=None)
    with pytest.raises(InputError, match="--lora-modules: bad JSON module"):
        parse_lora_modules(['{"name": "a", "name": "b", "path": "/x"}'], 8)
    assert parse_lora_modules(['{"name": "a", "path": "/nowhere"}'], 8) == [{"id": "a", "rank": 8, "rate": 1.0}]


def test_the_library_call_serves_what_the_options_ask_without_the_cli():
    """``lora_opt.emulate.launch.emulate`` is the command without its parsing: the instances its options ask for,
    their start-up lines to ``ready`` once they listen, served until every instance was shut down."""
    import threading

    import httpx

    from lora_opt.emulate.launch import EmulateOptions, emulate, instance_specs
    from twin.flags import EngineFlags
    port = free_ports(2)
    options = EmulateOptions(profile="llama-3.1-8b-h100-64gb", lora_modules=("a=/nowhere/a", "b=/nowhere/b"),
                             engine=EngineFlags(max_loras=2), port=port, instances=2, adapters="on-demand", speed=10)
    specs = instance_specs(options)
    assert [(s.name, s.port, s.preloaded) for s in specs] == [("instance 0", port, ()), ("instance 1", port + 1, ())]
    lines, listening = [], threading.Event()
    server = threading.Thread(target=emulate, args=(options,),
                              kwargs={"ready": lambda ls: (lines.extend(ls), listening.set())}, daemon=True)
    server.start()
    assert listening.wait(60)
    assert lines == [f"instance {i}: meta-llama/Llama-3.1-8B-Instruct + 2 adapters on http://127.0.0.1:{port + i}/v1 "
                     "(speed 10, imitating vLLM 0.8.5)" for i in range(2)]
    with httpx.Client(timeout=30, trust_env=False) as c:
        assert [m["id"] for m in c.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]][1:] == ["a", "b"]
        for i in range(2):
            c.post(f"http://127.0.0.1:{port + i}/emulator/shutdown")
    server.join(30)
    assert not server.is_alive()

def _residency(state):
    from numba import njit

    @njit
    def read(s):
        return s.gpu_res.copy(), s.cpu_res.copy()
    return read(state)


# ---- consistency with the fleet twin -------------------------------------------------------------
def _twin_fleet(policy: str, adapters: str):
    """The fleet twin on the consistency stream: (requests, adapter ids, fleet metrics, the fleet run)."""
    from twin.scenario import scenario_from_dict
    from twin.workload import generate_requests
    fleet_sc = scenario_from_dict({**INSTANCE, "adapters": [{**g, "rate": g["rate"] * K} for g in INSTANCE["adapters"]]})
    req = generate_requests(fleet_sc, fleet_sc.resolved_engine(fleet_sc.load_profile()).max_model_len)
    ids, fr = _simulate(policy, adapters, req)
    return req, ids, fleet_metrics(fr), fr


def _simulate(policy: str, adapters: str, req):
    """(adapter ids, the fleet twin's run) of the consistency fleet on ``req``."""
    from lora_opt.placement.instances import routing_seed
    from twin.fleet import FleetEngine, simulate_fleet
    from twin.routers import RouterSetup, make_router
    from twin.scenario import scenario_from_dict
    one = scenario_from_dict(INSTANCE)
    ids, _, _ = one.adapter_table()
    n = len(ids)
    preloaded = np.zeros(0, np.int64) if adapters == "on-demand" else None
    engines = [FleetEngine(one, np.arange(n), preloaded) for _ in range(K)]
    setup = RouterSetup(K, list(ids), seed=routing_seed(SEED), routes={a: [(e, 1.0) for e in range(K)] for a in range(n)})
    return list(ids), simulate_fleet(engines, req, make_router(policy, setup))


def twin_ttft_band(policy: str, adapters: str, req, want_ttft: float) -> tuple[float, float]:
    """The fleet twin's own spread of mean TTFT (ms, min and max) over its run and BAND_RUNS runs whose
    arrivals are each moved later by up to JITTER_MS (uniform): a policy that reads state (in flight,
    scraped metrics) decides by the instant, and a few ms move its mean TTFT by -10..+20 % on this stream
    (lora-affinity, least-requests; the static and round-robin twins move < 1 %).  The emulated fleet's
    HTTP path moves its instants that much, so its mean TTFT is judged against this band."""
    from twin.workload import Requests
    rng = np.random.default_rng(SEED)
    ttfts = [want_ttft]
    for _ in range(BAND_RUNS):
        arrival = np.sort(req.arrival + rng.uniform(0.0, JITTER_MS / 1000.0, len(req.arrival)))
        moved = Requests(arrival=arrival, adapter=req.adapter, in_len=req.in_len, out_len=req.out_len)
        ttfts.append(fleet_metrics(_simulate(policy, adapters, moved)[1])[1])
    return min(ttfts), max(ttfts)


def fleet_metrics(fr) -> tuple[float, float, float]:
    """(throughput tok/s, mean TTFT ms, mean ITL ms) of a fleet twin run: sums and pooled samples."""
    res = [r for r in fr.engines if r.samples]
    ttft = np.concatenate([r.samples["ttft_ms"] for r in res])
    itl = sum(float((r.samples["itl_ms"] * r.samples["itl_count"]).sum()) for r in res)
    count = sum(int(r.samples["itl_count"].sum()) for r in res)
    return sum(r.throughput_tok_s for r in fr.engines), float(ttft.mean()), itl / count


def _emulated_run(tmp_path, policy: str, adapters: str, req, ids):
    from lora_opt.emulate.client import replay, summarise
    path = tmp_path / "instance.yaml"
    path.write_text(yaml.safe_dump(INSTANCE))
    base, router = free_ports(K), _free_port()
    emu = Emulator(["--scenario", str(path), "--instances", str(K), "--port", str(base), "--router-port", str(router),
                    "--router", policy, "--adapters", adapters, "--speed", str(SPEED), "--seed", str(SEED)])
    try:
        records = asyncio.run(replay(f"http://127.0.0.1:{router}", req, ids, SPEED))
        got = summarise(records, SPEED, INSTANCE["duration_s"])
        failed = [f"request {k} (sent at {r.sent:.3f} s): {r.error or f'HTTP {r.status}'}"
                  for k, r in enumerate(records) if r.status != 200]
        import httpx
        with httpx.Client(timeout=10, trust_env=False) as c:
            lag = max(c.get(f"http://127.0.0.1:{base + i}/emulator/stats").json()["lag_ms"]["p99"] for i in range(K))
            served = [int(sum(float(line.split()[-1]) for line in c.get(f"http://127.0.0.1:{base + i}/metrics").text
                                  .splitlines() if line.startswith("vllm:request_success_total{")))
                      for i in range(K)]
    finally:
        assert emu.stop() == 0
    return got, lag, served, failed


POLICIES = ["static", "round-robin", "least-requests", "power-of-two", "consistent-hash", "lora-affinity"]


def check_consistency(tmp_path, policy: str, adapters: str = "static"):
    """The emulated fleet vs the fleet twin on the same open-loop stream: throughput within 2 %, mean
    ITL within 5 %, mean TTFT within 5 % of the twin's own band (:func:`twin_ttft_band`: the twin's run
    and its runs with the arrivals jittered by the HTTP path's few ms -- a single point for the policies
    that read no state).  Every request answered.  A miss on a run the machine delayed (client send
    lateness or engine lag p99 > NOISY_MS) is retried, up to 3 runs; every run noisy -> skip, a quiet
    miss fails."""
    req, ids, want, fr = _twin_fleet(policy, adapters)
    lo, hi = twin_ttft_band(policy, adapters, req, want[1])
    shares = np.bincount(fr.engine_of[fr.engine_of >= 0], minlength=K)
    quiet_miss = None
    for attempt in range(3):
        got, lag, served, failed = _emulated_run(tmp_path, policy, adapters, req, ids)
        ratios = (got.throughput_tok_s / want[0], got.ttft_mean_ms / want[1], got.itl_mean_ms / want[2])
        noisy = max(got.send_late_p99_ms, lag) > NOISY_MS
        print(f"{policy}/{adapters} attempt {attempt}: twin {want} (TTFT band {lo:.0f}..{hi:.0f} ms) "
              f"shares {shares.tolist()}, emulator "
              f"{got.as_dict()} served {served}, engine lag p99 {lag:.1f} ms, ratios {ratios}, noisy {noisy}")
        assert got.errors == 0, f"{policy}/{adapters}: failed requests through the router: {failed[:5]}"
        if abs(ratios[0] - 1) <= 0.02 and lo * 0.95 <= got.ttft_mean_ms <= hi * 1.05 and abs(ratios[2] - 1) <= 0.05:
            return ratios
        if not noisy:
            quiet_miss = ratios
    if quiet_miss is None:
        pytest.skip(f"every run at speed {SPEED:g} was delayed by the machine's other jobs (p99 > {NOISY_MS:g} ms)")
    pytest.fail(f"{policy}: the emulated fleet missed the fleet twin on a quiet run: ratios {quiet_miss} "
                f"(TTFT band {lo / want[1]:.3f}..{hi / want[1]:.3f} of the twin's run)")


@pytest.mark.slow
def test_emulated_fleet_matches_the_fleet_twin_lora_affinity_on_demand(tmp_path):
    """The policy reading most (scraped metrics) with adapters loaded on first use."""
    check_consistency(tmp_path, "lora-affinity", "on-demand")


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_emulated_fleet_matches_the_fleet_twin(tmp_path, policy):
    check_consistency(tmp_path, policy)
