"""Step time: scheduler + adapter loads + forward pass (the profile's estimators,
``twin.profile.LatencySpec.model_ms`` + ``scheduler_ms``)."""
from __future__ import annotations

from numba import njit

import twin.numba_cache  # noqa: F401  (before any @njit(cache=True))
from twin.profile import lora_extra, lora_prefill_share, lora_token_cost

_lora_extra = njit(cache=True)(lora_extra)
_prefill_share = njit(cache=True)(lora_prefill_share)
_token_cost = njit(cache=True)(lora_token_cost)


@njit(cache=True)
def step_seconds(lat, n_seqs, n_tokens, ctx, n_distinct, n_running, n_scanned, load_ms):
    """Seconds of one step with ``n_seqs`` sequences, ``n_tokens`` tokens, ``ctx`` context tokens
    read, ``n_distinct`` adapters, ``n_running`` running and ``n_scanned`` waiting requests visited
    by the scheduler, ``load_ms`` of adapter loads.  ``lat``: ``twin.engine_state.Latency``.
    The LoRA factor multiplies the per-sequence (decode-like) part; prefill tokens beyond one per
    sequence pay ``lora_prefill_share`` of the extra cost (``lora_prefill_share_above`` in a step of
    more than ``lora_prefill_knee`` tokens); every token of a step with an adapter pays ``lora_token_ms``
    (``lora_token_ms_above`` each beyond the knee: vLLM's CPU build's per-token adapter gather),
    ``lora_step_ms`` once (its slots' share included), ``lora_adapter_ms`` per distinct adapter and
    ``lora_seq_ms`` per sequence (the additive form, ``twin.profile.LoraOverheadSpec``)."""
    decode = lat.base_ms + lat.per_seq_ms * n_seqs + lat.per_ctx_ktoken_ms * ctx / 1000.0
    prefill = lat.per_token_ms * (n_tokens - n_seqs)
    if n_distinct > 0:
        extra = _lora_extra(lat.lora_jump, lat.lora_slope, lat.lora_nsat, n_distinct)
        share = _prefill_share(lat.lora_prefill_share, lat.lora_prefill_share_above, lat.lora_prefill_knee, n_tokens)
        model = decode * (1.0 + extra) + prefill * (1.0 + share * extra)
        model += _token_cost(lat.lora_token_ms, lat.lora_token_ms_above, lat.lora_prefill_knee, n_tokens)
        model += lat.lora_step_ms + lat.lora_adapter_ms * n_distinct + lat.lora_seq_ms * n_seqs
    else:
        model = decode + prefill
    sched = lat.sched_base_ms + lat.sched_per_running_ms * n_running + lat.sched_per_waiting_ms * n_scanned
    return (sched + load_ms + model) / 1000.0
