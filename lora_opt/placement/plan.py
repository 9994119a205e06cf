"""A placement: which adapters each GPU serves, with what weights, and each vLLM instance's flags.

An adapter is routed to one GPU (weight 1) or, for LoRAServe-style fractional routing, to several
GPUs with weights that sum to 1.  ``check_placement`` is the independent checker every placement
passes before it is shown or written: every adapter routed, weights valid, every adapter's rank <=
the ``--max-lora-rank`` of each GPU it is routed to, and vLLM's memory accounting (the profile's
``startup_check``) says each instance starts.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_opt.errors import InputError
from lora_opt.io import atomic_write_json
from twin.errors import ScenarioError
from twin.flags import EngineFlags, check_rank, flag_values
from twin.parsing import (build_dataclass, check_adapter_id, check_adapter_path, check_finite, check_type,
                          parse_json_text, read_text_file)
from twin.profile import VLLM_LORA_RANKS, Profile
from twin.scenario import MAX_ADAPTERS


class PlacementError(InputError):
    """A placement that must not be deployed; the message lists every problem found."""


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of the workload."""

    id: str
    """Name the clients use (``--lora-modules name=path``)."""
    rank: int
    """LoRA rank."""
    rate: float
    """Expected requests per second."""
    path: str | None = None
    """Checkpoint directory or hub id; default ``adapters/<id>``."""


@dataclass(frozen=True)
class GPUConfig(EngineFlags):
    """The flags of one vLLM instance (one GPU): ``twin.flags.EngineFlags`` (what each flag means
    and allows is documented there) with every flag set -- placement.json pins them all, so an
    instance never depends on a vLLM or model default (``field()`` makes each required again:
    ``EngineFlags`` defaults them to None).  Not validated on construction:
    :func:`placement_problems` is the independent checker that lists every problem of a placement."""

    max_loras: int = field()
    """A_max, chosen per GPU by the policy."""
    max_lora_rank: int = field()
    """The smallest allowed value >= every rank routed here."""
    max_cpu_loras: int = field()
    """>= max_loras; >= the adapters routed here avoids disk loads."""
    max_num_seqs: int = field()
    max_num_batched_tokens: int = field()
    gpu_memory_utilization: float = field()
    max_model_len: int = field()
    """Explicit, so start-up never depends on the model's default."""

    @classmethod
    def from_flags(cls, flags: EngineFlags) -> GPUConfig:
        """The GPU's flags from resolved ones (``twin.flags.resolve_flags``: ``policies.base.gpu_config``);
        ScenarioError naming a flag that is still unset -- placement.json pins every flag, a new one
        included (a flag no file, profile or declaration gives a value has none to pin)."""
        values = flag_values(flags)
        unset = [name for name, value in values.items() if value is None]
        if unset:
            raise ScenarioError(f"engine.{unset[0]}: no value for the GPU's vllm serve command: set it in the "
                                "workload's engine: section (neither the profile nor the flag's declaration "
                                "gives a default)")
        return cls(**values)

    def startup_check(self, profile: Profile) -> tuple[bool, int, str]:
        """(starts, KV tokens, reason) of this instance by the profile's memory model."""
        return profile.startup_check(self)


