"""vLLM's own rules for the engine flags it derives from others, and the combination it refuses at
start-up, per release -- each as that release's source states it -- looked up by a profile's
``vllm_version`` (:func:`flag_rules`, ``Profile.flag_rules``), as ``lora_opt.placement.vllm_launch``
looks up a release's ``vllm serve`` arguments.  ``twin.flags.resolve_flags`` applies them after the
profile's defaults (the release's per-GPU table: ``Profile.flag_defaults``).

What every release does (file:line in that release's source; ``tests/test_flag_rules.py`` checks
each rule against these lines):

* an unset ``max_num_batched_tokens`` without chunked prefill is at least ``max_model_len`` -- 0.5.0
  ``vllm/config.py:705``, 0.8.5 ``vllm/config.py:1983`` (V0; V1 always chunks), 0.32
  ``vllm/engine/arg_utils.py:3142``, 0.33 ``vllm/engine/arg_utils.py:3196``;
* ``max_num_batched_tokens < max_num_seqs`` is refused, whichever of the two was set or defaulted
  (``SchedulerConfig``) -- 0.5.0 ``vllm/config.py:731``, 0.8.5 ``vllm/config.py:2033``
  (``_verify_args``), 0.32 ``vllm/config/scheduler.py:328``, 0.33 ``vllm/config/scheduler.py:331``
  (``verify_max_model_len``).

From 0.32 on (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``) two more:

* an unset budget is at most ``max_num_seqs x max_model_len`` -- 0.32 ``arg_utils.py:3167``, 0.33
  ``arg_utils.py:3221``;
* an unset ``max_num_seqs`` is at most the budget, so a small explicit budget lowers it rather than
  being refused -- 0.32 ``arg_utils.py:3180``, 0.33 ``arg_utils.py:3234``.

0.5.0 and 0.8.5 take their defaults as they are (0.5.0: ``EngineArgs.max_num_seqs = 256``,
``vllm/engine/arg_utils.py:50``; 0.8.5: ``EngineArgs._set_default_args_v1``,
``vllm/engine/arg_utils.py:1612-1621``): an explicit budget below the default ``max_num_seqs``, or an
explicit ``max_num_seqs`` above the default budget, is refused.

Known gap: vLLM 0.5.0's own default budget is ``max(max_model_len, 2048)``; the Llama-2 profile
records 4,096 (its value at the model's 4,096-token context), so with a ``max_model_len`` set below
4,096 the twin keeps 4,096 where vLLM 0.5.0 takes ``max(max_model_len, 2048)``.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from twin.errors import ScenarioError
from twin.flags import release_key


@dataclass(frozen=True)
class FlagRules:
    """How one vLLM release fills the flags it derives from others, and where in its source."""

    release: str
    """The release whose source these rules were read from (``0.8.5``; matched by major.minor)."""
    caps_default_budget: bool
    """An unset ``max_num_batched_tokens`` is at most ``max_num_seqs x max_model_len``."""
    clamps_default_seqs: bool
    """An unset ``max_num_seqs`` is at most ``max_num_batched_tokens``."""
    source: str
    """Where the release's source states its rules (the refusal first)."""
    chunked_prefill: bool = True
    """The profile's: without chunked prefill an unset budget is at least ``max_model_len``."""

    def derive(self, given: dict[str, Any], out: dict[str, Any]) -> None:
        """Apply the derived defaults to ``out`` (every flag already taken from the file or the
        profile's defaults; ``given``: the flags as set, None = unset), in the release's order."""
        seqs, tokens, model_len = (out.get(n) for n in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
        if given.get("max_num_batched_tokens", 0) is None and tokens is not None and model_len is not None:
            if not self.chunked_prefill:
                tokens = max(model_len, tokens)
            if self.caps_default_budget and seqs is not None:
                tokens = min(seqs * model_len, tokens)
            out["max_num_batched_tokens"] = tokens
        if given.get("max_num_seqs", 0) is None and self.clamps_default_seqs and None not in (seqs, tokens):
            out["max_num_seqs"] = min(seqs, tokens)

    def refuse(self, given: dict[str, Any], out: dict[str, Any], where: str = "engine") -> None:
        """ScenarioError, naming the field, when vLLM would refuse the resolved flags at start-up."""
        seqs, tokens = out.get("max_num_seqs"), out.get("max_num_batched_tokens")
        if seqs is None or tokens is None or tokens >= seqs:
            return

        def how(name: str) -> str:
            return "" if given.get(name) is not None else " (the profile's default)"
        raise ScenarioError(f"{where}.max_num_batched_tokens: {tokens}{how('max_num_batched_tokens')} < max_num_seqs "
                            f"{seqs}{how('max_num_seqs')}: vLLM {self.release} refuses to start ('max_num_batched_tokens "
                            f"must be greater than or equal to max_num_seqs', {self.source}); set both")


#: vLLM release (major, minor) -> its rules; the refusal's line first, then the derived defaults'
RULES = {
    (0, 5): FlagRules("0.5.0", False, False, "vllm/config.py:731; defaults vllm/config.py:705, "
                                             "vllm/engine/arg_utils.py:50"),
    (0, 8): FlagRules("0.8.5", False, False, "vllm/config.py:2033; defaults vllm/engine/arg_utils.py:1612-1621"),
    (0, 32): FlagRules("0.32.0", True, True, "vllm/config/scheduler.py:328; defaults vllm/engine/arg_utils.py:3136-3180"),
    (0, 33): FlagRules("0.33.0", True, True, "vllm/config/scheduler.py:331; defaults vllm/engine/arg_utils.py:3190-3234"),
}


@functools.lru_cache(maxsize=None)
def flag_rules(vllm_version: str, chunked_prefill: bool = True, where: str = "vllm_version") -> FlagRules:
    """The rules of the release ``vllm_version`` names (``0.8.5``, ``0.32.0+cpu``, ``0.33``); a
    ScenarioError naming ``where`` for a release lora-opt has not read."""
    rules = RULES.get(release_key(vllm_version))
    if rules is None:
        raise ScenarioError(f"{where}: {vllm_version!r}: lora-opt knows vLLM's flag rules of "
                            f"{', '.join(r.release for r in RULES.values())} (by major.minor)")
    return rules if rules.chunked_prefill == chunked_prefill else dataclasses.replace(rules, chunked_prefill=chunked_prefill)
