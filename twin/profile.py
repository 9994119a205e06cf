"""Hardware/model profiles: everything the twin knows about one (model, GPU, vLLM version).

A profile is a YAML file (bundled ones live in ``configs/profiles/``).  Every number in it is
either a model dimension (from the model's ``config.json``) or a constant fitted on real
measurements by ``lora-opt calibrate``; the ``fit`` section records which data and command.

The estimators defined here are the only place where time and memory are computed:

* :meth:`Profile.kv_capacity_tokens` -- vLLM's start-up memory accounting (§2 of the reference).
* :meth:`LatencySpec.model_ms`      -- forward-pass time of one engine step.
* :meth:`LatencySpec.scheduler_ms`  -- CPU time of ``schedule()`` for one step.
* :meth:`LoadingSpec.cpu_to_gpu_ms` / :meth:`LoadingSpec.disk_to_cpu_ms` -- adapter loads.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.errors import ScenarioError
from twin.flag_rules import FlagRules, flag_rules
from twin.flags import VLLM_LORA_RANKS, EngineFlagChecks, EngineFlags, flag_values  # noqa: F401 - VLLM_LORA_RANKS: callers import it from here
from twin.parsing import read_config_file
from twin.paths import bundled_names, resolve_bundled

GIB = 1024**3
MIB = 1024**2

#: How a profile prices LoRA (``LoraOverheadSpec.form``): ``factor`` = the papers' factor on the step (plus the
#: CPU build's per-token terms), ``additive`` = ms per step, slot, distinct adapter, sequence and token, no factor.
LORA_FORMS = ("factor", "additive")

#: How a profile prices a ``max_lora_rank`` it has no entry for (``LatencySpec.lora_rank_rule``): the nearest
#: rank's entry, or every cost term linear in the rank through the two nearest entries.
LORA_RANK_RULES = ("nearest", "linear")
#: the LoRA terms ``linear`` interpolates (and extrapolates, never below 0)
_RANK_LINEAR_FIELDS = ("jump", "slope", "step_ms", "slot_ms", "adapter_ms", "seq_ms", "token_ms")

#: Which requests define the "LoRA set" the scheduler's gate compares with ``max_loras``.
#: 0.8.5 used the adapters of requests *scheduled* in this step; 0.33 uses all *running* requests.
LORA_SET_RULES = ("scheduled", "running")


@dataclass(frozen=True)
class ModelSpec:
    """Model dimensions, as in the model's ``config.json``."""

    name: str
    """Hugging Face id of the base model."""
    hidden_size: int
    """h: hidden size."""
    intermediate_size: int
    """I: MLP intermediate size."""
    num_layers: int
    """L: decoder layers."""
    num_heads: int
    """Attention heads (q = num_heads * head_dim)."""
    num_kv_heads: int
    """KV heads (GQA)."""
    head_dim: int
    """Per-head dimension."""
    vocab_size: int
    """V: vocabulary size."""
    max_model_len: int
    """Default ``--max-model-len`` (the model's context); start-up needs KV for one such request."""
    dtype_bytes: int = 2
    """Bytes per weight/KV element (bf16 = 2)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 * L * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def lora_elements_per_rank(self) -> int:
        """Elements of one LoRA slot per unit of rank, default target modules, TP=1.

        ``L*(7h + 2q + 2kv + 3I) + 2V + 2h`` (reference §2.2: qkv, o, gate_up, down in every
        layer plus embed_tokens and lm_head).
        """
        h, inter = self.hidden_size, self.intermediate_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.num_layers * (7 * h + 2 * q + 2 * kv + 3 * inter) + 2 * self.vocab_size + 2 * h


@dataclass(frozen=True)
class MemorySpec:
    """vLLM's start-up memory accounting for one GPU."""

    gpu_memory_gib: float
    """Total device memory as vLLM sees it (the papers' H100 reports 63.43 GiB)."""
    weights_gib: float
    """Base model weights in GPU memory."""
    non_kv_overhead_gib: float
    """Activation peak of the profiling run + non-torch memory (+ CUDA graphs where the version
    subtracts them), at ``max_num_batched_tokens = 2048``."""
    overhead_gib_per_1k_batched_tokens: float = 0.0
    """Growth of the activation peak per 1000 tokens of ``max_num_batched_tokens`` above 2048."""
    overhead_ref_max_num_seqs: int = 2048
    """``max_num_seqs`` at which ``non_kv_overhead_gib`` was measured."""
    overhead_gib_per_1k_seqs: float = 0.0
    """Growth of the profiling run's peak per 1000 ``max_num_seqs`` above ``seqs_knee`` (the
    sampler's ``[max_num_seqs, vocab]`` fp32 tensors outgrow the forward pass's activations)."""
    seqs_knee: float = 0.0
    """``max_num_seqs`` below which the sampler does not set the peak."""
    slot_fixed_mib: float = 0.0
    """Bytes per LoRA slot that do not scale with rank (0.8.5: extra-vocab rows and a residual)."""
    slot_rank_scale: float = 1.0
    """Multiplier on the code-derived per-rank slot size (1.0 = exactly vLLM's buffer shapes)."""
    block_size: int = 16
    """KV block size in tokens."""
    kv_cache_gib: float = 0.0
    """A KV cache of this fixed size (GiB), whatever the weights, LoRA slots and utilisation leave:
    vLLM's CPU build allocates ``VLLM_CPU_KVCACHE_SPACE`` GiB.  0 = a GPU's start-up accounting."""


