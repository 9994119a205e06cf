"""Surrogates end to end on a small twin dataset: training with fast grids into a temporary MLflow
store, the <= 1 % false-feasible threshold, save/load, the files of ``train_cli``, bad input."""
import functools
import itertools
import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_opt.smape import smape
from lora_opt.surrogates import dataset as ds
from lora_opt.surrogates import metrics as sm
from lora_opt.surrogates import model_files, reporting, training
from lora_opt.surrogates.oracle import Oracle, Surrogate, as_feature_matrix
from lora_opt.surrogates.features import FEATURES
from lora_opt.tracking import twin_version
from twin.errors import ScenarioError

PROFILE = "llama-3.1-8b-h100-64gb"
RANKS, RATES = (8, 16, 32), (1.6, 0.8, 0.4, 0.1, 0.05, 0.025)
SERVED, MAX_LORAS = (8, 16, 32, 64, 96, 128, 192), (8, 16, 32, 64, 192)   # 192 slots of rank 32: OOM


@functools.lru_cache(maxsize=2)
def twin_frame(workloads: int = 16, seed: int = 0) -> pd.DataFrame:
    """Rows of the dataset schema (``lora_opt.surrogates.dataset.make_row``) for ``workloads`` random workloads,
    each over every (served, A_max <= served) pair: ~370 twin runs of 300 s, ~10 s."""
    grid = ds.Grid(ranks=RANKS, rates=RATES, served=SERVED, max_loras=MAX_LORAS, duration_s=300.0,
                   early_stop=True, seed=0)
    rank_sets = list(itertools.combinations_with_replacement(RANKS, 3))
    rate_sets = list(itertools.combinations_with_replacement(sorted(RATES, reverse=True), 3))
    rng = np.random.default_rng(seed)
    pairs = rng.choice(len(rank_sets) * len(rate_sets), size=workloads, replace=False)
    version = twin_version()
    items = []
    for w in sorted(pairs):
        ranks, rates = rank_sets[w // len(rate_sets)], rate_sets[w % len(rate_sets)]
        for n in SERVED:
            for a in MAX_LORAS:
                if a <= n:
                    point = {"ranks": list(ranks), "rates": list(rates), "n": n, "max_loras": a}
                    pid = len(items)
                    items.append({"point": point, "point_id": pid, "groups": 3, "profile_name": PROFILE,
                                  "profile_hash": "test", "twin_version": version,
                                  "scenario": ds.point_scenario(point, pid, grid, PROFILE)})
    return pd.DataFrame(ds.label_points(items))


def write_shards(df: pd.DataFrame, out, n_shards: int = 3):
    out.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(np.array_split(np.arange(len(df)), n_shards)):
        df.iloc[part].to_parquet(ds.shard_path(out, i), index=False)
    return out


@pytest.fixture(autouse=True, scope="module")
def _forget_tracking_uri():
    """mlflow.set_tracking_uri is process-global (and exports MLFLOW_TRACKING_URI): undo it."""
    yield
    import mlflow

    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``train_cli`` once for the module: dataset shards -> surrogates, distilled trees, MLflow run."""
    base = tmp_path_factory.mktemp("surrogate")
    data_dir = write_shards(twin_frame(), base / "data")
    uri = f"sqlite:///{base}/m.db"
    metrics = training.train_cli(data_dir, base / "out", tracking_uri=uri, fast=True)
    return {"metrics": metrics, "out": base / "out", "data": data_dir, "uri": uri, "base": base}


def test_dataset_has_both_classes_and_oom():
    df = twin_frame()
    assert set(df["status"]) <= {"ok", "oom"} and (df["status"] == "oom").any()
    assert 0.2 < df["starving"].mean() < 0.9


def test_train_cli_writes_files_and_metrics(trained):
    out, m = trained["out"], trained["metrics"]
    for name in ("surrogate.json", "surrogate.skops", "distilled.json", "rules.txt", "metrics.json",
                 "plots/throughput_pred_vs_real.png", "plots/starvation_confusion.png"):
        assert (out / name).is_file(), name
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["chosen"] == m["chosen"]
    assert set(m["regressor"]) == set(m["classifier"]) == {"rf", "knn", "svm"}
    for fam in ("rf", "knn", "svm"):
        r, c = m["regressor"][fam], m["classifier"][fam]
        assert 0 <= r["test_smape"] < 60, (fam, r["test_smape"])
        assert 0 <= c["test"]["macro_f1"] <= 1
        assert r["latency"]["single_us"] > 0 and r["latency"]["batch_us_per_row"] > 0
    # the dataset hash links the run to the dataset run of lora_opt.surrogates.dataset
    assert m["dataset"]["sha256_16"] == ds.dataset_hash(trained["data"])
    assert "paper_ng" in m and m["paper_ng"]["workloads"] == 16
    assert m["paper_ng"]["meaningful"] is False and "anecdotal" in m["paper_ng"]["note"]


def test_threshold_keeps_false_feasible_under_one_percent_where_chosen(trained):
    for fam, c in trained["metrics"]["classifier"].items():
        assert c["oof"]["false_feasible_rate"] <= sm.MAX_FALSE_FEASIBLE, fam
    assert trained["metrics"]["distilled"]["oof"]["false_feasible_rate"] <= sm.MAX_FALSE_FEASIBLE


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=1, max_size=300),
       st.sampled_from([0.0, 0.01, 0.05, 0.2]))
def test_choose_threshold_bound_and_maximality(rows, bound):
    p = np.array([r[0] for r in rows])
    y = np.array([int(r[1]) for r in rows])
    t = sm.choose_threshold(p, y, bound)
    ff = ((y == 1) & (p < t)).sum()
    assert ff <= bound * max(1, (y == 1).sum()) + 1e-9
    if (y == 1).any() and t <= 1.0:      # any larger threshold would call one more starving row feasible
        larger = np.nextafter(t, 2.0)
        assert ((y == 1) & (p < larger)).sum() > bound * (y == 1).sum()


def test_surrogate_save_load_identical(trained, tmp_path):
    sur = Surrogate.load(trained["out"] / "surrogate.json")
    assert isinstance(sur, Oracle)
    X = twin_frame().loc[:, list(FEATURES)].to_numpy()
    a = sur.predict(X)
    assert sur.save(tmp_path / "s") == tmp_path / "s" / "surrogate.json"
    b = Surrogate.load(tmp_path / "s").predict(X)          # the directory works too
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert sur.metadata["dataset_hash"] == trained["metrics"]["dataset"]["sha256_16"]
    assert sur.metadata["sklearn_version"] and sur.feature_names == FEATURES
    thr, feasible, p = sur.predict(twin_frame().head(3))       # a DataFrame works too (by column name)
    assert thr.shape == feasible.shape == p.shape == (3,) and feasible.dtype == bool


def test_mlflow_run_models_and_registry(trained):
    import mlflow

    run_info = trained["metrics"]["mlflow"]
    mlflow.set_tracking_uri(trained["uri"])
    run = mlflow.get_run(run_info["run_id"])
    assert run.data.tags["dataset_hash"] == trained["metrics"]["dataset"]["sha256_16"]
    assert "classifier.rf.oof.false_feasible_rate" in run.data.metrics
    assert any(k.startswith("distilled.latency") for k in run.data.metrics)
    client = mlflow.MlflowClient()
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"plots", "distilled.json", "rules.txt", "metrics.json"} <= arts
    assert str(trained["base"]) in run.info.artifact_uri                     # not the repo's mlruns/
    for name in reporting.REGISTERED_NAMES.values():
        assert client.search_model_versions(f"name='{name}'")
    model = mlflow.sklearn.load_model(f"models:/{reporting.REGISTERED_NAMES['regressor']}/1")
    X = twin_frame().loc[:, list(FEATURES)].to_numpy()[:50]
    sur = Surrogate.load(trained["out"])
    np.testing.assert_array_equal(model.predict(X), sur.regressor.predict(X))
    # lora-opt's own reader of logged models: MLflow's model file through the fixed trusted list
    ours = model_files.load_logged_model(f"models:/{reporting.REGISTERED_NAMES['regressor']}/1")
    np.testing.assert_array_equal(ours.predict(X), sur.regressor.predict(X))
    flavor = mlflow.models.get_model_info(f"models:/{reporting.REGISTERED_NAMES['regressor']}/1").flavors["sklearn"]
    assert flavor["serialization_format"] == "skops"
    assert flavor["skops_trusted_types"] == list(model_files.TRUSTED_TYPES)


def test_missing_columns_and_empty_dataset_raise(tmp_path):
    df = twin_frame()
    with pytest.raises(ScenarioError, match="rate_sum.*max_loras"):
        training.train_surrogates(df.drop(columns=["rate_sum", "max_loras"]), tmp_path, fast=True, track=False)
    with pytest.raises(ScenarioError, match="no rows"):
        training.train_surrogates(df.iloc[:0], tmp_path, fast=True, track=False)
    with pytest.raises(ScenarioError, match="no columns"):
        training.train_surrogates(pd.DataFrame(), tmp_path, fast=True, track=False)
    with pytest.raises(ScenarioError, match="no shards"):
        training.train_cli(tmp_path, tmp_path / "out", fast=True, track=False)
    with pytest.raises(ScenarioError, match="missing feature column.*n_adapters"):
        as_feature_matrix(df.drop(columns=["n_adapters"]))
    with pytest.raises(ScenarioError, match="unknown model family"):
        training.train_surrogates(df, tmp_path, models=("xgb",), fast=True, track=False)


def test_metric_helpers():
    assert smape([110, 0], [90, 0], undefined="zero") == pytest.approx(10.0)   # the surrogates' rule
    r = sm.error_rates([1, 1, 0, 0], [True, False, True, False])
    assert r["false_feasible_rate"] == 0.5 and r["false_infeasible_rate"] == 0.5


def test_train_on_several_datasets_concatenates_them(trained, tmp_path):
    metrics = training.train_cli([trained["data"], trained["data"]], tmp_path / "two", fast=True, track=False)
    assert metrics["dataset"]["rows"] == 2 * trained["metrics"]["dataset"]["rows"]
    assert metrics["dataset"]["dir"].count(",") == 1
    # a directory without lora-opt dataset's summary.json is named by its path
    assert json.loads((tmp_path / "two" / "dataset_summary.json").read_text()) == [{"out": str(trained["data"])}] * 2


def test_train_writes_the_dataset_summary_beside_the_model(trained, tmp_path):
    """The bundled surrogates' provenance file is written by train itself: the dataset's summary.json."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(trained["data"], data)
    summary = {"out": "outputs/x", "rows": 1, "dataset_hash": ds.dataset_hash(data), "twin_version": twin_version()}
    (data / "summary.json").write_text(json.dumps(summary))
    training.train_cli(data, tmp_path / "out", fast=True, track=False)
    assert json.loads((tmp_path / "out" / "dataset_summary.json").read_text()) == summary


def test_trained_surrogate_loads_from_the_registry(trained):
    """``train`` registers both heads with the rows' provenance and logs the whole surrogate, which
    ``--surrogate models:/lora-opt-starvation/1`` loads (lora_opt.surrogates.registry)."""
    import mlflow

    from lora_opt.surrogates import registry

    client = mlflow.MlflowClient(trained["uri"])
    run = client.get_run(trained["metrics"]["mlflow"]["run_id"])
    assert run.data.tags["lora_opt.profile"] == PROFILE and run.data.tags["lora_opt.profile_hash"] == "test"
    for name in reporting.REGISTERED_NAMES.values():
        tags = client.get_model_version(name, "1").tags
        assert tags["dataset_hash"] == trained["metrics"]["dataset"]["sha256_16"]
        assert (tags["profile"], tags["profile_hash"], tags["twin_version"]) == (PROFILE, "test", twin_version())
    d = registry.surrogate_dir("models:/lora-opt-starvation/1", trained["uri"])
    for name in registry.SURROGATE_FILES:
        assert (d / name).read_bytes() == (trained["out"] / name).read_bytes(), name


def test_train_stores_intervals_and_intervals_only_adds_them(trained, tmp_path, capsys):
    from lora_opt.cli import main
    import shutil
    out = tmp_path / "s"
    shutil.copytree(trained["out"], out)
    manifest = json.loads((out / "surrogate.json").read_text())
    manifest["metadata"].pop("intervals", None)                 # as the bundled surrogates were made
    (out / "surrogate.json").write_text(json.dumps(manifest))
    sur = Surrogate.load(out)
    assert sur.intervals is None
    with pytest.raises(Exception, match="--intervals-only"):
        sur.throughput_interval(np.zeros((1, len(sur.feature_names))), 0.9)
    assert main(["train", "--dataset", str(trained["data"]), "--out", str(out), "--intervals-only"]) == 0
    assert "split conformal on" in capsys.readouterr().out
    sur = Surrogate.load(out)                                   # the model file untouched: its hash still checks
    assert sur.intervals["calibration_rows"] >= 10
    assert json.loads((out / "metrics.json").read_text())["intervals"] == sur.intervals
    X = twin_frame()[list(FEATURES)].to_numpy(np.float64)[:5]
    lo, hi = sur.throughput_interval(X, 0.8)
    assert lo[0] <= sur.predict(X)[0][0] <= hi[0]
    assert "held-out split of its training dataset" in sur.intervals["rows_from"]
    # a held-apart dataset (other rows): every regression row of it, named as such
    other = write_shards(twin_frame(workloads=6, seed=9), tmp_path / "other")
    assert main(["train", "--dataset", str(other), "--out", str(out), "--intervals-only"]) == 0
    assert "a held-apart dataset" in Surrogate.load(out).intervals["rows_from"]
    capsys.readouterr()
    # another profile's rows: refused, naming the flag
    (out / "dataset_summary.json").write_text(json.dumps({"profile": "qwen-2.5-7b-h100-64gb"}))
    assert main(["train", "--dataset", str(other), "--out", str(out), "--intervals-only"]) == 2
    assert "--dataset" in capsys.readouterr().err
