"""Write constraints/ci.txt: the versions installed in this environment of every distribution
lora-opt[dev] needs, directly or through its dependencies (``pip freeze`` limited to that closure).

    python constraints/update_ci.py          # run in the venv CI's command made (pip install -e ".[dev]")

Install the same set elsewhere with ``pip install -c constraints/ci.txt -e ".[dev]"``.
"""
from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

OUT = Path(__file__).resolve().parent / "ci.txt"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    """{distribution: installed version} for pyproject.toml's dependencies and its ``dev`` extra (read
    from the file, not from the installed metadata, which may be older) and everything they require."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    installed = {_canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    found: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = []
    for text in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate():
            todo.append((req.name, set(req.extras)))
    while todo:
        name, extras = todo.pop()
        dist = installed.get(_canonical(name))
        if dist is None:
            continue                       # an optional dependency not installed (another platform)
        key = _canonical(name)
        if key in found and not extras:
            continue
        found[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            env = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in env):
                if _canonical(req.name) not in found:
                    todo.append((req.name, set(req.extras)))
    return found


def main() -> int:
    pins = closure()
    header = ("# The versions CI tests (Python 3.11): lora-opt[dev]'s dependencies and theirs, as installed in\n"
              "# CI's venv. Written by constraints/update_ci.py; install with\n"
              "#   pip install -c constraints/ci.txt -e \".[dev]\"\n")
    OUT.write_text(header + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
    print(f"{OUT}: {len(pins)} pins", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
