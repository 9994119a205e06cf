"""Surrogates from the MLflow model registry: ``--surrogate models:/lora-opt-starvation@champion``.

``lora-opt train`` registers its two chosen heads (``reporting.REGISTERED_NAMES``:
``lora-opt-throughput``, ``lora-opt-starvation``) and logs the whole surrogate directory -- both
heads, the threshold chosen with them, the distilled trees (``surrogate.json``, ``surrogate.skops``,
``distilled.json``) -- to the same run under ``SURROGATE_ARTIFACT``.  A registered version names
its run, so either name resolves to that run's directory: the heads, threshold and trees trained
together, never a throughput head of one run with a classifier of another.

``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` is resolved in the store ``resolve_tracking_uri``
names (``MLFLOW_TRACKING_URI``, else ``./mlruns/mlflow.db``; ``MLFLOW_REGISTRY_URI`` if set), the
directory downloaded to a temporary directory (removed at exit) and then loaded as any
``--surrogate DIR``: the manifest, the sha256 and the fixed ``model_files.TRUSTED_TYPES`` are
checked before one object is built; MLflow's own loader (which trusts the list written in the
model's MLmodel file) and pickle are never used.

Promote a version (an alias is a movable name for one version)::

    lora-opt place --workload W --gpus 4 --surrogate models:/lora-opt-starvation/3   # try version 3
    python -c "import mlflow; mlflow.MlflowClient().set_registered_model_alias('lora-opt-starvation', 'champion', 3)"
    lora-opt place --workload W --gpus 4 --surrogate models:/lora-opt-starvation@champion

(run from the directory holding ``mlruns/``, or with ``MLFLOW_TRACKING_URI`` set).  Each registered
version carries the tags ``dataset_hash``, ``profile``, ``profile_hash`` and ``twin_version`` of the
rows it was trained on (``version_tags``).
"""
from __future__ import annotations

import atexit
import functools
import re
import shutil
import tempfile
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.surrogates import model_files
from lora_opt.tracking import log_dir, resolve_tracking_uri, twin_version

MODELS_SCHEME = "models:/"
#: the run artifact directory holding the whole surrogate
SURROGATE_ARTIFACT = "surrogate"
#: the files of a surrogate directory logged with the run (the oracle kinds ``oracle.ORACLE_FILES`` loads)
SURROGATE_FILES = (model_files.MANIFEST_NAME, model_files.MODEL_NAME, "distilled.json")
_MODEL_URI = re.compile(r"models:/(?P<name>[A-Za-z0-9._-]+)(?:/(?P<version>[0-9]+)|@(?P<alias>[A-Za-z0-9_-]+))")


def is_model_uri(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(MODELS_SCHEME)


def surrogate_dir(spec, tracking_uri: str | None = None):
    """``spec`` itself unless it is a ``models:/`` URI; then the local directory of the surrogate the
    registered version's run logged (see the module docstring)."""
    if not is_model_uri(spec):
        return spec
    m = _MODEL_URI.fullmatch(spec)
    if m is None:
        raise InputError(f"--surrogate {spec!r}: expected models:/NAME/VERSION or models:/NAME@ALIAS "
                         "(e.g. models:/lora-opt-starvation@champion), or a surrogate directory")
    run_id, what = _run_of(spec, m, tracking_uri)
    try:
        return _download(resolve_tracking_uri(tracking_uri), run_id)
    except InputError as exc:
        raise InputError(f"--surrogate {spec} ({what}): {exc}") from None


def _run_of(spec: str, m: re.Match, tracking_uri: str | None) -> tuple[str, str]:
    """(run id, what it is) of the registered version ``m`` names."""
    import mlflow  # heavy optional dependency: only when reading the registry
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(resolve_tracking_uri(tracking_uri))
    name = m["name"]
    try:
        mv = (client.get_model_version(name, m["version"]) if m["version"]
              else client.get_model_version_by_alias(name, m["alias"]))
    except MlflowException as exc:
        raise InputError(f"--surrogate {spec}: {_known_versions(client, name)} in "
                         f"{resolve_tracking_uri(tracking_uri)} ({exc.error_code})") from None
    if not mv.run_id:
        raise InputError(f"--surrogate {spec}: version {mv.version} of {name} has no run: not logged by lora-opt train")
    return mv.run_id, f"{name} version {mv.version}"


def _known_versions(client, name: str) -> str:
    from mlflow.exceptions import MlflowException  # heavy optional dependency: only when reading the registry

    try:
        rm = client.get_registered_model(name)
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    except MlflowException:
        return f"no registered model {name!r}"
    aliases = ", ".join(f"@{a} -> {v}" for a, v in sorted(rm.aliases.items())) or "no aliases"
    return f"no such version or alias of {name!r} (versions {versions}; {aliases})"


@functools.lru_cache(maxsize=16)
def _download(uri: str, run_id: str) -> Path:
    """The run's surrogate directory, downloaded once per process into a temporary directory."""
    import mlflow  # heavy optional dependency: only when reading the registry
    from mlflow.exceptions import MlflowException

    tmp = Path(tempfile.mkdtemp(prefix="lora-opt-surrogate-"))
    atexit.register(shutil.rmtree, tmp, True)
    try:
        local = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=SURROGATE_ARTIFACT,
                                                         dst_path=str(tmp), tracking_uri=uri))
    except (MlflowException, OSError) as exc:
        raise InputError(f"its run {run_id} holds no {SURROGATE_ARTIFACT}/ directory ({type(exc).__name__}); "
                         "it was logged before lora-opt logged whole surrogates, or not by lora-opt train: "
                         "train it again") from None
    model_files.read_manifest(model_files.manifest_path(local))     # fail now, naming the version, if not one
    return local


def version_tags(df) -> dict[str, str]:
    """What a registered version records about the rows it was trained on: the dataset hash is set
    by the caller; here the profile(s), their file hashes and the twin version(s) the rows carry
    (several, comma-joined, when datasets were concatenated); the twin version of this process
    when the rows predate the column."""
    def joined(col: str) -> str | None:
        return ",".join(sorted({str(v) for v in df[col].unique()})) if col in df.columns else None

    tags = {"profile": joined("profile"), "profile_hash": joined("profile_hash"),
            "twin_version": joined("twin_version") or twin_version()}
    return {k: v for k, v in tags.items() if v}


def tag_versions(models: dict, tags: dict[str, str], tracking_uri: str) -> None:
    """Set ``tags`` on every registered version in ``models`` (``reporting.log_sklearn_model``'s answers)."""
    import mlflow  # heavy optional dependency: only when tracking

    client = mlflow.MlflowClient(tracking_uri)
    for m in models.values():
        if m.get("version") is not None:
            for k, v in tags.items():
                client.set_model_version_tag(m["registered_name"], str(m["version"]), k, v)


def log_surrogate_dir(out_dir) -> None:
    """Log the surrogate directory's files (``SURROGATE_FILES``) to the active run under
    ``SURROGATE_ARTIFACT``, where ``surrogate_dir`` finds them."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for name in SURROGATE_FILES:
            if (out_dir / name).is_file():
                shutil.copy2(out_dir / name, Path(tmp) / name)
        log_dir(tmp, artifact_path=SURROGATE_ARTIFACT)
