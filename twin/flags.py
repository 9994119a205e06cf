"""The vLLM engine flags the twin models: one declaration, one validator (cf. vLLM's ``LoRAConfig``
and ``SchedulerConfig`` in ``vllm/config/``).

:class:`EngineFlags` declares every flag once -- the ``vllm serve`` name, the allowed values and
vLLM's default in the docstring under each field -- and :meth:`EngineFlagChecks.validate` holds
every check on them, the per-field ones and the cross-field rules vLLM enforces at start-up
(``max_cpu_loras >= max_loras``, ``max_num_batched_tokens >= max_num_seqs``).  A flag left None
is unset (vLLM's, or the profile's, default applies) and is not checked: the rules compare the
flags a file sets, not the profile's defaults filled in later (``Scenario.resolved_engine``).

Four places hold engine flags, each in the form its file has always had (their YAML/JSON keys are
part of the user-facing formats and do not change):

* a scenario's ``engine:`` section -- ``twin.scenario.EngineConfig``, *is* ``EngineFlags`` plus the
  twin's adapter-cache eviction policy (a what-if knob, not a vLLM flag);
* a placement's per-GPU flags -- ``lora_opt.placement.plan.GPUConfig``, *is* ``EngineFlags`` with
  every flag required (placement.json pins them all so launch never depends on a vLLM default);
* a profile's ``defaults:`` -- ``twin.profile.EngineDefaults``, and a workload's ``engine:`` --
  ``lora_opt.placement.workload_file.PlacementEngine``: *typed subsets* (only the flags a profile
  gives defaults for / the flags every GPU of a placement shares, with concrete defaults).  They
  cannot subclass ``EngineFlags``, whose other fields would become keys of their files; they
  inherit :class:`EngineFlagChecks` instead, so the same validator checks whichever flags they have.
  ``tests/test_flags.py`` keeps every subset's fields a subset of ``EngineFlags``'s.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from twin.errors import ScenarioError
from twin.parsing import check_choice

#: ``--max-lora-rank`` values vLLM accepts (``MaxLoRARanks`` in ``vllm/config/lora.py``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: integer flags that must be >= 1 when set, in the order they are checked
_AT_LEAST_ONE = ("max_loras", "max_num_seqs", "max_num_batched_tokens", "max_cpu_loras", "max_model_len")


_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)")


def release_key(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.32.0+cpu``, ``0.8.5``, ``v0.33.0``), or None when it
    is not one (``unreachable``, ``HTTP 404``, ``?``): the one parser of vLLM versions (launch flags,
    admission rules, the emulator's imitated release)."""
    m = _RELEASE.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


class EngineFlagChecks:
    """The validator of :class:`EngineFlags` and of every typed subset of it (a mixin: the checks
    use the flags the class has and skip unset ones)."""

    def _flag(self, name: str):
        """The flag's value; None when unset or when this subset does not have it."""
        return getattr(self, name, None)

    def validate(self, where: str = "engine", error: type[Exception] = ScenarioError) -> None:
        """Raise ``error`` naming the first bad flag as ``<where>.<flag>``; checks, in order:
        max_lora_rank is one of ``VLLM_LORA_RANKS``; max_loras, max_num_seqs, max_num_batched_tokens,
        max_cpu_loras, max_model_len >= 1; max_cpu_loras >= max_loras; gpu_memory_utilization in
        (0, 1]; max_num_batched_tokens >= max_num_seqs."""
        flag = self._flag
        if flag("max_lora_rank") is not None:
            check_choice(flag("max_lora_rank"), VLLM_LORA_RANKS, f"{where}.max_lora_rank", error)
        for name in _AT_LEAST_ONE:
            v = flag(name)
            if v is not None and v < 1:
                raise error(f"{where}.{name}: must be >= 1, got {v}")
        cpu, loras = flag("max_cpu_loras"), flag("max_loras")
        if cpu is not None and loras is not None and cpu < loras:
            raise error(f"{where}.max_cpu_loras: {cpu} must be >= max_loras {loras} "
                        "(vLLM: 'max_cpu_loras must be >= max_loras')")
        util = flag("gpu_memory_utilization")
        if util is not None and not 0 < util <= 1:
            raise error(f"{where}.gpu_memory_utilization: must be in (0, 1], got {util}")
        tokens, seqs = flag("max_num_batched_tokens"), flag("max_num_seqs")
        if tokens is not None and seqs is not None and tokens < seqs:
            raise error(f"{where}.max_num_batched_tokens: {tokens} must be >= max_num_seqs {seqs} "
                        "(vLLM refuses to start: 'max_num_batched_tokens must be greater than or "
                        "equal to max_num_seqs')")


def max_lora_rank_for(ranks) -> int:
    """``--max-lora-rank`` for adapters of these ranks: the smallest of ``VLLM_LORA_RANKS`` >= every
    rank.  The one definition (a scenario's default, a placement's GPU flags, a surrogate grid point,
    the emulator's flags; ``tests/test_one_owner.py`` keeps it so)."""
    top = max(ranks)
    for allowed in VLLM_LORA_RANKS:
        if allowed >= top:
            return allowed
    raise ScenarioError(f"adapter rank {top}: above vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]} "
                        f"(allowed values: {list(VLLM_LORA_RANKS)})")


def check_rank(rank: int, where: str, error: type[Exception] = ScenarioError) -> None:
    """A LoRA rank vLLM can serve: 1..the largest ``--max-lora-rank`` value."""
    if not 1 <= rank <= max(VLLM_LORA_RANKS):
        raise error(f"{where}: {rank} outside 1..{max(VLLM_LORA_RANKS)} "
                    f"(vLLM's max_lora_rank values: {list(VLLM_LORA_RANKS)})")


@dataclass(frozen=True)
class EngineFlags(EngineFlagChecks):
    """The flags of one vLLM instance that the twin models (same names as ``vllm serve``);
    None = unset: the profile's default for this (model, GPU, vLLM version) applies."""

    max_loras: int | None = None
    """``--max-loras``: GPU adapter slots (A_max), >= 1.  vLLM's default: 1."""
    max_lora_rank: int | None = None
    """``--max-lora-rank``: one of vLLM's allowed values 1 8 16 32 64 128 256 320 512; >= every
    adapter's rank.  vLLM's default: 16 (a scenario's default: the smallest allowed value that
    holds every adapter)."""
    max_cpu_loras: int | None = None
    """``--max-cpu-loras``: CPU adapter cache, >= max_loras.  vLLM's default: max_loras."""
    max_num_seqs: int | None = None
    """``--max-num-seqs``: cap on running requests, >= 1.  vLLM's default depends on the GPU and
    the entry point (the profile records it)."""
    max_num_batched_tokens: int | None = None
    """``--max-num-batched-tokens``: token budget of one step (chunked prefill), >= 1 and >=
    max_num_seqs (vLLM refuses to start otherwise).  vLLM's default depends on the GPU and the
    entry point (the profile records it)."""
    gpu_memory_utilization: float | None = None
    """``--gpu-memory-utilization``: fraction of device memory vLLM may use, in (0, 1].  vLLM's
    default: 0.9 (0.92 in 0.33)."""
    max_model_len: int | None = None
    """``--max-model-len``, >= 1.  vLLM's default: the model's context; start-up needs KV cache
    for one request of this length."""
