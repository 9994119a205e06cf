"""One owner per rule (issue 27, item 1): each rule below is defined in one place, and these tests
fail when a second copy appears (a copy that drifts is how a fix in one place misses the others).

=====================================  ==========================================================
rule                                   its one definition
=====================================  ==========================================================
exit statuses of every command         ``lora_opt/errors.py`` (``EXIT_*``)
SMAPE (and its NaN / zero rule)        ``lora_opt/smape.py`` (``smape``, ``smape_half``)
reading a real-runs CSV (validated)    ``lora_opt/calibration/runs_csv.py`` (``load_runs``)
the smallest vLLM rank >= the ranks    ``twin/flags.py`` (``max_lora_rank_for``)
the LoRA cost factor's extra           ``twin/profile.py`` (``lora_extra``)
adapters -> a scenario's adapter dicts ``lora_opt/placement/workload_file.py`` (``scenario_adapters``)
an unset engine flag's value           ``twin/flags.py`` (``resolve_flags``; the profile's defaults:
                                       ``Profile.flag_defaults``)
a flag's ``vllm serve`` spelling       ``twin/flags.py`` (``serve_option``)
the default vLLM release               ``twin/flags.py`` (``DEFAULT_VLLM_VERSION``)
the twin's version, a profile's hash   ``lora_opt/tracking.py`` (``twin_version``, ``profile_hash``)
MLflow store, metric names             ``lora_opt/tracking.py`` (``resolve_tracking_uri``,
                                       ``flat_metrics``)
=====================================  ==========================================================

The checks read the source (AST or text) of the product (``lora_opt/``, ``twin/``) and of the code
beside it that could grow a copy (``experiments/``, ``tools/``).
"""
from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys

import pytest

from twin.flags import EngineFlags, serve_option
from twin.paths import REPO_ROOT

SOURCE_DIRS = ("lora_opt", "twin", "experiments", "tools")
PRODUCT_DIRS = ("lora_opt", "twin")


def _sources(dirs=SOURCE_DIRS) -> dict[str, str]:
    """Repository-relative path -> source text of every Python file under ``dirs``."""
    out = {}
    for d in dirs:
        for path in sorted((REPO_ROOT / d).rglob("*.py")):
            out[path.relative_to(REPO_ROOT).as_posix()] = path.read_text(encoding="utf-8")
    return out


def _assigned_names(tree: ast.AST):
    """(name, line) of every name an assignment binds (tuple targets unpacked)."""
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Name):
                    yield sub.id, node.lineno


def _defined_in(names: set[str], dirs=SOURCE_DIRS) -> dict[str, list[str]]:
    """name -> the files (one entry per definition) defining a function or method of that name."""
    found: dict[str, list[str]] = {n: [] for n in names}
    for rel, text in _sources(dirs).items():
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
                found[node.name].append(rel)
    return found


# --- exit statuses ---------------------------------------------------------------------------

def test_exit_statuses_are_defined_only_in_lora_opt_errors():
    where = []
    for rel, text in _sources().items():
        for name, line in _assigned_names(ast.parse(text, rel)):
            if re.fullmatch(r"EXIT_[A-Z0-9_]+", name) and rel != "lora_opt/errors.py":
                where.append(f"{rel}:{line} {name}")
    assert where == [], "exit statuses are defined in lora_opt/errors.py only; import them from there"


def test_exit_statuses_are_imported_from_lora_opt_errors():
    """No module re-exports them (a re-export is where a second definition would slip in unseen)."""
    where = []
    for rel, text in _sources().items():
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.ImportFrom) and node.module != "lora_opt.errors":
                where += [f"{rel}:{node.lineno} {a.name} from {node.module}" for a in node.names
                          if a.name.startswith("EXIT_")]
    assert where == []


def test_library_verdicts_use_the_defined_statuses():
    from lora_opt import errors
    from lora_opt.placement import report as place_report
    from lora_opt.validate import report as validate_report
    for mod in (place_report, validate_report):
        for name in dir(mod):
            if name.startswith("EXIT_"):
                assert getattr(mod, name) is getattr(errors, name), (mod.__name__, name)
    statuses = {n: getattr(errors, n) for n in dir(errors) if n.startswith("EXIT_")}
    assert len(set(statuses.values())) == len(statuses) == 7, statuses