def lora_extra(jump, slope, n_sat, n_distinct):
    """The LoRA cost factor's extra part, ``jump + slope*n/(1 + n/n_sat)``, for ``n_distinct`` >= 1
    distinct adapters in a batch (a step's LoRA factor is ``1 + extra``).  The one definition: the
    profile's estimator, the calibration fits and the engine kernel (compiled with Numba) call it;
    floats or numpy arrays."""
    return jump + slope * n_distinct / (1.0 + n_distinct / n_sat)


def lora_prefill_share(share, share_above, knee_tokens, n_tokens):
    """The share of the LoRA extra a step's prefill tokens pay (the factor form), stepping up at the knee
    (``twin.engine_cost.step_seconds``): ``share`` in a step of up to ``knee_tokens`` tokens, ``share_above``
    in a larger one.  The one definition: the profile's estimator and the engine kernel (compiled with
    Numba) call it."""
    return share if n_tokens <= knee_tokens else share_above


def lora_token_cost(token_ms, token_ms_above, knee_tokens, n_tokens):
    """LoRA ms of a step's ``n_tokens`` tokens (the per-token form, vLLM's CPU build: one copy of the
    adapter's matrices gathered per token): ``token_ms`` for each token up to ``knee_tokens``,
    ``token_ms_above`` for each beyond -- a hinge, continuous at the knee.  The gathered copies leave the
    cache a token at a time, so a step one token past the knee costs one dearer token more, not all its
    tokens at the dearer rate: the probe's lone prompts at rank 32 cost 1.6 / 2.7 / 3.9 / 5.7 ms a token
    at 128 / 256 / 384 / 512 tokens, a ramp (issue 24; a step priced a 256-token prompt 48 % high).  The
    one definition: the profile's estimator and the engine kernel (compiled with Numba) call it."""
    if n_tokens <= knee_tokens:
        return token_ms * n_tokens
    return token_ms * knee_tokens + token_ms_above * (n_tokens - knee_tokens)


