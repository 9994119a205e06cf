"""Dataset generation: a small grid end to end on local Ray, serial = Ray, resume after kill -9,
the Parquet schema, bad grids."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from lora_opt.surrogates import dataset as ds
from lora_opt.surrogates.features import FEATURES
from twin.errors import ScenarioError
from twin.paths import REPO_ROOT

TINY = REPO_ROOT / "configs" / "grids" / "tiny.yaml"


def _grid(tmp_path, **over):
    g = yaml.safe_load(TINY.read_text())
    g.update(over)
    p = tmp_path / "grid.yaml"
    p.write_text(yaml.safe_dump(g))
    return p


def test_serial_equals_ray_and_schema(tmp_path):
    grid = _grid(tmp_path, duration_s=60)
    s1 = ds.generate(None, grid, tmp_path / "serial", workers=1, limit=40, progress=False, track=False)
    s2 = ds.generate(None, grid, tmp_path / "ray", workers=2, limit=40, progress=False, track=False)
    assert s1["dataset_hash"] == s2["dataset_hash"] and s1["rows"] == 40
    df = ds.load_dataset(tmp_path / "ray")
    assert list(df["point_id"]) == list(range(40))
    for col in (*FEATURES, "status", "starving", "throughput_tok_s", "itl_mean_ms", "ttft_p99_ms",
                "stopped_early_s", "seed", "profile", "twin_version", "wall_s", "group_ranks", "group_rates"):
        assert col in df.columns, col
    assert set(df["status"]) <= {"ok", "oom"}
    assert df["seed"].tolist() == list(range(40))
    assert (df["wall_s"] > 0).all()


def test_resume_after_kill_minus_9(tmp_path):
    grid = _grid(tmp_path, duration_s=240, shard_size=4)
    out = tmp_path / "d"
    cmd = [sys.executable, "-m", "lora_opt.cli", "dataset", "--grid", str(grid), "--out", str(out),
           "--workers", "1", "--limit", "48"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("shard-*.parquet"))) < 2:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = len(list(out.glob("shard-*.parquet")))
    assert 2 <= partial < 12, "the run should have been killed part-way"
    again = ds.generate(None, grid, out, workers=1, limit=48, progress=False, track=False)
    assert again["rows_resumed"] >= 8 and again["rows_resumed"] + again["rows_labelled_now"] == 48
    df = ds.load_dataset(out)
    assert list(df["point_id"]) == list(range(48))                 # none missing, none twice
    clean = ds.generate(None, grid, tmp_path / "clean", workers=1, limit=48, progress=False, track=False)
    assert clean["dataset_hash"] == again["dataset_hash"]
    assert not list(out.glob("*.tmp"))


def test_summary_adds_up_the_runs_of_a_resumed_labelling(tmp_path):
    """A labelling that spans several runs (a stop, a resume: the papers' grid spans sessions)
    keeps each run's wall time in summary.json, and their sum."""
    grid, out = _grid(tmp_path, duration_s=30, shard_size=4), tmp_path / "d"
    first = ds.generate(None, grid, out, workers=1, limit=8, progress=False, track=False)
    # a summary written before runs were listed counts as one run
    old = json.loads((out / "summary.json").read_text())
    old.pop("runs"), old.pop("wall_s_all_runs")
    (out / "summary.json").write_text(json.dumps(old))
    ds.shard_path(out, 1).unlink()                       # as if the first run had stopped there
    second = ds.generate(None, grid, out, workers=1, limit=8, progress=False, track=False)
    assert [r["rows_labelled"] for r in second["runs"]] == [8, 4]
    assert second["runs"][0]["wall_s"] == first["wall_s"]
    assert second["wall_s_all_runs"] == pytest.approx(first["wall_s"] + second["wall_s"])


def test_other_grid_in_same_directory_is_refused(tmp_path):
    ds.generate(None, _grid(tmp_path, duration_s=30), tmp_path / "d", workers=1, limit=4, progress=False, track=False)
    with pytest.raises(ScenarioError, match="different grid_hash"):
        ds.generate(None, _grid(tmp_path, duration_s=31), tmp_path / "d", workers=1, limit=4, progress=False,
                    track=False)


def test_bad_grid_names_field(tmp_path):
    with pytest.raises(ScenarioError, match="unknown field.*colour"):
        ds.load_grid(_grid(tmp_path, colour=1))
    with pytest.raises(ScenarioError, match="rates"):
        ds.load_grid(_grid(tmp_path, rates=[0.1, -1]))
    with pytest.raises(ScenarioError, match="grid file not found"):
        ds.load_grid(tmp_path / "nope.yaml")


def test_papers_grid_size():
    _, grid = ds.load_grid(REPO_ROOT / "configs" / "grids" / "papers.yaml")
    # 10 rank triples x 220 rate triples x 66 (served, A_max <= served) pairs
    assert len(grid.points()) == 10 * 220 * 66


def test_sampled_grid_is_a_seeded_subset(tmp_path):
    _, full = ds.load_grid(_grid(tmp_path))
    _, sampled = ds.load_grid(_grid(tmp_path, sample=30))
    pts = sampled.points()
    assert len(pts) == 30 and all(p in full.points() for p in pts)
    assert pts == ds.load_grid(_grid(tmp_path, sample=30))[1].points()
    _, default = ds.load_grid("default")
    assert len(default.points()) == 4000
    with pytest.raises(ScenarioError, match="sample"):
        ds.load_grid(_grid(tmp_path, sample=0))


def test_load_band_keeps_points_by_expected_load(tmp_path):
    from lora_opt.surrogates.features import DEFAULT_TOKENS_PER_REQUEST
    for name, (lo, hi) in (("boundary", (1500, 16000)), ("lowload", (0, 250))):
        _, g = ds.load_grid(name)
        pts = g.points()
        assert g.sample == len(pts)
        for p in pts:
            load = DEFAULT_TOKENS_PER_REQUEST * sum(c * q for c, q in zip(ds.split_counts(p["n"], g.groups), p["rates"]))
            assert lo <= load <= hi
    with pytest.raises(ScenarioError, match="load_band"):
        ds.load_grid(_grid(tmp_path, load_band=[5, 1]))


def test_workload_sample_keeps_whole_workloads(tmp_path):
    """`workloads: N` keeps every (served, A_max) point of N seeded workloads: what the N*/G*
    model needs (a uniform point sample leaves ~2 points per workload)."""
    _, full = ds.load_grid(_grid(tmp_path))
    _, some = ds.load_grid(_grid(tmp_path, workloads=2))
    key = lambda p: (tuple(p["ranks"]), tuple(p["rates"]))  # noqa: E731
    kept = {key(p) for p in some.points()}
    assert len(kept) == 2
    assert some.points() == [p for p in full.points() if key(p) in kept]
    assert some.points() == ds.load_grid(_grid(tmp_path, workloads=2))[1].points()
    _, bundled = ds.load_grid("workloads")
    assert len(bundled.points()) == 240 * 66
    for bad in (0, "all", True):
        with pytest.raises(ScenarioError, match="workloads"):
            ds.load_grid(_grid(tmp_path, workloads=bad))
