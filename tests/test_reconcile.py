"""The fleet brought back to its placement (``lora_opt.apply.reconcile``, what ``operate`` runs before and
between cycles), one fault kind at a time, on emulated instances each in its own process behind the router
in its own process (``emulate --routes``): an instance killed with SIGKILL (launched again with its
adapters; a request sent meanwhile waits in the router and is served), the router killed and restarted
from a stale file (its table put back), what a plan cut short leaves (an adapter loaded where it is not
placed, an instance launched where no GPU runs: unloaded, stopped), and an adapter whose load failed
held back from later plans."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lora_opt.apply.executor import ApplyOptions
from lora_opt.apply.operate import OperateConfig, Operator
from lora_opt.apply.reconcile import reconcile
from lora_opt.cli import main
from lora_opt.emulate.fleet import free_ports
from lora_opt.placement.plan import Placement
from lora_opt.placement.vllm_launch import router_table

PROFILE = "llama-3.1-8b-h100-64gb"
SPEED = 5.0
ENV = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONUNBUFFERED": "1"}
SERVER_CMD = f"{sys.executable} -m lora_opt.cli emulate --profile {PROFILE} --speed {SPEED}"


def _gpu() -> dict:
    return {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4, "max_num_seqs": 8,
            "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}


def _start(argv: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "emulate", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV, start_new_session=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"emulate {argv} did not start: {proc.wait()}")


@pytest.fixture()
def fleet(tmp_path):
    """Two GPUs (a0, a1 | a2, a3), each instance its own process; the router alone in another."""
    adapters = tmp_path / "adapters"
    for a in ("a0", "a1", "a2", "a3"):
        (adapters / a).mkdir(parents=True)
        (adapters / a / "adapter_config.json").write_text(json.dumps({"r": 8}))
    p = Placement.from_dict({"profile": PROFILE, "adapters": [{"id": a, "rank": 8, "rate": 1.0, "path": str(adapters / a)}
                                                              for a in ("a0", "a1", "a2", "a3")],
                             "gpus": [_gpu(), _gpu(), _gpu()],
                             "routes": {"a0": [[0, 1.0]], "a1": [[0, 1.0]], "a2": [[1, 1.0]], "a3": [[1, 1.0]]}})
    base, front = free_ports(3), free_ports(1)
    (tmp_path / "placement.json").write_text(json.dumps(p.to_dict()))
    (tmp_path / "router.json").write_text(json.dumps(router_table(p, base_port=base)))
    procs = {}
    for g, ids in ((0, ("a0", "a1")), (1, ("a2", "a3"))):
        procs[g] = _start(["--profile", PROFILE, "--speed", str(SPEED), "--port", str(base + g), "--max-loras", "2",
                           "--max-lora-rank", "8", "--lora-modules", *(f"{a}={adapters / a}" for a in ids)])
    procs["router"] = _start(["--routes", str(tmp_path / "router.json"), "--router-port", str(front),
                              "--retry-for-s", "30", "--health-interval-s", "0.5"])
    opts = ApplyOptions(router=f"http://127.0.0.1:{front}", server_cmd=SERVER_CMD, log_dir=tmp_path / "logs",
                        health_timeout_s=60)
    yield {"p": p, "base": base, "front": front, "procs": procs, "opts": opts, "tmp": tmp_path}
    with httpx.Client(timeout=5, trust_env=False) as c:     # the relaunched ones are not our children
        for g in range(3):
            try:
                c.post(f"http://127.0.0.1:{base + g}/emulator/shutdown")
            except httpx.HTTPError:
                pass
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _reconcile(f, known=()):
    return asyncio.run(reconcile(f["p"], opts=f["opts"], host="127.0.0.1", base_port=f["base"], known=known))


def _complete(front: int, model: str) -> int:
    with httpx.Client(timeout=120, trust_env=False) as c:
        return c.post(f"http://127.0.0.1:{front}/v1/completions",
                      json={"model": model, "prompt": [1] * 16, "max_tokens": 2}).status_code


def test_a_killed_instance_is_launched_again_and_a_request_sent_meanwhile_is_served(fleet):
    assert _reconcile(fleet).before == []                       # as placed: nothing to do
    fleet["procs"][1].send_signal(signal.SIGKILL)
    fleet["procs"][1].wait()
    answer = {}
    sender = threading.Thread(target=lambda: answer.update(status=_complete(fleet["front"], "a2")))
    sender.start()                      # its only instance is dead: the router holds it (--retry-for-s)
    time.sleep(1.0)
    r = _reconcile(fleet)
    assert any("not answering" in d for d in r.before), r
    assert r.after == [] and not r.error, r
    assert r.steps[0]["action"] == "launch" and r.steps[0]["instance"] == "gpu1"
    sender.join(60)
    assert answer.get("status") == 200, answer
    with httpx.Client(timeout=10, trust_env=False) as c:        # launched with its adapters, not loaded one by one
        ids = {m["id"] for m in c.get(f"http://127.0.0.1:{fleet['base'] + 1}/v1/models").json()["data"]}
    assert {"a2", "a3"} <= ids


def test_a_router_restarted_from_a_stale_file_gets_its_table_back(fleet):
    stale = router_table(fleet["p"], base_port=fleet["base"])
    stale["a2"] = stale["a0"]                                   # an older placement's route
    (fleet["tmp"] / "stale.json").write_text(json.dumps(stale))
    fleet["procs"]["router"].send_signal(signal.SIGKILL)
    fleet["procs"]["router"].wait()
    fleet["procs"]["router"] = _start(["--routes", str(fleet["tmp"] / "stale.json"), "--router-port",
                                       str(fleet["front"])])
    r = _reconcile(fleet)
    assert r.before == ["router: 1 adapter(s) routed otherwise (a2)"], r
    assert [s["action"] for s in r.steps] == ["route"] and r.steps[0]["adapters"] == ["a2"] and r.after == []
    assert _complete(fleet["front"], "a2") == 200


def test_what_a_plan_cut_short_left_is_undone(fleet):
    base = fleet["base"]
    stray = _start(["--profile", PROFILE, "--speed", str(SPEED), "--port", str(base + 2), "--lora-modules",
                    f"a0={fleet['tmp'] / 'adapters' / 'a0'}"])
    try:
        with httpx.Client(timeout=10, trust_env=False) as c:    # a load the cut plan made
            assert c.post(f"http://127.0.0.1:{base}/v1/load_lora_adapter",
                          json={"lora_name": "a2", "lora_path": str(fleet["tmp"] / "adapters" / "a2")}).status_code == 200
        r = _reconcile(fleet, known=[f"http://127.0.0.1:{base + 2}"])
        assert sorted(r.before) == [f"http://127.0.0.1:{base}: serves a2, not placed there",
                                    f"http://127.0.0.1:{base + 2}: answering, but no GPU of the placement runs there"]
        assert [(s["action"], s["status"]) for s in r.steps] == [("unload", "ok"), ("stop", "ok")], r.steps
        assert r.after == [] and stray.wait(30) == 0    # shut down: its only instance gone, the process ends
    finally:
        if stray.poll() is None:
            stray.kill()
        stray.wait()


def test_an_adapter_whose_load_failed_is_held_back_from_later_plans(tmp_path):
    p = Placement.from_dict({"profile": PROFILE, "adapters": [{"id": "a0", "rank": 8, "rate": 1.0},
                                                              {"id": "a1", "rank": 8, "rate": 1.0}],
                             "gpus": [_gpu(), _gpu()], "routes": {"a0": [[0, 1.0]], "a1": [[1, 1.0]]}})
    (tmp_path / "placement.json").write_text(json.dumps(p.to_dict()))
    op = Operator(tmp_path / "placement.json", OperateConfig(prometheus="http://127.0.0.1:1", router="http://x"),
                  None, tmp_path / "out", track=False)
    steps = [{"step": 1, "action": "load", "adapter": "a1", "instance": "gpu0"},
             {"step": 2, "action": "launch", "instance": "gpu2", "new_gpu": 1}]
    op._hold_failed_loads([{"step": 1, "action": "load", "status": "failed", "detail": "HTTP 404: No adapter found"}],
                          steps)
    assert list(op.held) == ["a1"] and "No adapter found" in op.held["a1"]
    assert op.held_back({"steps": steps[:1]}, p) == ["a1"]
    assert op.held_back({"steps": steps[1:]}, p) == ["a1"]     # a launch whose GPU serves it loads it too
    assert op.held_back({"steps": [{"step": 1, "action": "load", "adapter": "a0"}]}, p) == []
    op._save()
    again = Operator(tmp_path / "placement.json", OperateConfig(prometheus="http://127.0.0.1:1", router="http://x"),
                     None, tmp_path / "out", track=False)
    assert again.held == op.held                                # a restarted operate keeps holding it
    # the table a restarted router starts from: the running placement's
    assert json.loads((tmp_path / "out" / "router.json").read_text()) == router_table(p)


@pytest.mark.parametrize("table, flags, says", [
    (None, ["--router-port", "1"], "router table file not found"),
    ({"a": [{"endpoint": "http://127.0.0.1:9/v1"}]}, [], "--routes: needs --router-port"),
    ({"a": [{"endpoint": "http://127.0.0.1:9/v1", "weight": -1}]}, ["--router-port", "1"], "weight must be"),
    (["a"], ["--router-port", "1"], "is not a router table"),
    ({"a": [{"endpoint": "http://127.0.0.1:9/v1"}]}, ["--router-port", "1", "--router", "lora-affinity"],
     "reads the instances' metrics"),
])
def test_the_router_alone_refuses_bad_input(tmp_path, capsys, table, flags, says):
    path = tmp_path / "router.json"
    if table is not None:
        path.write_text(json.dumps(table))
    assert main(["emulate", "--routes", str(path), *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_plan_for_another_fleet_is_refused_and_the_fleet_untouched(fleet, capsys):
    """A plan whose instances are not the ones the router routes to (made with another --base-port)."""
    plan_dir = fleet["tmp"] / "other"
    plan_dir.mkdir()
    other = f"http://127.0.0.1:{fleet['base'] + 1}"            # only one of the fleet's two instances
    (plan_dir / "placement.json").write_text(json.dumps(fleet["p"].to_dict()))
    (plan_dir / "plan.json").write_text(json.dumps({
        "endpoints": {"gpu0": other}, "instances": [{"instance": "gpu0", "current_gpu": 0, "new_gpu": 0, "action": "keep"}],
        "steps": [{"step": 1, "action": "route", "weights": {"a0": [["gpu0", other, 1.0]]}}]}))
    router = f"http://127.0.0.1:{fleet['front']}"
    with httpx.Client(timeout=10, trust_env=False) as c:
        before = c.get(router + "/router/routes").json()["routes"]
        assert main(["apply", str(plan_dir), "--router", router, "--out", str(fleet["tmp"] / "applied"),
                     "--no-track"]) == 2
        assert "which are not the plan's instances" in capsys.readouterr().err
        assert c.get(router + "/router/routes").json()["routes"] == before


def test_a_plan_whose_load_fails_is_undone_and_its_adapter_held(fleet):
    """operate carries out a plan: a3 loaded on GPU 0 (ok), then a2, whose path no longer loads (404): the plan
    stops, the fleet is reconciled back to the running placement (a3 unloaded again), a2 is held."""
    import shutil
    tmp, base = fleet["tmp"], fleet["base"]
    shutil.rmtree(tmp / "adapters" / "a2")
    folder = tmp / "cycle"
    folder.mkdir()
    moved = Placement.from_dict({**fleet["p"].to_dict(), "routes": {"a0": [[0, 1.0]], "a1": [[0, 1.0]],
                                                                  "a2": [[0, 1.0]], "a3": [[0, 1.0]]}})
    (folder / "placement.json").write_text(json.dumps(moved.to_dict()))
    url0 = f"http://127.0.0.1:{base}"
    steps = [{"step": k + 1, "action": "load", "instance": "gpu0", "adapter": a,
              "request": {"method": "POST", "url": f"{url0}/v1/load_lora_adapter",
                          "json": {"lora_name": a, "lora_path": str(tmp / "adapters" / a)}}}
             for k, a in enumerate(("a3", "a2"))]
    (folder / "plan.json").write_text(json.dumps({"endpoints": {"gpu0": url0, "gpu1": f"http://127.0.0.1:{base + 1}"},
                                                  "instances": [], "steps": steps}))
    op = Operator(tmp / "placement.json", OperateConfig(prometheus="http://127.0.0.1:1", router=fleet["opts"].router,
                                                        base_port=base, reconcile_s=0.5, apply=fleet["opts"]),
                  None, tmp / "out", track=False)
    row = {"why": "saves 1 GPU(s) (2 -> 1)"}
    op.carry_out(folder, moved, steps, row)
    assert row["decision"] == "apply failed" and "step 2 (load) failed: HTTP 404" in row["why"], row
    assert list(op.held) == ["a2"] and op.current_path == tmp / "placement.json"
    assert op.differences() == ""                               # a3 unloaded from GPU 0 again
    assert op.held_back({"steps": steps}, moved) == ["a2"]