@dataclass(frozen=True)
class LoraOverheadSpec:
    """Cost of LoRA kernels on the forward pass, in one of two forms (``form``).

    ``factor`` (the papers' form, plus vLLM's CPU build's cost per token):

    ``extra(n, A) = jump * (1 - slot_share + slot_share * A / ref_max_loras)
    + slope * n / (1 + n / n_sat)`` for n >= 1 distinct adapters in the batch and A = max_loras
    slots (0 for n = 0).  The per-sequence (decode) part of a step is multiplied by ``1 + extra``,
    prefill tokens by ``1 + prefill_share * extra`` (``prefill_share_above`` in a step of more than
    ``prefill_knee_tokens`` tokens).  ``n_sat = inf`` is the papers' linear model.  A step with an
    adapter also pays ``token_ms`` per token it carries (``token_ms_above`` for each beyond the knee).

    ``additive`` (the H100 profiles since issue 36): no factor; a step with an adapter pays
    ``step_ms + slot_ms * A + adapter_ms * n + seq_ms * sequences + token_ms * tokens`` ms -- fitted on the
    end-to-end fit half, where the factor form priced a 1-sequence step's LoRA 1.5x and a 60-sequence step's
    0.6x what the real runs show (``lora_opt.calibration.additive_fit``).
    """

    jump: float
    """Relative extra cost of the first adapter, measured at ``ref_max_loras`` slots."""
    slope: float
    """Relative extra cost per further distinct adapter, at small n."""
    n_sat: float = math.inf
    """Saturation scale of the per-adapter cost (inf = linear)."""
    ref_max_loras: float = 300.0
    """``max_loras`` of the runs ``jump`` was measured on."""
    slot_share: float = 0.0
    """Share of ``jump`` that scales with the number of slots (vLLM 0.8.5's kernels are launched
    over all ``max_loras`` slots); 0 = independent of slots."""
    prefill_share: float = 1.0
    """Share of the LoRA extra cost paid by prefill tokens (compute-bound GEMMs hide part of it);
    1 = the papers' model, the whole step is multiplied."""
    prefill_knee_tokens: float = math.inf
    """Tokens in a step above which its prefill tokens pay ``prefill_share_above`` instead of
    ``prefill_share``, and each token beyond it ``token_ms_above`` instead of ``token_ms`` (vLLM's CPU build: about 6,000 / ``max_lora_rank`` on a 32 MiB L3, where the
    per-token adapter gather leaves the cache); inf = one share (every GPU profile)."""
    prefill_share_above: float | None = None
    """``prefill_share`` in a step above ``prefill_knee_tokens`` tokens (None = ``prefill_share``)."""
    token_ms: float = 0.0
    """LoRA ms per token of a step (decode or prefill), added to a step that runs an adapter, whatever
    its size: vLLM's CPU build gathers one copy of the adapter's matrices per token, so its LoRA cost
    grows with the step's tokens and the rank, and a factor on the step (``jump``) prices a small batch
    several times too high (measured: issue 24, ``experiments/real_validation/cpu/REPORT.md``).  0 =
    the factor form only."""
    token_ms_above: float | None = None
    """LoRA ms of each token of a step beyond its first ``prefill_knee_tokens`` (None = ``token_ms``):
    the cost is continuous at the knee (:func:`lora_token_cost`)."""
    step_ms: float = 0.0
    """LoRA ms of a step that runs an adapter, whatever its size: vLLM's CPU build pays ~5 ms a step for
    its LoRA layers at rank 16 even at one sequence (measured: decode windows at 1-32 sequences, issue
    24), which per-token pricing fitted at 16 sequences puts on the tokens -- too little for one
    sequence, too much for forty.  0 = none (every GPU profile)."""
    slot_ms: float = 0.0
    """LoRA ms of a step that runs an adapter, per ``max_loras`` slot (the additive form: vLLM 0.8.5's
    LoRA kernels are launched over every slot, used or not).  0 = none."""
    adapter_ms: float = 0.0
    """LoRA ms of a step per distinct adapter it runs (the additive form: each adapter's A and B matrices
    are read once a step, whatever its batch).  The papers' factor form prices the same adapters in
    proportion to the step's decode time instead (``slope``), which an H100 step of 1 or 600 sequences
    does not show (issue 36: ``experiments/fidelity/report.md``).  0 = none."""
    form: str = "factor"
    """How LoRA is priced (of :data:`LORA_FORMS`): ``factor`` -- ``jump`` / ``slope`` multiply the step (the
    papers' form); ``additive`` -- no factor (``jump`` and ``slope`` are kept as the estimator fitted them but
    not used), only the ms terms below (``step_ms``, ``slot_ms``, ``adapter_ms``, ``seq_ms``, ``token_ms``)."""
    seq_ms: float = 0.0
    """LoRA ms per sequence of a step that runs an adapter (the additive form: a decode token's LoRA
    cost beyond ``token_ms``, which every token pays; prefill tokens are compute-bound GEMMs where the
    LoRA matrices cost relatively less).  0 = none."""

    def fixed_ms_at(self, max_loras: int) -> float:
        """LoRA ms of any step that runs an adapter, whatever its tokens and adapters: ``step_ms`` plus
        ``slot_ms`` for each of ``max_loras`` slots."""
        return self.step_ms + self.slot_ms * max_loras

    @property
    def token_above(self) -> float:
        return self.token_ms if self.token_ms_above is None else self.token_ms_above

    def token_cost(self, n_tokens: int) -> float:
        """LoRA ms of a step's ``n_tokens`` tokens (:func:`lora_token_cost`)."""
        return lora_token_cost(self.token_ms, self.token_above, self.prefill_knee_tokens, n_tokens)

    @property
    def share_above(self) -> float:
        return self.prefill_share if self.prefill_share_above is None else self.prefill_share_above

    def prefill_share_at(self, n_tokens: int) -> float:
        return lora_prefill_share(self.prefill_share, self.share_above, self.prefill_knee_tokens, n_tokens)

    def __post_init__(self):
        if self.form not in LORA_FORMS:
            raise ScenarioError(f"latency.lora.form: {self.form!r} not in {list(LORA_FORMS)}")

    @property
    def additive(self) -> bool:
        return self.form == "additive"

    def jump_at(self, max_loras: int) -> float:
        if self.additive:
            return 0.0
        return self.jump * (1.0 - self.slot_share + self.slot_share * max_loras / self.ref_max_loras)

    def extra(self, n_adapters: int, max_loras: int) -> float:
        if n_adapters <= 0 or self.additive:
            return 0.0
        return lora_extra(self.jump_at(max_loras), self.slope, self.n_sat, n_adapters)


