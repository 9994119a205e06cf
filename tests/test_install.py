"""Install anywhere, with dependencies that say the truth (issue 13).

Default run: the wheel built from this tree, installed into a venv in a temporary directory outside
the checkout, runs ``lora-opt --version``, ``simulate example --json`` and ``place --workload example
--gpus 4 --emit-vllm`` from another temporary directory, reading every bundled file from its package
data and writing nothing under site-packages but Python's and Numba's caches.  That venv borrows the
test environment's third-party packages (a ``.pth`` file) so the test needs no network and stays
short; ``pytest -m slow tests/test_install.py`` installs the wheel with its dependencies from the
index into a fresh venv (CI's versions, constraints/ci.txt) and, separately, the dependency floors
(constraints/floors.txt, binary wheels only) and runs a subset of the tests on them.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from twin import paths
from twin.errors import ScenarioError

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: what a source tree needs to build the wheel (what an sdist would hold)
SOURCE_ITEMS = ("twin", "lora_opt", "configs", "data", "pyproject.toml", "README.md", "LICENSE")
#: the floors run: one test module per dependency group the code leans on (numba/numpy: the twin;
#: pandas/pyarrow/scipy: workloads and calibration; sklearn/skops: surrogates; optuna/sqlalchemy:
#: search; mlflow/alembic: tracking; ray: parallel; fastapi/starlette/uvicorn/httpx/prometheus: emulate)
FLOORS_TESTS = ("tests/test_scenario.py", "tests/test_workload_file.py", "tests/test_place_cli.py",
                "tests/test_bundled_surrogates.py", "tests/test_model_files.py", "tests/test_search.py",
                "tests/test_tracking.py", "tests/test_parallel.py", "tests/test_emulate.py",
                "tests/test_calibrate.py", "tests/test_install.py")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = PYPROJECT["project"]
    texts = project["optional-dependencies"][extra] if extra else project["dependencies"]
    out = []
    for req in map(Requirement, texts):
        if _canonical(req.name) == "lora-opt":          # an extra that includes another (dev -> ui)
            out += [r for e in sorted(req.extras) for r in _requirements(e)]
        else:
            out.append(req)
    return out


def _pins(path: Path) -> dict[str, Version]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[_canonical(name)] = Version(version)
    return out


# ---- the declared dependencies ---------------------------------------------------------------
def _imported_top_level_modules() -> set[str]:
    found = set()
    for pkg in ("twin", "lora_opt"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"twin", "lora_opt"}


def test_every_imported_third_party_module_is_declared():
    declared = {_canonical(r.name) for r in _requirements()}
    providers = metadata.packages_distributions()
    undeclared = {m: providers.get(m) for m in _imported_top_level_modules()
                  if not declared & {_canonical(d) for d in providers.get(m, [])}}
    assert undeclared == {}, "imported but not in pyproject.toml's dependencies (module: distributions)"


def test_every_dependency_has_a_floor_and_a_cap_and_the_constraint_files_agree():
    floors = _pins(ROOT / "constraints" / "floors.txt")
    ci = _pins(ROOT / "constraints" / "ci.txt")
    problems = []
    for req in [*_requirements(), *_requirements("dev")]:
        name = _canonical(req.name)
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        if not lower or not any(s.operator == "<" for s in req.specifier):
            if name != "setuptools":            # a build tool for the test, any recent one
                problems.append(f"{req}: needs a floor (>=) and a cap (<)")
            continue
        if floors.get(name) != lower[0]:
            problems.append(f"{req}: constraints/floors.txt pins {floors.get(name)}, not the floor {lower[0]}")
        if name in ci and not req.specifier.contains(ci[name], prereleases=True):
            problems.append(f"{req}: constraints/ci.txt pins {ci[name]}, outside the range")
        if name not in ci and (req.marker is None or req.marker.evaluate()):
            problems.append(f"{req}: missing from constraints/ci.txt")
    assert problems == []


def test_pyproject_lists_every_package_and_the_bundle_mapping():
    """pyproject.toml lists packages by hand (the bundle's package-dir mapping rules out
    packages.find): every directory of twin/ and lora_opt/ with an __init__.py must be there."""
    setuptools_cfg = PYPROJECT["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for pkg in ("twin", "lora_opt")
               for p in (ROOT / pkg).rglob("__init__.py")}
    mapped = setuptools_cfg["package-dir"]
    assert set(setuptools_cfg["packages"]) == on_disk | set(mapped)
    assert all((ROOT / target).is_dir() for target in mapped.values())
    for pkg, patterns in setuptools_cfg["package-data"].items():
        folder = ROOT / mapped.get(pkg, pkg.replace(".", "/"))
        assert all(any(f.is_file() for f in folder.glob(pat)) for pat in patterns), pkg


def test_experiments_use_the_installed_package():
    offenders = [p.name for p in (ROOT / "experiments").rglob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []


# ---- bundled files by name -------------------------------------------------------------------
def test_bundled_workloads_scenarios_and_profiles_resolve_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.resolve_bundled("workload", "example") == paths.WORKLOADS_DIR / "example.yaml"
    assert paths.resolve_bundled("scenario", "example") == paths.SCENARIOS_DIR / "example.yaml"
    assert "llama-3.1-8b-h100-64gb" in paths.bundled_names("profile")
    # a path is a path; an existing file of that name wins over the bundled one
    assert paths.resolve_bundled("workload", "mine.yaml") == Path("mine.yaml")
    (tmp_path / "example").write_text("adapters: []\n")
    assert paths.resolve_bundled("workload", "example") == Path("example")
    with pytest.raises(ScenarioError, match=r"unknown scenario 'nope'.*bundled scenarios: \['example'\]"):
        paths.resolve_bundled("scenario", "nope", ScenarioError)


def test_bundled_files_are_under_the_bundle_root():
    """Every path the code reads its bundled files from derives from the one resolver."""
    from lora_opt.calibration.model_table import MODEL_TABLE_PATH
    from lora_opt.placement.policies.base import SURROGATES_DIR
    from lora_opt.placement.vllm_launch import SERVE_ARG_TABLES
    from twin.paths import VLLM_SERVE_ARGS_DIR
    from lora_opt.surrogates.dataset import GRIDS_DIR
    from twin.bundled_data import LENGTH_FILES, TRACES

    for path in (MODEL_TABLE_PATH, SURROGATES_DIR, GRIDS_DIR, paths.REAL_RUNS_CSV,
                 *(VLLM_SERVE_ARGS_DIR / name for name in SERVE_ARG_TABLES.values()),
                 *LENGTH_FILES.values(), *TRACES.values()):
        assert path.exists() and path.resolve().is_relative_to(paths.BUNDLE_ROOT), path


# ---- the wheel -------------------------------------------------------------------------------
def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH pointing into a checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, **extra}


def _run(cmd: list, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(**env), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def build_wheel(work: Path) -> Path:
    """The wheel of a copy of this tree, built offline, with a Numba cache and an outputs/ directory
    planted in the copy as a user's checkout has them (the wheel must carry neither)."""
    src = work / "src"
    for item in SOURCE_ITEMS:
        (shutil.copytree if (ROOT / item).is_dir() else shutil.copy2)(ROOT / item, src / item)
    for planted in ("twin/__pycache__/engine.run_engine-1.py311.nbi", "twin/__pycache__/engine.run_engine-1.py311.1.nbc",
                    "configs/profiles/__pycache__/x.nbi", "outputs/placement-example/placement.json"):
        (src / planted).parent.mkdir(parents=True, exist_ok=True)
        (src / planted).write_text("{}")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", work / "dist", src], cwd=work)
    (wheel,) = (work / "dist").glob("lora_opt-*.whl")
    return wheel


