"""The vLLM engine flags the twin models: one declaration, one validator (cf. vLLM's ``LoRAConfig``
and ``SchedulerConfig`` in ``vllm/config/``).

:class:`EngineFlags` declares every flag once -- the ``vllm serve`` name, the allowed values and
vLLM's default in the docstring under each field -- and :meth:`EngineFlagChecks.validate` holds
every check on them, the per-field ones and the cross-field rules vLLM enforces at start-up
(``max_cpu_loras >= max_loras``, ``max_num_batched_tokens >= max_num_seqs``).  A flag left None
is unset (vLLM's, or the profile's, default applies) and is not checked.  :func:`resolve_flags` is the
one resolution of unset flags -- the defaults of a (model, GPU, vLLM version), then the release's
own rules for the flags it derives from others and its refusal (``twin.flag_rules``) -- and every
resolved set of flags (a scenario's ``Scenario.resolved_engine``, a placement's per-GPU
``policies.base.gpu_config``) comes from it; ``Profile.startup_check`` takes the resolved flags
object and the kernel's ``Config`` starts with :data:`KERNEL_FLAGS`; :func:`flag_values` is the one
walk over the flags (resolution, per-GPU flags, launch commands), so a field added to
:class:`EngineFlags` reaches all of them (``tests/test_extension_points.py``).

Four places hold engine flags, each in the form its file has always had (their YAML/JSON keys are
part of the user-facing formats and do not change):

* a scenario's ``engine:`` section -- ``twin.scenario.EngineConfig``, *is* ``EngineFlags`` plus the
  twin's adapter-cache eviction policy (a what-if knob, not a vLLM flag);
* a placement's per-GPU flags -- ``lora_opt.placement.plan.GPUConfig``, *is* ``EngineFlags`` with
  every flag required (placement.json pins them all so launch never depends on a vLLM default);
* a workload's ``engine:`` -- ``lora_opt.placement.workload_file.PlacementEngine``, *is*
  ``EngineFlags`` with the surrogates' concrete defaults, less :data:`PER_INSTANCE_FLAGS` (a policy
  chooses those per GPU; a workload file setting one is refused);
* a profile's ``defaults:`` -- ``twin.profile.EngineDefaults``: a *typed subset* (only the flags a
  profile records defaults for).  It cannot subclass ``EngineFlags``, whose other fields would
  become keys of profile files; it inherits :class:`EngineFlagChecks` instead, so the same validator
  checks whichever flags it has.  ``tests/test_flags.py`` keeps its fields a subset of ``EngineFlags``'s.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from twin.errors import ScenarioError
from twin.parsing import check_choice

#: ``--max-lora-rank`` values vLLM accepts (``MaxLoRARanks`` in ``vllm/config/lora.py``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: the flags chosen for each instance from the adapters it serves -- A_max, the rank that holds them,
#: the CPU cache -- by a placement policy or a surrogate grid point: a workload's or a grid's shared
#: ``engine:`` section cannot set them
PER_INSTANCE_FLAGS = ("max_loras", "max_lora_rank", "max_cpu_loras")

#: integer flags that must be >= 1 when set, in the order they are checked
_AT_LEAST_ONE = ("max_loras", "max_num_seqs", "max_num_batched_tokens", "max_cpu_loras", "max_model_len")


_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)")


def release_key(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.32.0+cpu``, ``0.8.5``, ``v0.33.0``), or None when it
    is not one (``unreachable``, ``HTTP 404``, ``?``): the one parser of vLLM versions (launch flags,
    admission rules, the emulator's imitated release)."""
    m = _RELEASE.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


#: the vLLM release (major.minor) lora-opt targets when neither ``--vllm-version`` nor the profile
#: names one it knows: launch commands are written for it (``lora_opt.placement.vllm_launch``) and the
#: emulator imitates it (``lora_opt.emulate.vllm_versions``) -- the newest release lora-opt has read
DEFAULT_VLLM_VERSION = "0.33"


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


def engine_flag(*, kernel: bool = False, vllm_default: Any = None) -> Any:
    """An :class:`EngineFlags` field (default None: unset) and what the rest of lora-opt reads off its
    declaration: ``kernel`` -- the engine kernel reads it (:data:`KERNEL_FLAGS`, ``twin.engine_state.Config``);
    ``vllm_default`` -- its value when neither the file nor the profile's defaults give one (a flag whose
    default is the same on every GPU and release; the others' come from the profile)."""
    return dataclasses.field(default=None, metadata={"kernel": kernel, "vllm_default": vllm_default})