@dataclass(frozen=True)
class LatencySpec:
    """Step-time estimators (milliseconds)."""

    base_ms: float
    """Fixed cost of a forward pass."""
    per_seq_ms: float
    """Cost per sequence in the step (a decode is one sequence with one token)."""
    per_token_ms: float
    """Cost per token beyond one per sequence (prefill chunks)."""
    per_ctx_ktoken_ms: float = 0.0
    """Attention cost per 1000 tokens of context (KV already computed) of scheduled sequences."""
    lora: dict[int, LoraOverheadSpec] = field(default_factory=dict)
    """LoRA overhead by ``max_lora_rank``; the nearest rank is used when one is missing."""
    ttft_frontend_ms: float = 0.0
    """Time the front end (API server, IPC, detokenizer, streaming) adds to every first token."""
    ttft_frontend_per_running_ms: float = 0.0
    """Front-end time per running request when the first token comes out (every running request
    streams a chunk per step through the same API server)."""
    sched_base_ms: float = 0.0
    """Scheduler CPU time per step."""
    sched_per_running_ms: float = 0.0
    """Scheduler time per running request."""
    sched_per_waiting_ms: float = 0.0
    """Scheduler time per waiting request the admission loop visits (vLLM's Python scheduler walks
    the waiting queue past every request the LoRA gate skips)."""
    lora_rank_rule: str = "nearest"
    """How a ``max_lora_rank`` without a ``lora`` entry is priced (of :data:`LORA_RANK_RULES`): ``nearest`` -- the
    nearest rank's entry; ``linear`` -- each cost term (``jump``, ``slope`` and the additive form's ms) on the
    line through the two nearest ranks' entries (beyond the last, extrapolated; never below 0)."""

    def __post_init__(self):
        if self.lora_rank_rule not in LORA_RANK_RULES:
            raise ScenarioError(f"latency.lora_rank_rule: {self.lora_rank_rule!r} not in {list(LORA_RANK_RULES)}")

    def lora_for_rank(self, max_lora_rank: int) -> LoraOverheadSpec:
        if not self.lora:
            return LoraOverheadSpec(0.0, 0.0)
        if max_lora_rank in self.lora:
            return self.lora[max_lora_rank]
        by_distance = sorted(self.lora, key=lambda r: (abs(r - max_lora_rank), r))
        nearest = self.lora[by_distance[0]]
        if self.lora_rank_rule == "nearest" or len(self.lora) < 2:
            return nearest
        ranks = sorted(self.lora)
        below = [r for r in ranks if r < max_lora_rank]
        above = [r for r in ranks if r > max_lora_rank]
        # the bracketing entries; outside the table, the two nearest at its end
        r0, r1 = (below[-1], above[0]) if below and above else (ranks[:2] if above else ranks[-2:])
        e0, e1 = self.lora[r0], self.lora[r1]
        t = (max_lora_rank - r0) / (r1 - r0)
        return dataclasses.replace(nearest, **{k: max(0.0, getattr(e0, k) + t * (getattr(e1, k) - getattr(e0, k)))
                                               for k in _RANK_LINEAR_FIELDS})

    def model_ms(self, n_seqs: int, n_tokens: int, ctx_tokens: int, n_adapters: int,
                 max_lora_rank: int, max_loras: int) -> float:
        """Forward-pass time (the engine kernel computes the same in ``twin.engine_cost.step_seconds``)."""
        lora = self.lora_for_rank(max_lora_rank)
        extra = lora.extra(n_adapters, max_loras)
        decode = self.base_ms + self.per_seq_ms * n_seqs + self.per_ctx_ktoken_ms * ctx_tokens / 1000.0
        prefill = self.per_token_ms * (n_tokens - n_seqs)
        model = decode * (1.0 + extra) + prefill * (1.0 + lora.prefill_share_at(n_tokens) * extra)
        if n_adapters <= 0:
            return model
        return (model + lora.fixed_ms_at(max_loras) + lora.adapter_ms * n_adapters + lora.seq_ms * n_seqs
                + lora.token_cost(n_tokens))

    def scheduler_ms(self, n_running: int, n_scanned: int) -> float:
        return self.sched_base_ms + self.sched_per_running_ms * n_running + self.sched_per_waiting_ms * n_scanned


