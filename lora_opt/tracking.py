"""MLflow tracking: every command that fits, evaluates or searches is one MLflow run, in a local
store by default (nothing leaves the machine unless the user points elsewhere).

Store: ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlruns/mlflow.db``
with artifacts under ``<cwd>/mlruns/artifacts/<experiment>`` -- the current directory, as MLflow's
own default, never the package's directory (a wheel install would write into site-packages).
Browse it with ``mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db`` from that directory
(``pip install 'lora-opt[ui]'``).

Every run carries the same provenance tags (``provenance_tags``): the lora-opt version, the git
commit of the checkout lora-opt runs from (none for an installed wheel), the twin's version (its
package version + a hash of its sources, as the dataset rows record it), the profile's name and
file hash, and the seeds.  Commands log through ``tracked_run`` (a context, for work that logs as it
goes) or ``log_command_run`` (one call after the work, for commands that only report a summary).

Nothing here prints: the run's location goes to the ``lora_opt.tracking`` logger (INFO).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import subprocess
import time
from pathlib import Path

import twin
from lora_opt import no_network_env  # noqa: F401  (MLflow telemetry off before mlflow is imported)
from twin.errors import ScenarioError
from twin.profile import load_profile

log = logging.getLogger(__name__)

# MLflow's own INFO lines ("Creating initial MLflow database tables...", "Created version '3' of
# model ...") go to stderr through its own handler unless its level is raised before it is imported;
# its artifact download progress bars too (a command shows its own progress)
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

#: the checkout lora-opt runs from, when it runs from one (the directory above the package)
SOURCE_ROOT = Path(__file__).resolve().parent.parent
#: the store's directory, relative to the current directory
MLRUNS_DIRNAME = "mlruns"
#: tag keys (prefix ``lora_opt.``) every tracked run carries
TAG_PREFIX = "lora_opt."
#: MLflow's limit on a param value's length
_MAX_PARAM_CHARS = 6000


# ---- where ------------------------------------------------------------------------------------------
def default_store_dir() -> Path:
    """``./mlruns`` of the current directory (absolute)."""
    return Path.cwd().resolve() / MLRUNS_DIRNAME


def default_tracking_uri() -> str:
    """``sqlite:///<cwd>/mlruns/mlflow.db`` (the directory is created)."""
    store = default_store_dir()
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}"


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The store a run goes to: the argument, else ``MLFLOW_TRACKING_URI``, else the default."""
    return tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def ui_command(uri: str) -> str:
    """The command that browses ``uri`` (relative to the current directory when it is below it)."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        with contextlib.suppress(ValueError):
            uri = f"sqlite:///{path.relative_to(Path.cwd().resolve())}"
        return f"mlflow ui --backend-store-uri {uri}"
    return f"open {uri}" if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"


