"""The full surrogate's files on disk: its scikit-learn heads stored with skops, never with pickle,
behind a small JSON manifest that is checked before anything is deserialised.

Loading a surrogate must never run code: a surrogate directory is user input (``--surrogate DIR``),
and unpickling a file (pickle, joblib) runs whatever the file asks for.

Why skops and not plain arrays
------------------------------
The chosen heads are support vector machines (libsvm), random forests, k-nearest neighbours and
Platt-calibrated SVMs; re-implementing each family's ``predict`` bit for bit from exported arrays
is a second, untested copy of scikit-learn.  skops stores the same fitted objects as a schema of
plain values plus numpy arrays and builds only types it trusts, so the loaded heads are the trained
ones and predict bit-identically, and a file naming any other type is refused before one object
is built (skops imports a type's module only when it constructs it, after the audit).

Layout of a surrogate directory (``lora-opt train`` writes both)::

    surrogate.json    {"format": FORMAT, "model_file": "surrogate.skops", "sha256": <hex of the file>,
                       "threshold": ..., "feature_names": [...], "metadata": {...}}
    surrogate.skops   skops zip of {"regressor": fitted, "classifier": fitted}

Writing is crash-safe: the new model goes to ``surrogate.skops.pending``, the manifest (the commit
point) replaces the old one, then the model is renamed into place; a crash before the manifest
leaves the previous surrogate loading, one after it leaves the new one loading from the pending
file (``read`` looks there when the hash does not match, with the same checks).

Loading, in this order, each step refusing with ``InputError`` (naming the file and what is
expected) before the next one runs:

1. the manifest is plain JSON with ``format == FORMAT`` and ``model_file == MODEL_NAME``;
2. the sha256 of the model file's bytes equals the manifest's (the bytes checked are the bytes
   loaded: the file is read once);
3. every type in the skops file that skops does not trust by default (builtins, numpy arrays,
   scikit-learn's public estimators) is in ``TRUSTED_TYPES``, a fixed list written here -- never
   derived from a file;
4. skops builds the objects with that same fixed list.

The hash is an integrity check (a truncated or edited file), not an authentication: whoever can
write the directory can write a matching hash, which is why step 3 is the security boundary.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_bytes, atomic_write_text
from twin.parsing import read_json_file

FORMAT = "lora-opt-surrogate/2"
MANIFEST_NAME = "surrogate.json"
MODEL_NAME = "surrogate.skops"
#: where ``write`` puts a new model until the manifest naming it is in place (see ``write``)
PENDING_NAME = MODEL_NAME + ".pending"
#: the file name older lora-opt versions pickled the surrogate to; refused, never unpickled
LEGACY_PICKLE_NAME = "surrogate.joblib"
PICKLE_SUFFIXES = (".joblib", ".pkl", ".pickle")
MODEL_KEYS = ("regressor", "classifier")

#: Types of the model families ``lora_opt.surrogates.training`` fits that skops does not trust by
#: default: scikit-learn internals holding fitted state (trees, k-NN search trees and their
#: metrics, the calibrated SVM's per-fold calibrators).  Reviewed by hand; add a type here only
#: after reading what skops does to build it.
TRUSTED_TYPES = (
    "sklearn.calibration._CalibratedClassifier",   # svm classifier: Platt-scaled SVC
    "sklearn.calibration._SigmoidCalibration",
    "sklearn.metrics._dist_metrics.EuclideanDistance64",   # knn, p=2
    "sklearn.metrics._dist_metrics.ManhattanDistance64",   # knn, p=1
    "sklearn.neighbors._ball_tree.BallTree",
    "sklearn.neighbors._kd_tree.KDTree",
    "sklearn.tree._tree.Tree",                     # random forests
)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def untrusted_types(blob: bytes) -> list[str]:
    """Types in a skops file that neither skops nor ``TRUSTED_TYPES`` trusts (builds nothing)."""
    import skops.io as sio  # heavy optional dependency: only when reading or writing models

    return sorted(set(sio.get_untrusted_types(data=blob)) - set(TRUSTED_TYPES))


def load_trusted(blob: bytes, source) -> Any:
    """The object of a skops file, built only if every type in it is trusted; InputError otherwise."""
    import skops.io as sio  # heavy optional dependency: only when reading or writing models

    try:
        extra = untrusted_types(blob)
        if extra:
            raise InputError(f"{source}: holds type(s) lora-opt does not trust: {', '.join(extra)}; a "
                             "surrogate holds only scikit-learn models of the families lora-opt trains "
                             "(trusted: skops' defaults and lora_opt.surrogates.model_files.TRUSTED_TYPES)")
        return sio.loads(blob, trusted=list(TRUSTED_TYPES))
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt zip or schema, an untrusted type: all bad input
        raise InputError(f"{source}: not a readable skops model file ({type(exc).__name__}: {exc})") from None


def refuse_pickle(path) -> None:
    """InputError if ``path`` is an existing pickle file (e.g. an older lora-opt's surrogate.joblib)."""
    target = Path(path)
    if target.suffix.lower() in PICKLE_SUFFIXES and target.is_file():
        raise InputError(f"{target}: a pickle (joblib) file; lora-opt does not load pickle files "
                         f"(unpickling runs code). Expected {MANIFEST_NAME} + {MODEL_NAME} (format {FORMAT}), "
                         "as `lora-opt train` writes them: train the surrogate again, or use the bundled one")


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON serialisable")


def write(directory, models: dict, fields: dict) -> Path:
    """Write ``models`` (the fitted heads, keys ``MODEL_KEYS``) to ``directory/MODEL_NAME`` and the
    manifest with ``fields`` (threshold, feature names, metadata) and the file's hash; return the
    manifest's path.  Refuses models holding a type the loader would not trust."""
    import skops.io as sio  # heavy optional dependency: only when reading or writing models

    if tuple(models) != MODEL_KEYS:
        raise ValueError(f"surrogate models: keys must be {MODEL_KEYS}, got {tuple(models)}")
    blob = sio.dumps(dict(models), compression=zipfile.ZIP_DEFLATED)
    extra = untrusted_types(blob)
    if extra:    # it could not be loaded again: fail now, while its maker is watching
        raise ValueError(f"surrogate models hold types outside TRUSTED_TYPES: {', '.join(extra)}; review "
                         "them and add them to lora_opt.surrogates.model_files.TRUSTED_TYPES")
    directory = Path(directory)
    manifest = {"format": FORMAT, "model_file": MODEL_NAME, "sha256": hashlib.sha256(blob).hexdigest(), **fields}
    text = json.dumps(manifest, indent=1, default=_json_default)
    # Two files, one commit point: the new model goes to PENDING_NAME, the manifest naming its hash
    # replaces the old one, then the model takes its place.  A crash before the manifest leaves the
    # previous pair; after it, ``read`` finds the model under PENDING_NAME by the manifest's hash.
    atomic_write_bytes(directory / PENDING_NAME, blob)
    path = atomic_write_text(directory / MANIFEST_NAME, text)
    os.replace(directory / PENDING_NAME, directory / MODEL_NAME)
    return path


def manifest_path(path) -> Path:
    """The manifest of a surrogate given as its directory or its manifest file."""
    p = Path(path)
    if p.is_dir():
        if not (p / MANIFEST_NAME).is_file():
            refuse_pickle(p / LEGACY_PICKLE_NAME)       # say why rather than "no surrogate.json"
        p = p / MANIFEST_NAME
    refuse_pickle(p)
    if p.name != MANIFEST_NAME:
        raise InputError(f"{p}: not a surrogate manifest; expected a surrogate directory or its "
                         f"{MANIFEST_NAME} (beside {MODEL_NAME}, as `lora-opt train` writes them)")
    if not p.is_file():
        raise InputError(f"{p}: no such file; a surrogate directory holds {MANIFEST_NAME} + {MODEL_NAME} "
                         "(`lora-opt train` writes them)")
    return p


def read_manifest(path: Path) -> dict:
    """The checked manifest: plain JSON, our format tag, our model file name, a sha256."""
    try:
        m = read_json_file(path, "surrogate manifest", InputError, allow_nan=True)
    except InputError as exc:
        raise InputError(f"{path}: cannot read the surrogate manifest ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise InputError(f"{path}: not a lora-opt surrogate manifest: format {got!r}, expected {FORMAT!r}")
    if m.get("model_file") != MODEL_NAME:
        raise InputError(f"{path}: model_file {m.get('model_file')!r}, expected {MODEL_NAME!r}")
    if not isinstance(m.get("sha256"), str) or not _SHA256.fullmatch(m["sha256"]):
        raise InputError(f"{path}: sha256 must be 64 lower-case hex digits, got {m.get('sha256')!r}")
    return m


def read(path) -> tuple[dict, dict]:
    """(the fitted heads by ``MODEL_KEYS``, the manifest) of a surrogate directory or manifest, each
    step checked before the next (see the module docstring)."""
    mpath = manifest_path(path)
    manifest = read_manifest(mpath)
    model = mpath.parent / MODEL_NAME
    blob, digest, unreadable = b"", "", None
    try:
        blob = model.read_bytes()
        digest = hashlib.sha256(blob).hexdigest()
    except OSError as exc:
        unreadable = exc
    pending = mpath.parent / PENDING_NAME
    if digest != manifest["sha256"] and pending.is_file():
        # ``write`` stopped between the manifest and the final rename: the new model is still pending
        pending_blob = pending.read_bytes()
        if hashlib.sha256(pending_blob).hexdigest() == manifest["sha256"]:
            model, blob, digest, unreadable = pending, pending_blob, manifest["sha256"], None
    if unreadable is not None:
        raise InputError(f"{model}: cannot read the surrogate's model file ({unreadable})") from None
    if digest != manifest["sha256"]:
        raise InputError(f"{model}: sha256 {digest} does not match {manifest['sha256']} in {mpath}: the file "
                         "changed after it was written; refusing to load it (train the surrogate again)")
    models = load_trusted(blob, model)
    if not isinstance(models, dict) or tuple(models) != MODEL_KEYS:
        raise InputError(f"{model}: expected a dict with keys {', '.join(MODEL_KEYS)}")
    return models, manifest


def load_logged_model(model_uri: str):
    """A scikit-learn model logged to MLflow (``reporting.log_sklearn_model``), loaded through the
    same fixed trusted list: MLflow's own loader trusts the list written in the model's MLmodel file,
    which whoever wrote the run controls."""
    import mlflow  # heavy optional dependency: only when reading from MLflow

    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    skops_file = local / "model.skops"          # MLflow's file name in its skops format
    if not skops_file.is_file():
        pickled = ", a pickle (model.pkl), which lora-opt never loads" if (local / "model.pkl").exists() else ""
        raise InputError(f"{model_uri}: no model.skops in the logged model{pickled}; lora-opt loads only "
                         "models logged in skops format (reporting.log_sklearn_model)")
    return load_trusted(skops_file.read_bytes(), f"{model_uri} (model.skops)")
