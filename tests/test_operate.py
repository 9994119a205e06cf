"""``lora-opt operate``: the closed loop on an emulated fleet -- a real Prometheus scraping the fleet's router,
demand that dropped (a GPU can go), the cycle that applies the replan, the next that keeps the fleet
(hysteresis), a cycle whose Prometheus is down (nothing changed, said), and an operate restarted with the
same ``--out`` continuing from its state file."""
from __future__ import annotations

import csv
import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest
import yaml
from test_emulate import Emulator
from test_prometheus_demand import _prometheus_or_skip

from lora_opt.apply.operate import decide
from lora_opt.bench.prometheus_server import PrometheusServer
from lora_opt.cli import main
from lora_opt.emulate.fleet import free_ports
from lora_opt.errors import EXIT_OK
from lora_opt.placement.plan import Placement

PROFILE = "llama-3.1-8b-h100-64gb"
SPEED = 5.0


def _gpu(max_loras: int) -> dict:
    return {"max_loras": max_loras, "max_lora_rank": 8, "max_cpu_loras": max_loras, "max_num_seqs": 8,
            "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}


def test_hysteresis_acts_only_for_a_saved_or_a_starving_gpu():
    two = Placement.from_dict({"profile": PROFILE, "adapters": [{"id": "a", "rank": 8, "rate": 1.0},
                                                                {"id": "b", "rank": 8, "rate": 1.0}],
                               "gpus": [_gpu(1), _gpu(1)], "routes": {"a": [[0, 1.0]], "b": [[1, 1.0]]}})
    one = Placement.from_dict({**two.to_dict(), "gpus": [_gpu(2)], "routes": {"a": [[0, 1.0]], "b": [[0, 1.0]]},
                               "meta": {"gpus_used": 1}})
    same = Placement.from_dict({**two.to_dict(), "meta": {"gpus_used": 2}})
    assert decide(two, one, []) == (True, "saves 1 GPU(s) (2 -> 1)")
    assert decide(two, same, [])[0] is False and "the fleet is kept" in decide(two, same, [])[1]
    assert decide(two, same, ["gpu1"])[0] is True


def _send(front: int, stop: threading.Event, adapters: list[str], period_s: float) -> None:
    with httpx.Client(timeout=60, trust_env=False) as c:
        k = 0
        while not stop.is_set():
            c.post(f"http://127.0.0.1:{front}/v1/completions",
                   json={"model": adapters[k % len(adapters)], "prompt": [1] * 32, "max_tokens": 4})
            k += 1
            stop.wait(period_s)


def test_operate_consolidates_a_fleet_whose_demand_dropped_then_keeps_it(tmp_path, capsys):
    _prometheus_or_skip()
    ids = [f"a{i}" for i in range(6)]
    wl = {"profile": PROFILE, "name": "busy", "rho": 0.9, "engine": {"max_num_seqs": 8},
          "adapters": [{"id": a, "rank": 8, "rate": 3.0} for a in ids],
          "evaluation": {"lengths": {"source": "mean", "mean_in": 200, "mean_out": 40}, "duration_s": 120, "seed": 0}}
    (tmp_path / "busy.yaml").write_text(yaml.safe_dump(wl))
    for a in ids:
        (tmp_path / "adapters" / a).mkdir(parents=True)
        (tmp_path / "adapters" / a / "adapter_config.json").write_text(json.dumps({"r": 8}))
    assert main(["place", "--workload", str(tmp_path / "busy.yaml"), "--gpus", "4", "--verify-s", "120",
                 "--out", str(tmp_path / "placed")]) == EXIT_OK
    placed = Placement.load(tmp_path / "placed")
    assert sum(1 for g in range(len(placed.gpus)) if placed.adapters_on(g)) >= 2, "the busy demand needs 2+ GPUs"
    base, front = free_ports(8), free_ports(1)
    fleet = Emulator(["--placement", str(tmp_path / "placed"), "--base-port", str(base), "--router-port", str(front),
                      "--speed", str(SPEED)], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    stop = threading.Event()
    sender = threading.Thread(target=_send, args=(front, stop, ids[:2], 0.5), daemon=True)
    prom, out = None, tmp_path / "operate"
    server_cmd = f"{sys.executable} -m lora_opt.cli emulate --profile {PROFILE} --speed {SPEED}"
    argv = ["operate", str(tmp_path / "placed"), "--router", f"http://127.0.0.1:{front}", "--window", "20s",
            "--interval-s", "1", "--base-port", str(base), "--server-cmd", server_cmd, "--adapter-dir",
            str(tmp_path / "adapters"), "--verify-s", "120", "--out", str(out), "--no-track"]
    try:
        prom = PrometheusServer([f"127.0.0.1:{front}"], tmp_path / "prometheus", scrape_interval="1s")
        sender.start()
        time.sleep(8.0)                         # the light demand: 2 adapters, 2 requests/s in all
        assert main([*argv[:2], "--prometheus", prom.url, *argv[2:], "--cycles", "2"]) == EXIT_OK
        printed = capsys.readouterr().out
        rows = list(csv.DictReader(open(out / "cycles.csv")))
        assert [r["decision"] for r in rows] == ["applied", "keep"], printed
        assert "saves" in rows[0]["why"] and "the fleet is kept" in rows[1]["why"]
        assert int(rows[0]["gpus_planned"]) < int(rows[0]["gpus_running"])
        assert int(rows[1]["gpus_running"]) == int(rows[0]["gpus_planned"])      # the fleet runs the new placement
        state = json.loads((out / "operate-state.json").read_text())
        assert state["cycle"] == 2 and state["current"].endswith("cycle-0001/placement.json")
        # every request answered while the fleet changed under it
        with httpx.Client(timeout=30, trust_env=False) as c:
            text = c.get(f"http://127.0.0.1:{front}/metrics").text
        assert "inference_model_request_error_total{" not in text, text[-2000:]
        # a router that lost its table (restarted from its file): the next cycle puts it back
        with httpx.Client(timeout=30, trust_env=False) as c:
            routed = c.get(f"http://127.0.0.1:{front}/router/routes").json()["routes"]
            assert c.post(f"http://127.0.0.1:{front}/router/routes", json={"routes": {ids[0]: []}}).status_code == 200
        # Prometheus gone: the cycle reads no demand, changes nothing, says why; a restarted operate continues
        prom.stop()
        prom = None
        assert main([*argv[:2], "--prometheus", f"http://127.0.0.1:{free_ports(1)}", *argv[2:], "--cycles", "1"]) == EXIT_OK
        rows = list(csv.DictReader(open(out / "cycles.csv")))
        assert [r["cycle"] for r in rows] == ["1", "2", "3"] and rows[2]["decision"] == "keep"
        assert "no demand read" in rows[2]["why"] and "does not answer" in rows[2]["why"]
        assert rows[2]["router_fixed"] == "1" and rows[1]["router_fixed"] == "0"
        with httpx.Client(timeout=30, trust_env=False) as c:
            assert c.get(f"http://127.0.0.1:{front}/router/routes").json()["routes"] == routed
    finally:
        stop.set()
        if prom is not None:
            prom.stop()
        for f in out.glob("cycle-*/apply/apply.json"):
            for info in json.loads(f.read_text())["launched"].values():
                if info.get("pid"):
                    try:
                        os.kill(info["pid"], signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        fleet.stop()
