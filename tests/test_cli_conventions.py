"""The command line's conventions: logging flags before or after the command, one logging setup
(our INFO shown, third-party INFO only with -v, --log-file), exit statuses documented in one
place, library code that does not print, and what a user reads (simulate's verdict, place's
margin bounds and notes, evaluate's units and exit status, fidelity's example family)."""
import ast
import io
import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from small_scenarios import small_scenario
from lora_opt import cli
from lora_opt.cli.conventions import EPILOG, setup_logging, verbosity
from lora_opt.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NOT_ACCEPTABLE, EXIT_OK
from lora_opt.placement.plan import Placement
from lora_opt.placement.report import (MARGIN_CEILING, MARGIN_FLOOR, MARGIN_STARVING, margin_cell,
                                       placement_table, table_notes)
from twin.paths import REPO_ROOT


@pytest.fixture
def restore_logging():
    """setup_logging changes process-wide logging: put it back after the test."""
    root = logging.getLogger()
    names = ("lora_opt", "twin", "mlflow", "alembic", "sqlalchemy", "httpx")
    saved = (list(root.handlers), root.level, {n: (logging.getLogger(n).level, logging.getLogger(n).propagate)
                                               for n in names})
    yield
    for h in list(root.handlers):
        if h not in saved[0]:
            root.removeHandler(h)
            h.close()
    root.setLevel(saved[1])
    for n, (level, propagate) in saved[2].items():
        logging.getLogger(n).setLevel(level)
        logging.getLogger(n).propagate = propagate
    logging.captureWarnings(False)


@pytest.mark.parametrize("argv, level, log_file", [
    (["simulate", "s.yaml"], 0, None),
    (["-v", "simulate", "s.yaml"], 1, None),
    (["simulate", "s.yaml", "-v"], 1, None),
    (["-vv", "simulate", "s.yaml"], 2, None),
    (["simulate", "-q", "s.yaml"], -1, None),
    (["-q", "simulate", "s.yaml", "-v"], -1, None),            # quiet wins
    (["--log-file", "x.log", "simulate", "s.yaml"], 0, "x.log"),
    (["simulate", "s.yaml", "--log-file", "x.log"], 0, "x.log"),
])
def test_logging_flags_before_or_after_the_command(argv, level, log_file):
    args = cli.build_parser().parse_args(argv)
    assert args.command == "simulate" and verbosity(args) == level
    assert getattr(args, "log_file", None) == log_file


def test_every_command_takes_the_logging_flags():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        flags = {o for a in p._actions for o in a.option_strings}
        assert {"-v", "--verbose", "-q", "--quiet", "--log-file"} <= flags, name


def test_help_lists_exit_statuses_and_environment(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for code in (EXIT_OK, EXIT_BAD_INPUT, EXIT_NOT_ACCEPTABLE, EXIT_INTERRUPTED):
        assert re.search(rf"^\s+{code}\s+\S", text, re.M), code
    assert "MLFLOW_TRACKING_URI" in text and "OPTUNA_STORAGE" in text and EPILOG.splitlines()[0] in text


def test_docs_document_the_same_exit_statuses():
    section = (REPO_ROOT / "docs" / "reference" / "conventions.md").read_text()
    for code in (EXIT_OK, EXIT_BAD_INPUT, EXIT_NOT_ACCEPTABLE, EXIT_INTERRUPTED):
        assert f"| {code} |" in section, code
    for flag in ("-v", "-q", "--log-file", "MLFLOW_TRACKING_URI", "OPTUNA_STORAGE"):
        assert flag in section


def _log_all(stream_level, log_file=None):
    out = io.StringIO()
    setup_logging(stream_level, log_file, stream=out)
    logging.getLogger("lora_opt.some.module").debug("our debug")
    logging.getLogger("lora_opt.some.module").info("our info")
    logging.getLogger("mlflow.store.db.utils").info("mlflow info")
    logging.getLogger("alembic.runtime.migration").info("alembic info")
    logging.getLogger("httpx").warning("httpx warning")
    logging.getLogger("lora_opt.some.module").error("our error")
    return out.getvalue()


def test_default_shows_our_info_and_third_party_warnings_only(restore_logging):
    text = _log_all(0)
    assert "lora-opt: our info" in text and "our debug" not in text
    assert "mlflow info" not in text and "alembic info" not in text
    assert "httpx: warning: httpx warning" in text and "lora-opt: error: our error" in text


def test_verbose_quiet_and_log_file(restore_logging, tmp_path):
    text = _log_all(1)
    assert "our debug" in text and "mlflow.store.db.utils: mlflow info" in text
    assert "alembic info" not in text                # every migration step: only with -vv
    assert "alembic info" in _log_all(2)
    text = _log_all(-1, tmp_path / "run.log")
    assert text == "lora-opt: error: our error\n"
    logged = (tmp_path / "run.log").read_text()
    assert "DEBUG" in logged and "lora_opt.some.module: our debug" in logged and "mlflow info" in logged


def test_a_warning_goes_through_logging(restore_logging):
    import warnings
    out = io.StringIO()
    setup_logging(0, stream=out)
    warnings.warn("careful", UserWarning)
    assert "careful" in out.getvalue()


def test_log_file_that_cannot_be_opened_is_bad_input(tmp_path, capsys, restore_logging):
    rc = cli.main(["--log-file", str(tmp_path / "no" / "such" / "dir.log"), "simulate", "x.yaml"])
    assert rc == EXIT_BAD_INPUT and "--log-file" in capsys.readouterr().err


def _print_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]


