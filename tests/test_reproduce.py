"""The reproduction framework: one cheap result run into a temporary MLflow store, then the README's
Results section generated from it (and regenerated idempotently)."""
import importlib.util
import json
from pathlib import Path

import mlflow
import pytest

from reproduce import VERDICTS, Row              # experiments/ is on pytest's pythonpath (pyproject)
from reproduce.registry import RESULTS, by_name

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    """experiments/<name>.py as a module (the reproduce script shares its name with the package)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


reproduce_cli = _script("reproduce")
results_section = _script("results_section")

CHEAP = "p2_fig11_azure"          # reads committed outputs only: a few seconds


def test_registry_is_well_formed():
    names = [m.NAME for m in RESULTS]
    assert len(names) == len(set(names))
    for m in RESULTS:
        assert m.PAPER in ("first", "second") and isinstance(m.QUICK, bool) and m.TITLE and callable(m.run)
    with pytest.raises(KeyError, match="known"):
        by_name("no_such_result")


def test_row_refuses_unknown_verdict():
    with pytest.raises(ValueError, match="verdict"):
        Row(name="x", title="t", paper_value="", ours="", real="", verdict="great", why="")
    assert "reproduced" in VERDICTS


def test_one_result_tracked_then_results_section(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    out = tmp_path / "results"
    assert reproduce_cli.main(["--only", CHEAP, "--quick", "--out", str(out), "--tracking-uri", uri]) == 0
    row = json.loads((out / CHEAP / "row.json").read_text())
    assert row["verdict"] in VERDICTS and row["paper_value"] and row["ours"]
    assert (out / CHEAP / "figure.png").stat().st_size > 1000
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["reproduce"], output_format="list")
    assert len(runs) == 1 and runs[0].data.tags["reproduce.name"] == CHEAP
    assert runs[0].data.params["result"] == CHEAP and "wall_s" in runs[0].data.metrics
    arts = {f.path for f in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id)}
    assert {"figure.png", "table.md", "row.json"} <= arts

    readme = tmp_path / "README.md"
    readme.write_text("# X\n\n## Something\n\ntext\n\n## Reliability\n\nkept\n")
    assert results_section.main(["--readme", str(readme), "--tracking-uri", uri]) == 0
    text = readme.read_text()
    assert text.index("## Results") < text.index("## Reliability") and text.endswith("kept\n")
    assert f"`{CHEAP}`" in text and row["verdict"] in text and text.count(results_section.BEGIN) == 1
    assert results_section.main(["--readme", str(readme), "--tracking-uri", uri, "--check"]) == 0
    assert results_section.main(["--readme", str(readme), "--tracking-uri", uri]) == 0
    assert readme.read_text() == text                      # regenerating changes nothing
    readme.write_text(text.replace(row["verdict"], "edited by hand", 1))
    assert results_section.main(["--readme", str(readme), "--tracking-uri", uri, "--check"]) == 1


@pytest.mark.slow
def test_quick_set_runs_and_fills_the_results_section(tmp_path):
    """The whole quick set (``python experiments/reproduce.py --quick``, ~6-15 min on 2 cores) into a
    temporary store, every row well-formed, then the generated section lists every result."""
    uri = f"sqlite:///{tmp_path}/m.db"
    assert reproduce_cli.main(["--quick", "--out", str(tmp_path / "results"), "--tracking-uri", uri]) == 0
    quick = [m.NAME for m in RESULTS if m.QUICK]
    for name in quick:
        row = json.loads((tmp_path / "results" / name / "row.json").read_text())
        assert row["verdict"] in VERDICTS and row["paper_value"] and row["ours"] and row["why"]
    readme = tmp_path / "README.md"
    readme.write_text("# X\n\n## Reliability\n")
    assert results_section.main(["--readme", str(readme), "--tracking-uri", uri]) == 0
    text = readme.read_text()
    assert all(f"`{n}`" in text for n in quick)
