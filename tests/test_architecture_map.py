"""docs/architecture.md's ownership table is true: every module of ``twin/`` and ``lora_opt/`` is named in
it, in the row of the package that holds it, and every module it names exists.  The README's Layout names
every top-level folder of the repository and every package of ``lora_opt/``.

The rule (stated above the table): a row's package is the first cell's folder; a backticked name ending
in ``.py`` in the row's "owns" cell is a module path relative to that folder (``engine.py`` in
``twin/``'s row, ``policies/greedy.py`` in ``lora_opt/placement/``'s); a module belongs to the row whose
folder is the longest prefix of its path; another package's module is referred to by its dotted name
(``lora_opt.replan.router_config``), never by a ``.py`` path; a name starting with one of the repository's
other folders (``experiments/``, ``tests/``, ``tools/``) is a script's path from the repository root.
``__init__.py`` and ``__main__.py`` need not be named.  The "does not" cell is prose and is not read.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"
PACKAGES = ("twin", "lora_opt")
SECTION = "## What each package owns"
UNNAMED = ("__init__.py", "__main__.py")
#: folders outside the packages: a name under one is a path from the repository root
SCRIPT_FOLDERS = ("experiments/", "tests/", "tools/")


def _rows() -> dict[str, str]:
    """The table's rows: package folder (``lora_opt/placement/``) -> the "owns" cell."""
    text = MAP.read_text()
    assert SECTION in text, f"{MAP.name} has no section {SECTION!r}"
    rows = {}
    for line in text.split(SECTION, 1)[1].split("\n## ", 1)[0].splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a row of three cells (package | owns | does not): {line[:80]}"
        folder = re.match(r"`([^`]+/)`", cells[0])
        assert folder, f"the first cell names a package folder in backticks: {cells[0]!r}"
        assert folder.group(1) not in rows, f"two rows for {folder.group(1)}"
        rows[folder.group(1)] = cells[1]
    return rows


def _modules() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if p.name not in UNNAMED)


def _owner(path: str, rows: dict[str, str]) -> str | None:
    folders = [f for f in rows if path.startswith(f)]
    return max(folders, key=len) if folders else None


def _names(owns: str) -> list[str]:
    """The package modules an "owns" cell names (scripts outside the packages left out)."""
    return [n for n in re.findall(r"`([^`\s]+\.py)`", owns) if not n.startswith(SCRIPT_FOLDERS)]


def _named(rows: dict[str, str]) -> set[str]:
    """Every module the table names, as a path from the repository root."""
    return {folder + name for folder, owns in rows.items() for name in _names(owns)}


def test_every_row_is_a_package_folder():
    for folder in _rows():
        assert (ROOT / folder / "__init__.py").is_file(), f"the row {folder} is not a package"


def test_every_module_is_named_in_its_packages_row():
    named = _named(_rows())
    missing = [m for m in _modules() if m not in named]
    assert missing == [], ("modules the ownership table of docs/architecture.md does not name (add each to its "
                           f"package's row, as a path relative to the package): {missing}")


def test_every_named_module_exists_in_the_row_that_owns_it():
    rows = _rows()
    for folder, owns in rows.items():
        for name in _names(owns):
            path = folder + name
            assert (ROOT / path).is_file(), f"docs/architecture.md names {name} in {folder}'s row: no {path}"
            assert _owner(path, rows) == folder, (f"{path} is named in {folder}'s row but belongs to "
                                                  f"{_owner(path, rows)}'s")


def test_every_named_script_exists():
    for folder, owns in _rows().items():
        for name in re.findall(r"`([^`\s]+\.py)`", owns):
            if name.startswith(SCRIPT_FOLDERS):
                assert (ROOT / name).is_file(), f"docs/architecture.md names {name} in {folder}'s row: no such file"


def test_no_glob_stands_for_modules():
    """``step_fit*.py`` would hide a new module: each is named whole."""
    for folder, owns in _rows().items():
        globs = re.findall(r"`([^`]*\*[^`]*\.py)`", owns)
        assert globs == [], f"{folder}'s row names modules by a pattern: {globs}"


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    assert "\n## Layout\n" in text, "the README has a Layout section"
    return text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_layout_names_every_package_of_lora_opt():
    layout = _readme_layout()
    packages = sorted(p.parent.name for p in (ROOT / "lora_opt").glob("*/__init__.py"))
    assert [p for p in packages if f"`{p}/`" not in layout] == [], "name each lora_opt package in the README's Layout"


def test_the_readme_layout_names_every_top_level_folder():
    """Tracked folders only (a checkout's outputs/, mlruns/ and .venv/ are not the project's)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked folders are unknown")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = sorted({f.split("/", 1)[0] for f in files.splitlines() if "/" in f})
    layout = _readme_layout()
    assert [f for f in folders if f"`{f}/" not in layout] == [], "name each top-level folder in the README's Layout"