# --- SMAPE -----------------------------------------------------------------------------------

def test_smape_is_defined_only_in_lora_opt_smape():
    assert _defined_in({"smape", "smape_half"}) == {"smape": ["lora_opt/smape.py"],
                                                    "smape_half": ["lora_opt/smape.py"]}
    # the formula itself, (|p| + |r|) written out, appears nowhere else either
    formula = re.compile(r"abs\([^()]*(\([^()]*\))?[^()]*\)\s*\+\s*(np\.)?abs\(")
    where = [rel for rel, text in _sources().items() if rel != "lora_opt/smape.py" and formula.search(text)]
    assert where == [], "SMAPE's formula outside lora_opt/smape.py: call lora_opt.smape.smape"


@pytest.mark.parametrize("pred, real, drop, zero", [
    ([110, 90], [100, 100], (10 / 105 + 10 / 95) / 2 * 100, (10 / 105 + 10 / 95) / 2 * 100),
    ([110, 0], [90, 0], 20.0, 10.0),                  # a pair of zeros: left out / no error
    ([110, float("nan")], [90, 5.0], 20.0, 10.0),     # a NaN: left out / no error
    ([110, float("inf")], [90, 5.0], 20.0, float("nan")),   # an inf: left out / NaN
    ([0, 0], [0, 0], float("nan"), 0.0),
    ([], [], float("nan"), float("nan")),
])
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")   # inf / inf
def test_smape_rules_for_undefined_pairs(pred, real, drop, zero):
    from lora_opt.smape import smape, smape_half
    for rule, want in (("drop", drop), ("zero", zero)):
        got = smape(pred, real, undefined=rule)
        assert got == pytest.approx(want, nan_ok=True), rule
        assert smape_half(pred, real, undefined=rule) == pytest.approx(want / 2, nan_ok=True), rule
    assert smape(pred, real) == pytest.approx(drop, nan_ok=True)          # drop is the default


def test_smape_rules_agree_bit_for_bit_on_finite_nonzero_pairs():
    import numpy as np

    from lora_opt.smape import smape
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 400))
        p, r = rng.lognormal(3, 2, n), rng.lognormal(3, 2, n)
        assert smape(p, r, undefined="drop") == smape(p, r, undefined="zero")


def test_smape_refuses_an_unknown_rule():
    from lora_opt.smape import smape
    with pytest.raises(ValueError, match="undefined='skip'; allowed: drop, zero"):
        smape([1], [1], undefined="skip")


# --- the real-runs CSV -----------------------------------------------------------------------

def test_real_runs_csv_has_one_loader():
    # (experiments/reproduce/curves.py's load_runs reads another table: the fidelity replays)
    assert _defined_in({"load_runs"}, PRODUCT_DIRS) == {"load_runs": ["lora_opt/calibration/runs_csv.py"]}
    from lora_opt.calibration import e2e_fit, fidelity, probe_fit, profile_fit, runs_csv
    for mod in (e2e_fit, fidelity, probe_fit, profile_fit):
        assert mod.load_runs is runs_csv.load_runs, mod.__name__


def test_fidelity_validates_its_runs_csv_as_calibrate_does(tmp_path):
    """The one loader validates for every reader: fidelity refuses a table without the real-runs
    columns with exit status 2 and their names (it used to read any CSV and fail later)."""
    bad = tmp_path / "runs.csv"
    bad.write_text("experiment,model\nx,y\n")
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "fidelity", "--runs", str(bad), "--workers", "1",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--runs:" in r.stderr and "lacks column(s)" in r.stderr and "'status'" in r.stderr
    assert "Traceback" not in r.stderr


# --- the smallest vLLM rank >= the adapters' ranks -------------------------------------------

#: copies not yet replaced, in files this change could not touch (lora_opt/emulate/ had another
#: owner): each must go -- replace it with twin.flags.max_lora_rank_for and drop it from here
KNOWN_RANK_COPIES: set[str] = set()