@dataclass(frozen=True)
class LoadingSpec:
    """Adapter load costs by adapter rank (ms); linear interpolation between listed ranks."""

    cpu_to_gpu_ms: dict[int, float]
    """Activation: host-to-device copy into a GPU slot."""
    disk_to_cpu_ms: dict[int, float]
    """Reading the checkpoint from disk into the CPU cache."""

    @staticmethod
    def _interp(table: dict[int, float], rank: int) -> float:
        ranks = sorted(table)
        if rank <= ranks[0]:
            return table[ranks[0]] * (rank / ranks[0] if len(ranks) > 1 and rank < ranks[0] else 1.0)
        if rank >= ranks[-1]:
            if len(ranks) == 1:
                return table[ranks[-1]]
            r0, r1 = ranks[-2], ranks[-1]
            return table[r1] + (table[r1] - table[r0]) / (r1 - r0) * (rank - r1)
        for r0, r1 in zip(ranks, ranks[1:]):
            if r0 <= rank <= r1:
                return table[r0] + (table[r1] - table[r0]) * (rank - r0) / (r1 - r0)
        raise AssertionError("unreachable")

    def cpu_ms(self, rank: int) -> float:
        return self._interp(self.cpu_to_gpu_ms, rank)

    def disk_ms(self, rank: int) -> float:
        return self._interp(self.disk_to_cpu_ms, rank)


@dataclass(frozen=True)
class EngineDefaults(EngineFlagChecks):
    """Defaults of the vLLM version/GPU the profile describes, used where a scenario is silent: a
    typed subset of ``twin.flags.EngineFlags`` (what each flag means and allows is documented
    there), checked by the same validator."""

    max_loras: int = 1
    """``--max-loras`` default."""
    max_lora_rank: int = 16
    """``--max-lora-rank`` default."""
    max_num_seqs: int = 256
    """``--max-num-seqs`` default for the OpenAI server on this GPU."""
    max_num_batched_tokens: int = 2048
    """``--max-num-batched-tokens`` default for the OpenAI server on this GPU."""
    gpu_memory_utilization: float = 0.9
    """``--gpu-memory-utilization`` default (0.9 in 0.8.5, 0.92 in 0.33)."""


