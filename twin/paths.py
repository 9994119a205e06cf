"""Where the bundled files are: the one resolver, for a checkout and for an installed wheel.

The repository's ``configs/`` (profiles, models.yaml, grids, workloads, scenarios, surrogates) and
``data/`` (real runs, traces, length distributions, kernel profiles, the vLLM option table) are the
source of truth.  A wheel carries copies of both as package data under ``twin/_bundled/``
(pyproject.toml maps them there); this module finds them with ``importlib.resources`` and falls back
to the checkout (``pip install -e .``, ``PYTHONPATH=<checkout>``), where ``twin/_bundled`` does not
exist.  Nothing is ever written here: outputs go under the current directory.

Bundled profiles, workloads and scenarios are addressable by name (``example``): ``resolve_bundled``
turns a name that is not an existing file into the bundled file, and its error lists the names.
"""
from __future__ import annotations

import importlib.resources
from pathlib import Path

#: the directory ``twin/`` sits in: a checkout's root (tests run commands there), or site-packages
REPO_ROOT = Path(__file__).resolve().parent.parent


def _bundle_root() -> Path:
    """The directory holding ``configs/`` and ``data/``: the wheel's package data, else the checkout."""
    packaged = importlib.resources.files("twin") / "_bundled"
    if packaged.is_dir() and isinstance(packaged, Path):
        return packaged.resolve()
    return REPO_ROOT


#: the directory holding ``configs/`` and ``data/`` (paths recorded in profiles are relative to it)
BUNDLE_ROOT = _bundle_root()
#: True when running from a wheel's package data rather than a checkout
FROM_WHEEL = BUNDLE_ROOT != REPO_ROOT
CONFIGS_DIR = BUNDLE_ROOT / "configs"
PROFILES_DIR = CONFIGS_DIR / "profiles"
SCENARIOS_DIR = CONFIGS_DIR / "scenarios"
WORKLOADS_DIR = CONFIGS_DIR / "workloads"
#: day-long demand drifts (``lora-opt schedule --drift day``)
DRIFT_DIR = CONFIGS_DIR / "drift"
GRIDS_DIR = CONFIGS_DIR / "grids"
SURROGATES_DIR = CONFIGS_DIR / "surrogates"
MODEL_TABLE_PATH = CONFIGS_DIR / "models.yaml"
DATA_DIR = BUNDLE_ROOT / "data"
#: the option tables of ``vllm serve``, one per vLLM release, each recorded from that release's own
#: parser (``vllm_serve_args-<version>.json``; ``--emit-vllm`` and ``probe --launch`` check against them)
VLLM_SERVE_ARGS_DIR = DATA_DIR / "reference"
#: the real vLLM runs calibration and fidelity read
REAL_RUNS_CSV = DATA_DIR / "real_runs" / "real_runs_vllm_lora.csv"

#: the kinds of input addressable by name: directory and what it holds
NAMED_KINDS = {"profile": PROFILES_DIR, "workload": WORKLOADS_DIR, "scenario": SCENARIOS_DIR, "drift": DRIFT_DIR}
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def bundled_names(kind: str) -> list[str]:
    """The bundled files of ``kind`` (``profile``, ``workload``, ``scenario``), by name."""
    folder = NAMED_KINDS[kind]
    return sorted(f.stem for f in folder.glob("*.yaml")) if folder.is_dir() else []


def is_bundled_name(name_or_path: str | Path) -> bool:
    """A bare name (no '/', no YAML/JSON suffix) that is not an existing file."""
    text = str(name_or_path)
    return ("/" not in text and Path(text).suffix.lower() not in CONFIG_SUFFIXES
            and not Path(text).is_file())


def resolve_bundled(kind: str, name_or_path: str | Path, error: type[Exception] = ValueError) -> Path:
    """The file a user means: a path as given, or a bundled ``kind`` by name.  ``error`` (the
    caller's bad-input type) names the bundled files when the name is unknown."""
    if not is_bundled_name(name_or_path):
        return Path(name_or_path)
    folder = NAMED_KINDS[kind]
    candidate = folder / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    if not folder.is_dir():
        raise error(f"{kind}: the bundled {kind}s are missing ({folder} does not exist; a broken install?); "
                    f"give a path to a {kind} YAML")
    raise error(f"{kind}: unknown {kind} {str(name_or_path)!r} (not a file, not a bundled name); "
                f"bundled {kind}s: {bundled_names(kind)} (or give a path to a {kind} YAML/JSON)")


def bundle_relative(path: str | Path) -> str:
    """``path`` relative to the bundle root when it lies under it (``data/...``), else as given:
    how profiles record the files they were fitted on, the same from a checkout or a wheel."""
    try:
        return str(Path(path).resolve().relative_to(BUNDLE_ROOT))
    except ValueError:
        return str(path)