def test_smallest_allowed_rank_has_one_definition():
    # "the first allowed rank >= something": next(r for r in VLLM_LORA_RANKS if r >= ...), a loop, min(...)
    pattern = re.compile(r"in\s+(\w+\.)?VLLM_LORA_RANKS\s+if\s+\w+\s*>=|min\([^)]*VLLM_LORA_RANKS")
    where = {rel for rel, text in _sources().items() if rel != "twin/flags.py" and pattern.search(text)}
    assert where - KNOWN_RANK_COPIES == set(), "call twin.flags.max_lora_rank_for instead"
    assert KNOWN_RANK_COPIES <= where, f"fixed: remove {sorted(KNOWN_RANK_COPIES - where)} from KNOWN_RANK_COPIES"
    assert _defined_in({"max_lora_rank_for", "lora_rank_for"}) == {"max_lora_rank_for": ["twin/flags.py"],
                                                                  "lora_rank_for": []}


@pytest.mark.parametrize("ranks, want", [([8], 8), ([1], 1), ([2], 8), ([8, 9], 16), ([300], 320),
                                         ([512], 512), ((r for r in (4, 33)), 64)])
def test_max_lora_rank_for(ranks, want):
    from twin.flags import max_lora_rank_for
    assert max_lora_rank_for(ranks) == want


def test_max_lora_rank_for_refuses_a_rank_above_vllms_largest():
    from twin.errors import ScenarioError
    from twin.flags import max_lora_rank_for
    with pytest.raises(ScenarioError, match="adapter rank 513: above vLLM's largest --max-lora-rank 512"):
        max_lora_rank_for([8, 513])


def test_scenario_and_placement_take_the_rank_from_it():
    from lora_opt.placement.policies.base import gpu_config
    from lora_opt.placement.workload_file import workload_from_dict
    from twin.profile import load_profile
    from twin.scenario import build_scenario

    profile = "llama-3.1-8b-h100-64gb"
    sc = build_scenario(profile, [{"id": "a", "rank": 9, "rate": 1.0}, {"id": "b", "rank": 4, "rate": 1.0}])
    assert sc.resolved_engine(load_profile(profile)).max_lora_rank == 16
    wl = workload_from_dict({"profile": profile, "adapters": [{"count": 2, "rank": 33, "rate": 0.5}]})
    assert gpu_config(wl, load_profile(profile), [33, 8], 2, 2).max_lora_rank == 64


# --- an unset engine flag's value: twin.flags.resolve_flags --------------------------------------

#: readers of flag defaults outside the resolution, each for a reason: the calibration makes a
#: profile, and its real runs record no budget (the model table's default is theirs)
KNOWN_DEFAULT_READERS = {"lora_opt/calibration/step_fit.py", "lora_opt/calibration/memory_check.py"}


def test_unset_flags_are_resolved_in_one_place():
    """The profile's flag defaults (and the model's context as max_model_len) are read by
    ``Profile.flag_defaults`` alone, and filled in by ``resolve_flags`` alone: a scenario's, a
    workload's and a placement GPU's flags resolve alike (tests/test_flags.py checks they agree)."""
    pattern = re.compile(r"\.model\.max_model_len\b|\.defaults\.(max_\w+|gpu_memory_utilization)\b")
    where = {rel for rel, text in _sources().items() if rel != "twin/profile.py" and pattern.search(text)}
    assert where - KNOWN_DEFAULT_READERS == set(), "resolve flags with Scenario/Workload.resolved_engine"
    assert KNOWN_DEFAULT_READERS <= where, f"fixed: remove {sorted(KNOWN_DEFAULT_READERS - where)}"
    assert _defined_in({"resolve_flags", "flag_defaults"}) == {"resolve_flags": ["twin/flags.py"],
                                                               "flag_defaults": ["twin/profile.py"]}


# --- a flag's vllm serve spelling: twin.flags.serve_option ---------------------------------------

#: files that spell engine flags as options by hand, each for a reason: the probe reads a launch
#: command's flags into real-runs CSV columns (no max_model_len column) and offers its own options
KNOWN_OPTION_SPELLERS = {"lora_opt/probe/run.py", "lora_opt/probe/launch.py", "lora_opt/probe/compare.py",
                         "lora_opt/cli/probe.py"}


def test_flags_are_spelled_as_options_in_one_place():
    """``serve_command`` (launch scripts) and ``lora-opt emulate`` (vLLM's own flags) take each
    option's spelling from ``serve_option``: a new EngineFlags field reaches both."""
    options = "|".join(re.escape(serve_option(f.name)) for f in dataclasses.fields(EngineFlags))
    pattern = re.compile(rf"[\"']({options})[\"']")
    where = {rel for rel, text in _sources(PRODUCT_DIRS).items() if pattern.search(text)}
    assert where - KNOWN_OPTION_SPELLERS == set(), "spell a flag with twin.flags.serve_option"
    assert KNOWN_OPTION_SPELLERS <= where, f"fixed: remove {sorted(KNOWN_OPTION_SPELLERS - where)}"