@dataclass
class Placement:
    """Adapters, GPUs and routes (adapter id -> [(gpu index, weight)])."""

    profile: str
    adapters: list[Adapter]
    gpus: list[GPUConfig]
    routes: dict[str, list[tuple[int, float]]]
    policy: str = ""
    meta: dict = field(default_factory=dict)

    def adapters_on(self, gpu: int) -> list[Adapter]:
        """Adapters routed (wholly or partly) to ``gpu``, in route order."""
        return [self.adapters[k] for k, _ in self.by_gpu()[gpu]] if 0 <= gpu < len(self.gpus) else []

    def by_gpu(self) -> list[list[tuple[int, float]]]:
        """Per GPU: (index into ``adapters``, routing weight), built in one pass over the routes
        (placements of 100k adapters on 1,000 GPUs are read GPU by GPU)."""
        index = {a.id: k for k, a in enumerate(self.adapters)}
        out: list[list[tuple[int, float]]] = [[] for _ in self.gpus]
        for aid, rs in self.routes.items():
            k = index.get(aid)
            for g, w in rs:
                if k is not None and 0 <= g < len(out):
                    out[g].append((k, w))
        return out

    def to_dict(self) -> dict:
        return {"profile": self.profile, "policy": self.policy, "meta": self.meta,
                "adapters": [dataclasses.asdict(a) for a in self.adapters],
                "gpus": [dataclasses.asdict(g) for g in self.gpus],
                "routes": {k: [[g, w] for g, w in v] for k, v in self.routes.items()}}

    @classmethod
    def from_dict(cls, d: Any, where: str = "placement") -> Placement:
        """A placement from its JSON form, every field typed and checked (ids and paths by the
        launch rule, routes to existing GPUs with finite weights); PlacementError names the field."""
        if not isinstance(d, dict):
            raise PlacementError(f"{where}: expected a JSON object, got {type(d).__name__}")
        unknown = sorted(map(str, set(d) - _PLACEMENT_KEYS))
        missing = sorted({"profile", "adapters", "gpus", "routes"} - set(d))
        if unknown or missing:
            raise PlacementError(f"{where}: malformed ({f'unknown field(s) {unknown}' if unknown else ''}"
                                 f"{'; ' if unknown and missing else ''}{f'missing {missing}' if missing else ''})")
        for key, typ in (("adapters", list), ("gpus", list), ("routes", dict), ("meta", dict)):
            if key in d and not isinstance(d[key], typ):
                raise PlacementError(f"{where}.{key}: expected a JSON {'array' if typ is list else 'object'}")
        if len(d["adapters"]) > MAX_ADAPTERS or len(d["gpus"]) > MAX_PLACEMENT_GPUS:
            raise PlacementError(f"{where}: at most {MAX_ADAPTERS:,} adapters and {MAX_PLACEMENT_GPUS:,} GPUs")
        adapters = [_adapter(a, f"{where}.adapters[{i}]") for i, a in enumerate(d["adapters"])]
        gpus = [build_dataclass(GPUConfig, g, f"{where}.gpus[{i}]", PlacementError) for i, g in enumerate(d["gpus"])]
        routes = {}
        for aid, rs in d["routes"].items():
            w = f"{where}.routes[{aid!r:.40}]"
            if not isinstance(rs, list) or not all(isinstance(r, list) and len(r) == 2 for r in rs):
                raise PlacementError(f"{w}: expected a list of [gpu, weight] pairs")
            pairs = []
            for g, wt in rs:
                g = check_type(g, "int", f"{w}.gpu", PlacementError)
                if not 0 <= g < len(gpus):
                    raise PlacementError(f"{w}: routed to GPU {g}, which does not exist (the placement has "
                                         f"{len(gpus)} GPUs: 0..{len(gpus) - 1})")
                pairs.append((g, check_finite(wt, f"{w}.weight", 0.0, 1.0, PlacementError, lo_open=True)))
            routes[aid] = pairs
        return cls(profile=check_type(d["profile"], "str", f"{where}.profile", PlacementError),
                   policy=check_type(d.get("policy", ""), "str", f"{where}.policy", PlacementError),
                   meta=d.get("meta", {}), adapters=adapters, gpus=gpus, routes=routes)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """A placement file, or a directory holding exactly one ``placement.json`` (the folder
        ``lora-opt place`` writes); PlacementError names the file and the field."""
        p = Path(path)
        if p.is_dir():
            if not (p / "placement.json").is_file():
                raise PlacementError(f"{p}: a directory without placement.json; give the placement file "
                                     "(lora-opt place writes <out>/placement.json)")
            p = p / "placement.json"
        # free-form meta may hold NaN (json.dumps writes it); every field that is a number is checked
        return cls.from_dict(parse_json_text(read_text_file(p, "placement", PlacementError), str(p), PlacementError,
                                             allow_nan=True), p.name)