# ---- provenance -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def package_version() -> str:
    try:
        return importlib.metadata.version("lora-opt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def git_commit(root: Path = SOURCE_ROOT) -> str | None:
    """The commit of the checkout at ``root`` (``+dirty`` when tracked files changed), or None when
    ``root`` is not the top of a git checkout (an installed wheel: site-packages may sit inside some
    other repository, whose commit says nothing about lora-opt) or git is missing."""
    if not (root / ".git").exists():
        return None
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


@functools.lru_cache(maxsize=1)
def twin_version() -> str:
    """The twin's package version + a hash of its sources: what a dataset's rows record as
    ``twin_version`` (exactly which twin made them) and a run's provenance tags carry."""
    h = hashlib.sha256()
    for f in sorted(Path(twin.__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return f"{twin.__version__}+{h.hexdigest()[:10]}"


def profile_hash(profile) -> str:
    """sha256 of a loaded ``Profile``'s file, first 16 hex digits: what a dataset's rows and a run's
    tags record as ``profile_hash``."""
    return hashlib.sha256(Path(profile.source).read_bytes()).hexdigest()[:16]


def profile_info(profile) -> tuple[str, str] | None:
    """(name, :func:`profile_hash`) of a profile given as a bundled name, a path or a loaded
    ``Profile``; None when it cannot be read."""
    try:
        p = profile if hasattr(profile, "source") else load_profile(profile)
        return p.name, profile_hash(p)
    except (OSError, ScenarioError, TypeError, ValueError):
        return None


def provenance_tags(profile=None, *, profile_hash: str | None = None, seeds=None) -> dict[str, str]:
    """The tags every tracked run carries (keys prefixed ``lora_opt.``).  ``profile``: a name, path or
    ``Profile`` (its file is hashed now), or a name whose ``profile_hash`` is known (e.g. from the
    dataset rows a surrogate was trained on).  ``seeds``: an int or a dict of named seeds."""
    tags = {"version": package_version(), "twin_version": twin_version()}
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
    if profile is not None:
        info = None if profile_hash else profile_info(profile)
        tags["profile"] = info[0] if info else str(getattr(profile, "name", profile))
        if profile_hash or info:
            tags["profile_hash"] = profile_hash or info[1]
    if seeds is not None:
        tags["seeds"] = json.dumps(seeds, sort_keys=True, default=str) if isinstance(seeds, dict) else str(seeds)
    return {TAG_PREFIX + k: v for k, v in tags.items()}


# ---- runs -------------------------------------------------------------------------------------------
def _experiment_id(mlflow, experiment: str, uri: str) -> str:
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    # a local SQLite store keeps its artifacts beside the database file
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///"):]).resolve().parent / "artifacts" / experiment).as_uri()
    return mlflow.create_experiment(experiment, artifact_location=location)


@contextlib.contextmanager
def tracked_run(experiment: str, run_name: str | None = None, tracking_uri: str | None = None, *,
                profile=None, profile_hash: str | None = None, seeds=None, track: bool = True,
                start_time: float | None = None):
    """An MLflow run in ``experiment`` (created with artifacts under mlruns/ when local), tagged with
    ``provenance_tags(profile, profile_hash=..., seeds=...)``; yields the active run, or None (and
    logs nothing) when ``track`` is false.  ``start_time``: the work's start (``time.time()``) when
    the run is logged after it."""
    if not track:
        yield None
        return
    import mlflow  # heavy optional dependency: only when tracking

    uri = resolve_tracking_uri(tracking_uri)
    mlflow.set_tracking_uri(uri)
    exp_id = _experiment_id(mlflow, experiment, uri)
    tags = provenance_tags(profile, profile_hash=profile_hash, seeds=seeds)
    run_id = None
    if start_time:       # logged after the work: the run starts when the work did
        run_id = mlflow.MlflowClient(uri).create_run(exp_id, start_time=int(1000 * start_time), tags=tags,
                                                     run_name=run_name).info.run_id
    with mlflow.start_run(run_id=run_id, experiment_id=None if run_id else exp_id,
                          run_name=None if run_id else run_name, tags=None if run_id else tags) as run:
        yield run
    log.info("MLflow run %s (experiment %r) in %s; browse: %s", run.info.run_id, experiment, uri, ui_command(uri))


@contextlib.contextmanager
def mlflow_quiet():
    """MLflow's unconditional stderr lines (``eprint``: "Successfully registered model 'x'.",
    "Created version '1' ...", and its log lines) off for the block, unless MLflow's logger is at
    INFO or below (the user asked for its messages).  Through MLflow's own counted switch: a plain on/off flag is
    switched back on by MLflow's internal guards inside ``log_model``."""
    if logging.getLogger("mlflow").getEffectiveLevel() <= logging.INFO:
        yield
        return
    try:
        from mlflow.utils.autologging_utils.logging_and_warnings import (  # heavy optional dependency
            MlflowEventsAndWarningsBehaviorGlobally as events_switch)
    except ImportError:                  # moved in a later MLflow: its lines show, nothing breaks
        yield
        return
    with events_switch(disable_event_logs=True, disable_warnings=False, reroute_warnings=False):
        yield


def log_params(params: dict) -> None:
    """Log ``params`` (values as strings, cut to MLflow's length limit) to the active run; a no-op
    outside a run (``tracked_run(track=False)``)."""
    import mlflow  # heavy optional dependency: only when tracking

    if mlflow.active_run() is None:
        return
    mlflow.log_params({k: str(v)[:_MAX_PARAM_CHARS] for k, v in params.items() if v is not None})


#: characters MLflow refuses in a metric name (it allows alphanumerics, _ - . space : /); spaces too,
#: which it allows but which make names awkward to query
_METRIC_NAME_BAD = re.compile(r"[^A-Za-z0-9_\-.:/]")


def flat_metrics(prefix: str, d) -> dict[str, float]:
    """Every finite number of a nested dict as ``{"prefix.key.sub": value}`` (characters MLflow
    refuses in a name, and spaces, become ``_``)."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flat_metrics(f"{prefix}.{k}" if prefix else str(k), v))
    elif isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d):
        out[_METRIC_NAME_BAD.sub("_", prefix.replace(",", ""))] = float(d)
    elif hasattr(d, "item") and getattr(d, "ndim", None) == 0:      # a numpy scalar
        out.update(flat_metrics(prefix, d.item()))
    return out


def log_flat_metrics(prefix: str, d: dict) -> None:
    """Log every finite number of a nested dict as ``prefix.key.sub`` metrics (no-op outside a run)."""
    import mlflow  # heavy optional dependency: only when tracking

    if mlflow.active_run() is None:
        return
    mlflow.log_metrics(flat_metrics(prefix, d))   # one batch: per-metric calls cost ~30 ms each on SQLite


def log_dir(path: str | Path, artifact_path: str | None = None) -> None:
    """Log a directory's files as artifacts (no-op outside a run)."""
    import mlflow  # heavy optional dependency: only when tracking

    if mlflow.active_run() is None:
        return
    mlflow.log_artifacts(str(path), artifact_path=artifact_path)


def log_command_run(experiment: str, run_name: str | None = None, *, params: dict | None = None,
                    metrics: dict | None = None, artifacts=(), profile=None, profile_hash: str | None = None,
                    seeds=None, wall_s: float | None = None, tracking_uri: str | None = None,
                    track: bool = True) -> str | None:
    """One finished run for a command that reports a summary: ``params``, the finite numbers of
    ``metrics`` (nested dicts flattened), ``artifacts`` (files or directories; None skipped), the provenance tags;
    started ``wall_s`` seconds ago.  Returns the run id (None when ``track`` is false)."""
    start = time.time() - wall_s if wall_s and math.isfinite(wall_s) else None
    with tracked_run(experiment, run_name, tracking_uri, profile=profile, profile_hash=profile_hash, seeds=seeds,
                     track=track, start_time=start) as run:
        if run is None:
            return None
        import mlflow  # heavy optional dependency: only when tracking

        log_params(params or {})
        if metrics:
            mlflow.log_metrics(flat_metrics("", metrics))
        for a in artifacts:
            if not a:       # an optional output not written (None)
                continue
            a = Path(a)
            if a.is_dir():
                mlflow.log_artifacts(str(a), artifact_path=a.name)
            elif a.is_file():
                mlflow.log_artifact(str(a))
        return run.info.run_id
