"""What a vLLM server does with a completion request's lengths before it schedules it, by version:
admit it, clamp its ``max_tokens``, or refuse it (HTTP 400).  ``lora-opt validate`` sends the
requests as they are to the live endpoints and gives the twin the requests those endpoints admit
(``lora_opt.validate``), and ``lora-opt emulate`` answers by the same rule,
so both sides serve the same tokens.

vLLM 0.32 (measured on the CPU build) and 0.33 (read in its source, ``get_max_tokens`` and
``renderers/params.py``; reference/vllm_http_surface.md section 2):

* prompt >= ``max_model_len``: refused (a prompt of exactly ``max_model_len`` leaves
  ``max_tokens`` clamped to 0, which ``SamplingParams`` refuses);
* ``max_tokens`` > ``max_model_len``: refused;
* prompt + ``max_tokens`` > ``max_model_len``, each within it: served, ``max_tokens`` clamped to
  ``max_model_len - prompt`` (``finish_reason: length``).

Older releases refused the last case too (0.8.5: ``This model's maximum context length is M
tokens. However, you requested T tokens ...``; still so in 0.15 and 0.20, vLLM issues #33418 and
#42474)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twin.flags import release_key

#: the oldest vLLM release known to clamp ``max_tokens`` rather than refuse prompt + max_tokens >
#: max_model_len (0.32.0 measured; the release that changed it lies between 0.20 and 0.32 and is not
#: known, so earlier versions get the refusal they are known to give)
CLAMPING_SINCE = (0, 32)

def clamps_max_tokens(version: str | None) -> bool | None:
    """Whether vLLM ``version`` clamps ``max_tokens`` to fit ``max_model_len`` (True) or refuses the
    request (False); None when ``version`` is not a version."""
    key = release_key(version)
    return None if key is None else key >= CLAMPING_SINCE


@dataclass(frozen=True)
class Admission:
    """The requests as a server admits them: ``out_len`` the ``max_tokens`` served (clamped where
    the server clamps), ``refused`` / ``clamped`` masks."""

    out_len: np.ndarray
    refused: np.ndarray
    clamped: np.ndarray


def admit(in_len: np.ndarray, out_len: np.ndarray, max_model_len: int, clamps: bool) -> Admission:
    """Apply the admission rules of a server with ``max_model_len`` that clamps (``clamps``) or
    refuses prompt + max_tokens > max_model_len (see the module's docstring)."""
    i = np.asarray(in_len, np.int64)
    o = np.asarray(out_len, np.int64)
    over = i + o > max_model_len
    alone = (i >= max_model_len) | (o > max_model_len)
    refused = alone | (over & (not clamps))
    clamped = over & ~refused
    served = np.where(clamped, max_model_len - i, o)
    return Admission(out_len=served, refused=refused, clamped=clamped)