def _check_wheel_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    bundled = {n.split("twin/_bundled/", 1)[1] for n in names if n.startswith("twin/_bundled/")}
    expected = {str(p.relative_to(ROOT)) for d in ("configs", "data") for p in (ROOT / d).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    assert bundled == expected
    assert not [n for n in names if "__pycache__" in n or n.endswith((".nbi", ".nbc", ".pyc"))]
    assert not [n for n in names if n.startswith("outputs/") or "/outputs/" in n]
    assert {"twin/py.typed", "lora_opt/py.typed"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def _site_packages(venv: Path) -> Path:
    (sp,) = (venv / "lib").glob("python3*/site-packages")
    return sp


def _files_outside_caches(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def run_the_three_commands(venv: Path, cwd: Path) -> None:
    """``lora-opt --version``, ``simulate example --json``, ``place --workload example --gpus 4
    --emit-vllm`` with the installed package, from ``cwd``; nothing written under site-packages."""
    bin_dir = venv / "bin"
    site = _site_packages(venv)
    before = _files_outside_caches(site)
    where = _run([bin_dir / "python", "-c", "import lora_opt, twin, twin.paths as p; "
                  "print(lora_opt.__file__, twin.__file__, p.BUNDLE_ROOT, p.FROM_WHEEL)"], cwd=cwd).stdout.split()
    assert all(Path(w).resolve().is_relative_to(site.resolve()) for w in where[:3]) and where[3] == "True", where
    version = _run([bin_dir / "lora-opt", "--version"], cwd=cwd).stdout.strip()
    assert version == f"lora-opt {PYPROJECT['project']['version']}"
    sim = json.loads(_run([bin_dir / "lora-opt", "simulate", "example", "--json"], cwd=cwd).stdout)
    assert sim["throughput_tok_s"] > 0, sim
    _run([bin_dir / "lora-opt", "place", "--workload", "example", "--gpus", "4", "--emit-vllm", "--out", "pl"], cwd=cwd)
    assert (cwd / "pl" / "placement.json").is_file() and (cwd / "pl" / "vllm" / "serve_commands.txt").is_file()
    assert _files_outside_caches(site) == before, "a command wrote under site-packages"


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path / "build")
    _check_wheel_contents(wheel)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
          "--no-index", wheel], cwd=tmp_path)
    # the third-party packages of this test environment, appended after the venv's own site-packages
    # (a path in a .pth file is not itself scanned for .pth files: an editable lora-opt there stays off)
    shared = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (_site_packages(venv) / "_test_shared_dependencies.pth").write_text("\n".join(shared) + "\n")
    user_dir = tmp_path / "elsewhere"
    user_dir.mkdir()
    run_the_three_commands(venv, user_dir)