#: the keys of placement.json
_PLACEMENT_KEYS = {"profile", "policy", "meta", "adapters", "gpus", "routes"}
#: the most GPUs a placement may hold
MAX_PLACEMENT_GPUS = 100_000


def _adapter(a: Any, where: str) -> Adapter:
    ad = build_dataclass(Adapter, a, where, PlacementError)
    check_adapter_id(ad.id, f"{where}.id", PlacementError)
    if ad.path is not None:
        check_adapter_path(ad.path, f"{where}.path", PlacementError)
    check_rank(ad.rank, f"{where}.rank", PlacementError)
    check_finite(ad.rate, f"{where}.rate", 0.0, error=PlacementError)
    return ad


def placement_problems(p: Placement, profile: Profile, *, include_startup: bool = True) -> list[str]:
    """Every reason this placement must not be deployed (empty = valid).  ``include_startup=False``
    checks the structure only (used to evaluate baselines whose instances do not start)."""
    problems = []
    ids = [a.id for a in p.adapters]
    if len(set(ids)) != len(ids):
        problems.append("adapter ids are not unique")
    n_gpus = len(p.gpus)
    max_rank = [g.max_lora_rank for g in p.gpus]
    for a in p.adapters:
        rs = p.routes.get(a.id)
        if not rs:
            problems.append(f"adapter {a.id}: not routed to any GPU")
            continue
        if len(rs) == 1:                       # the common case, kept cheap (100k adapters)
            g, w = rs[0]
            if not 0 <= g < n_gpus:
                problems.append(f"adapter {a.id}: routed to a GPU that does not exist")
            elif w != 1.0 and not math.isclose(w, 1.0, abs_tol=1e-9):
                problems.append(f"adapter {a.id}: routing weights must be > 0 and sum to 1, got {[w]}")
            elif a.rank > max_rank[g]:
                problems.append(f"adapter {a.id}: rank {a.rank} > max_lora_rank {max_rank[g]} of GPU {g}")
            continue
        if any(not 0 <= g < n_gpus for g, _ in rs):
            problems.append(f"adapter {a.id}: routed to a GPU that does not exist")
            continue
        if any(w <= 0 for _, w in rs) or not math.isclose(sum(w for _, w in rs), 1.0, abs_tol=1e-9):
            problems.append(f"adapter {a.id}: routing weights must be > 0 and sum to 1, got {[w for _, w in rs]}")
        for g, _ in rs:
            if a.rank > max_rank[g]:
                problems.append(f"adapter {a.id}: rank {a.rank} > max_lora_rank {max_rank[g]} of GPU {g}")
    for extra in sorted(set(p.routes) - set(ids)):
        problems.append(f"route for unknown adapter {extra}")
    for i, g in enumerate(p.gpus):
        unset = [name for name, value in flag_values(g).items() if value is None]
        if unset:
            problems.append(f"GPU {i}: {', '.join(unset)} not set (placement.json pins every engine flag)")
            continue
        if g.max_lora_rank not in VLLM_LORA_RANKS:
            problems.append(f"GPU {i}: max_lora_rank {g.max_lora_rank} not in {list(VLLM_LORA_RANKS)}")
        if g.max_cpu_loras < g.max_loras:
            problems.append(f"GPU {i}: max_cpu_loras {g.max_cpu_loras} < max_loras {g.max_loras}")
        if g.max_num_batched_tokens < g.max_num_seqs:
            problems.append(f"GPU {i}: max_num_batched_tokens {g.max_num_batched_tokens} < max_num_seqs "
                            f"{g.max_num_seqs} (vLLM refuses it)")
        if not include_startup:
            continue
        starts, kv, reason = g.startup_check(profile)
        if not starts:
            problems.append(f"GPU {i}: vLLM would not start: {reason}")
    return problems


def check_placement(p: Placement, profile: Profile) -> None:
    """Raise PlacementError listing every problem; return None for a deployable placement."""
    problems = placement_problems(p, profile)
    if problems:
        raise PlacementError("placement is not deployable:\n  - " + "\n  - ".join(problems))
