"""The (model, GPU, vLLM version) table (configs/models.yaml): bundled content, validation, and a new
setup of a known engine generation calibrated from a YAML entry and its runs alone."""
from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import yaml

from lora_opt.calibration import model_table, profile_fit, realruns
from lora_opt.calibration.model_table import ENGINE_GENERATIONS, FIT_HALF, GPUS, MODEL_PROFILES, MODELS, load_model_table
from lora_opt.errors import InputError
from twin.paths import PROFILES_DIR, REPO_ROOT

RUNS = REPO_ROOT / "data" / "real_runs" / "real_runs_vllm_lora.csv"


def test_bundled_table():
    assert sorted(MODELS) == ["llama-2-7b", "llama-3.1-8b-instruct", "probe-llama", "qwen-2.5-7b-instruct"]
    assert GPUS["h100-64gb"].memory_gib == 63.43 and GPUS["h100-64gb"].name == "H100"
    assert {m.engine for m in MODELS.values()} == set(ENGINE_GENERATIONS)
    assert FIT_HALF == {"llama-3.1-8b-instruct": "/rank_16_", "qwen-2.5-7b-instruct": "/rank_16_",
                        "llama-2-7b": "_rate_0.0125", "probe-llama": "ingested/cpu-fit"}
    # the real-vLLM tier's CPU setup: fitted on probe rows only, its KV cache a fixed size, the front end
    # the only end-to-end constant its validation runs fit
    cpu = MODELS["probe-llama"]
    assert (cpu.fitted_from, cpu.gpu.kv_cache_gib, cpu.e2e_fit, cpu.vllm_version) == ("probe", 1.0, ("frontend",), "0.32")
    assert {m.fitted_from for k, m in MODELS.items() if k != "probe-llama"} == {"real_runs"}
    assert MODEL_PROFILES == {k: m.profile_name for k, m in MODELS.items()}
    assert realruns.MODEL_PROFILES is MODEL_PROFILES
    for key, m in MODELS.items():
        assert m.csv_name == key and (PROFILES_DIR / f"{m.profile_name}.yaml").exists()


def _raw() -> dict:
    return yaml.safe_load(model_table.MODEL_TABLE_PATH.read_text())


def _write(tmp_path, raw: dict):
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("edit, words", [
    (lambda r: r["models"]["llama-2-7b"].update(colour="red"), ["models.llama-2-7b", "unknown field", "colour"]),
    (lambda r: r["models"]["llama-2-7b"].pop("engine"), ["models.llama-2-7b", "missing field", "engine"]),
    (lambda r: r["models"]["llama-2-7b"].update(engine="v9"), ["models.llama-2-7b.engine", "v9", "v0", "v1"]),
    (lambda r: r["models"]["llama-2-7b"].update(gpu="a100"), ["models.llama-2-7b.gpu", "a100", "h100-64gb"]),
    (lambda r: r["models"]["llama-2-7b"]["spec"].update(layers=3), ["models.llama-2-7b.spec", "layers"]),
    (lambda r: r["models"]["llama-2-7b"].pop("cpu_to_gpu_ms_from"), ["models.llama-2-7b", "cpu_to_gpu_ms_from"]),
    (lambda r: r["models"]["llama-2-7b"]["cpu_to_gpu_ms_from"].update(model="gpt"), ["cpu_to_gpu_ms_from.model", "gpt"]),
    (lambda r: r["gpus"]["h100-64gb"].update(memory_gib=-1), ["gpus.h100-64gb.memory_gib", "-1"]),
    (lambda r: r.update(extra={}), ["gpus", "models"]),
])
def test_bad_table_names_the_field(tmp_path, edit, words):
    raw = _raw()
    edit(raw)
    with pytest.raises(InputError) as exc:
        load_model_table(_write(tmp_path, raw))
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_a_new_setup_is_a_yaml_entry_and_its_runs(tmp_path, monkeypatch):
    """A copy of Llama-3.1's runs under a new model name, with a new entry of the same (v1)
    generation: calibrate fits the same profile without any code change."""
    raw = _raw()
    raw["models"]["llama-3.1-8b-copy"] = dict(copy.deepcopy(raw["models"]["llama-3.1-8b-instruct"]),
                                              profile_name="llama-3.1-8b-copy-h100-64gb")
    _, models = load_model_table(_write(tmp_path, raw))
    monkeypatch.setitem(MODELS, "llama-3.1-8b-copy", models["llama-3.1-8b-copy"])
    runs = pd.read_csv(RUNS, low_memory=False)
    runs = runs[runs["model"] == "llama-3.1-8b-instruct"].copy()
    runs["model"] = "llama-3.1-8b-copy"
    runs["experiment"] = runs["experiment"].str.replace("/llama-3.1-8b-instruct", "/llama-3.1-8b-copy", regex=False)
    csv = tmp_path / "runs.csv"
    runs.to_csv(csv, index=False)
    prof = profile_fit.calibrate(csv, "llama-3.1-8b-copy", tmp_path / "copy.yaml")
    bundled = yaml.safe_load((PROFILES_DIR / "llama-3.1-8b-h100-64gb.yaml").read_text())
    assert prof["name"] == "llama-3.1-8b-copy-h100-64gb" and prof["model"] == bundled["model"]
    assert prof["memory"] == bundled["memory"] and prof["loading"] == bundled["loading"]
    for key in ("base_ms", "per_seq_ms", "per_token_ms", "per_ctx_ktoken_ms"):
        assert math.isclose(prof["latency"][key], bundled["latency"][key], rel_tol=1e-6)
    for rank, spec in prof["latency"]["lora"].items():
        for key in ("jump", "slope", "n_sat", "ref_max_loras"):
            assert spec[key] == pytest.approx(bundled["latency"]["lora"][rank][key], rel=1e-6)
