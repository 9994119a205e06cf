"""Calibration: fit a twin profile (``twin.profile``) from real vLLM measurements.

``calibrate(runs_csv, model, out, report_dir)`` reads the real-run table
(``data/real_runs/real_runs_vllm_lora.csv``), fits every estimator of a profile from the model's
own *estimator* families, writes the profile YAML (with a ``fit`` provenance section) and, when
asked, a fit report (markdown + PNG plots, :mod:`lora_opt.calibration.report`).
``calibrate_runs`` is ``lora-opt calibrate`` as one call: ``calibrate``, or ``probe_fit.calibrate_probe``
for a table of ``lora-opt probe`` rows, and the command's MLflow run.

Honesty rules
-------------
Only the estimator families are used for fitting (``runs_csv.ESTIMATOR_PREFIXES``):
``digital_twin_dynamic/estimators/*`` and ``performance_analysis/{memory,compute,loading}_overhead/*``.
The validation families (``digital_twin_modelling/real_results/*``, ``motivation_figure/*``) are
never fitted on; :func:`memory_check` only *checks* the memory model against their start-up status
and KV-cache size.  Every row a fit uses goes through ``runs_csv.family_rows``, which refuses any
other prefix.

Where each part lives
---------------------
* ``model_table``: the (model, GPU, vLLM version) setups, from ``configs/models.yaml``.
* ``runs_csv``: the real-run table, its columns and families.
* ``memory_fit`` / ``max_num_seqs_fit``: ``MemorySpec``; ``memory_check``: the check on every run.
* ``step_fit``: ``LatencySpec`` (the shared pieces; ``*_v1``: vLLM 0.8.5, ``*_v0``: vLLM 0.5.0).
* ``loading_fit``: ``LoadingSpec``.
* ``generations``: which fits each engine generation runs (one table keyed by ``ModelEntry.engine``).
* here: the profile assembled from the fits, checked by the schema and written.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from lora_opt.calibration import report as calibrate_report
# E2E_*_KEYS, ESTIMATOR_PREFIXES, VALIDATION_PREFIXES, MODELS, expected_distinct_adapters, weights_gib and
# sha256_of are imported for callers too (__all__): they lived here before the split
from lora_opt.calibration.e2e_params import E2E_LATENCY_KEYS, E2E_LORA_KEYS, with_e2e_params
from lora_opt.calibration.fitting import FitResult, clean, sha256_of, sig
from lora_opt.calibration.generations import GENERATIONS, fit_estimators
from lora_opt.calibration.memory_check import check_summary, memory_check
from lora_opt.calibration.memory_fit import weights_gib
from lora_opt.calibration.model_table import MODELS, ModelEntry, model_entry
from lora_opt.calibration.probe_fit import calibrate_probe, is_probe_table
from lora_opt.calibration.profile_io import write_profile
from lora_opt.calibration.runs_csv import (BLOCK_SIZE, DEFAULT_UTIL, ESTIMATOR_PREFIXES, VALIDATION_PREFIXES,
                                           load_runs)
from lora_opt.calibration.step_fit import expected_distinct_adapters
from lora_opt.tracking import log_command_run
from twin.errors import ScenarioError
from twin.parsing import read_config_file
from twin.paths import bundle_relative
from twin.profile import profile_from_dict


def _rel_data_path(path: Path) -> str:
    return bundle_relative(path)


def _profile_dict(entry: ModelEntry, fits: dict[str, FitResult | None], data_path: Path,
                  out: Path) -> dict[str, Any]:
    mem, dec, pre, lora, load = (fits[k] for k in ("memory", "decode", "prefill", "lora", "loading"))
    seqs_term = fits["max_num_seqs_term"]
    model = dataclasses.asdict(entry.spec)
    memory = {"gpu_memory_gib": entry.gpu.memory_gib,
              "weights_gib": sig(mem.params["weights_gib"]),
              "non_kv_overhead_gib": sig(mem.params["non_kv_overhead_gib"]),
              "overhead_gib_per_1k_batched_tokens": 0.0,
              "overhead_ref_max_num_seqs": entry.memory_max_num_seqs,
              "overhead_gib_per_1k_seqs": sig(seqs_term.params["slope_gib_per_1k_seqs"]) if seqs_term else 0.0,
              "seqs_knee": sig(seqs_term.params["knee_seqs"]) if seqs_term else 0.0,
              "slot_fixed_mib": sig(mem.params["slot_fixed_mib"]),
              "slot_rank_scale": sig(mem.params["slot_rank_scale"]),
              "block_size": BLOCK_SIZE}
    latency = {"base_ms": sig(dec.params["base_ms"]), "per_seq_ms": sig(dec.params["per_seq_ms"]),
               "per_token_ms": sig(pre.params["per_token_ms"]),
               "per_ctx_ktoken_ms": sig(dec.params["per_ctx_ktoken_ms"]),
               "lora": {int(r): {k: sig(v) for k, v in p.items()} for r, p in lora.params.items()},
               "sched_base_ms": 0.0, "sched_per_running_ms": 0.0, "sched_per_waiting_ms": 0.0}
    if entry.lora_rank_rule != "nearest":
        latency["lora_rank_rule"] = entry.lora_rank_rule
    loading = {"cpu_to_gpu_ms": {int(r): sig(v) for r, v in load.params["cpu_to_gpu_ms"].items()},
               "disk_to_cpu_ms": {int(r): sig(v) for r, v in load.params["disk_to_cpu_ms"].items()}}
    data_rel = _rel_data_path(data_path)
    fit = {
        "tool": "lora_opt.calibrate",          # the tool's name in every fit record, kept across the package move
        "model": entry.csv_name,
        "command": (f"lora-opt calibrate --runs {data_rel} --model {entry.csv_name} "
                    f"--out {_rel_data_path(out)}"),
        "data": {"file": data_rel, "sha256": sha256_of(data_path)},
        "setup": {"gpu_memory_gib": entry.gpu.memory_gib, "gpu_memory_utilization": DEFAULT_UTIL,
                  "vllm_version": entry.vllm_version, "engine": entry.engine},
        "estimators": {
            "memory": mem.summary(),
            "max_num_seqs_term": (fits["max_num_seqs_term"].summary() if fits["max_num_seqs_term"]
                                  else {"identified": False,
                                        "note": "fewer than 4 distinct max_num_seqs values without LoRA"}),
            "step_decode": dec.summary(),
            "step_prefill_per_token": pre.summary(),
            "lora_overhead": lora.summary(),
            "loading": load.summary(),
            "scheduler": {"identified": False,
                          "note": "no estimator family separates schedule() CPU time from the forward "
                                  "pass; its cost is inside base_ms/per_seq_ms; constants left 0"},
        },
        "notes": list(entry.notes),
    }
    return {"name": entry.profile_name, "vllm_version": entry.vllm_version,
            "lora_set_rule": entry.lora_set_rule, "reserve_full_prompt": entry.reserve_full_prompt,
            "chunked_prefill": GENERATIONS[entry.engine].chunked_prefill,
            "model": model, "memory": memory, "latency": latency, "loading": loading,
            "defaults": dataclasses.asdict(entry.defaults), "fit": clean(fit)}


def _header(entry: ModelEntry, data_rel: str) -> str:
    return (f"# Generated by lora_opt.calibrate from {data_rel} (model {entry.csv_name}).\n"
            "# Do not edit by hand: rerun the command in fit.command.\n")


def calibrate(runs_csv: str | Path, model: str, out: str | Path,
              report_dir: str | Path | None = None) -> dict[str, Any]:
    """Fit a profile for ``model`` from ``runs_csv``; write it to ``out`` (and a report).

    Returns the profile as a dict (the YAML's content, loadable by ``profile_from_dict``).
    Raises ScenarioError on an unknown model, a missing/unreadable CSV or missing columns.
    """
    entry = model_entry(model)
    if entry.fitted_from == "probe":
        raise ScenarioError(f"calibrate --model {model}: its profile is fitted on lora-opt probe rows "
                            f"(configs/models.yaml fitted_from: probe): calibrate --runs PROBE/rows.csv --model {model}")
    runs = load_runs(runs_csv)
    if not (runs["model"] == entry.csv_name).any():
        raise ScenarioError(f"calibrate: {runs_csv} has no runs of model {model!r}; models present: "
                            f"{sorted(set(runs['model']))}")
    fits = fit_estimators(runs, entry)
    out = Path(out)
    data_path = Path(runs_csv)
    prof = _profile_dict(entry, fits, data_path, out)
    prof = _carry_e2e(prof, out)
    profile = profile_from_dict(prof, str(out))  # schema check before anything is written
    from_profile = GENERATIONS[entry.engine].max_num_seqs_term_from_profile
    if fits["max_num_seqs_term"] is None and from_profile is not None:
        term = from_profile(runs, entry, profile)
        if term is not None:
            fits["max_num_seqs_term"] = term
            prof["memory"]["overhead_gib_per_1k_seqs"] = sig(term.params["slope_gib_per_1k_seqs"])
            prof["memory"]["seqs_knee"] = sig(term.params["knee_seqs"])
            prof["fit"]["estimators"]["max_num_seqs_term"] = clean(term.summary())
            profile = profile_from_dict(prof, str(out))
    check = memory_check(runs, profile, entry.csv_name)
    prof["fit"]["memory_check"] = clean(check_summary(check))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_profile(out, _header(entry, _rel_data_path(data_path)), prof)   # untouched when the text is the same
    if report_dir is not None:
        calibrate_report.write_report(Path(report_dir), entry, prof, fits, check)
    return prof


def calibrate_runs(runs_csv: str | Path, model: str, out: str | Path, report_dir: str | Path | None = None, *,
                   tracking_uri: str | None = None, track: bool = False) -> tuple[dict[str, Any], bool]:
    """``lora-opt calibrate``: (the profile as a dict, whether ``runs_csv`` held ``lora-opt probe`` rows) --
    fitted by ``probe_fit.calibrate_probe`` (``model`` the base profile; no report) when it did, else by
    ``calibrate`` --, and, when ``track``, the command's MLflow run (experiment ``calibrate``: the estimators'
    fit numbers, the profile and report as artifacts) in ``tracking_uri``."""
    probe_rows = is_probe_table(runs_csv)
    prof = (calibrate_probe(runs_csv, model, out) if probe_rows
            else calibrate(runs_csv, model, out, report_dir=report_dir))
    log_command_run("calibrate", model, params={"runs": runs_csv, "model": model, "out": out, "probe_rows": probe_rows},
                    metrics=prof["fit"]["estimators"], artifacts=[out, report_dir], profile=out,
                    seeds="none: deterministic fits", tracking_uri=tracking_uri, track=track)
    return prof, probe_rows


def _carry_e2e(prof: dict[str, Any], out: Path) -> dict[str, Any]:
    """Keep the end-to-end constants (``lora-opt calibrate-e2e``, fitted on half of the
    end-to-end runs) of the profile being overwritten: they are not estimator fits."""
    if not out.exists():
        return prof
    old = read_config_file(out, "profile") or {}
    e2e = (old.get("fit") or {}).get("e2e")
    if not e2e:
        return prof
    p = e2e["params"]
    prof = with_e2e_params(prof, p["slot_share"], p["prefill_share"],
                           (p["ttft_frontend_ms"], p["ttft_frontend_per_running_ms"]), p.get("step_overhead_ms", 0.0),
                           p.get("additive"), p.get("adapter_ms_by_rank"))
    prof["fit"]["e2e"] = e2e
    return prof


__all__ = ["calibrate", "calibrate_runs", "memory_check", "load_runs", "MODELS", "ESTIMATOR_PREFIXES",
           "VALIDATION_PREFIXES", "E2E_LATENCY_KEYS", "E2E_LORA_KEYS", "expected_distinct_adapters", "weights_gib",
           "sha256_of"]
