"""Calibration pipeline: reproducibility of the bundled profiles, memory-model check, bad input."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lora_opt.calibration import profile_fit as cal
from lora_opt.calibration.families import family_rows
from twin.errors import ScenarioError
from twin.paths import PROFILES_DIR, REPO_ROOT
from twin.profile import load_profile

RUNS = REPO_ROOT / "data" / "real_runs" / "real_runs_vllm_lora.csv"
MODELS = {m: e.profile_name for m, e in cal.MODELS.items()}


@pytest.fixture(scope="module")
def runs() -> pd.DataFrame:
    return cal.load_runs(RUNS)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Each model calibrated afresh (no report) into a temporary directory."""
    out_dir = tmp_path_factory.mktemp("profiles")
    result = {}
    for model, name in MODELS.items():
        out = out_dir / f"{name}.yaml"
        result[model] = (cal.calibrate(RUNS, model, out), out)
    return result


def _assert_close(a, b, where: str = "", rel: float = 1e-6) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            if k == "command":  # contains the output path, which differs here
                continue
            _assert_close(a[k], b[k], f"{where}.{k}", rel)
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]", rel)
    elif isinstance(a, bool) or not isinstance(a, (int, float)):
        assert a == b, f"{where}: {a!r} != {b!r}"
    elif math.isinf(a) or math.isinf(b):
        assert a == b, f"{where}: {a} != {b}"
    else:
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-12), f"{where}: {a} != {b}"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_calibration_reproduces_bundled_profile(model, calibrated):
    prof, _ = calibrated[model]
    with open(PROFILES_DIR / f"{MODELS[model]}.yaml") as fh:
        bundled = yaml.safe_load(fh)
    # The end-to-end constants (lora-opt calibrate-e2e) are not estimator fits: compare without them.
    bundled["fit"].pop("e2e", None)
    prof = {**prof, "latency": dict(prof["latency"])}
    for k in cal.E2E_LATENCY_KEYS:
        bundled["latency"].pop(k, None)
        prof["latency"].pop(k, None)
    for spec in bundled["latency"]["lora"].values():
        for k in cal.E2E_LORA_KEYS:
            spec.pop(k, None)
    # Every section, fitted parameters and fit statistics included, within 1e-6 relative.
    _assert_close(prof, bundled, MODELS[model])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_written_yaml_loads_and_records_provenance(model, calibrated):
    prof, out = calibrated[model]
    p = load_profile(out)
    assert p.name == MODELS[model]
    assert p.fit["data"]["sha256"] == cal.sha256_of(RUNS)
    assert p.fit["command"].startswith(f"lora-opt calibrate --runs data/real_runs/real_runs_vllm_lora.csv "
                                       f"--model {model} --out ")
    for name, est in p.fit["estimators"].items():
        for fam in est.get("families", []):
            assert not fam.startswith(cal.VALIDATION_PREFIXES), f"{name} fitted on validation family {fam}"
    assert p.latency.lora, "no LoRA overhead fitted"
    assert p.loading.cpu_to_gpu_ms and p.loading.disk_to_cpu_ms


@pytest.mark.parametrize("model", sorted(MODELS))
def test_bundled_profile_predicts_startup_of_real_runs(model, runs):
    check = cal.memory_check(runs, load_profile(MODELS[model]))
    assert check["n_runs"] > 200
    assert check["accuracy"] >= 0.98, check["misclassified"]


def test_llama31_kv_within_2pct_at_calibrated_max_num_seqs(runs):
    check = cal.memory_check(runs, load_profile(MODELS["llama-3.1-8b-instruct"]))
    s = check["kv_ok_runs_at_calibrated_max_num_seqs"]
    assert s["n"] >= 30
    assert s["max_abs_rel_error"] <= 0.02


@pytest.mark.xfail(strict=True, reason="known limit, see fit_report.md: the linear slot model cannot follow "
                   "the measured non-linearity (Qwen 224x32: 3.7 %; vLLM 0.5.0 Llama-2 near the frontier: 35 %)")
@pytest.mark.parametrize("model", ["qwen-2.5-7b-instruct", "llama-2-7b"])
def test_kv_within_2pct_at_calibrated_max_num_seqs_known_misses(model, runs):
    check = cal.memory_check(runs, load_profile(MODELS[model]))
    assert check["kv_ok_runs_at_calibrated_max_num_seqs"]["max_abs_rel_error"] <= 0.02


def test_kv_within_2pct_at_every_max_num_seqs(runs):
    """Llama-3.1: every measured KV size, at every max_num_seqs (the sampler term), within 2 %."""
    check = cal.memory_check(runs, load_profile(MODELS["llama-3.1-8b-instruct"]))
    assert check["kv_ok_runs"]["max_abs_rel_error"] <= 0.02


