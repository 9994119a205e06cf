"""The end-to-end constants in a profile dict (fitted by ``lora-opt calibrate-e2e``, kept by
``lora-opt calibrate``): LoRA slot and prefill shares, the front end's TTFT terms, V0's step overhead."""
from __future__ import annotations

import copy

#: latency keys only the end-to-end fit sets (``sched_base_ms``: V0's per-step CPU time)
E2E_LATENCY_KEYS = ("ttft_frontend_ms", "ttft_frontend_per_running_ms", "sched_base_ms")
#: keys of every ``latency.lora`` rank only the end-to-end fit sets
E2E_LORA_KEYS = ("slot_share", "prefill_share")


def with_e2e_params(profile: dict, slot_share: float | None, prefill_share: float | None,
                    frontend: tuple[float, float] = (0.0, 0.0), step_overhead_ms: float = 0.0) -> dict:
    """A copy of ``profile`` with these end-to-end constants (every LoRA rank gets the same shares; a share
    of None keeps each rank's own: one the probe measured per rank)."""
    p = copy.deepcopy(profile)
    for spec in p["latency"]["lora"].values():
        if slot_share is not None:
            spec["slot_share"] = float(slot_share)
        if prefill_share is not None:
            spec["prefill_share"] = float(prefill_share)
    p["latency"]["ttft_frontend_ms"] = float(frontend[0])
    p["latency"]["ttft_frontend_per_running_ms"] = float(frontend[1])
    p["latency"]["sched_base_ms"] = float(step_overhead_ms)
    return p
