"""Writing a profile YAML the way ``lora-opt calibrate`` and ``lora-opt calibrate-e2e`` both do:
one style (leaf mappings and lists in flow style, 110 columns, keys in the order given), the
file's ``#`` header kept, written atomically and only when its text changes.

One style for both commands is what makes a rerun reviewable: a rerun whose values did not change
leaves the file byte-identical (not even its modification time changes), and one changed value
changes only the lines that hold it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lora_opt.io import atomic_write_text

#: ``yaml.safe_dump``'s options for every profile this package writes
PROFILE_YAML_STYLE = {"sort_keys": False, "default_flow_style": None, "width": 110}


def header_of(text: str) -> str:
    """The ``#`` comment lines of a profile's text (its provenance header), in order."""
    return "".join(line for line in text.splitlines(True) if line.startswith("#"))


def profile_text(header: str, prof: dict[str, Any]) -> str:
    """The full text of a profile file: ``header`` (comment lines) then ``prof`` in the profile style."""
    return header + yaml.safe_dump(prof, **PROFILE_YAML_STYLE)


def write_profile(path: str | Path, header: str, prof: dict[str, Any]) -> bool:
    """Write ``prof`` to ``path`` (atomically) unless the file already holds exactly that text;
    whether it was written."""
    path = Path(path)
    text = profile_text(header, prof)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    atomic_write_text(path, text)
    return True
