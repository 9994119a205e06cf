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
import unicodedata
from pathlib import Path
from typing import Any, Callable

import yaml

from twin.errors import ScenarioError

#: the largest config file read (bytes): scenario, workload, grid, placement files are kilobytes
MAX_FILE_BYTES = 16 * 1024 * 1024
#: the most nodes a YAML/JSON document may hold once its aliases are expanded (an alias bomb --
#: "billion laughs" -- is a few hundred bytes that expand to billions of nodes)
MAX_DOCUMENT_NODES = 2_000_000
#: the deepest nesting of mappings and lists accepted
MAX_DEPTH = 64
#: integers accepted anywhere (int64): larger ones would wrap in the kernel's arrays
MAX_INT = 2**63 - 1


def _sort_keys(keys) -> list[str]:
    """Keys of a parsed mapping for a message (YAML keys need not be strings)."""
    return sorted(map(str, keys))


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
            raise error(f"{where}: expected an integer, got {_short(value)}")
        if not -MAX_INT <= value <= MAX_INT:
            raise error(f"{where}: {_short(value)} is out of range (|value| <= {MAX_INT})")
        return int(value)
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{where}: expected a number, got {_short(value)}")
        return check_finite(value, where, error=error)
    if base == "bool":
        if not isinstance(value, bool):
            raise error(f"{where}: expected true or false, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise error(f"{where}: expected a string, got {_short(value)}")
        return value
    return value


def _short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (a message must not echo a megabyte)."""
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long to print
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[:limit] + "..."


def check_finite(value, where: str, lo: float | None = None, hi: float | None = None,
                 error: type[Exception] = ScenarioError, *, lo_open: bool = False) -> float:
    """``value`` as a finite float within [``lo``, ``hi``] (``lo_open``: ``lo`` excluded); bools,
    strings, NaN and infinities are refused.  The one numeric check of every boundary (config
    fields, CLI flags, request logs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{where}: expected a number, got {_short(value)}")
    try:
        x = float(value)
    except OverflowError:
        raise error(f"{where}: {_short(value)} is out of range") from None
    if not math.isfinite(x):
        raise error(f"{where}: expected a finite number, got {_short(value)}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise error(f"{where}: must be {'>' if lo_open else '>='} {lo:g}, got {x:g}")
    if hi is not None and x > hi:
        raise error(f"{where}: must be <= {hi:g}, got {x:g}")
    return x


def build_dataclass(cls, data: Any, where: str, error: type[Exception] = ScenarioError,
                    **nested: Callable[[Any, str], Any]):
    """An instance of the dataclass ``cls`` from the mapping ``data``: unknown and missing fields
    are errors, scalars are checked with :func:`check_type`, and a field named in ``nested`` is
    parsed by that function, called as ``parse(value, where_of_the_field)``."""
    if not isinstance(data, dict):
        raise error(f"{where}: expected a mapping with fields {sorted(dataclass_fields(cls))}, got {_short(data)}")
    fields = dataclass_fields(cls)
    unknown = _sort_keys(set(data) - set(fields))
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
        raise error(f"{where}: {_short(value)} is not allowed; allowed values: {', '.join(map(str, allowed))}")


def check_positive(value, where: str, strict: bool = True, error: type[Exception] = ScenarioError) -> None:
    """``value`` (None = unset, accepted) must be > 0 (``strict``) or >= 0."""
    if value is not None and (value <= 0 if strict else value < 0):
        raise error(f"{where}: must be {'> 0' if strict else '>= 0'}, got {value}")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (plain data only) that refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key_node.value!r:.80} at line {key_node.start_mark.line + 1} "
                            f"(first at line {seen[key]})", key_node.start_mark)
                    seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _expanded_size(root) -> tuple[int, int]:
    """(nodes, depth) of a composed YAML document with every alias expanded, counted without
    expanding (a node referenced twice counts twice; the count stops past the limit)."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if not children_done:
            if key in depths and depths[key] < 0:      # on the stack: a recursive alias
                raise yaml.YAMLError("a recursive alias (a node containing itself)")
            depths[key] = -1
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
            continue
        sizes[key] = min(1 + sum(sizes[id(k)] for k in kids), MAX_DOCUMENT_NODES + 1)
        depths[key] = 1 + max((depths[id(k)] for k in kids), default=0)
    return sizes[id(root)], depths[id(root)]


def parse_yaml_text(text: str, where: str, error: type[Exception] = ScenarioError):
    """A YAML document as plain data: duplicate keys, more than :data:`MAX_DOCUMENT_NODES` nodes
    once aliases are expanded, or nesting deeper than :data:`MAX_DEPTH` are ``error``s naming
    ``where`` (and the line)."""
    try:
        loader = _Loader(text)             # the reader refuses non-printable characters here
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML: {str(exc).replace('<unicode string>', where)}") from None
    loader.name = where                    # marks (line, column) name the file
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes, depth = _expanded_size(node)
        if nodes > MAX_DOCUMENT_NODES:
            raise error(f"{where}: more than {MAX_DOCUMENT_NODES:,} values once its aliases are expanded "
                        "(an alias bomb?); refused")
        if depth > MAX_DEPTH:
            raise error(f"{where}: nested {depth} levels deep; at most {MAX_DEPTH}")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise error(f"{where}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    finally:
        loader.dispose()


def _json_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def _json_pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_json_text(text: str, where: str, error: type[Exception] = ScenarioError, allow_nan: bool = False):
    """A JSON document as plain data; NaN/Infinity (unless ``allow_nan``: then the fields that
    need numbers check them), duplicate keys and nesting deeper than :data:`MAX_DEPTH` are
    ``error``s naming ``where``."""
    try:
        data = json.loads(text, parse_constant=float if allow_nan else _json_constant, object_pairs_hook=_json_pairs)
    except (json.JSONDecodeError, ValueError) as exc:
        raise error(f"{where}: not valid JSON: {exc}") from None
    except RecursionError:
        raise error(f"{where}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    if _depth(data) > MAX_DEPTH:
        raise error(f"{where}: nested more than {MAX_DEPTH} levels deep")
    return data


def _depth(data) -> int:
    """Nesting depth of plain data (iterative; stops counting past MAX_DEPTH + 1)."""
    best, stack = 0, [(data, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            best = max(best, d)
            if d <= MAX_DEPTH:
                stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return best


def read_text_file(path: str | Path, what: str, error: type[Exception] = ScenarioError,
                   max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a config file; ``error`` naming the file when it is missing, not a
    regular file (a directory), larger than ``max_bytes``, unreadable or not UTF-8 text."""
    p = Path(path)
    try:
        if not p.exists():
            raise error(f"{what} file not found: {p}")
        if p.is_dir():
            raise error(f"{p}: is a directory; expected a {what} file")
        if not p.is_file():
            raise error(f"{p}: not a regular file; expected a {what} file")
        size = p.stat().st_size
        if size > max_bytes:
            raise error(f"{p}: {size:,} bytes; a {what} file may hold at most {max_bytes:,} bytes "
                        f"({max_bytes // 2**20} MiB)")
        with open(p, "rb") as fh:        # read(n) allocates n bytes: ask for what the file holds
            raw = fh.read(size + 1)
            if len(raw) > size:              # it grew since stat(): read on, up to the cap
                raw += fh.read(max_bytes + 1 - len(raw))
    except OSError as exc:
        raise error(f"{p}: cannot be read: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise error(f"{p}: a {what} file may hold at most {max_bytes:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not a {what} file (not UTF-8 text: byte {exc.start})") from None
    if "\x00" in text:
        raise error(f"{p}: not a {what} file (binary data: a NUL byte)")
    return text


def read_config_file(path: str | Path, what: str = "scenario", error: type[Exception] = ScenarioError):
    """The parsed content of a YAML (or .json) file, read with :func:`read_text_file`'s limits and
    parsed by :func:`parse_yaml_text` / :func:`parse_json_text`; ``error`` if missing or malformed.
    With :func:`read_json_file`, the one reader of every file a user hands in (tests/test_house.py)."""
    p = Path(path)
    text = read_text_file(p, what, error)
    if p.suffix.lower() == ".json":
        return parse_json_text(text, str(p), error)
    return parse_yaml_text(text, str(p), error)


def read_json_file(path: str | Path, what: str, error: type[Exception] = ScenarioError, *, allow_nan: bool = False):
    """The parsed content of a JSON file whatever its name, read with :func:`read_text_file`'s limits
    and parsed by :func:`parse_json_text` (``allow_nan``: NaN and Infinity read as floats, as in the
    files lora-opt writes itself, e.g. a run's results); ``error`` if missing or malformed."""
    return parse_json_text(read_text_file(path, what, error), str(path), error, allow_nan=allow_nan)


#: the longest adapter id and adapter path accepted
MAX_ID_CHARS, MAX_PATH_CHARS = 256, 4096


def _bad_chars(text: str, allow_space: bool = False) -> list[str]:
    """Whitespace (but a plain space with ``allow_space``) and control or separator characters of
    ``text`` (as they would be written in a message)."""
    return sorted({repr(c) for c in text if (c.isspace() and not (allow_space and c == " "))
                   or unicodedata.category(c)[0] in "CZ" and c != " " or (c == " " and not allow_space)})


def _launch_text_problems(text, where: str, error: type[Exception], limit: int, *, allow_space: bool) -> list[str]:
    """What makes ``text`` unsafe on a ``vllm serve`` line, in the checks ids and paths share (the
    type first: a non-string is refused at once)."""
    if not isinstance(text, str):
        raise error(f"{where}: expected a string, got {_short(text)}")
    problems = []
    if not text:
        problems.append("empty")
    if len(text) > limit:
        problems.append(f"longer than {limit} characters")
    bad = _bad_chars(text, allow_space=allow_space)
    if bad:
        what = "line breaks, tabs or control characters" if allow_space else "whitespace or control characters"
        problems.append(f"{what} {', '.join(bad[:3])}")
    if text.startswith("-"):
        problems.append("starts with '-'")
    return problems


def check_adapter_id(aid, where: str, error: type[Exception] = ScenarioError) -> str:
    """The one rule for an adapter id, given or generated from a group prefix: it becomes
    ``--lora-modules id=path`` on a ``vllm serve`` line, a router key and the default path
    ``adapters/<id>``, so it must be non-empty, at most :data:`MAX_ID_CHARS` characters, without
    whitespace or control characters (one command per line), ``=`` (vLLM splits ``name=path`` on
    it), ``,`` (vLLM reads a value with one as JSON), a leading ``-`` (read as a flag) or ``..``
    (the default path would leave ``adapters/``)."""
    problems = _launch_text_problems(aid, where, error, MAX_ID_CHARS, allow_space=False)
    problems += [f"contains {c!r}" for c in ("=", ",", "..") if c in aid]
    if problems:
        raise error(f"{where}: adapter id {_short(aid)} is not allowed ({'; '.join(problems)}); ids become "
                    "--lora-modules id=path: no whitespace, control characters, '=', ',', '..' or leading '-'")
    return aid


def check_adapter_path(path, where: str, error: type[Exception] = ScenarioError) -> str:
    """An adapter checkpoint path (or hub id) safe on a ``--lora-modules id=path`` line: non-empty,
    at most :data:`MAX_PATH_CHARS` characters, no line breaks, tabs or control characters, no ``=`` or
    ``,`` and no ``..`` component (plain spaces are allowed: the commands are shell-quoted)."""
    problems = _launch_text_problems(path, where, error, MAX_PATH_CHARS, allow_space=True)
    problems += [f"contains {c!r}" for c in ("=", ",") if c in path]
    if ".." in path.replace("\\", "/").split("/"):
        problems.append("has a '..' component")
    if problems:
        raise error(f"{where}: adapter path {_short(path)} is not allowed ({'; '.join(problems)})")
    return path
