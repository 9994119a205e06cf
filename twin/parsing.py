"""Reading YAML/JSON config files into validated dataclasses: the helpers every config file shares.

Scenario files (``twin.scenario``), profiles' engine defaults and lora-opt's workload files are all
mappings whose keys are the fields of a frozen dataclass.  These helpers turn such a mapping into
the dataclass, coercing each YAML scalar by the field's annotation and raising an error that names
the field (``where``), the value and what is allowed.  The error class defaults to the twin's
``ScenarioError``; lora-opt passes its own ``InputError`` for the files it reads itself.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

import yaml

from twin.errors import ScenarioError


def dataclass_fields(cls) -> dict[str, dataclasses.Field]:
    """The fields of a dataclass by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(cls)}


def check_type(value, typ: str, where: str, error: type[Exception] = ScenarioError):
    """``value`` (a YAML scalar) coerced to the annotation string ``typ`` of a dataclass field:
    ``int``, ``float``, ``bool`` or ``str``, each optionally ``| None``; other annotations pass the
    value through.  Integral floats become ints, ints become floats; bools are never numbers."""
    allow_none = "None" in typ
    if value is None:
        if allow_none:
            return None
        raise error(f"{where}: required, got null")
    base = typ.replace(" | None", "").strip()
    if base == "int":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise error(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise error(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if base == "bool":
        if not isinstance(value, bool):
            raise error(f"{where}: expected true or false, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise error(f"{where}: expected a string, got {value!r}")
        return value
    return value


def build_dataclass(cls, data: Any, where: str, error: type[Exception] = ScenarioError,
                    **nested: Callable[[Any, str], Any]):
    """An instance of the dataclass ``cls`` from the mapping ``data``: unknown and missing fields
    are errors, scalars are checked with :func:`check_type`, and a field named in ``nested`` is
    parsed by that function, called as ``parse(value, where_of_the_field)``."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping with fields {sorted(dataclass_fields(cls))}, got {data!r}")
    fields = dataclass_fields(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"{where}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        if name in nested:
            kwargs[name] = nested[name](value, f"{where}.{name}")
        else:
            kwargs[name] = check_type(value, str(fields[name].type), f"{where}.{name}", error)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}: missing required field(s) {missing}")
    return cls(**kwargs)


def check_choice(value, allowed, where: str, error: type[Exception] = ScenarioError) -> None:
    """``value`` must be one of ``allowed``; the error lists them."""
    if value not in allowed:
        raise error(f"{where}: {value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")


def check_positive(value, where: str, strict: bool = True, error: type[Exception] = ScenarioError) -> None:
    """``value`` (None = unset, accepted) must be > 0 (``strict``) or >= 0."""
    if value is not None and (value <= 0 if strict else value < 0):
        raise error(f"{where}: must be {'> 0' if strict else '>= 0'}, got {value}")


def read_config_file(path: str | Path, what: str = "scenario", error: type[Exception] = ScenarioError):
    """The parsed content of a YAML (or .json) file; ``error`` if missing or malformed."""
    p = Path(path)
    if not p.exists():
        raise error(f"{what} file not found: {p}")
    text = p.read_text()
    try:
        return json.loads(text) if p.suffix.lower() == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise error(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
