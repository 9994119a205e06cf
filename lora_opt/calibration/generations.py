"""The fitting code of each engine generation, behind one table keyed by ``ModelEntry.engine``.

A (model, GPU, vLLM version) of a known generation needs only its entry in ``configs/models.yaml``;
a new generation is a new :class:`Generation` here (and its name in
``model_table.ENGINE_GENERATIONS``).  A generation's own fits sit beside the other generations' fits of
the same estimator, named with the generation's key as a suffix: ``step_fit.fit_decode_v1``,
``loading_fit.fit_loading_v0``, ``max_num_seqs_fit.fit_max_num_seqs_term_v0``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd

from lora_opt.calibration.fitting import FitResult
from lora_opt.calibration.loading_fit import fit_loading_v0, fit_loading_v1
from lora_opt.calibration.max_num_seqs_fit import fit_max_num_seqs_term, fit_max_num_seqs_term_v0
from lora_opt.calibration.memory_fit import fit_memory
from lora_opt.calibration.model_table import ENGINE_GENERATIONS, MODELS, ModelEntry
from lora_opt.calibration.step_fit import (fit_decode_v0, fit_decode_v1, fit_lora_v0, fit_lora_v1, fit_prefill_v0,
                                           fit_prefill_v1)
from twin.profile import Profile


@dataclass(frozen=True)
class Generation:
    """How the profile of one engine generation is fitted."""

    chunked_prefill: bool
    """Whether the engine splits prompts over steps (the profile's ``chunked_prefill``)."""
    memory_families: Callable[[ModelEntry], list[str]]
    """The estimator families whose start-ups the memory model is fitted on."""
    fit_step_and_loading: Callable[[pd.DataFrame, ModelEntry], dict[str, FitResult]]
    """(runs, entry) -> the ``decode``, ``prefill``, ``lora`` and ``loading`` fits."""
    max_num_seqs_term_from_profile: Callable[[pd.DataFrame, ModelEntry, Profile], FitResult | None] | None
    """Where the latency families give no ``max_num_seqs`` term: (runs, entry, profile without the
    term) -> the term, or None; None here: no other source."""


def _memory_families_v1(entry: ModelEntry) -> list[str]:
    # predictor_loading (max_loras 1, same max_num_seqs) adds small-n points
    return ["digital_twin_dynamic/estimators/find_available_gpu_memory_depending_on_loaded_adapters/"
            f"{entry.csv_name}",
            f"digital_twin_dynamic/estimators/predictor_loading/{entry.csv_name}/"]


def _memory_families_v0(entry: ModelEntry) -> list[str]:
    return [f"performance_analysis/memory_overhead/{entry.csv_name}/"]


def _fit_v1(runs: pd.DataFrame, entry: ModelEntry) -> dict[str, FitResult]:
    decode = fit_decode_v1(runs, entry)
    return {"decode": decode, "prefill": fit_prefill_v1(runs, entry, decode),
            "lora": fit_lora_v1(runs, entry, decode), "loading": fit_loading_v1(runs, entry)}


def _fit_v0(runs: pd.DataFrame, entry: ModelEntry) -> dict[str, FitResult]:
    lora = fit_lora_v0(runs, entry)
    # V0 logs no CPU->GPU load time: the table of the (V1) model the entry names
    source = MODELS[entry.cpu_to_gpu_ms_from.model]
    return {"lora": lora, "decode": fit_decode_v0(runs, entry, lora), "prefill": fit_prefill_v0(entry),
            "loading": fit_loading_v0(runs, entry, lambda: fit_loading_v1(runs, source))}


GENERATIONS: dict[str, Generation] = {
    "v1": Generation(chunked_prefill=True, memory_families=_memory_families_v1,
                     fit_step_and_loading=_fit_v1, max_num_seqs_term_from_profile=None),
    "v0": Generation(chunked_prefill=False, memory_families=_memory_families_v0,
                     fit_step_and_loading=_fit_v0, max_num_seqs_term_from_profile=fit_max_num_seqs_term_v0),
}
assert set(GENERATIONS) == set(ENGINE_GENERATIONS), "model_table.ENGINE_GENERATIONS lists the fitted generations"


def fit_estimators(runs: pd.DataFrame, entry: ModelEntry) -> dict[str, FitResult | None]:
    """Every estimator of ``entry``'s profile fitted on its estimator families (``max_num_seqs_term``
    None when the latency families do not identify it)."""
    generation = GENERATIONS[entry.engine]
    return {"memory": fit_memory(runs, entry, generation.memory_families(entry)),
            "max_num_seqs_term": fit_max_num_seqs_term(runs, entry),
            **generation.fit_step_and_loading(runs, entry)}
