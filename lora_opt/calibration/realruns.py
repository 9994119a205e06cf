"""The papers' real vLLM runs (``data/real_runs/real_runs_vllm_lora.csv``) as twin scenarios.

One row = one benchmark run of vLLM with LoRA on an H100 (64 GB).  ``run_to_scenario`` rebuilds the
configuration the authors ran: served adapters with rates and ranks assigned round-robin (adapter i
gets ``rates[i % len(rates)]`` and ``ranks[i % len(ranks)]`` -- this reproduces every recorded
``adapter_rate_counts``), the engine flags of the run, Poisson arrivals, and the run's length
distribution (ShareGPT -> the ``sharegpt`` model; the fixed-length "mean" dataset -> its exact
lengths), for the run's duration.
"""
from __future__ import annotations

import hashlib
import math

from lora_opt.calibration.model_table import MODEL_PROFILES  # model column -> bundled profile
from twin.paths import DATA_DIR, PROFILES_DIR, REAL_RUNS_CSV  # noqa: F401 - REAL_RUNS_CSV: the CLIs' --runs default
from twin.scenario import scenario_dict

PEER_TWIN_CSV = DATA_DIR / "real_runs" / "peer_twin_validation.csv"

#: the papers' benchmark client: never more than this many requests in flight (running + waiting)
#: in any run of the fit halves (max of running_max + waiting_max, lora_opt.calibration.e2e_fit.observed_inflight_cap);
#: excess requests failed (real TTFT at saturation equals the server queueing time).
BENCHMARK_CLIENT = {"max_inflight": 27934, "overflow": "drop"}

#: end-to-end families used for validation (never for fitting)
VALIDATION_FAMILIES = ("digital_twin_modelling/real_results", "motivation_figure/with_slots")
#: the experiment prefix of rows ``lora-opt ingest`` writes (end-to-end runs: replayed by fidelity too)
INGESTED_FAMILY = "ingested/"
#: experiments ``fidelity`` replays
REPLAYED_FAMILIES = VALIDATION_FAMILIES + (INGESTED_FAMILY,)


def _num(row, col, default=None):
    v = row.get(col)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return default
    return v


#: the seeds of a replay of real runs, as its MLflow run records them (``lora-opt fidelity``, ``error-model``)
RUN_SEEDS = "per run: sha256 of its source directory (realruns.run_seed)"


def run_seed(row) -> int:
    """A stable seed per run (from its directory), so every report draws the same requests."""
    return int(hashlib.sha256(str(row["source_dir"]).encode()).hexdigest()[:8], 16)


def usable(row) -> tuple[bool, str]:
    """Whether a run can be replayed: status ok, a profile for its model, a known workload."""
    if row.get("status") != "ok":
        return False, f"status {row.get('status')}"
    if row["model"] not in MODEL_PROFILES or not (PROFILES_DIR / f"{MODEL_PROFILES[row['model']]}.yaml").exists():
        return False, f"no profile for model {row['model']}"
    if not any(str(row["experiment"]).startswith(f) for f in REPLAYED_FAMILIES):
        return False, "not an end-to-end validation family"
    if _num(row, "n_served_adapters") is None or _num(row, "completed", 0) <= 0:
        return False, "no adapters or nothing completed"
    if _num(row, "adapter_rates") is None:
        return False, "no per-adapter rates"
    return True, ""


def run_to_scenario(row, lengths: str = "auto", seed: int | None = None) -> dict:
    """The scenario dict of a real run (``lengths``: auto | mean, the papers' Table 1 variant)."""
    n = int(row["n_served_adapters"])
    rates = [float(x) for x in str(row["adapter_rates"]).split()]
    ranks = [int(x) for x in str(_num(row, "adapter_module_ranks", row["max_lora_rank"])).split()]
    adapters = [{"count": 1, "rank": ranks[i % len(ranks)], "rate": rates[i % len(rates)]} for i in range(n)]
    max_loras = int(row["max_loras"])
    engine = {"max_loras": max_loras, "max_lora_rank": int(row["max_lora_rank"]),
              "max_cpu_loras": int(_num(row, "max_cpu_loras", max_loras)),
              "gpu_memory_utilization": float(_num(row, "gpu_memory_utilization", 0.9))}
    if _num(row, "max_num_seqs") is not None:
        engine["max_num_seqs"] = int(row["max_num_seqs"])
    if _num(row, "max_num_batched_tokens") is not None:
        engine["max_num_batched_tokens"] = int(row["max_num_batched_tokens"])
    if str(row["dataset"]).startswith("ShareGPT") and lengths == "auto":
        length_cfg: dict = {"source": "sharegpt"}
    else:
        # fixed-length dataset (or the "Mean" variant): every request has the run's mean lengths
        length_cfg = {"source": "mean", "mean_in": float(row["total_input_tokens"]) / float(row["completed"]),
                      "mean_out": float(row["total_output_tokens"]) / float(row["completed"])}
        if str(row["dataset"]).startswith("ShareGPT"):
            length_cfg = {"source": "mean"}      # the twin's ShareGPT means, 223 / 193
    return scenario_dict(MODEL_PROFILES[row["model"]], adapters, engine=engine, arrivals={"process": "poisson"},
                         lengths=length_cfg, duration_s=float(_num(row, "total_time", 3600)),
                         client=BENCHMARK_CLIENT, seed=run_seed(row) if seed is None else seed)


def workload_key(row) -> str:
    """The workload a run belongs to (same family and A_max, varying served adapters)."""
    return f"{row['experiment']}|max_loras={int(row['max_loras'])}"
