"""Placement policies behind one interface (``PlacementPolicy``); ``POLICIES`` names them all."""
from __future__ import annotations

from lora_opt.placement.policies.base import (ORACLE_FILES, Assignment, GPUAssignment, PlacementContext,
                                              PlacementPolicy, startup_failures)
from lora_opt.placement.policies.baselines import DLoRA, DLoRACapped, LoRAServe, LoRAServeCapped
from lora_opt.placement.policies.greedy import Greedy, GreedyFast, GreedyPlus
from twin.errors import ScenarioError

POLICIES: dict[str, type[PlacementPolicy]] = {
    cls.name: cls for cls in (GreedyPlus, Greedy, GreedyFast, DLoRA, LoRAServe, DLoRACapped, LoRAServeCapped)
}
DEFAULT_POLICY = "greedy-plus"


def get_policy(name: str, **options) -> PlacementPolicy:
    """An instance of the named policy (options go to its constructor)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ScenarioError(f"policy: {name!r} is not a policy; allowed values: {', '.join(POLICIES)}")
    return cls(**options)


__all__ = ["POLICIES", "DEFAULT_POLICY", "ORACLE_FILES", "get_policy", "PlacementPolicy", "PlacementContext", "Assignment",
           "GPUAssignment", "startup_failures"]
