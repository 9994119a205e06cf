"""The fan-out's serial-or-Ray choice: asked-for Ray is Ray, --workers 1 is serial, the default is
serial until the work would pay Ray's start-up -- with identical results either way."""
import pytest

from lora_opt import parallel
from lora_opt.parallel import TaskPool, idle_task, ray_pays_off, run_batches, run_scenarios, use_ray
from lora_opt.placement.evaluate import evaluate_placement
from lora_opt.placement.plan import GPUConfig, Placement
from lora_opt.placement.workload_file import workload_from_dict
from twin.scenario import scenario_dict

P = "llama-3.1-8b-h100-64gb"


def tiny_scenarios(n, duration_s=20):
    return [scenario_dict(P, [{"count": 4, "rank": 16, "rate": 0.5}], duration_s=duration_s, seed=s) for s in range(n)]


def test_who_decides(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert use_ray(1, None) is False
    assert use_ray(2, None) is True and use_ray(1, "127.0.0.1:6379") is True
    assert use_ray(None, None) is None                      # the default: decided from the work
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert use_ray(None, None) is True and use_ray(1, None) is True


def test_threshold_from_the_measured_start_up(monkeypatch):
    monkeypatch.setattr(parallel, "_ray_running", lambda: False)
    s = parallel.RAY_STARTUP_S
    assert not ray_pays_off(1, 1e6, 2)                       # one task cannot be split
    assert not ray_pays_off(100, 1.0, 1)                     # one CPU: nothing to gain
    assert not ray_pays_off(3, 0.5, 2)                       # the 3-GPU example: serial
    assert not ray_pays_off(40, 0.9 * 2 * s / 40, 2)         # just under ~2 x start-up of serial work
    assert ray_pays_off(40, 1.2 * 2 * s / 40, 2)             # above it: Ray
    monkeypatch.setattr(parallel, "_ray_running", lambda: True)
    assert ray_pays_off(4, 0.5, 2)                           # Ray already up: no start-up to pay


def test_small_work_runs_serially_and_says_so(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(parallel, "_ray_running", lambda: False)
    said, got = [], {}
    mode = run_batches(parallel._simulate_batch, [[s] for s in tiny_scenarios(3)], got.__setitem__,
                       report=said.append, what="3 GPU replays")
    assert mode == "serial" and said == ["serial: 3 GPU replays, below the Ray threshold"]
    assert sorted(got) == [0, 1, 2]
    serial = run_scenarios(tiny_scenarios(3), workers=1, progress=False)
    assert [r["throughput_tok_s"] for r in serial] == [got[i][0]["throughput_tok_s"] for i in range(3)]


def test_default_switches_to_ray_when_it_pays_and_results_are_identical(monkeypatch):
    """Ray made free: the first batch runs here, timed, the rest on Ray -- same rows as serial."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(parallel, "RAY_STARTUP_S", 0.0)
    monkeypatch.setattr(parallel, "RAY_TASK_S", 0.0)
    scs = tiny_scenarios(6, duration_s=120)
    said = []
    mode = run_batches(parallel._simulate_batch, [[s] for s in scs], lambda i, r: None, workers=None, report=said.append)
    assert mode == "ray" and said[0].startswith("Ray: 6 tasks on") and "1 of 6 tasks ran here" in said[0]
    strip = (lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows])
    auto = run_scenarios(scs, batch_size=1, progress=False)
    assert strip(auto) == strip(run_scenarios(scs, workers=1, progress=False))


def test_task_pool_default_is_serial_for_few_tasks(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(parallel, "_ray_running", lambda: False)
    pool = TaskPool(idle_task, tasks=3)
    assert pool.serial and pool.mode == "serial: 3 tasks, below the Ray threshold"
    for k in range(3):
        pool.submit(k, 0.0)
    assert [pool.next_done()[0] for _ in range(3)] == [0, 1, 2] and pool.serial
    assert TaskPool(idle_task, workers=1).mode.endswith(", --workers 1")


@pytest.mark.parametrize("workers", [1, None])
def test_evaluate_same_numbers_serial_default_and_ray(workers):
    wl = workload_from_dict({"profile": P, "adapters": [{"count": 6, "rank": 8, "rate": 0.3}],
                             "evaluation": {"duration_s": 120, "seed": 3}})
    cfg = GPUConfig(8, 16, 8, 2048, 2048, 0.9, 131072)
    routes = {a.id: [(i % 3, 1.0)] for i, a in enumerate(wl.adapters)}
    p = Placement(P, list(wl.adapters), [cfg] * 3, routes, "manual", {"rho": 0.9})
    assert evaluate_placement(p, wl, workers=workers, progress=False) == evaluate_placement(p, wl, workers=2,
                                                                                           progress=False)


def test_inline_task_longer_than_the_timeout_fails_as_on_ray():
    pool = TaskPool(idle_task, workers=1)
    pool.submit("slow", 0.05)
    pool.submit("quick", 0.0)
    key, res = pool.next_done(timeout_s=0.01)
    assert key == "slow" and isinstance(res, TimeoutError)
    assert pool.next_done(timeout_s=0.01) == ("quick", 0.0)
