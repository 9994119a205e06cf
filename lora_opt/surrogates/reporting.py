"""What training reports: the held-out plots, ``metrics.json``, and the MLflow run (experiment
``surrogate``) with its parameters, metrics, plots and the two registered models."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lora_opt import no_network_env  # noqa: F401  (MLflow telemetry off before mlflow is imported)
from lora_opt.io import atomic_write_figure, atomic_write_json
from lora_opt.surrogates import model_files, registry
from lora_opt.surrogates.features import FEATURES
from lora_opt.smape import smape
from lora_opt.surrogates.metrics import MAX_FALSE_FEASIBLE
from lora_opt.surrogates.training_data import TrainingData
from lora_opt.tracking import flat_metrics, mlflow_quiet, resolve_tracking_uri, tracked_run

REGISTERED_NAMES = {"regressor": "lora-opt-throughput", "classifier": "lora-opt-starvation"}


# ---- files ------------------------------------------------------------------------------------------
def write_json(path, obj) -> None:
    atomic_write_json(path, _jsonable(obj), indent=2, allow_nan=True)


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


# ---- plots ------------------------------------------------------------------------------------------
def plot_pred_vs_real(pred, real, starving, path) -> Path:
    from matplotlib.figure import Figure  # heavy optional dependency: only when plotting

    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    s = np.asarray(starving, bool)
    ax.scatter(real[~s], pred[~s], s=10, label="feasible")
    ax.scatter(real[s], pred[s], s=10, marker="x", label="starving (full run)")
    lim = [max(1.0, min(real.min(), pred.min()) * 0.8), max(real.max(), pred.max()) * 1.2]
    ax.plot(lim, lim, "k--", lw=1)
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="twin throughput (tok/s)",
           ylabel="predicted throughput (tok/s)", title=f"held-out, SMAPE {smape(pred, real, undefined='zero'):.1f} %")
    ax.legend()
    atomic_write_figure(path, fig, dpi=100, bbox_inches="tight")
    return Path(path)


def plot_confusion(starving, feasible_pred, threshold, path) -> Path:
    from matplotlib.figure import Figure  # heavy optional dependency: only when plotting

    y = np.asarray(starving, int)
    ps = (~np.asarray(feasible_pred, bool)).astype(int)
    m = np.array([[((y == a) & (ps == b)).sum() for b in (0, 1)] for a in (0, 1)])
    fig = Figure(figsize=(4.5, 4))
    ax = fig.subplots()
    ax.imshow(m, cmap="Blues")
    for a in (0, 1):
        for b in (0, 1):
            ax.text(b, a, str(m[a, b]), ha="center", va="center", fontsize=14)
    ax.set(xticks=[0, 1], yticks=[0, 1], xticklabels=["feasible", "starving"], yticklabels=["feasible", "starving"],
           xlabel="predicted", ylabel="twin", title=f"held-out, p_starving < {threshold:.3g} = feasible")
    atomic_write_figure(path, fig, dpi=100, bbox_inches="tight")
    return Path(path)


# ---- MLflow -----------------------------------------------------------------------------------------
def _pip_requirements() -> list[str]:
    import scipy  # heavy optional dependencies: only when logging a model
    import skops
    import sklearn

    return [f"scikit-learn=={sklearn.__version__}", f"numpy=={np.__version__}", f"scipy=={scipy.__version__}",
            f"skops=={skops.__version__}"]


def log_sklearn_model(model, name: str, registered_name: str, X_example: np.ndarray, output) -> dict:
    """Log (skops format) and register one fitted estimator in the active run.  The trusted types
    recorded with it are the fixed ``model_files.TRUSTED_TYPES``, never the model's own list; read
    it back with ``model_files.load_logged_model``."""
    import mlflow  # heavy optional dependencies: only when tracking
    import pandas as pd
    import skops.io as sio
    from mlflow.models import infer_signature

    extra = model_files.untrusted_types(sio.dumps(model))
    if extra:
        raise ValueError(f"{name}: holds types outside TRUSTED_TYPES: {', '.join(extra)}; review them and add "
                         "them to lora_opt.surrogates.model_files.TRUSTED_TYPES")
    signature = infer_signature(pd.DataFrame(X_example, columns=list(FEATURES)), output)
    with mlflow_quiet():                 # no "Successfully registered model ..." on stderr
        info = mlflow.sklearn.log_model(
            model, name=name, signature=signature, pip_requirements=_pip_requirements(),
            skops_trusted_types=list(model_files.TRUSTED_TYPES), registered_model_name=registered_name,
            pyfunc_predict_fn="predict_proba" if hasattr(model, "predict_proba") else "predict")
    return {"model_uri": info.model_uri, "registered_name": registered_name,
            "version": int(info.registered_model_version) if info.registered_model_version else None}


def log_training_run(result: dict, data: TrainingData, out_dir: Path, args: dict, tracking_uri: str | None,
                     provenance: dict | None = None) -> dict:
    """One MLflow run (experiment "surrogate"): params, metrics, plots, the chosen models, registered
    with ``provenance`` (``registry.version_tags`` of the rows) and the dataset hash as version tags."""
    import mlflow  # heavy optional dependency: only when tracking

    metrics, sur = result["metrics"], result["surrogate"]
    uri = resolve_tracking_uri(tracking_uri)
    provenance = {"dataset_hash": data.dataset_hash, **(provenance or {})}
    with tracked_run("surrogate", run_name=f"surrogate-{data.dataset_hash}", tracking_uri=uri,
                     profile=provenance.get("profile"), profile_hash=provenance.get("profile_hash"),
                     seeds={"split_and_cv": args.get("seed")}) as run:
        mlflow.set_tag("dataset_hash", data.dataset_hash)
        params = {**args, "dataset_hash": data.dataset_hash, "rows": len(data.X),
                  "chosen_regressor": metrics["chosen"]["regressor"],
                  "chosen_classifier": metrics["chosen"]["classifier"], "threshold": sur.threshold,
                  "max_false_feasible": MAX_FALSE_FEASIBLE}
        for head in ("regressor", "classifier"):
            for fam, m in metrics[head].items():
                params.update({f"{head}.{fam}.{k}": v for k, v in m["best_params"].items()})
        mlflow.log_params({k: str(v) for k, v in params.items()})
        mlflow.log_metrics(flat_metrics("", {k: metrics[k] for k in ("regressor", "classifier", "paper_ng",
                                                                       "dataset", "train_wall_s")}))
        mlflow.log_artifacts(str(out_dir / "plots"), artifact_path="plots")
        X_ex = data.X[data.test[:20]]
        models = {
            "regressor": log_sklearn_model(sur.regressor, "throughput_model", REGISTERED_NAMES["regressor"],
                                           X_ex, sur.regressor.predict(X_ex)),
            "classifier": log_sklearn_model(sur.classifier, "starvation_model", REGISTERED_NAMES["classifier"],
                                            X_ex, sur.classifier.predict_proba(X_ex)),
        }
        registry.tag_versions(models, provenance, uri)
        return {"run_id": run.info.run_id, "experiment": "surrogate", "tracking_uri": uri, "models": models}


def log_distilled(run: dict, report: dict, out_dir: Path, file_names) -> None:
    """Add the distillation's metrics and files to the surrogate run."""
    import mlflow  # heavy optional dependency: only when tracking

    mlflow.set_tracking_uri(run["tracking_uri"])
    with mlflow.start_run(run_id=run["run_id"]):
        mlflow.log_metrics(flat_metrics("distilled", report))
        for name in file_names:
            mlflow.log_artifact(str(out_dir / name))
        registry.log_surrogate_dir(out_dir)     # what --surrogate models:/NAME@ALIAS loads
