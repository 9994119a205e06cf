"""The CLI's structure: one module per command, choices from the registries, bad input -> exit 2."""
import argparse

import pytest

from lora_opt import cli
from lora_opt.cli.bench import BENCHMARKS
from lora_opt.errors import BAD_INPUT, InputError
from lora_opt.placement.plan import PlacementError
from lora_opt.placement.policies import DEFAULT_POLICY, ORACLE_FILES, POLICIES
from lora_opt.search.study import DEFAULT_OBJECTIVE, OBJECTIVES
from lora_opt.surrogates.dataset import GRIDS_DIR
from twin.errors import ScenarioError
from twin.scenario import ARRIVAL_PROCESSES, TRACE_MAPPINGS


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings or a.dest == flag)


def test_every_command_module_registers_one_command_with_a_run():
    subs = _subparsers(cli.build_parser())
    assert list(subs) == ["simulate", "bench", "calibrate", "calibrate-e2e", "dataset", "train", "place",
                          "evaluate", "replan", "schedule", "search", "pareto", "fidelity", "error-model", "emulate",
                          "validate", "ingest", "probe", "apply", "operate"]
    for name, p in subs.items():
        run = p.get_default("run")
        assert callable(run) and run.__module__.startswith("lora_opt.cli."), name


def test_choices_come_from_the_registries():
    subs = _subparsers(cli.build_parser())
    assert _option(subs["place"], "--policy").choices == list(POLICIES)
    # place resolves an absent --policy to the default (absent, --deployment best is its default)
    assert _option(subs["place"], "--policy").default is None
    assert f"(default: {DEFAULT_POLICY})" in _option(subs["place"], "--policy").help
    assert _option(subs["place"], "--oracle").choices == list(ORACLE_FILES)
    for cmd in ("search", "pareto"):
        assert _option(subs[cmd], "--objective").choices == list(OBJECTIVES)
        assert _option(subs[cmd], "--objective").default == DEFAULT_OBJECTIVE
    assert _option(subs["evaluate"], "--arrivals").choices == list(ARRIVAL_PROCESSES)
    assert _option(subs["evaluate"], "--mapping").choices == list(TRACE_MAPPINGS)
    assert _option(subs["bench"], "what").choices == list(BENCHMARKS)
    from lora_opt.search.run import BACKENDS, DEFAULT_BACKEND
    assert _option(subs["search"], "--backend").choices == list(BACKENDS)
    assert _option(subs["search"], "--backend").default == DEFAULT_BACKEND


def test_dataset_help_lists_every_bundled_grid():
    text = " ".join(_subparsers(cli.build_parser())["dataset"].format_help().split())
    grids = sorted(f.stem for f in GRIDS_DIR.glob("*.yaml"))
    assert len(grids) >= 6 and f"({', '.join(grids)})" in text


def test_placement_errors_are_input_errors_and_bad_input():
    assert issubclass(PlacementError, InputError)
    assert set(BAD_INPUT) == {InputError, ScenarioError}


@pytest.mark.parametrize("exc", [InputError("--x: bad"), ScenarioError("field: bad"), PlacementError("placement: bad")])
def test_main_reports_bad_input_with_exit_status_2(monkeypatch, capsys, exc):
    def boom(args):
        raise exc
    monkeypatch.setattr(cli.simulate, "run", boom)
    assert cli.main(["simulate", "x.yaml"]) == 2
    assert capsys.readouterr().err == f"lora-opt simulate: error: {exc}\n"


def test_a_cli_flag_error_is_an_input_error(capsys):
    assert cli.main(["calibrate-e2e", "--model", "no-such-model"]) == 2
    assert "lora-opt calibrate-e2e: error: --model 'no-such-model': allowed values:" in capsys.readouterr().err
