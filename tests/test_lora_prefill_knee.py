"""The LoRA prefill knee (issue 24): on vLLM's CPU build what an adapter adds per prompt token steps up
where a step's tokens x ``--max-lora-rank`` leave the cache (``experiments/real_validation/cpu_launch_check.py``).
The profile carries it per rank (``prefill_knee_tokens``, ``prefill_share_above``; defaults = one share, every
GPU profile unchanged), the kernel and the estimator price it with one rule, the probe's fit finds it only where
the measurement demands it."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from lora_opt.calibration.fitting import FitResult
from lora_opt.calibration.probe_fit import PROBE_PREFIX, prefill_known, fit_lora_prefill
from twin.profile import LoraOverheadSpec, load_profile, profile_from_dict, profile_to_dict

DECODE = FitResult(params={"base_ms": 11.6, "per_seq_ms": 0.6, "per_ctx_ktoken_ms": 2.2}, families=[], n=6)
PREFILL = FitResult(params={"per_token_ms": 0.57}, families=[], n=4, extra={"ttft_constant_ms": 7.0})
LORA = FitResult(params={32: {"jump": 1.6}, 16: {"jump": 1.0}}, families=[], n=10)
LENGTHS = (64, 128, 256, 384, 512, 768, 1024)


def _rows(shares: dict[int, tuple[float, float, float]], noise: float, seed: int = 0) -> pd.DataFrame:
    """ttft_lora rows as the probe writes them, from the fit's own model with (share, knee, share above) per
    rank and relative noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for rank, (below, knee, above) in shares.items():
        jump = LORA.params[rank]["jump"]
        for p in LENGTHS:
            for _ in range(3):
                known, chunks = prefill_known(DECODE.params, p, 2048)
                share = below if p <= knee else above
                y = 7.0 + known * (1 + jump) + 0.57 * (p - chunks) * (1 + share * jump)
                rows.append({"experiment": PROBE_PREFIX + "ttft_lora", "status": "ok", "probe_prompt_tokens": p,
                             "probe_ttft_ms": y * (1 + noise * rng.standard_normal()), "max_lora_rank": rank,
                             "max_num_batched_tokens": 2048})
    return pd.DataFrame(rows)


def test_the_fit_finds_a_knee_the_measurement_demands():
    """One knee in tokens x rank for every rank (the gather's working set), in the middle of the measured
    prompts around the step."""
    fit = fit_lora_prefill(_rows({32: (3.5, 256, 5.5), 16: (1.5, 512, 2.5)}, noise=0.03), DECODE, PREFILL, LORA)
    assert fit.extra["knee"]["between"] == [256 * 32, 384 * 32]
    for rank, (below, knee, above) in {32: (3.5, 256, 5.5), 16: (1.5, 512, 2.5)}.items():
        got = fit.params[rank]
        assert got["prefill_knee_tokens"] == 320 * 32 / rank
        assert got["prefill_share"] == pytest.approx(below, rel=0.1) and got["prefill_share_above"] == pytest.approx(above, rel=0.1)


def test_one_share_when_there_is_no_step():
    """A linear cost (a GPU's) keeps one share: noise does not make a knee."""
    for seed in range(5):
        fit = fit_lora_prefill(_rows({16: (2.0, math.inf, 2.0)}, noise=0.03, seed=seed), DECODE, PREFILL, LORA)
        assert set(fit.params[16]) == {"prefill_share"} and fit.params[16]["prefill_share"] == pytest.approx(2.0, rel=0.1)


def test_a_profile_without_a_knee_writes_as_before_and_one_with_it_round_trips():
    d = profile_to_dict(load_profile("llama-3.1-8b-h100-64gb"))
    assert all("prefill_knee_tokens" not in e and "prefill_share_above" not in e for e in d["latency"]["lora"].values())
    d["latency"]["lora"][8].update(prefill_knee_tokens=256.0, prefill_share_above=0.5)
    back = profile_from_dict(d).latency.lora[8]
    assert back.prefill_knee_tokens == 256 and back.prefill_share_above == 0.5
    assert back.prefill_share_at(256) == back.prefill_share and back.prefill_share_at(257) == 0.5


def test_the_step_model_prices_the_knee():
    lora = LoraOverheadSpec(jump=1.0, slope=0.0, prefill_share=2.0, prefill_knee_tokens=256, prefill_share_above=4.0)
    assert LoraOverheadSpec(jump=1.0, slope=0.0, prefill_share=2.0).share_above == 2.0      # None = one share
    lat = load_profile("probe-llama-cpu-vllm032").latency
    knee = replace(lat, lora={32: lora})
    flat = replace(lat, lora={32: replace(lora, prefill_knee_tokens=math.inf)})
    assert knee.model_ms(1, 256, 0, 1, 32, 4) == flat.model_ms(1, 256, 0, 1, 32, 4)
    # past the knee the prefill tokens pay 1 + 4*extra instead of 1 + 2*extra
    grown = knee.model_ms(1, 257, 0, 1, 32, 4) - flat.model_ms(1, 257, 0, 1, 32, 4)
    assert grown == pytest.approx(lat.per_token_ms * 256 * 2.0)
