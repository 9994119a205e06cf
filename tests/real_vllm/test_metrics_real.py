"""``/metrics`` of real vLLM 0.32 and of ``lora-opt emulate`` started with the same flags, under the
same requests: the families lora-opt reads (lora_opt.validate.live.SCRAPED, the probe's
``vllm:cache_config_info``, request success totals, the latency histograms) have the same names,
label names, types, buckets and meaning, and lora-opt's own parsers read both alike.

The requests (both servers, ``--max-loras 2``): three on two adapters (r8-a twice, r16-a), then,
once they run, one on r32-a, which must wait for a LoRA slot; scrapes before, while the four are in
the engine, after they finish, and after a client leaves a stream (an abort).  Quirks
of 0.32 the emulator imitates (docs/emulate.md): ``vllm:lora_requests_info`` keeps one series per
label set ever seen (value: update time), lists the same adapters in both labels -- those with a
request that has produced output, so the waiting r32-a is in neither -- and a client's disconnect is
not counted in ``request_success_total{finished_reason="abort"}``.
"""
from __future__ import annotations

import asyncio
import warnings

import pytest
from real_vllm_tier import tier_command
from test_emulate_metrics import (
    FAMILIES,
    MAX_TOKENS,
    SCRAPED_NAMES,
    check_meaning,
    emulator,
    exercise,
    families,
)

from lora_opt.probe.measure import kv_tokens_from_metrics
from lora_opt.validate.live import SCRAPED, parse_scrape


@pytest.fixture(scope="module")
def emulated(tier):
    """``lora-opt emulate`` with the shared real server's flags (tests/real_vllm/conftest.py
    ``vllm_server``: the tier's model and adapters), imitating the tier's vLLM version."""
    with emulator("--model", tier["model"], "--vllm-version", tier["vllm_version"],
                  "--served-model-name", tier["served_model_name"],
                  "--lora-modules", *[f"{n}={a['path']}" for n, a in tier["adapters"].items()]) as url:
        yield url


#: the real side's requests are long (the window in which the fourth request must find the three still
#: running is their decode time: ~8 s of 480 tokens here, too short on a faster machine -- CI once saw all
#: four done before a scrape caught them), so its server's context is longer than the shared one's
REAL_MAX_MODEL_LEN, REAL_MAX_TOKENS = 2048, 2000


@pytest.fixture(scope="module")
def fresh_server(tier, launch_vllm):
    """A real vLLM of its own, with the shared server's flags but a longer context: the scrapes compare
    counters and series from a clean start (the shared server carries what earlier tests left in its
    metrics).  A list of one: ``runs`` replaces a server that dies under it."""
    servers = [launch_vllm(tier_command(tier, max_model_len=REAL_MAX_MODEL_LEN))]
    yield servers
    servers[-1].stop()


#: runs of the harness a side may take: a run that missed the window, or whose connection the server
#: closed, is run again
RUN_TRIES = 3


@pytest.fixture(scope="module")
def runs(fresh_server, emulated, tier, launch_vllm) -> dict:
    import httpx
    assert httpx.get(emulated + "/version").json()["version"] == tier["vllm_version"]

    # the window is a race (the real server's speed is the machine's): a run whose scrapes never saw the four
    # in the engine, the three running, is the harness's miss, not the server's answer -- run again.  A
    # connection the server closed under a scrape (CI once saw "Server disconnected without sending a
    # response" mid-run; never reproduced here) is run again too; a real server that died is started
    # afresh once, with its log tail as a warning -- these tests compare /metrics, not crash resistance
    def until_reached(side: str, max_tokens: int) -> dict:
        run, failures, restarted = None, [], False
        for _ in range(RUN_TRIES):
            base = fresh_server[-1].url if side == "real" else emulated
            try:
                run = asyncio.run(exercise(base, max_tokens))
            except httpx.TransportError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                server = fresh_server[-1]
                if side == "real" and server.proc is not None and server.proc.poll() is not None:
                    warnings.warn(f"the real vLLM exited ({server.proc.returncode}) under the metrics run: "
                                  f"{server.log_tail(40)}", stacklevel=1)
                    if restarted:
                        pytest.fail(f"the real vLLM died twice under the metrics run: {server.log_tail(40)}")
                    restarted = True
                    fresh_server.append(launch_vllm(tier_command(tier, max_model_len=REAL_MAX_MODEL_LEN)))
                continue
            if run["reached"]:
                break
        if run is None:
            pytest.fail(f"{side}: every metrics run lost its connection: {failures}")
        if failures:
            warnings.warn(f"{side}: metrics runs lost their connection before one completed: {failures}", stacklevel=1)
        return run
    out = {"real": until_reached("real", REAL_MAX_TOKENS), "emulator": until_reached("emulator", MAX_TOKENS)}
    if not out["real"]["reached"]:
        # the window is the machine's timing, not the server's answer: on a loaded 2-core CI machine every try
        # can miss it (CI stop 41). Say so instead of failing on a measurement that was never made.
        pytest.skip(f"the harness never caught the real server with 3 running and 1 waiting in {RUN_TRIES} tries "
                    f"(trace {out['real']['trace']}): nothing compared")
    return out