def test_v0_max_num_seqs_term_from_the_loading_family(runs):
    """vLLM 0.5.0: the loading family (max_num_seqs 50) is the only estimator family at another
    max_num_seqs than the memory family's 4096; with the sampler term fitted from it, every KV size
    it logged is within 2 % (without it: -8 %), and the term leaves the memory family unchanged."""
    prof = load_profile(MODELS["llama-2-7b"])
    assert prof.memory.seqs_knee == 50 and prof.memory.overhead_gib_per_1k_seqs > 0
    check = cal.memory_check(runs, prof)
    fam = check["kv_by_family_ok_runs"]["performance_analysis/loading_overhead/latency"]
    assert fam["n"] >= 40 and fam["max_abs_rel_error"] <= 0.02
    flat = dataclasses.replace(prof, memory=dataclasses.replace(prof.memory, overhead_gib_per_1k_seqs=0.0))
    assert prof.kv_capacity_tokens(8, 16, 0.9, 4096, max_num_seqs=4096) == \
        flat.kv_capacity_tokens(8, 16, 0.9, 4096, max_num_seqs=4096)
    # about 3.5 GiB more KV at max_num_seqs 50 (0.5 MiB per token: ~7k tokens)
    gain = prof.kv_capacity_tokens(1, 16, 0.9, 4096, max_num_seqs=50) - \
        flat.kv_capacity_tokens(1, 16, 0.9, 4096, max_num_seqs=50)
    assert 6000 < gain < 8000


def test_recalibrating_keeps_the_end_to_end_constants(tmp_path):
    """calibrate rewrites the estimator fits and keeps what calibrate-e2e fitted on the fit half
    (for the vLLM 0.5.0 profile: the V0 per-step CPU time too)."""
    import shutil
    out = tmp_path / "llama-2.yaml"
    shutil.copy(PROFILES_DIR / "llama-2-7b-h100-64gb.yaml", out)
    bundled = yaml.safe_load(out.read_text())
    cal.calibrate(RUNS, "llama-2-7b", out)
    again = yaml.safe_load(out.read_text())
    assert again["fit"]["e2e"] == bundled["fit"]["e2e"]
    assert bundled["fit"]["e2e"]["params"]["step_overhead_ms"] > 0
    for k in cal.E2E_LATENCY_KEYS:
        assert again["latency"][k] == bundled["latency"][k]
    assert load_profile(out).latency.sched_base_ms == bundled["fit"]["e2e"]["params"]["step_overhead_ms"]


def test_report_is_written(tmp_path):
    cal.calibrate(RUNS, "qwen-2.5-7b-instruct", tmp_path / "q.yaml", tmp_path / "report")
    report = tmp_path / "report" / "fit_report.md"
    assert report.exists() and "Memory check" in report.read_text()
    pngs = list((tmp_path / "report").glob("*.png"))
    assert len(pngs) >= 5
    assert all(p.stat().st_size < 200_000 for p in pngs)


# ---- bad input ----------------------------------------------------------------------------------
def test_unknown_model_names_allowed_values(tmp_path):
    with pytest.raises(ScenarioError) as exc:
        cal.calibrate(RUNS, "gpt-5", tmp_path / "x.yaml")
    msg = str(exc.value)
    assert "gpt-5" in msg and all(m in msg for m in MODELS)


def test_missing_csv(tmp_path):
    with pytest.raises(ScenarioError, match="file not found"):
        cal.calibrate(tmp_path / "nope.csv", "llama-2-7b", tmp_path / "x.yaml")


def test_csv_without_needed_columns(tmp_path):
    bad = tmp_path / "bad.csv"
    pd.read_csv(RUNS, nrows=20).drop(columns=["gpu_kv_cache_tokens", "mean_itl_ms"]).to_csv(bad, index=False)
    with pytest.raises(ScenarioError) as exc:
        cal.calibrate(bad, "llama-2-7b", tmp_path / "x.yaml")
    assert "gpu_kv_cache_tokens" in str(exc.value) and "mean_itl_ms" in str(exc.value)
    assert not (tmp_path / "x.yaml").exists()


def test_csv_without_the_models_runs(tmp_path):
    other = tmp_path / "other.csv"
    df = pd.read_csv(RUNS, low_memory=False)
    df[df["model"] != "llama-2-7b"].to_csv(other, index=False)
    with pytest.raises(ScenarioError, match="no runs of model 'llama-2-7b'"):
        cal.calibrate(other, "llama-2-7b", tmp_path / "x.yaml")


# ---- pieces -------------------------------------------------------------------------------------
def test_fitting_refuses_validation_families(runs):
    with pytest.raises(AssertionError):
        family_rows(runs, "digital_twin_modelling/real_results/llama-3.1-8b-instruct")
    with pytest.raises(AssertionError):
        family_rows(runs, "motivation_figure/")


def test_expected_distinct_adapters():
    d = cal.expected_distinct_adapters
    assert d(1, 200, 4096) == pytest.approx(1.0)
    assert d(300, 1, 4096) == pytest.approx(1.0)
    assert d(4096, 200, 4096) == pytest.approx(200.0)
    # Drawing half the requests of 2 adapters with 2048 requests each almost surely sees both.
    assert d(2, 2048, 4096) == pytest.approx(2.0)


def test_weights_from_config():
    assert cal.weights_gib(cal.MODELS["llama-3.1-8b-instruct"]) == pytest.approx(14.96, abs=0.01)
    assert cal.weights_gib(cal.MODELS["llama-2-7b"]) == pytest.approx(12.55, abs=0.01)