def test_library_code_does_not_print():
    """Results are printed by lora_opt/cli; the library logs (child-process scripts held in strings,
    which answer on their stdout, are strings, not calls)."""
    offenders = {}
    for pkg in ("lora_opt", "twin"):
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            if "cli" in path.relative_to(REPO_ROOT).parts:
                continue
            lines = _print_calls(path)
            if lines:
                offenders[str(path.relative_to(REPO_ROOT))] = lines
    assert offenders == {}


# ---- what a user reads -------------------------------------------------------------------------
def test_simulate_prints_one_verdict(tmp_path, capsys):
    sc = small_scenario(adapters=[{"count": 8, "rank": 8, "rate": 4.0}], duration_s=60)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sc))
    assert cli.main(["simulate", str(path)]) == EXIT_OK        # a report, not a judgement
    text = capsys.readouterr().out
    verdicts = [line for line in text.splitlines() if line.startswith("verdict")]
    assert len(verdicts) == 1 and "status" not in text
    assert verdicts[0].startswith("verdict     STARVING: throughput") and "< rho x incoming" in verdicts[0]


def test_margin_cells_show_the_grid_ends_as_bounds():
    assert margin_cell(MARGIN_CEILING) == ">= +170 %" and margin_cell(MARGIN_FLOOR) == "<= -55 %"
    assert margin_cell(0.3) == "+30 %" and margin_cell(-0.26) == "-26 %" and margin_cell(None) == "-"
    assert MARGIN_STARVING == pytest.approx(-0.1)


SMALL = """profile: llama-3.1-8b-h100-64gb
adapters:
  - {count: 40, rank: 8, rate: 0.2, prefix: s-}
  - {count: 20, rank: 16, rate: 0.1, prefix: m-}
evaluation: {duration_s: 120}
"""


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """dLoRA's placement of a small workload on 4 GPUs (it uses every GPU of the pool, consults no
    surrogate) and what place printed."""
    d = tmp_path_factory.mktemp("placed")
    (d / "w.yaml").write_text(SMALL)
    from lora_opt.placement.workload_file import load_workload
    from lora_opt.search.place import PlaceOptions, place_report, place_workload
    # a fixed margin, not a confidence: the table's margin column, not the error model's
    done = place_workload(load_workload(str(d / "w.yaml")), 4, PlaceOptions(policy="dlora", margin=0.1,
                                                                              out_dir=str(d / "out")))
    assert done.code in (EXIT_OK, 4)
    return Placement.load(d / "out" / "placement.json"), place_report(done)


