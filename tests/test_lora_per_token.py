"""LoRA priced per token (issue 24): on vLLM's CPU build every token of a step with an adapter costs
``token_ms`` of its rank (the per-token adapter gather), not a factor on the step.  A model entry says which
form its probe fit uses (``lora_cost``); the fit recovers ``token_ms`` (and the knee) from decode windows and
lone prompts; the step model, the kernel and the early stop's work bound price it; GPU profiles are unchanged."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from lora_opt.calibration.fitting import FitResult
from lora_opt.calibration.model_table import MODELS, load_model_table
from lora_opt.calibration.probe_fit import PROBE_PREFIX, prefill_known, fit_lora_per_token
from lora_opt.errors import InputError
from twin.paths import MODEL_TABLE_PATH
from twin.profile import LoraOverheadSpec, load_profile, lora_token_cost, profile_to_dict

DECODE = FitResult(params={"base_ms": 9.6, "per_seq_ms": 0.5, "per_ctx_ktoken_ms": 2.0}, families=[], n=6)
PREFILL = FitResult(params={"per_token_ms": 0.35}, families=[], n=4, extra={"ttft_constant_ms": 5.0})
LENGTHS = (64, 128, 256, 384, 512, 768, 1024)


def _rows(costs: dict[int, tuple[float, float, float]], noise: float, seed: int = 0) -> pd.DataFrame:
    """LoRA decode windows (B = 16, D = 1..16) and lone prompts through an adapter, from the per-token model
    with (token_ms, knee in tokens, token_ms for each token beyond it) per rank and relative noise."""
    rng = np.random.default_rng(seed)
    d = DECODE.params
    rows = []
    for rank, (below, knee, above) in costs.items():
        for dist in (1, 2, 4, 8, 16):
            y = d["base_ms"] + d["per_seq_ms"] * 16 + d["per_ctx_ktoken_ms"] * 2.8 + 16 * (below if 16 <= knee else above)
            rows.append({"experiment": PROBE_PREFIX + "lora", "status": "ok", "probe_batch": 16, "probe_step_ms":
                         y * (1 + noise * rng.standard_normal()), "probe_ctx_ktokens_mean": 2.8, "max_lora_rank": rank,
                         "probe_distinct_adapters": dist, "max_loras": 16})
        for p in LENGTHS:
            known, chunks = prefill_known(d, p, 2048)
            y = 5.0 + known + 0.35 * (p - chunks) + lora_token_cost(below, above, knee, p)
            rows.append({"experiment": PROBE_PREFIX + "ttft_lora", "status": "ok", "probe_prompt_tokens": p,
                         "probe_ttft_ms": y * (1 + noise * rng.standard_normal()), "max_lora_rank": rank,
                         "max_num_batched_tokens": 2048})
    return pd.DataFrame(rows)


def test_the_fit_recovers_token_ms_and_one_knee_in_tokens_x_rank():
    costs = {32: (3.0, 256, 6.4), 16: (1.6, 512, 3.2)}
    fit = fit_lora_per_token(_rows(costs, noise=0.03), DECODE, PREFILL)
    assert fit.extra["form"] == "per_token" and fit.extra["knee"]["form"] == "hinge"
    assert fit.extra["knee"]["knee_product"] == 256 * 32
    for rank, (below, _, above) in costs.items():
        got = fit.params[rank]
        assert got["jump"] == 0.0 and got["prefill_share"] == 0.0 and got["ref_max_loras"] == 16.0
        assert got["token_ms"] == pytest.approx(below, rel=0.1) and got["token_ms_above"] == pytest.approx(above, rel=0.1)
        assert got["prefill_knee_tokens"] == 256 * 32 / rank


def test_the_lora_cost_is_continuous_at_the_knee():
    """A step one token past the knee pays one dearer token more (a hinge), not all its tokens at the dearer
    rate; no knee (inf) is one rate; the kernel compiles the same rule."""
    from twin.engine_cost import _token_cost
    for cost in (lora_token_cost, _token_cost):
        assert cost(3.0, 6.0, 256, 256) == 768.0 and cost(3.0, 6.0, 256, 257) == 774.0
        assert cost(3.0, 6.0, 256.0, 1000) == 3.0 * 256 + 6.0 * 744 and cost(3.0, 6.0, math.inf, 1000) == 3000.0


def test_one_cost_per_token_without_a_step():
    for seed in range(3):
        fit = fit_lora_per_token(_rows({8: (0.85, math.inf, 0.85)}, noise=0.03, seed=seed), DECODE, PREFILL)
        assert "token_ms_above" not in fit.params[8] and fit.params[8]["token_ms"] == pytest.approx(0.85, rel=0.1)


def test_the_step_model_adds_token_ms_per_token_of_a_step_with_an_adapter():
    lat = load_profile("probe-llama-cpu-vllm032").latency
    lora = LoraOverheadSpec(jump=0.0, slope=0.0, prefill_share=0.0, token_ms=3.0, prefill_knee_tokens=256,
                            token_ms_above=6.0)
    plain = replace(lat, lora={32: LoraOverheadSpec(0.0, 0.0, prefill_share=0.0)})
    per_token = replace(lat, lora={32: lora})
    for n_seqs, n_tokens in ((1, 1), (16, 16), (1, 256), (2, 257), (1, 600)):
        lora_ms = 3.0 * min(n_tokens, 256) + 6.0 * max(n_tokens - 256, 0)
        assert per_token.model_ms(n_seqs, n_tokens, 500, 1, 32, 2) == pytest.approx(
            plain.model_ms(n_seqs, n_tokens, 500, 1, 32, 2) + lora_ms)
        assert per_token.model_ms(n_seqs, n_tokens, 500, 0, 32, 2) == plain.model_ms(n_seqs, n_tokens, 500, 0, 32, 2)


def test_gpu_profiles_have_no_per_token_knee():
    """The GPU profiles price LoRA as a factor (Llama-2) or additively (Llama-3.1, Qwen: issue 36), never with the
    CPU build's knee; only the CPU tier's model entry is per_token."""
    assert {m.lora_cost for k, m in MODELS.items() if k != "probe-llama"} <= {"factor", "additive"}
    assert MODELS["probe-llama"].lora_cost == "per_token"
    for name in ("llama-3.1-8b-h100-64gb", "qwen-2.5-7b-h100-64gb", "llama-2-7b-h100-64gb"):
        d = profile_to_dict(load_profile(name))
        assert all("token_ms_above" not in e and "prefill_knee_tokens" not in e for e in d["latency"]["lora"].values())
    d = profile_to_dict(load_profile("llama-2-7b-h100-64gb"))
    assert all("token_ms" not in e and "form" not in e for e in d["latency"]["lora"].values())


def test_a_model_entry_with_an_unknown_lora_cost_is_refused(tmp_path):
    bad = tmp_path / "models.yaml"
    bad.write_text(MODEL_TABLE_PATH.read_text().replace("lora_cost: per_token", "lora_cost: gather"))
    with pytest.raises(InputError, match=r"lora_cost: 'gather'; allowed: \['factor', 'per_token', 'additive'\]"):
        load_model_table(bad)


def _rows_with_step(rank: int, step_ms: float, token_ms: float, batches=(1, 4, 16, 32), noise: float = 0.02,
                    seed: int = 0) -> pd.DataFrame:
    """One-adapter decode windows at ``batches`` and lone prompts, from ``step_ms`` + ``token_ms`` per token."""
    rng = np.random.default_rng(seed)
    d = DECODE.params
    rows = []
    for b in batches:
        ctx = 0.17 * b
        y = d["base_ms"] + d["per_seq_ms"] * b + d["per_ctx_ktoken_ms"] * ctx + step_ms + b * token_ms
        rows.append({"experiment": PROBE_PREFIX + "lora", "status": "ok", "probe_batch": b, "probe_step_ms":
                     y * (1 + noise * rng.standard_normal()), "probe_ctx_ktokens_mean": ctx, "max_lora_rank": rank,
                     "probe_distinct_adapters": 1, "max_loras": 16})
    for p in LENGTHS[:4]:
        known, chunks = prefill_known(d, p, 2048)
        y = 5.0 + known + 0.35 * (p - chunks) + step_ms + p * token_ms
        rows.append({"experiment": PROBE_PREFIX + "ttft_lora", "status": "ok", "probe_prompt_tokens": p,
                     "probe_ttft_ms": y * (1 + noise * rng.standard_normal()), "max_lora_rank": rank,
                     "max_num_batched_tokens": 2048})
    return pd.DataFrame(rows)


def test_windows_at_several_batch_sizes_separate_the_fixed_cost_a_step():
    """vLLM's CPU build pays ~5 ms a step for LoRA at rank 16 even at one sequence (issue 24): windows at 1-32
    sequences recover it beside token_ms; windows at one batch size leave it 0 (every ms on the tokens)."""
    fit = fit_lora_per_token(_rows_with_step(16, 5.0, 0.75), DECODE, PREFILL)
    assert fit.params[16]["step_ms"] == pytest.approx(5.0, rel=0.25)
    assert fit.params[16]["token_ms"] == pytest.approx(0.75, rel=0.1)
    assert fit.extra["rank_16"]["window_batches"] == [1, 4, 16, 32]
    one = fit_lora_per_token(_rows_with_step(16, 5.0, 0.75, batches=(16,)), DECODE, PREFILL)
    assert "step_ms" not in one.params[16] and one.extra["rank_16"]["step_ms"] == 0.0


def test_the_step_model_adds_step_ms_once_to_a_step_with_an_adapter():
    prof = load_profile("tests/data/profile-cpu-knee.yaml")
    lora8 = prof.latency.lora_for_rank(8)
    assert lora8.step_ms == 4.5
    lat = prof.latency
    without = replace(prof.latency, lora={**lat.lora, 8: replace(lora8, step_ms=0.0)})
    for n_seqs, n_tokens in ((1, 1), (16, 16), (2, 300)):
        assert lat.model_ms(n_seqs, n_tokens, 1000, 1, 8, 4) - without.model_ms(n_seqs, n_tokens, 1000, 1, 8, 4) \
            == pytest.approx(4.5)
        assert lat.model_ms(n_seqs, n_tokens, 1000, 0, 8, 4) == without.model_ms(n_seqs, n_tokens, 1000, 0, 8, 4)
    # a profile without it writes as before: the field is left out at its default
    assert all("step_ms" not in spec for spec in profile_to_dict(load_profile("llama-2-7b-h100-64gb"))["latency"]["lora"].values())