# ---- slow: real installs from the index ----------------------------------------------------
@pytest.mark.slow
def test_wheel_installs_with_its_dependencies_into_a_fresh_venv(tmp_path):
    """The user's install: ``pip install lora_opt-*.whl`` into a new venv, dependencies from the index
    (at CI's versions: constraints/ci.txt), then the three commands."""
    wheel = build_wheel(tmp_path / "build")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "-c", ROOT / "constraints" / "ci.txt", wheel],
         cwd=tmp_path, timeout=1800)
    _run([venv / "bin" / "python", "-m", "pip", "check"], cwd=tmp_path)
    user_dir = tmp_path / "elsewhere"
    user_dir.mkdir()
    run_the_three_commands(venv, user_dir)


@pytest.mark.slow
def test_dependency_floors_install_and_the_tests_pass_on_them(tmp_path):
    """constraints/floors.txt (every floor of pyproject.toml at once, binary wheels only) installs,
    and a test per dependency group passes on those versions (this checkout's code, run from it)."""
    wheel = build_wheel(tmp_path / "build")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--only-binary=:all:",
          "-c", ROOT / "constraints" / "floors.txt", f"{wheel}[dev]"], cwd=tmp_path, timeout=1800)
    _run([venv / "bin" / "python", "-m", "pip", "check"], cwd=tmp_path)
    installed = _run([venv / "bin" / "python", "-m", "pip", "freeze"], cwd=tmp_path).stdout
    floors = _pins(ROOT / "constraints" / "floors.txt")
    got = {_canonical(n): Version(v) for n, v in re.findall(r"^([^=\s]+)==(\S+)$", installed, re.M)}
    assert {n: got.get(n) for n in floors} == floors
    # python -m pytest from the checkout: the checkout's code, the floors' dependencies; a Numba
    # cache of its own (the checkout's belongs to CI's Numba)
    _run([venv / "bin" / "python", "-m", "pytest", "-p", "no:cacheprovider", "-m", "not slow",
          *FLOORS_TESTS], cwd=ROOT, timeout=3000, NUMBA_CACHE_DIR=str(tmp_path / "numba_cache"))