@dataclass(frozen=True)
class Profile:
    """One (model, GPU, vLLM version)."""

    name: str
    """Profile name (bundled profiles are referred to by it)."""
    vllm_version: str
    """vLLM version whose behaviour the engine follows."""
    lora_set_rule: str
    """``scheduled`` (0.8.5) or ``running`` (0.33): which requests define the LoRA gate's set."""
    reserve_full_prompt: bool
    """Admission needs KV blocks for the whole prompt (0.33 ``scheduler_reserve_full_isl``) or
    only for the first chunk (0.8.5)."""
    model: ModelSpec
    memory: MemorySpec
    latency: LatencySpec
    loading: LoadingSpec
    chunked_prefill: bool = True
    """V1 chunked prefill (prefill chunks and decodes share a step); False = V0: a step is either
    prefill-only (whole prompts) or decode-only."""
    defaults: EngineDefaults = EngineDefaults()
    fit: dict[str, Any] = field(default_factory=dict)
    """Provenance: data files, command, date, goodness of fit."""
    source: str = ""
    """Where the profile was loaded from."""

    def flag_defaults(self) -> dict[str, Any]:
        """Flag name -> this (model, GPU, vLLM version)'s default: ``defaults:``, and the model's
        context as ``max_model_len`` (what ``twin.flags.resolve_flags`` fills unset flags from)."""
        return {**flag_values(self.defaults), "max_model_len": self.model.max_model_len}

    def flag_rules(self) -> FlagRules:
        """This vLLM release's rules for the flags it derives from others and its refusal
        (``twin.flag_rules``; ScenarioError for a release lora-opt has not read)."""
        return flag_rules(self.vllm_version, self.chunked_prefill, f"profile {self.name}.vllm_version")

    # ---- memory -------------------------------------------------------------------------------
    def slot_bytes(self, max_lora_rank: int) -> float:
        """GPU bytes of one LoRA slot, padded to ``max_lora_rank``."""
        m = self.memory
        per_rank = self.model.lora_elements_per_rank * self.model.dtype_bytes * m.slot_rank_scale
        return per_rank * max_lora_rank + m.slot_fixed_mib * MIB

    def non_kv_bytes(self, max_num_batched_tokens: int, max_num_seqs: int | None = None) -> float:
        """Weights + activation peak + non-torch memory (everything but LoRA slots and KV)."""
        m = self.memory
        extra = m.overhead_gib_per_1k_batched_tokens * (max_num_batched_tokens - 2048) / 1000.0
        if max_num_seqs is not None:
            extra += m.overhead_gib_per_1k_seqs * (max(max_num_seqs, m.seqs_knee)
                                                   - max(m.overhead_ref_max_num_seqs, m.seqs_knee)) / 1000.0
        return (m.weights_gib + m.non_kv_overhead_gib + extra) * GIB

    def kv_capacity_tokens(self, max_loras: int, max_lora_rank: int, gpu_memory_utilization: float,
                           max_num_batched_tokens: int, enable_lora: bool = True,
                           max_num_seqs: int | None = None) -> int:
        """KV-cache tokens vLLM allocates at start-up (a multiple of the block size; <= 0 = OOM).
        ``max_num_seqs`` None = the value the overhead was measured at."""
        block_bytes = self.memory.block_size * self.model.kv_bytes_per_token
        if self.memory.kv_cache_gib > 0:
            return math.floor(self.memory.kv_cache_gib * GIB / block_bytes) * self.memory.block_size
        budget = gpu_memory_utilization * self.memory.gpu_memory_gib * GIB
        used = self.non_kv_bytes(max_num_batched_tokens, max_num_seqs)
        if enable_lora:
            used += max_loras * self.slot_bytes(max_lora_rank)
        avail = budget - used
        blocks = math.floor(avail / block_bytes)
        return blocks * self.memory.block_size

    def startup_check(self, flags: EngineFlags) -> tuple[bool, int, str]:
        """(starts, kv_tokens, reason) of an instance with these flags (resolved: ``twin.flags.resolve_flags``;
        ``max_model_len`` None = the model's context, ``max_num_seqs`` None = the value the overhead
        was measured at).  vLLM refuses to start when the LoRA buffers do not fit or the KV cache
        cannot hold one ``max_model_len`` request."""
        mml = flags.max_model_len or self.model.max_model_len
        kv = self.kv_capacity_tokens(flags.max_loras, flags.max_lora_rank, flags.gpu_memory_utilization,
                                     flags.max_num_batched_tokens, max_num_seqs=flags.max_num_seqs)
        budget = flags.gpu_memory_utilization * self.memory.gpu_memory_gib * GIB
        weights_and_slots = self.memory.weights_gib * GIB + flags.max_loras * self.slot_bytes(flags.max_lora_rank)
        if weights_and_slots > budget and self.memory.kv_cache_gib <= 0:
            return False, max(kv, 0), "LoRA slots do not fit: CUDA OOM while loading the model"
        if kv < mml:
            return False, max(kv, 0), (f"KV cache holds {max(kv, 0)} tokens < max_model_len {mml}: "
                                       "vLLM refuses to start")
        return True, kv, ""


