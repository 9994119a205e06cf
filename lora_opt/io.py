"""Writing output files whole or not at all: every file lora-opt writes goes through here.

:func:`atomic_write_bytes` writes to a temporary file in the same directory, named uniquely per
process and call (``.<name>.<pid>.<random>.tmp``), flushes and fsyncs it, then renames it over the
target: a reader (or a crash, ``kill -9`` included) sees the old file or the new one, never a torn
one, and two writers never share a temporary name.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lora_opt.errors import InputError


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename); ``mode``: chmod bits.
    A path that cannot be written (a directory, no permission, disk full) is an ``InputError``
    naming it; the old file, if any, is left as it was."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> Path:
    """:func:`atomic_write_bytes` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 1, default=None,
                      allow_nan: bool = True) -> Path:
    """:func:`atomic_write_bytes` of ``obj`` as JSON."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=default, allow_nan=allow_nan))


def atomic_write_rows(path: str | Path, rows: list[dict], columns) -> Path:
    """Dict rows as CSV (header ``columns``, in that order; other keys left out), written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return atomic_write_text(path, buf.getvalue())


def atomic_write_csv(path: str | Path, df, **to_csv_kwargs) -> Path:
    """A pandas DataFrame as CSV (``df.to_csv(**to_csv_kwargs)``), written atomically."""
    return atomic_write_text(path, df.to_csv(**to_csv_kwargs))


def atomic_write_figure(path: str | Path, fig, **savefig_kwargs) -> Path:
    """A matplotlib figure rendered in memory (format from the file's suffix, PNG by default), then
    written atomically: a failure while rendering leaves the old file as it was."""
    buf = io.BytesIO()
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    fig.savefig(buf, format=fmt, **savefig_kwargs)
    return atomic_write_bytes(path, buf.getvalue())