def test_table_notes_agree_with_what_the_table_shows(placed):
    p = placed[0]
    assert len(p.gpus) == 4
    p.meta["starvation_margin"] = [MARGIN_CEILING, MARGIN_FLOOR, -0.26, 0.3]
    p.meta["predicted_throughput"] = [None, 3000.0, 2500.0, 2000.0]
    p.meta["twin_verified_at_load"] = [1.1, None, 1.1, 1.1]
    table, notes = placement_table(p), "\n".join(table_notes(p))
    rows = table.splitlines()[1:]
    assert ">= +170 %" in rows[0] and "<= -55 %" in rows[1] and "-26 %" in rows[2] and "+30 %" in rows[3]
    assert "bounds" in notes and "pred tok/s '-' (GPU 0)" in notes and "twin 'ok at Lx'" in notes
    # the sign shown agrees with the note: GPU 1 and 2 below -10 %, the twin overruled only GPU 2
    assert "GPU 1: margin below -10 %: the surrogate predicts starvation at the expected load\n" in notes + "\n"
    assert "GPU 2: margin below -10 %: the surrogate predicts starvation at the expected load; the twin passed " \
           "the GPU at 1.1x its load" in notes
    assert "GPU 3" not in notes
    # nothing to explain: no note about signs that are not shown
    p.meta["starvation_margin"] = [0.3] * 4
    p.meta["predicted_throughput"] = [3000.0] * 4
    p.meta["twin_verified_at_load"] = [None] * 4
    notes = table_notes(p)
    assert len(notes) == 1 and notes[0].startswith("margin = ")


def test_a_policy_without_surrogate_says_why_its_columns_are_dashes(placed):
    assert "policy dlora consults no surrogate" in placed[1]


def test_evaluate_units_and_exit_status_3_when_a_gpu_does_not_start(tmp_path, capsys):
    big = "profile: llama-3.1-8b-h100-64gb\nadapters:\n  - {count: 700, rank: 32, rate: 0.005}\n" \
          "evaluation: {duration_s: 60}\n"
    (tmp_path / "w.yaml").write_text(big)
    assert cli.main(["place", "--workload", str(tmp_path / "w.yaml"), "--gpus", "1", "--policy", "dlora",
                     "--out", str(tmp_path / "o")]) == 4
    capsys.readouterr()
    rc = cli.main(["evaluate", str(tmp_path / "o"), "--workload", str(tmp_path / "w.yaml"), "--workers", "1",
                   "--grace-s", "0", "--out", str(tmp_path / "ev.json")])
    text = capsys.readouterr().out
    assert rc == EXIT_NOT_ACCEPTABLE
    header, units = text.splitlines()[1:3]
    assert "TTFT mean" in header and units.split() == ["tok/s", "ms", "ms", "ms", "ms"]
    assert "NOT ACCEPTABLE: 1 GPU(s) failing to start (exit status 3)" in text
    assert json.loads((tmp_path / "ev.json").read_text())["gpus_failing_startup"] == 1   # written all the same
    rc = cli.main(["evaluate", str(tmp_path / "o"), "--workload", str(tmp_path / "w.yaml"), "--workers", "1",
                   "--grace-s", "0", "--json"])
    assert rc == EXIT_NOT_ACCEPTABLE and json.loads(capsys.readouterr().out)["gpus_failing_startup"] == 1


def test_fidelity_help_example_is_a_family_with_report_half_runs():
    from lora_opt.calibration.model_table import FIT_HALF
    from lora_opt.calibration.replay import select_runs
    from lora_opt.calibration.runs_csv import load_runs

    sub = next(a for a in cli.build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    help_text = " ".join(sub.choices["fidelity"].format_help().split())
    family = re.search(r"e\.g\. (\S+?):", help_text).group(1)
    rows = select_runs(load_runs(), family)
    report = [e for m, e in zip(rows["model"], rows["experiment"]) if FIT_HALF.get(m, "\0") not in e]
    assert len(rows) >= 20 and len(report) == len(rows)


@pytest.mark.slow       # ~40 s: labels a small dataset on the twin, then trains (train_cli runs by default in test_surrogate)
def test_train_json_is_the_metrics_and_mlflow_prints_are_log_records(tmp_path, capsys, restore_logging):
    from test_surrogate import twin_frame, write_shards
    data = write_shards(twin_frame(workloads=8), tmp_path / "data")
    log_file = tmp_path / "train.log"
    rc = cli.main(["train", "--dataset", str(data), "--out", str(tmp_path / "out"), "--fast", "--json",
                   "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "--log-file", str(log_file)])
    captured = capsys.readouterr()
    assert rc == EXIT_OK
    metrics = json.loads(captured.out)
    assert metrics == json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert "Successfully registered model" not in captured.err             # MLflow's own prints: not on stderr
    assert "mlflow: Successfully registered model 'lora-opt-throughput'" in log_file.read_text()


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """``lora-opt simulate example | head -1``: the pipe closes before the output is written; the command
    ends with 141 (128 + SIGPIPE, what a shell shows) and no traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "lora_opt.cli", "simulate", "example"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()                       # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141 and "Traceback" not in err, err
