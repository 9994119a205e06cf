"""Demand from Prometheus (``lora_opt.placement.prometheus_demand``, ``place/replan --prometheus``): the
router's per-adapter series under the Gateway API Inference Extension's names, scraped by a real
Prometheus (Debian's package; ``tools/prometheus/install.sh``) started on 127.0.0.1 by the test, read back
through PromQL; the errors a user meets (no server, not a Prometheus, a window too short, no series,
stale series, a model the workload lacks)."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import yaml
from test_emulate import Emulator, _free_port
from test_router_health import HealthyFake

from lora_opt.bench.prometheus_server import PrometheusServer, prometheus_binary
from lora_opt.cli import main
from lora_opt.emulate.fleet import free_ports
from lora_opt.emulate.router_metrics import usage_of
from lora_opt.errors import EXIT_BAD_INPUT, EXIT_OK, InputError
from lora_opt.placement.prometheus_demand import (Prometheus, PrometheusDemand, _by_model, _spread, parse_duration,
                                                  read_demand, workload_from_demand)
from lora_opt.placement.workload_file import workload_from_dict

PROFILE = "llama-3.1-8b-h100-64gb"
SENT = {"ad0": 16, "ad1": 8}                # requests per adapter
PROMPT, OUT = 48, 6                         # tokens per request


# ---- no server needed -------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("1h", 3600), ("90s", 90), ("1h30m", 5400), ("500ms", 0.5)])
def test_durations_are_prometheus_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "h", "1 h", "-1h", "1x", "0s"])
def test_a_bad_window_is_refused_naming_it(text):
    with pytest.raises(InputError, match="--window"):
        parse_duration(text)


def test_the_usage_and_spread_readers():
    assert usage_of(b'data: {"usage": null}\n\ndata: {"choices":[],"usage":{"prompt_tokens":7,"total_tokens":17,'
                    b'"completion_tokens":10}}\n\n') == (7, 10)
    assert usage_of(b'{"usage": null}') is None
    buckets = [({"le": "8"}, 0.0), ({"le": "16"}, 10.0), ({"le": "32"}, 10.0), ({"le": "+Inf"}, 10.0)]
    assert _spread(buckets) == 0.0                        # one bucket: no spread the buckets can show
    assert _spread([({"le": "8"}, 5.0), ({"le": "24"}, 10.0)]) == pytest.approx(6.0)   # midpoints 4 and 16


def _demand(rates, lengths=None):
    return PrometheusDemand(url="http://p", window="1h", window_s=3600, at=0.0, scrape_interval_s=15.0, rates=rates,
                            requests=sum(rates.values()) * 3600, lengths=lengths)


def test_the_workload_takes_the_windows_rates_and_lengths():
    wl = workload_from_dict({"profile": PROFILE, "adapters": [{"id": "ad0", "rank": 8, "rate": 1.0},
                                                              {"id": "ad1", "rank": 16, "rate": 1.0}]})
    out = workload_from_demand(wl, _demand({"ad0": 0.5}, {"mean_in": 100, "std_in": 10, "mean_out": 20, "std_out": 2}))
    assert [(a.id, a.rank, a.rate) for a in out.adapters] == [("ad0", 8, 0.5), ("ad1", 16, 0.0)]
    assert out.evaluation.lengths.source == "normal" and out.evaluation.lengths.mean_in == 100
    assert out.meta["rates_from_prometheus"] == "http://p" and out.meta["lengths_from_prometheus"]
    assert workload_from_demand(wl, _demand({"ad0": 0.5})).evaluation.lengths == wl.evaluation.lengths
    with pytest.raises(InputError, match="not in the workload: zz"):
        workload_from_demand(wl, _demand({"ad0": 0.5, "zz": 0.1}))
    with pytest.raises(InputError, match="no request for any adapter"):
        workload_from_demand(wl, _demand({"ad0": 0.0}))


def test_a_server_that_is_not_there_or_not_prometheus_is_named():
    with pytest.raises(InputError, match="does not answer"):
        read_demand(f"http://127.0.0.1:{_free_port()}", "1h")
    fake = HealthyFake(0)                                  # answers 404 to everything it does not know
    try:
        with pytest.raises(InputError, match="a Prometheus server"):
            read_demand(f"http://127.0.0.1:{fake.server.server_address[1]}", "1h")
    finally:
        fake.stop()
    with pytest.raises(InputError, match="not an http"):
        read_demand("127.0.0.1:9090", "1h")


# ---- a real Prometheus scraping an emulated fleet's router --------------------------------------
def _prometheus_or_skip():
    if prometheus_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: tools/prometheus/install.sh (the README's test command) installs it")
        pytest.skip("prometheus is not installed (tools/prometheus/install.sh, or set PROMETHEUS_BIN)")


@pytest.fixture(scope="module")
def scraped_fleet(tmp_path_factory):
    """``lora-opt emulate``: 2 instances of ad0, ad1 behind a router; a Prometheus scraping the router
    every second; 16 requests for ad0 and 8 for ad1 (48 prompt, 6 output tokens each) sent through it."""
    _prometheus_or_skip()
    d = tmp_path_factory.mktemp("prom")
    base, front = free_ports(2), free_ports(1)
    emu = Emulator(["--profile", PROFILE, "--lora-modules", "ad0=/nonexistent", "ad1=/nonexistent",
                    "--max-lora-rank", "16", "--instances", "2", "--port", str(base), "--router-port", str(front),
                    "--router", "round-robin", "--speed", "20"])
    prom = None
    try:
        prom = PrometheusServer([f"127.0.0.1:{front}"], d / "prometheus", scrape_interval="1s")
        with httpx.Client(timeout=60, trust_env=False) as c:
            time.sleep(1.5)                                  # a sample at 0 before the first request
            for model, n in SENT.items():
                for k in range(n):
                    body = {"model": model, "prompt": [1] * PROMPT, "max_tokens": OUT, "ignore_eos": True}
                    if k % 2:                                # streams carry usage when asked for it
                        body |= {"stream": True, "stream_options": {"include_usage": True}}
                    assert c.post(f"http://127.0.0.1:{front}/v1/completions", json=body).status_code == 200
            text = c.get(f"http://127.0.0.1:{front}/metrics").text
            time.sleep(4.0)                                  # the last counts scraped
        yield d, prom, front, text
    finally:
        if prom is not None:
            prom.stop()
        emu.stop()


def test_the_router_exports_the_inference_extensions_series(scraped_fleet):
    _, _, _, text = scraped_fleet
    for model, n in SENT.items():
        labels = f'model_name="{model}",target_model_name="{model}"'
        assert f"inference_model_request_total{{{labels}}} {float(n)}" in text
        assert f"inference_model_input_tokens_count{{{labels}}} {float(n)}" in text
        assert f"inference_model_input_tokens_sum{{{labels}}} {float(n * PROMPT)}" in text
        assert f"inference_model_output_tokens_sum{{{labels}}} {float(n * OUT)}" in text
        assert f'inference_model_running_requests{{model_name="{model}"}} 0.0' in text
    assert 'inference_model_input_tokens_bucket{le="32778.0"' in text.replace(
        'model_name="ad0",target_model_name="ad0",', "")   # the endpoint picker's own buckets


def test_a_query_prometheus_refuses_is_named_with_why(scraped_fleet):
    _, prom, _, _ = scraped_fleet
    with pytest.raises(InputError, match=r"refused 'sum\(inference_model_request_total': bad_data: .*parse error"):
        Prometheus(prom.url).query("sum(inference_model_request_total", time.time())


def test_read_demand_gives_each_adapters_rate_and_the_lengths(scraped_fleet):
    _, prom, _, _ = scraped_fleet
    demand = read_demand(prom.url, "60s")
    assert demand.scrape_interval_s == 1.0
    # Prometheus holds the counts exactly ...
    raw = _by_model(Prometheus(prom.url).query("inference_model_request_total", demand.at))
    assert raw == {m: float(n) for m, n in SENT.items()}
    # ... and increase() extrapolates the last sample to the window's end: by up to one scrape interval over
    # the ~10 s these series have lived (over an hour scraped every 15 s: under 0.5 %); both series alike
    assert sum(SENT.values()) <= demand.requests <= 1.3 * sum(SENT.values())
    assert demand.rates["ad0"] / demand.rates["ad1"] == pytest.approx(2.0, rel=0.05)
    assert demand.lengths["mean_in"] == pytest.approx(PROMPT) and demand.lengths["mean_out"] == pytest.approx(OUT)
    assert demand.per_model_lengths["ad1"] == pytest.approx((PROMPT, OUT))
    with pytest.raises(InputError, match="shorter than two scrape intervals"):
        read_demand(prom.url, "1s")


def test_place_and_replan_read_their_demand_from_prometheus(scraped_fleet, tmp_path, capsys):
    d, prom, _, _ = scraped_fleet
    (tmp_path / "w.yaml").write_text(yaml.safe_dump({
        "profile": PROFILE, "adapters": [{"id": "ad0", "rank": 8, "rate": 9.0}, {"id": "ad1", "rank": 16, "rate": 9.0}]}))
    assert main(["place", "--workload", str(tmp_path / "w.yaml"), "--gpus", "2", "--verify-s", "0",
                 "--prometheus", prom.url, "--window", "60s", "--out", str(tmp_path / "p")]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"rates from {prom.url}: " in out and "over the last 60s" in out and "lengths in 48" in out
    placed = json.loads((tmp_path / "p" / "placement.json").read_text())
    rates = {a["id"]: a["rate"] for a in placed["adapters"]}
    assert 16 / 60 <= rates["ad0"] <= 1.3 * 16 / 60 and 8 / 60 <= rates["ad1"] <= 1.3 * 8 / 60
    assert main(["replan", str(tmp_path / "p"), "--prometheus", prom.url, "--window", "60s", "--verify-s", "0",
                 "--out", str(tmp_path / "r")]) == EXIT_OK
    assert f"rates from {prom.url}" in capsys.readouterr().out
    code = main(["replan", str(tmp_path / "p"), "--prometheus", prom.url, "--window", "1s", "--out", str(tmp_path / "x")])
    assert code == EXIT_BAD_INPUT and "shorter than two scrape intervals" in capsys.readouterr().err


def test_no_series_and_stale_series_are_said(tmp_path):
    """A Prometheus that scrapes only itself has no gateway series; one whose gateway stopped has
    series that stopped within the window."""
    _prometheus_or_skip()
    port = _free_port()
    with PrometheusServer([f"127.0.0.1:{port}"], tmp_path / "none", scrape_interval="1s") as prom:
        time.sleep(2.5)
        with pytest.raises(InputError, match="has no series inference_model_request_total"):
            read_demand(prom.url, "30s")
    base, front = free_ports(1), free_ports(1)
    emu = Emulator(["--profile", PROFILE, "--lora-modules", "ad0=/nonexistent", "--max-lora-rank", "16",
                    "--port", str(base), "--router-port", str(front), "--speed", "20"])
    try:
        with PrometheusServer([f"127.0.0.1:{front}"], tmp_path / "stale", scrape_interval="1s") as prom:
            with httpx.Client(timeout=60, trust_env=False) as c:
                c.post(f"http://127.0.0.1:{front}/v1/completions", json={"model": "ad0", "prompt": [1] * 8, "max_tokens": 2})
            time.sleep(2.5)
            assert read_demand(prom.url, "30s").requests > 0
            emu.stop()                                      # the gateway goes away: its series stop
            time.sleep(3.0)
            with pytest.raises(InputError, match="stopped within the window"):
                read_demand(prom.url, "30s")
    finally:
        emu.stop()
