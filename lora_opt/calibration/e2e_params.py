"""The end-to-end constants in a profile dict (fitted by ``lora-opt calibrate-e2e``, kept by
``lora-opt calibrate``): LoRA slot and prefill shares, the front end's TTFT terms, V0's step overhead."""
from __future__ import annotations

import copy

#: latency keys only the end-to-end fit sets (``sched_base_ms``: V0's per-step CPU time)
E2E_LATENCY_KEYS = ("ttft_frontend_ms", "ttft_frontend_per_running_ms", "sched_base_ms")
#: keys of every ``latency.lora`` rank only the end-to-end fit sets
E2E_LORA_KEYS = ("slot_share", "prefill_share")
#: keys of every ``latency.lora`` rank the end-to-end fit of the additive form sets (``lora_opt.calibration.additive_fit``)
ADDITIVE_LORA_KEYS = ("form", "step_ms", "slot_ms", "adapter_ms", "seq_ms", "token_ms")


def with_e2e_params(profile: dict, slot_share: float | None, prefill_share: float | None,
                    frontend: tuple[float, float] = (0.0, 0.0), step_overhead_ms: float = 0.0,
                    additive: dict | None = None, adapter_ms_by_rank: dict | None = None) -> dict:
    """A copy of ``profile`` with these end-to-end constants (every LoRA rank gets the same shares; a share
    of None keeps each rank's own: one the probe measured per rank).  ``additive``: the additive form's
    constants (:data:`ADDITIVE_LORA_KEYS` but ``form``), given to every rank, which is then priced by them
    alone (its ``jump`` and ``slope`` stay as the estimators fitted them, unused).  ``adapter_ms_by_rank``: the
    additive ``adapter_ms`` of each rank fitted apart (a rank the profile has no entry for gets one, a copy of
    its nearest rank's)."""
    p = copy.deepcopy(profile)
    lora = p["latency"]["lora"]
    for rank in sorted({int(r) for r in (adapter_ms_by_rank or {})} - {int(r) for r in lora}):
        nearest = min(lora, key=lambda r: (abs(int(r) - rank), int(r)))
        lora[rank] = copy.deepcopy(lora[nearest])
    for rank, spec in lora.items():
        if additive is not None:
            spec.update({"form": "additive", **{k: float(additive[k]) for k in ADDITIVE_LORA_KEYS[1:]}})
            for k in E2E_LORA_KEYS:          # the factor form's shares: not used by the additive form
                spec.pop(k, None)
            by_rank = {int(r): v for r, v in (adapter_ms_by_rank or {}).items()}
            if int(rank) in by_rank:
                spec["adapter_ms"] = float(by_rank[int(rank)])
        if slot_share is not None:
            spec["slot_share"] = float(slot_share)
        if prefill_share is not None:
            spec["prefill_share"] = float(prefill_share)
    p["latency"]["ttft_frontend_ms"] = float(frontend[0])
    p["latency"]["ttft_frontend_per_running_ms"] = float(frontend[1])
    p["latency"]["sched_base_ms"] = float(step_overhead_ms)
    return p
