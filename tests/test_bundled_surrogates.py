"""The bundled default surrogates load on a fresh machine and answer sensibly."""
import numpy as np
import pytest

from lora_opt.surrogates.distill import DistilledSurrogate
from lora_opt.surrogates.features import feature_matrix, gpu_features
from lora_opt.surrogates.oracle import Oracle, Surrogate
from twin.paths import CONFIGS_DIR

BUNDLED = sorted(p for p in (CONFIGS_DIR / "surrogates").iterdir() if p.is_dir())


def test_a_surrogate_for_the_main_profile_is_bundled():
    assert "llama-3.1-8b-h100-64gb" in [p.name for p in BUNDLED]


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_bundled_surrogate_answers(path):
    light = gpu_features([8] * 16, [0.05] * 16, max_loras=16)           # 16 adapters, 0.8 req/s in all
    heavy = gpu_features([32] * 384, [3.2] * 384, max_loras=384)        # cannot even start (OOM)
    X = feature_matrix([light, heavy])
    for model in (Surrogate.load(path / "surrogate.json"), DistilledSurrogate.load(path / "distilled.json")):
        assert isinstance(model, Oracle)
        thr, feasible, p_starving = model.predict(X)
        assert feasible.tolist() == [True, False]
        # the light GPU serves what arrives: ~0.8 req/s x 416 tokens
        assert thr[0] == pytest.approx(0.8 * 416, rel=0.25)
        assert np.all((0 <= p_starving) & (p_starving <= 1))


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_bundled_provenance_is_consistent(path):
    """dataset_summary.json (written by train) names the rows metrics.json says the model saw."""
    import json
    summary = json.loads((path / "dataset_summary.json").read_text())
    metrics = json.loads((path / "metrics.json").read_text())
    assert summary["dataset_hash"] == metrics["dataset"]["sha256_16"]
    assert summary["profile"] == path.name