# --- the LoRA cost factor: jump + slope*n/(1 + n/n_sat) ------------------------------------------

#: copies not yet replaced (none: the kernel, twin/engine_cost.py, calls ``njit(lora_extra)`` since
#: session 11; test_engine's step-time test checks it against the profile's estimator)
KNOWN_LORA_FACTOR_COPIES: set[str] = set()


def _saturation_shapes(text: str, rel: str) -> list[int]:
    """Lines holding ``x / (1 + y / z)`` -- the per-adapter term's saturating shape."""
    def one(n):
        return isinstance(n, ast.Constant) and n.value in (1, 1.0)
    return [node.lineno for node in ast.walk(ast.parse(text, rel))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.BinOp)
            and isinstance(node.right.op, ast.Add) and one(node.right.left)
            and isinstance(node.right.right, ast.BinOp) and isinstance(node.right.right.op, ast.Div)]


def test_lora_cost_factor_has_one_definition():
    where = {rel for rel, text in _sources().items() if rel != "twin/profile.py" and _saturation_shapes(text, rel)}
    assert where - KNOWN_LORA_FACTOR_COPIES == set(), "call twin.profile.lora_extra instead"
    assert KNOWN_LORA_FACTOR_COPIES <= where, \
        f"fixed: remove {sorted(KNOWN_LORA_FACTOR_COPIES - where)} from KNOWN_LORA_FACTOR_COPIES"
    assert _defined_in({"lora_extra"}) == {"lora_extra": ["twin/profile.py"]}
    from lora_opt.calibration import step_fit
    from twin import profile
    assert step_fit.lora_extra is profile.lora_extra


def test_lora_extra_is_the_profiles_estimator_and_compiles_bit_identical():
    """The spec's ``extra`` is the formula; Numba compiles the same function with the same bits
    (so the engine kernel can call it instead of its own copy)."""
    import math

    import numpy as np
    from numba import njit

    from twin.profile import LoraOverheadSpec, lora_extra
    spec = LoraOverheadSpec(jump=0.87, slope=0.0173, n_sat=40.0, slot_share=0.5, ref_max_loras=300.0)
    assert spec.extra(0, 16) == 0.0
    assert spec.extra(5, 16) == spec.jump_at(16) + 0.0173 * 5 / (1.0 + 5 / 40.0)
    compiled = njit(lora_extra)
    for n_sat in (40.0, math.inf):
        for n in (1, 3, 17, 300):
            assert compiled(0.87, 0.0173, n_sat, n) == lora_extra(0.87, 0.0173, n_sat, n)
        x = np.array([1.0, 2.5, 40.0])
        assert np.array_equal(lora_extra(0.87, 0.0173, n_sat, x),
                              [lora_extra(0.87, 0.0173, n_sat, float(v)) for v in x])


# --- adapters -> a scenario's adapter dicts ------------------------------------------------------

#: copies not yet replaced (none: the emulator's placement instances, which floored at 1e-9, call
#: ``scenario_adapters`` since session 11)
KNOWN_ADAPTER_DICT_COPIES: set[str] = set()


def _floored_adapter_dicts(text: str, rel: str) -> list[int]:
    """Lines of a dict display with "rank" and "rate" keys whose rate is floored (``max(...)``)."""
    out = []
    for node in ast.walk(ast.parse(text, rel)):
        if isinstance(node, ast.Dict):
            keys = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
            rate = keys.get("rate")
            if "rank" in keys and isinstance(rate, ast.Call) and getattr(rate.func, "id", None) == "max":
                out.append(node.lineno)
    return out


def test_adapter_scenario_dicts_have_one_definition():
    owner = "lora_opt/placement/workload_file.py"
    where = {rel for rel, text in _sources().items() if rel != owner and _floored_adapter_dicts(text, rel)}
    assert where - KNOWN_ADAPTER_DICT_COPIES == set(), "call lora_opt.placement.workload_file.scenario_adapters"
    assert KNOWN_ADAPTER_DICT_COPIES <= where, \
        f"fixed: remove {sorted(KNOWN_ADAPTER_DICT_COPIES - where)} from KNOWN_ADAPTER_DICT_COPIES"
    assert _defined_in({"scenario_adapters"}) == {"scenario_adapters": [owner]}
    assert not re.search(r"IDLE_RATE\s*=", "".join(t for r, t in _sources().items() if r != owner))


