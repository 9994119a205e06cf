"""The vLLM versions the emulator imitates and what differs between them where a client can tell.

``--vllm-version`` chooses; without it, the profile's ``vllm_version`` when it is one of these
(major.minor: 0.8.5 matches 0.8, 0.32.0+cpu matches 0.32), else ``twin.flags.DEFAULT_VLLM_VERSION``.  ``/version``
answers the chosen one.

* 0.32 -- measured on the CPU build (tests/real_vllm/test_conformance.py runs the emulator against it).
* 0.33 -- read in its source (reference/vllm_http_surface.md): the same request validation, length
  rules and error envelope as 0.32.
* 0.8.5 -- read in its source: the flat error ``{"object": "error", "message", "type", "param",
  "code"}``, request-validation errors typed ``BadRequestError`` with pydantic's message and no
  ``param``, prompt + ``max_tokens`` over ``max_model_len`` refused (400, "This model's maximum
  context length is ..."), not clamped; an unknown model's message without the "Valid aliases" list.
"""
from __future__ import annotations

from dataclasses import dataclass

from lora_opt.errors import InputError
from twin.admission import clamps_max_tokens
from twin.flags import DEFAULT_VLLM_VERSION, release_key


@dataclass(frozen=True)
class VllmBehaviour:
    """What one vLLM version answers where the versions differ."""

    version: str
    """What ``/version`` says."""
    nested_errors: bool
    """``{"error": {...}}`` (>= 0.9) or the flat ``{"object": "error", ...}`` (0.8.5)."""
    validation_type: str
    """``type`` of a request-validation (pydantic) error."""
    validation_param: bool
    """Whether a request-validation error names the field in ``param`` (``body.<field>``)."""
    clamps_max_tokens: bool
    """prompt + max_tokens > max_model_len: clamp max_tokens (True) or refuse (False)."""
    aliases_in_not_found: bool
    """An unknown model's 404 lists the served names ("Valid aliases: ...")."""
    request_id_hex: int
    """Hex digits of a generated request id (``cmpl-<id>``)."""

    @property
    def key(self) -> str:
        major, minor = release_key(self.version)
        return f"{major}.{minor}"


def _behaviour(version: str) -> VllmBehaviour:
    modern = release_key(version) >= (0, 9)
    return VllmBehaviour(version=version, nested_errors=modern,
                         validation_type="Bad Request" if modern else "BadRequestError",
                         validation_param=modern, clamps_max_tokens=bool(clamps_max_tokens(version)),
                         aliases_in_not_found=modern, request_id_hex=16 if modern else 32)


#: major.minor -> the behaviour imitated
VERSIONS: dict[str, VllmBehaviour] = {b.key: b for b in map(_behaviour, ("0.8.5", "0.32.0", "0.33.0"))}


def choose(flag: str | None, profile_version: str | None) -> VllmBehaviour:
    """The behaviour for ``--vllm-version`` (``flag``), else the profile's version when imitated,
    else ``DEFAULT_VLLM_VERSION``."""
    if flag is not None:
        key = release_key(flag)
        b = VERSIONS.get(f"{key[0]}.{key[1]}") if key else None
        if b is None:
            raise InputError(f"--vllm-version: {flag!r} is not one the emulator imitates "
                             f"(one of {', '.join(VERSIONS)})")
        return b
    key = release_key(profile_version)
    return VERSIONS.get(f"{key[0]}.{key[1]}" if key else "", VERSIONS[DEFAULT_VLLM_VERSION])