@dataclass(frozen=True)
class EngineFlags(EngineFlagChecks):
    """The flags of one vLLM instance that the twin models (same names as ``vllm serve``);
    None = unset: the profile's default for this (model, GPU, vLLM version) applies.  A flag is
    declared here once, last (``GPUConfig`` makes the ones before it required again), with
    :func:`engine_flag` when the kernel reads it or it has a default of its own."""

    max_loras: int | None = engine_flag(kernel=True)
    """``--max-loras``: GPU adapter slots (A_max), >= 1.  vLLM's default: 1."""
    max_lora_rank: int | None = None
    """``--max-lora-rank``: one of vLLM's allowed values 1 8 16 32 64 128 256 320 512; >= every
    adapter's rank.  vLLM's default: 16 (a scenario's default: the smallest allowed value that
    holds every adapter)."""
    max_cpu_loras: int | None = engine_flag(kernel=True)
    """``--max-cpu-loras``: CPU adapter cache, >= max_loras.  vLLM's default: max_loras."""
    max_num_seqs: int | None = engine_flag(kernel=True)
    """``--max-num-seqs``: cap on running requests, >= 1.  vLLM's default depends on the GPU and
    the entry point (the profile records it)."""
    max_num_batched_tokens: int | None = engine_flag(kernel=True)
    """``--max-num-batched-tokens``: token budget of one step (chunked prefill), >= 1 and >=
    max_num_seqs (vLLM refuses to start otherwise).  vLLM's default depends on the GPU and the
    entry point (the profile records it)."""
    gpu_memory_utilization: float | None = None
    """``--gpu-memory-utilization``: fraction of device memory vLLM may use, in (0, 1].  vLLM's
    default: 0.9 (0.92 in 0.33)."""
    max_model_len: int | None = None
    """``--max-model-len``, >= 1.  vLLM's default: the model's context; start-up needs KV cache
    for one request of this length."""


FlagsT = TypeVar("FlagsT", bound=EngineFlags)
_FIELDS = {f.name: f for f in dataclasses.fields(EngineFlags)}

#: the flags the engine kernel reads, in :class:`EngineFlags`' order: the first fields of its
#: ``twin.engine_state.Config`` (the one list; a flag declared with ``engine_flag(kernel=True)`` joins it)
KERNEL_FLAGS = tuple(name for name, f in _FIELDS.items() if f.metadata.get("kernel"))


def flag_type(name: str) -> type:
    """The Python type of flag ``name``'s values: ``float`` or ``int`` (every flag is one of them)."""
    return float if "float" in str(_FIELDS[name].type) else int


def flag_values(flags) -> dict[str, Any]:
    """Flag name -> value of every :class:`EngineFlags` field ``flags`` has (``EngineFlags``, a
    subclass, or a typed subset such as ``EngineDefaults``), in ``EngineFlags``' field order: the one
    walk over the flags."""
    return {f.name: getattr(flags, f.name) for f in dataclasses.fields(EngineFlags) if hasattr(flags, f.name)}


def serve_option(name: str) -> str:
    """``vllm serve``'s spelling of flag ``name``: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def shared_flags(flags) -> dict[str, Any]:
    """:func:`flag_values` less :data:`PER_INSTANCE_FLAGS`: the flags every instance of a placement
    (or every point of a surrogate grid) shares."""
    return {name: value for name, value in flag_values(flags).items() if name not in PER_INSTANCE_FLAGS}


def resolve_flags(flags: FlagsT, defaults: Mapping[str, Any], rules) -> FlagsT:
    """``flags`` (of its own type) with every unset flag filled in, as vLLM fills them at start-up:

    1. a flag ``defaults`` has a value for takes it (a profile's defaults for its model, GPU and
       vLLM version: ``Profile.flag_defaults``), else its declared ``vllm_default`` (:func:`engine_flag`);
    2. ``max_cpu_loras``: ``max_loras`` (vLLM's ``LoRAConfig``);
    3. the release's derived defaults -- ``rules``: a ``twin.flag_rules.FlagRules``
       (``Profile.flag_rules``): a defaulted budget without chunked prefill at least ``max_model_len``;
       from vLLM 0.32 on, a defaulted budget at most ``max_num_seqs x max_model_len`` and a
       defaulted ``max_num_seqs`` at most the budget;
    4. the release's refusal: ``max_num_batched_tokens < max_num_seqs`` after 1-3 is a ScenarioError
       naming ``engine.max_num_batched_tokens`` (an explicit pair is refused earlier, where the file is
       read: :meth:`EngineFlagChecks.validate`).

    A flag with no value anywhere stays None."""
    given = flag_values(flags)
    out = {name: value if value is not None else _default(name, defaults) for name, value in given.items()}
    if given.get("max_cpu_loras", 0) is None:
        out["max_cpu_loras"] = out.get("max_loras")
    rules.derive(given, out)
    rules.refuse(given, out)
    return dataclasses.replace(flags, **out)


def _default(name: str, defaults: Mapping[str, Any]) -> Any:
    value = defaults.get(name)
    return _FIELDS[name].metadata.get("vllm_default") if value is None else value