def test_scenario_adapters_floor_scale_and_ids():
    from lora_opt.placement.workload_file import IDLE_RATE, Adapter, scenario_adapters
    ads = [Adapter(id="a", rank=8, rate=2.0), Adapter(id="idle", rank=16, rate=0.0)]
    assert scenario_adapters(ads) == [{"count": 1, "rank": 8, "rate": 2.0, "id": "a"},
                                      {"count": 1, "rank": 16, "rate": IDLE_RATE, "id": "idle"}]
    assert IDLE_RATE == 1e-12
    assert [d["rate"] for d in scenario_adapters(ads, 1.5)] == [3.0, IDLE_RATE]


# --- provenance and MLflow names: lora_opt/tracking.py -------------------------------------------

def test_tracking_rules_have_one_definition():
    """The twin's version a dataset row records is the one a run's tags carry; the store and the
    metric names of every run (surrogate training's included) come from the same functions."""
    names = {"twin_version", "profile_hash", "resolve_tracking_uri", "flat_metrics"}
    assert _defined_in(names) == {n: ["lora_opt/tracking.py"] for n in names}


def test_surrogate_metric_names_are_unchanged():
    """Surrogate training logged its metrics through its own copy of ``flat_metrics`` (spaces to
    ``_``, commas dropped); the committed surrogates' metrics keep those names under the one rule."""
    import json
    import math

    from lora_opt.tracking import flat_metrics

    def old(prefix, d):               # surrogates/reporting.py's copy, before it was removed
        out = {}
        if isinstance(d, dict):
            for k, v in d.items():
                out.update(old(f"{prefix}.{k}" if prefix else str(k), v))
        elif isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d):
            out[prefix.replace(" ", "_").replace(",", "")] = float(d)
        return out

    paths = sorted((REPO_ROOT / "configs" / "surrogates").glob("*/metrics.json"))
    assert paths
    for path in paths:
        m = json.loads(path.read_text())
        for prefix, d in (("", {k: m[k] for k in ("regressor", "classifier", "paper_ng", "dataset", "train_wall_s")}),
                          ("distilled", m["distilled"])):
            assert flat_metrics(prefix, d) == old(prefix, d) != {}, path


# --- the default vLLM release: twin.flags.DEFAULT_VLLM_VERSION ----------------------------------

#: string constants equal to the default release that are not the default: the releases lora-opt has
#: an option table for
KNOWN_RELEASE_LITERALS = {"lora_opt/placement/vllm_launch.py"}


def test_default_vllm_release_has_one_definition():
    """Launch commands, the emulator and the CLI's help texts take the default release from
    ``twin.flags.DEFAULT_VLLM_VERSION``; no second copy (an assignment, a literal, a help text's
    "else 0.33") can drift from it."""
    from lora_opt.emulate.vllm_versions import VERSIONS
    from lora_opt.placement.vllm_launch import SERVE_ARG_TABLES
    from twin.flags import DEFAULT_VLLM_VERSION

    assert DEFAULT_VLLM_VERSION in SERVE_ARG_TABLES and DEFAULT_VLLM_VERSION in VERSIONS
    where, literals = [], set()
    for rel, text in _sources().items():
        tree = ast.parse(text, rel)
        where += [f"{rel}:{line}" for name, line in _assigned_names(tree)
                  if name == "DEFAULT_VLLM_VERSION" and rel != "twin/flags.py"]
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == DEFAULT_VLLM_VERSION
                    or re.search(rf"(default|else)\D{{0,60}}\b{re.escape(DEFAULT_VLLM_VERSION)}\b", node.value)):
                literals.add(rel)
    assert where == []
    literals.discard("twin/flags.py")
    assert literals - KNOWN_RELEASE_LITERALS == set(), "use twin.flags.DEFAULT_VLLM_VERSION"
    assert KNOWN_RELEASE_LITERALS <= literals, f"fixed: remove {sorted(KNOWN_RELEASE_LITERALS - literals)}"
