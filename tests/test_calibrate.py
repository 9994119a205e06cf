"""Calibration pipeline: reproducibility of the bundled profiles, memory-model check, bad input."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lora_opt.calibration import profile_fit as cal
from lora_opt.calibration.e2e_params import ADDITIVE_LORA_KEYS
from lora_opt.calibration.runs_csv import family_rows
from twin.errors import ScenarioError
from twin.paths import PROFILES_DIR, REPO_ROOT
from twin.profile import load_profile

RUNS = REPO_ROOT / "data" / "real_runs" / "real_runs_vllm_lora.csv"
#: the setups fitted on the real-run CSV (a probe-fitted one, e.g. the CPU tier's, has no runs there)
MODELS = {m: e.profile_name for m, e in cal.MODELS.items() if e.fitted_from == "real_runs"}


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
        for k in cal.E2E_LORA_KEYS + (ADDITIVE_LORA_KEYS if spec.get("form") == "additive" else ()):
            spec.pop(k, None)
    # the additive form's ranks the end-to-end fit added (the fit half's 16): the estimators fit rank 8 only
    bundled["latency"]["lora"] = {r: v for r, v in bundled["latency"]["lora"].items() if r in prof["latency"]["lora"]}
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


# ---- lora-opt probe rows: only positive costs reach a profile (issue 23) -------------------------
PROBE_BASE = "llama-3.1-8b-h100-64gb"


def _probe_rows(path: Path, *, per_ctx: float = 0.06, disk_ms: float = 70.0, edit=None) -> Path:
    """Probe rows (lora-opt probe's CSV) of a made-up server: decode step = 11 + 0.03 B + per_ctx ctx_k
    ms; TTFT = 20 + 0.02 P ms; LoRA r8 x (1 + 0.3 + 0.02 D); loads 6 ms (CPU) and ``disk_ms`` (disk)
    per adapter.  ``edit(rows)`` changes rows (dicts by run_name) before writing."""
    from lora_opt.probe.plan import ProbeContext
    from lora_opt.validate.ingest import rows_csv

    ctx = ProbeContext("tiny", 1.0, {"max_num_batched_tokens": 2048, "max_loras": 8, "max_lora_rank": 8,
                                     "enable_lora": True})
    rows = {}
    for b in (1, 4, 16):
        for p in (32, 448):
            ck = b * (p + 32) / 1000
            rows[f"decode_b{b}_p{p}"] = ctx.row("decode", f"decode_b{b}_p{p}",
                                                probe_step_ms=11 + 0.03 * b + per_ctx * ck, probe_batch=b,
                                                probe_ctx_ktokens_mean=ck, probe_prompt_tokens=p)
    for p in (256, 510):
        rows[f"prefill_p{p}"] = ctx.row("prefill", f"prefill_p{p}", probe_ttft_ms=20 + 0.02 * p + 11.03,
                                        probe_prompt_tokens=p, probe_batch=1)
    for d in (1, 4, 8):
        ck = 8 * 0.16
        step = (11 + 0.24 + per_ctx * ck) * (1.3 + 0.02 * d)
        rows[f"lora_r8_b8_d{d}"] = ctx.row("lora", f"lora_r8_b8_d{d}", probe_step_ms=step, probe_batch=8,
                                           probe_ctx_ktokens_mean=ck, probe_distinct_adapters=d)
    rows["load_cpu_r8"] = ctx.row("loading", "load_cpu_r8", probe_load_kind="cpu", probe_load_ms_per_adapter=6.0)
    rows["load_disk_r8"] = ctx.row("loading", "load_disk_r8", probe_load_kind="disk",
                                   probe_load_ms_per_adapter=6.0 + disk_ms)
    if edit is not None:
        edit(rows)
    path.write_text(rows_csv(list(rows.values())))
    return path


def _calibrate_cli(runs: Path, out: Path, capsys) -> tuple[int, str]:
    from lora_opt.cli import main as cli_main

    rc = cli_main(["calibrate", "--runs", str(runs), "--model", PROBE_BASE, "--out", str(out), "--no-track"])
    return rc, capsys.readouterr().err


def test_probe_rows_of_positive_costs_calibrate(tmp_path, capsys):
    rc, err = _calibrate_cli(_probe_rows(tmp_path / "rows.csv"), tmp_path / "p.yaml", capsys)
    assert rc == 0, err
    p = load_profile(str(tmp_path / "p.yaml"))
    assert p.latency.per_ctx_ktoken_ms == pytest.approx(0.06, rel=1e-3)
    assert p.latency.per_token_ms == pytest.approx(0.02, rel=0.05)
    assert p.loading.cpu_to_gpu_ms[8] == pytest.approx(6.0) and p.loading.disk_to_cpu_ms[8] == pytest.approx(70.0)


def test_calibrate_refuses_ok_rows_with_non_positive_costs(tmp_path, capsys):
    """The issue's rows: a window 'ok' with a 0.0 ms step (all tokens in one read) and a -12 ms load
    'ok': exit 2, the rows named, no traceback, nothing written."""
    def edit(rows):
        rows["decode_b1_p32"]["probe_step_ms"] = 0.0
        rows["load_cpu_r8"]["probe_load_ms_per_adapter"] = -12.0
        rows["prefill_p256"]["probe_ttft_ms"] = float("nan")
    out = tmp_path / "p.yaml"
    rc, err = _calibrate_cli(_probe_rows(tmp_path / "rows.csv", edit=edit), out, capsys)
    assert rc == 2 and err.startswith("lora-opt calibrate: error:") and "Traceback" not in err
    assert "decode_b1_p32 (probe_step_ms 0)" in err and "load_cpu_r8 (probe_load_ms_per_adapter -12)" in err
    assert "prefill_p256 (probe_ttft_ms nan)" in err and "3 probe row(s)" in err
    assert not out.exists()
    # rows a probe marked noisy are left out, not refused
    def noisy(rows):
        edit(rows)
        for name in ("decode_b1_p32", "load_cpu_r8", "load_disk_r8", "prefill_p256"):
            rows[name]["status"] = "noisy"
        rows["prefill_p300"] = {**rows["prefill_p510"], "run_name": "prefill_p300", "probe_prompt_tokens": 300,
                                "probe_ttft_ms": 20 + 0.02 * 300 + 11.03}
    rc, err = _calibrate_cli(_probe_rows(tmp_path / "rows.csv", edit=noisy), out, capsys)
    assert rc == 0, err
    assert load_profile(str(out)).loading == load_profile(PROBE_BASE).loading     # not identified: kept


@pytest.mark.parametrize("case, expect", [
    ("per_ctx", ["decode per_ctx_ktoken_ms = ", "decode_b1_p32", "decode_b16_p448"]),
    ("disk", ["loading disk_to_cpu_ms r8 = -2", "load_cpu_r8", "load_disk_r8"]),
    ("prefill", ["prefill per_token_ms = 0 ", "prefill_p256, prefill_p510"]),
    ("lora", ["lora r8 jump = ", "lora_r8_b8_d1"]),
])
def test_calibrate_refuses_fitted_costs_that_are_not_positive(tmp_path, capsys, case, expect):
    """Rows each positive, fits that are not: a step that does not grow with context, a disk load
    below the CPU load, TTFT falling with the prompt (the fit's per-token cost stops at 0), LoRA steps
    faster than the same batch without LoRA (a distinct-adapter slope of 0 is not refused: it is what
    vLLM's CPU build measures, and the fit says so -- test_probe_fit_accepts_a_zero_slope)."""
    def prefill(rows):
        rows["prefill_p256"]["probe_ttft_ms"], rows["prefill_p510"]["probe_ttft_ms"] = 40.0, 30.0

    def lora(rows):
        for d, v in ((1, 8.0), (4, 8.1), (8, 7.9)):
            rows[f"lora_r8_b8_d{d}"]["probe_step_ms"] = v
    kw = {"per_ctx": {"per_ctx": 0.0}, "disk": {"disk_ms": -2.0}, "prefill": {"edit": prefill},
          "lora": {"edit": lora}}[case]
    out = tmp_path / "p.yaml"
    rc, err = _calibrate_cli(_probe_rows(tmp_path / "rows.csv", **kw), out, capsys)
    assert rc == 2 and "Traceback" not in err and "costs that are not positive" in err, err
    assert all(e in err for e in expect), err
    assert not out.exists()


def test_probe_fit_accepts_a_zero_slope(tmp_path, capsys):
    """LoRA steps that do not grow with distinct adapters (vLLM's CPU LoRA ops): the slope is not demanded
    by the F-test, so the profile has slope 0 and the jump alone, and the fit records the test."""
    def flat(rows):
        for d, v in ((1, 16.0), (4, 16.2), (8, 15.9)):
            rows[f"lora_r8_b8_d{d}"]["probe_step_ms"] = v
    rc, err = _calibrate_cli(_probe_rows(tmp_path / "rows.csv", edit=flat), tmp_path / "p.yaml", capsys)
    assert rc == 0, err
    p = load_profile(str(tmp_path / "p.yaml"))
    assert p.latency.lora[8].slope == 0.0 and p.latency.lora[8].jump > 0.3
    test = p.fit["estimators"]["lora"]["rank_8"]["slope_test"]
    assert test["fitted"] is False and test["p_value"] >= 1e-3


def test_calibrate_names_the_rows_when_too_few_are_ok(tmp_path, capsys):
    """Real vLLM on 2 shared cores: single-stream windows come in bursts (noisy); the refusal lists every
    decode row with its status."""
    def edit(rows):
        for name in list(rows):
            if name.startswith(("decode_b1_", "decode_b4_")):
                rows[name]["status"] = "noisy"
    rc, err = _calibrate_cli(_probe_rows(tmp_path / "rows.csv", edit=edit), tmp_path / "p.yaml", capsys)
    assert rc == 2 and "fewer than 3 ok decode runs" in err and "Traceback" not in err, err
    assert "decode_b1_p32 noisy" in err and "decode_b16_p448 ok" in err
    assert not (tmp_path / "p.yaml").exists()
