"""MLflow tracking goes to the given local store and records metrics and artifacts."""
import mlflow

from lora_opt.tracking import log_flat_metrics, tracked_run


def test_tracked_run_logs_metrics_and_artifacts(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    art = tmp_path / "a"
    art.mkdir()
    (art / "x.txt").write_text("hi")
    with tracked_run("unit", run_name="r", tracking_uri=uri) as run:
        log_flat_metrics("smape", {"report half": {"throughput": {"sharegpt": 3.5, "peer": None}}})
        mlflow.log_artifacts(str(art))
    got = mlflow.get_run(run.info.run_id)
    assert got.data.metrics == {"smape.report_half.throughput.sharegpt": 3.5}
    assert [f.path for f in mlflow.MlflowClient().list_artifacts(run.info.run_id)] == ["x.txt"]
