"""Measurements in, real-runs rows out (``lora-opt ingest``): a ``vllm bench serve --save-result``
JSON (field names of ``vllm/benchmarks/serve.py``: ``duration``, ``completed``, ``failed``,
``total_input_tokens``, ``total_output_tokens``, ``request_throughput``, ``output_throughput``,
``total_token_throughput``, ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``, ...) with the
server's flags and adapters taken from a placement's GPU, or a ``lora-opt validate`` output
directory (one row per GPU), become rows of the real-runs CSV format
(``data/real_runs/real_runs_vllm_lora.csv``'s columns) that ``calibrate`` and ``fidelity`` read.

Rows get the experiment ``ingested/<label>``: ``fidelity --runs ROWS.csv`` replays them (Poisson
arrivals at the rows' per-adapter rates, the run's lengths: ShareGPT, or fixed at the run's means)."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from lora_opt.calibration.model_table import MODELS
from lora_opt.calibration.realruns import INGESTED_FAMILY, REAL_RUNS_CSV
from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement
from twin.parsing import read_config_file

#: what a bench serve JSON must hold
BENCH_FIELDS = ("duration", "completed", "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "mean_itl_ms")


def csv_columns() -> list[str]:
    """The real-runs CSV's columns (the bundled file's header)."""
    with open(REAL_RUNS_CSV, newline="") as fh:
        return next(csv.reader(fh))


def model_for_profile(profile: str) -> str:
    """The CSV ``model`` of a bundled profile (``configs/models.yaml``)."""
    for key, m in MODELS.items():
        if m.profile_name == profile:
            return key
    raise InputError(f"ingest: profile {profile!r} has no entry in configs/models.yaml (give --model)")


def _server_columns(p: Placement, g: int) -> dict:
    if not 0 <= g < len(p.gpus):
        raise InputError(f"ingest --gpu-index: {g} is not a GPU of the placement (0..{len(p.gpus) - 1})")
    on = p.by_gpu()[g]
    if not on:
        raise InputError(f"ingest --gpu-index: GPU {g} serves no adapter")
    f = p.gpus[g]
    return {"n_served_adapters": len(on), "max_loras": f.max_loras, "max_lora_rank": f.max_lora_rank,
            "max_cpu_loras": f.max_cpu_loras, "max_num_seqs": f.max_num_seqs,
            "max_num_batched_tokens": f.max_num_batched_tokens, "gpu_memory_utilization": f.gpu_memory_utilization,
            "adapter_rates": " ".join(f"{p.adapters[k].rate * w:.6g}" for k, w in on),
            "adapter_module_ranks": " ".join(str(p.adapters[k].rank) for k, _ in on), "enable_lora": 1}


def _dataset(lengths: str) -> str:
    return "ShareGPT_V3_unfiltered_cleaned_split.json" if lengths.startswith("sharegpt") else "random"


def row_from_bench(result: dict, p: Placement, g: int, *, model: str, lengths: str, label: str, source: str) -> dict:
    """One row from a ``vllm bench serve`` result dict run against GPU ``g`` of ``p`` (its flags and
    adapter ranks; the rates: bench serve's ``request_rate`` split evenly over the adapters, as its
    random LoRA assignment does, else the placement's)."""
    missing = [k for k in BENCH_FIELDS if not isinstance(result.get(k), (int, float))]
    if missing:
        raise InputError(f"ingest {source}: not a vllm bench serve result (missing {', '.join(missing)})")
    dur = float(result["duration"])
    if not math.isfinite(dur) or dur <= 0:
        raise InputError(f"ingest {source}: duration must be > 0, got {dur}")
    server = _server_columns(p, g)
    rate = result.get("request_rate")
    if rate is not None:           # bench serve: --request-rate R over its --lora-modules, drawn at random
        if not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise InputError(f"ingest {source}: request_rate {rate!r}: only runs at a finite rate (Poisson "
                             "arrivals) can be replayed")
        n = server["n_served_adapters"]
        server["adapter_rates"] = " ".join([f"{rate / n:.6g}"] * n)
    row = {"source_dir": source, "run_name": Path(source).name, "experiment": f"{INGESTED_FAMILY}{label}",
           "result_source": "vllm bench serve", "model": model, "dataset": _dataset(lengths), "total_time": dur,
           "duration_s": dur, "status": "ok" if result["completed"] > 0 else "failed",
           **server}
    for k in ("completed", "total_input_tokens", "total_output_tokens", "request_throughput"):
        row[k] = result.get(k)
    row["input_throughput"] = result["total_input_tokens"] / dur
    row["output_throughput"] = result.get("output_throughput", result["total_output_tokens"] / dur)
    for m in ("ttft", "tpot", "itl"):
        for s in ("mean", "median", "p99"):
            row[f"{s}_{m}_ms"] = result.get(f"{s}_{m}_ms")
    return row


def rows_from_validate(d: Path, *, model: str | None, label: str) -> list[dict]:
    """One row per used GPU of a ``lora-opt validate`` output directory."""
    real = read_config_file(d / "real.json", "validate output", InputError)
    info = real.get("info") or {}
    p = Placement.load(info["placement"])
    model = model or model_for_profile(p.profile)
    T = float(real["duration_s"])
    with open(d / "requests.csv", newline="") as fh:
        reqs = list(csv.DictReader(fh))
    with open(d / "timeseries.csv", newline="") as fh:
        series = list(csv.DictReader(fh))
    rows = []
    for pg in real["per_gpu"]:
        g = pg["gpu"]
        mine = [r for r in reqs if int(r["gpu"]) == g and r["status"] == "ok"]
        if not pg["arrived"]:
            continue
        tin = sum(int(r["input_tokens"]) for r in mine)
        tout = sum(int(r["output_tokens_received"]) for r in mine)
        tpots = [float(r["tpot_ms"]) for r in mine if r["tpot_ms"] not in ("", "nan")]
        s = [x for x in series if int(x["gpu"]) == g and float(x["time_s"]) <= T]
        result = {"duration": T, "request_rate": None, "completed": len(mine), "total_input_tokens": tin, "total_output_tokens": tout,
                  "request_throughput": len(mine) / T, "output_throughput": tout / T,
                  "mean_tpot_ms": float(np.mean(tpots)) if tpots else None,
                  "median_tpot_ms": float(np.median(tpots)) if tpots else None}
        for m in ("ttft", "itl"):
            for st in ("mean", "median", "p99"):
                result[f"{st}_{m}_ms"] = (pg[f"{m}_ms"] or {}).get(st)
        if result["mean_ttft_ms"] is None:
            result["mean_ttft_ms"] = result["mean_itl_ms"] = math.nan
        row = row_from_bench(result, p, g, model=model, lengths=info.get("lengths", "sharegpt"), label=label,
                             source=f"{d}#gpu{g}")
        for col, key in (("running_mean", "running"), ("waiting_mean", "waiting"), ("kv_cache_usage_mean", "kv_usage")):
            vals = [float(x[key]) for x in s if x[key] not in ("", "nan")]
            row[col] = float(np.mean(vals)) if vals else None
        row["failed"] = pg.get("failed", 0)
        rows.append(row)
    return rows


def ingest(sources: list[str], *, placement: str | None = None, gpu_index: int = 0, model: str | None = None,
           lengths: str = "mean", label: str = "run") -> list[dict]:
    """Rows of every source: a validate output directory, or a bench serve JSON (needs ``placement``:
    the server's flags and adapters are GPU ``gpu_index``'s)."""
    rows = []
    for src in sources:
        path = Path(src)
        if path.is_dir():
            if not (path / "real.json").is_file():
                raise InputError(f"ingest: {path} is not a lora-opt validate output directory (no real.json)")
            rows += rows_from_validate(path, model=model, label=label)
            continue
        if not path.is_file():
            raise InputError(f"ingest: {path} not found")
        if placement is None:
            raise InputError(f"ingest {path}: a vllm bench serve result needs --placement (the server's flags and "
                             "adapters: its GPU --gpu-index)")
        result = read_config_file(path, "vllm bench serve result", InputError)
        if not isinstance(result, dict):
            raise InputError(f"ingest {path}: expected a JSON object")
        p = Placement.load(placement)
        rows.append(row_from_bench(result, p, gpu_index, model=model or model_for_profile(p.profile),
                                   lengths=lengths, label=label, source=str(path)))
    return rows


def rows_csv(rows: list[dict]) -> str:
    """The rows as CSV text with the real-runs columns (and any extra ones after them)."""
    cols = csv_columns()
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in r.items()})
    return buf.getvalue()