# ---- loading ---------------------------------------------------------------------------------
def _build(cls, data: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def profile_from_dict(d: dict, source: str = "") -> Profile:
    d = dict(d)
    where = f"profile {source or d.get('name', '?')}"
    for key in ("name", "vllm_version", "lora_set_rule", "model", "memory", "latency", "loading"):
        if key not in d:
            raise ScenarioError(f"{where}: missing field '{key}'")
    if d["lora_set_rule"] not in LORA_SET_RULES:
        raise ScenarioError(f"{where}.lora_set_rule: {d['lora_set_rule']!r} not in {LORA_SET_RULES}")
    lat = dict(d["latency"])
    lat["lora"] = {int(r): _build(LoraOverheadSpec, v, f"{where}.latency.lora.{r}")
                   for r, v in (lat.get("lora") or {}).items()}
    load = {k: {int(r): float(v) for r, v in tab.items()} for k, tab in d["loading"].items()}
    defaults = _build(EngineDefaults, d.get("defaults") or {}, f"{where}.defaults")
    defaults.validate(f"{where}.defaults")
    return Profile(
        name=d["name"], vllm_version=str(d["vllm_version"]), lora_set_rule=d["lora_set_rule"],
        reserve_full_prompt=bool(d.get("reserve_full_prompt", True)),
        chunked_prefill=bool(d.get("chunked_prefill", True)),
        model=_build(ModelSpec, d["model"], f"{where}.model"),
        memory=_build(MemorySpec, d["memory"], f"{where}.memory"),
        latency=_build(LatencySpec, lat, f"{where}.latency"),
        loading=_build(LoadingSpec, load, f"{where}.loading"),
        defaults=defaults,
        fit=d.get("fit") or {}, source=source,
    )


_KNEE_DEFAULTS = {"prefill_knee_tokens": math.inf, "prefill_share_above": None, "token_ms": 0.0, "token_ms_above": None,
                  "step_ms": 0.0, "slot_ms": 0.0, "adapter_ms": 0.0, "seq_ms": 0.0, "form": "factor"}


def profile_to_dict(p: Profile) -> dict:
    out = dataclasses.asdict(p)
    out.pop("source", None)
    # the knee's and the per-token cost's fields at their defaults are left out: profiles without them
    # read and write as before
    out["latency"]["lora"] = {int(r): {k: v for k, v in dataclasses.asdict(e).items()
                                       if not (k in _KNEE_DEFAULTS and v == _KNEE_DEFAULTS[k])}
                              for r, e in p.latency.lora.items()}
    if p.latency.lora_rank_rule == "nearest":
        del out["latency"]["lora_rank_rule"]
    return out


def bundled_profiles() -> list[str]:
    return bundled_names("profile")


def load_profile(name_or_path: str | Path) -> Profile:
    """A bundled profile by name, or a profile YAML by path (parsed once per file version)."""
    p = resolve_bundled("profile", name_or_path, ScenarioError)
    if not p.is_file():
        raise ScenarioError(f"profile: {'not a file' if p.exists() else 'file not found'}: {p}")
    st = p.stat()
    return _load_profile_file(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _load_profile_file(path: str, _mtime_ns: int, _size: int) -> Profile:
    p = Path(path)
    data = read_config_file(p, "profile")
    if not isinstance(data, dict):
        raise ScenarioError(f"profile {p}: not a mapping")
    return profile_from_dict(data, str(p))
