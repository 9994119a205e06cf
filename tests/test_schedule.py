"""``lora-opt schedule``: a placement per step, replanned from the previous one, and its savings."""
from __future__ import annotations

import json

import yaml

from lora_opt.cli import main
from lora_opt.replan.drift import drift_from_dict, drift_workloads
from lora_opt.placement.policies import PlacementContext, get_policy
from lora_opt.replan.schedule import run_schedule, totals

DRIFT = {"profile": "llama-3.1-8b-h100-64gb", "adapters": 40, "peak_rate": 14.0, "trough_fraction": 0.3,
         "steps": 4, "step_s": 21600, "peak_hour": 12, "start_hour": 0, "churn": 0.2,
         "arrivals_per_step": 2, "retirements_per_step": 2, "seed": 2, "name": "tiny",
         "evaluation": {"duration_s": 300}}


def test_a_schedule_replans_every_step_and_holds_the_slo():
    wls = drift_workloads(drift_from_dict(DRIFT))
    policy = get_policy("greedy-plus")
    ctx = PlacementContext.for_workload(wls[0])
    seen = []
    result = run_schedule(wls, policy, lambda wl: ctx, step_s=21600, on_step=lambda r, p, plan: seen.append((r, p)))
    rows, tot = result["steps"], result["totals"]
    assert [r.step for r in rows] == [0, 1, 2, 3] and len(seen) == 4
    for r, p in seen:
        assert r.gpus == len(p.gpus) and r.transition_ok and r.gpus_starving == 0
        assert sorted(p.routes) == sorted(a.id for a in wls[r.step].adapters)
    assert rows[0].moves == 0
    assert tot["gpu_hours"] == sum(r.gpus for r in rows) * 6
    assert tot["gpu_hours"] <= tot["gpu_hours_static_peak"]
    assert tot["moves"] <= tot["moves_from_scratch"]
    assert tot["transitions_not_ok"] == [] and tot["steps_starving"] == []
    assert tot["restart_kept"] == sum(r.restart_kept for r in rows)
    assert totals(rows, 3600)["gpu_hours"] == sum(r.gpus for r in rows)


def test_the_cli_writes_the_table_the_files_and_the_plot(tmp_path, capsys):
    (tmp_path / "drift.yaml").write_text(yaml.safe_dump({**DRIFT, "steps": 2}))
    code = main(["schedule", "--drift", str(tmp_path / "drift.yaml"), "--out", str(tmp_path / "out"),
                 "--no-evaluate"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "GPU-hours" in out and "static for the peak" in out
    doc = json.loads((tmp_path / "out" / "schedule.json").read_text())
    assert len(doc["steps"]) == 2 and doc["steps"][0]["gpus_starving"] is None
    assert (tmp_path / "out" / "schedule.png").stat().st_size > 1000
    assert (tmp_path / "out" / "schedule.csv").read_text().startswith("step,workload,")
    assert (tmp_path / "out" / "steps" / "step-001" / "plan.json").is_file()


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert main(["schedule", "--drift", "no-such-drift"]) == 2
    assert "drift" in capsys.readouterr().err
    assert main(["schedule", "--drift", "day", "--step-s", "60"]) == 2
    assert "--step-s" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**DRIFT, "churn": 3}))
    assert main(["schedule", "--drift", str(tmp_path / "bad.yaml")]) == 2
    assert "churn" in capsys.readouterr().err