def test_families_types_labels_and_buckets_match(runs):
    shapes = {}
    for side, run in runs.items():
        fam = families(run["during"])
        assert set(fam) == set(FAMILIES), (side, set(FAMILIES) - set(fam))
        shapes[side] = {}
        for name, (typ, samples) in fam.items():
            assert typ == FAMILIES[name], (side, name, typ)
            shapes[side][name] = ({s[0] for s in samples}, {k for s in samples for k in s[1]},
                                  {s[1].get("le") for s in samples} - {None},
                                  {s[1].get("finished_reason") for s in samples} - {None})
    for name in FAMILIES:
        assert shapes["real"][name] == shapes["emulator"][name], name
    # the sample names lora-opt keeps from a scrape are in both
    for side, run in runs.items():
        kept = {ln.split(b"{")[0].split(b" ")[0] for ln in run["during"].encode().split(b"\n") if ln.startswith(SCRAPED)}
        assert SCRAPED_NAMES <= kept, side


@pytest.mark.parametrize("side", ["real", "emulator"])
def test_meaning_before_during_after_and_abort(runs, side):
    check_meaning(runs[side], "0.32")


def test_lora_opt_parsers_read_both_alike(runs):
    parsed = {}
    for side, run in runs.items():
        lines = [ln for ln in run["during"].encode().split(b"\n") if ln.startswith(SCRAPED)]
        parsed[side] = parse_scrape(lines)
        assert kv_tokens_from_metrics(run["during"]) > 0, side
    for side, v in parsed.items():
        assert (v["running"], v["waiting"], v["running_loras"], v["waiting_loras"], v["max_lora"]) == (3, 1, 2, 2, 2), side
        assert 0 < v["kv_usage"] <= 1 and v["generation_tokens_total"] > 0, side
        idle = parse_scrape([ln for ln in runs[side]["after"].encode().split(b"\n") if ln.startswith(SCRAPED)])
        assert (idle["running"], idle["running_loras"], idle["waiting_loras"], idle["max_lora"]) == (0, 0, 0, 2), side


# ---- the fleet router in front of real vLLM ----------------------------------------------------
def test_router_in_front_of_real_vllm_and_a_dead_instance(vllm_server, tier):
    """The router forwards to real vLLM as to an emulator: streams, vLLM's own errors and cards pass
    through; an adapter routed to a dead instance is a 502; the router's own errors are shaped as
    real vLLM answers them (an unknown route or method: the same status and body)."""
    import httpx
    from test_emulate_router import Router, _free_port

    dead = f"http://127.0.0.1:{_free_port()}/v1"
    router = Router({"r8-a": [{"endpoint": vllm_server.url + "/v1", "weight": 1.0}]})
    # a second router for the dead instance: the first sends names it does not route (the base model,
    # an unknown adapter) to the real instance, its only one
    to_dead = Router({"gone": [{"endpoint": dead, "weight": 1.0}]})
    try:
        with httpx.Client(timeout=120, trust_env=False) as c:
            r = c.post(router.url + "/v1/completions", json={"model": "r8-a", "prompt": [11, 12, 13], "max_tokens": 5,
                                                             "ignore_eos": True, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            r = c.post(router.url + "/v1/completions", json={"model": "r8-a", "prompt": [11, 12, 13], "max_tokens": 5,
                                                             "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            r = c.post(router.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
            direct = c.post(vllm_server.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
            assert (r.status_code, r.json()) == (direct.status_code, direct.json()) and r.status_code == 404
            r = c.post(to_dead.url + "/v1/completions", json={"model": "gone", "prompt": "hi"})
            assert r.status_code == 502 and r.json()["error"]["type"] == "Bad Gateway"
            ids = [m["id"] for m in c.get(router.url + "/v1/models").json()["data"]]
            assert ids[0] == tier["served_model_name"] and set(ids[1:]) == set(tier["adapters"])
            for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions"), ("DELETE", "/v1/models")):
                mine, real = c.request(method, router.url + path), c.request(method, vllm_server.url + path)
                assert (mine.status_code, mine.json()) == (real.status_code, real.json()), (method, path)
    finally:
        router.stop()
        to_dead.stop()
