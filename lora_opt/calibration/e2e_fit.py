"""The few constants only end-to-end runs identify, fitted on one half of the workloads.

The estimator families (``lora-opt calibrate``) pin down memory, decode and prefill cost, the LoRA
slope and loading.  Three effects are not in any estimator family:

* ``slot_share`` -- how much of the first adapter's cost scales with ``max_loras`` (the estimator
  runs all used 300 slots; at 8-32 slots the real low-load ITL shows a much smaller jump);
* ``prefill_share`` -- how much of the LoRA cost prefill tokens pay (the estimator runs are
  decode-only);
* the front end's share of TTFT (``ttft_frontend_ms`` + ``ttft_frontend_per_running_ms`` x running
  requests): the client measures TTFT through the API server, which streams a chunk per running
  request per step;
* vLLM 0.5.0 (V0) only: a fixed CPU time per step (``sched_base_ms``: scheduling, sampling and
  output processing in V0's Python engine).  Its decode fit extrapolates large-batch runs to an
  intercept of ~6 ms, while the fit half's real runs decode at ~14.5 ms with 1-3 requests running.

They are fitted on the **fit half** of the end-to-end workloads (below) and the fidelity report is
given on the **report half** (and, marked as such, on all runs).  The search is a small coordinate
search over a grid (each point replays the whole fit half on the twin); the front-end terms are a
non-negative least-squares fit of real minus simulated median TTFT on the unsaturated fit-half runs.

The benchmark client's in-flight cap is an observation, not a fit: running + waiting never exceeded
``BENCHMARK_CLIENT['max_inflight']`` in any fit-half run (the report half shows the same ceiling),
and the real TTFT of saturated runs equals the server's queueing time, so excess requests failed
(``overflow: drop``) rather than queued at the client.
"""
from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from lora_opt.calibration import realruns
from lora_opt.calibration.additive_fit import fit_estimator_rank, fit_on_replay
from lora_opt.calibration.e2e_params import with_e2e_params
from lora_opt.calibration.model_table import FIT_HALF, MODELS  # FIT_HALF: also the CLI's list of --model values
from lora_opt.calibration.profile_io import header_of, write_profile
from lora_opt.calibration.replay import replay_with_profile, select_runs
from lora_opt.calibration.runs_csv import load_runs
from lora_opt.errors import InputError
from lora_opt.smape import smape
from twin.errors import ScenarioError
from twin.parsing import parse_yaml_text, read_config_file, read_text_file
from twin.paths import FROM_WHEEL
from twin.profile import profile_from_dict

log = logging.getLogger(__name__)

SLOT_SHARE_GRID = (0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 1.0)
#: V0 per-step CPU time searched (ms); V1 profiles keep 0 (their ITL fits contain it)
STEP_OVERHEAD_GRID = (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0)
PREFILL_SHARE_GRID = (0.0, 0.25, 0.5, 1.0)


class NoFitRuns(ScenarioError):
    """The runs hold no fit-half run of the model."""


def split_rows(runs, model: str):
    """(fit half, report half) of the usable validation runs of ``model``."""
    rows = select_runs(runs[runs["model"] == model])
    fit = rows["experiment"].str.contains(FIT_HALF[model], regex=False)
    return rows[fit], rows[~fit]


def observed_inflight_cap(rows) -> int | None:
    """The most requests running + waiting in any run (None when no run recorded both: rows ingested from
    lora-opt validate carry means, not maxima)."""
    total = (rows["running_max"] + rows["waiting_max"]).to_numpy(dtype=float)
    return int(np.nanmax(total)) if np.isfinite(total).any() else None


def _metric(res: list[dict], key: str, sub: str | None = None) -> np.ndarray:
    return np.array([np.nan if x.get("status") != "ok" else (x[key][sub] if sub else x[key]) for x in res], float)


def _objective(rows, res) -> dict:
    thr = smape(_metric(res, "throughput_tok_s"), rows["input_throughput"] + rows["output_throughput"])
    itl = smape(_metric(res, "itl_ms", "mean"), rows["mean_itl_ms"])
    return {"throughput_smape": thr, "itl_mean_smape": itl, "loss": (thr + itl) / 2}


def fit_frontend(rows, res) -> tuple[float, float]:
    """Non-negative least squares of (real - twin) median TTFT on a + b x running_mean, over the
    runs without a queue (waiting_mean < 1 in the real run and in the twin), where TTFT is one
    step plus the front end."""
    quiet = (rows["waiting_mean"] < 1).to_numpy() & (_metric(res, "waiting_mean") < 1)
    twin_med = _metric(res, "ttft_ms", "median")
    y = rows["median_ttft_ms"].to_numpy(float) - twin_med
    x = rows["running_mean"].to_numpy(float)
    ok = quiet & np.isfinite(y) & np.isfinite(x)
    if ok.sum() < 3:
        return 0.0, 0.0
    sol, _ = nnls(np.column_stack([np.ones(ok.sum()), x[ok]]), y[ok])
    return float(sol[0]), float(sol[1])


def fit_model(model: str, runs_csv=realruns.REAL_RUNS_CSV, workers: int | None = None,
              tmp: Path | None = None) -> dict:
    """Fit the end-to-end constants of ``model``'s bundled profile on its fit half; rewrite the
    profile with them and a ``fit.e2e`` record (:func:`write_fitted_profile`: untouched when nothing
    changed).  Returns that record, with ``wall_s`` and ``profile_written``."""
    t0 = time.perf_counter()
    runs = load_runs(runs_csv)
    fit_rows, report_rows = split_rows(runs, model)
    if fit_rows.empty:
        raise NoFitRuns(f"calibrate-e2e --model {model}: {runs_csv} holds no usable fit-half runs of {model} "
                        f"(experiment containing {FIT_HALF[model]!r})")
    prof_path = Path(realruns.PROFILES_DIR) / f"{realruns.MODEL_PROFILES[model]}.yaml"
    text = read_text_file(prof_path, "profile")
    header, base = header_of(text), parse_yaml_text(text, str(prof_path))
    tmp = Path(tmp or tempfile.mkdtemp(prefix="lora_opt_e2e_"))
    trace = []

    def evaluate(s, pf, so):
        res = replay_with_profile(fit_rows, with_e2e_params(base, s, pf, step_overhead_ms=so), tmp, workers)
        obj = _objective(fit_rows, res)
        trace.append({"slot_share": s, "prefill_share": pf, "step_overhead_ms": so, **obj})
        log.info(f"  {model}: slot_share {s} prefill_share {pf} step overhead {so:g} ms -> throughput "
            f"{obj['throughput_smape']:.1f} %, ITL {obj['itl_mean_smape']:.1f} %")
        return obj["loss"], res

    if MODELS[model].lora_cost == "additive":
        return _fit_additive(model, runs, fit_rows, report_rows, prof_path, header, base, tmp, workers, t0)
    # coordinate search: (V0) the step overhead at the profile's shares, slot_share at prefill_share
    # 0, then prefill_share at the best slot_share
    v0 = base.get("chunked_prefill") is False
    best_so = 0.0
    if v0:
        lora0 = next(iter(base["latency"]["lora"].values()))     # every rank carries the same shares
        s0, pf0 = float(lora0.get("slot_share", 0.0)), float(lora0.get("prefill_share", 1.0))
        best = np.inf
        for so in STEP_OVERHEAD_GRID:
            loss, _ = evaluate(s0, pf0, so)
            if loss < best:
                best_so, best = so, loss
    fitted = MODELS[model].e2e_fit           # the rest keep the profile's values (None: each rank's own)
    best_s, best_loss, best_res = None, np.inf, None
    for s in (SLOT_SHARE_GRID if "slot_share" in fitted else (None,)):
        loss, res = evaluate(s, 0.0 if "prefill_share" in fitted else None, best_so)
        if loss < best_loss:
            best_s, best_loss, best_res = s, loss, res
    best_pf = 0.0 if "prefill_share" in fitted else None
    for pf in (PREFILL_SHARE_GRID[1:] if "prefill_share" in fitted else ()):
        loss, res = evaluate(best_s, pf, best_so)
        if loss < best_loss:
            best_pf, best_loss, best_res = pf, loss, res
    base_frontend = (float(base["latency"].get("ttft_frontend_ms", 0.0)),
                     float(base["latency"].get("ttft_frontend_per_running_ms", 0.0)))
    frontend = fit_frontend(fit_rows, best_res) if "frontend" in fitted else base_frontend
    record = {
        "command": f"lora-opt calibrate-e2e --model {model}",
        "fit_half": FIT_HALF[model], "fit_runs": int(len(fit_rows)), "report_runs": int(len(report_rows)),
        "params": {"slot_share": best_s, "prefill_share": best_pf, "ttft_frontend_ms": frontend[0],
                   "ttft_frontend_per_running_ms": frontend[1], "step_overhead_ms": best_so},
        "objective": "mean of throughput and mean-ITL SMAPE on the fit half",
        "fit_half_loss": best_loss, "search": trace,
        "observed_inflight_cap_fit_half": observed_inflight_cap(fit_rows),
        "wall_s": time.perf_counter() - t0,
    }
    written = write_fitted_profile(prof_path, header, with_e2e_params(base, best_s, best_pf, frontend, best_so),
                                   record)
    return {**record, "profile_written": written}


def _fit_additive(model, runs, fit_rows, report_rows, prof_path, header, base, tmp, workers, t0) -> dict:
    """``fit_model`` for a model priced by the additive LoRA form (``lora_opt.calibration.additive_fit``): its
    constants fitted on the fit half (run-level fit, refined on the replay), then the front end's TTFT terms."""
    trace = []
    best = {"loss": np.inf, "res": None}

    def loss_of(additive):
        # no front-end terms in the replays (they add to TTFT only): fitted on the best one's TTFT, as the factor form's
        res = replay_with_profile(fit_rows, with_e2e_params(base, None, None, additive=additive), tmp, workers)
        obj = _objective(fit_rows, res)
        trace.append({**{k: round(v, 6) for k, v in additive.items()}, **obj})
        log.info(f"  {model}: additive {additive} -> throughput {obj['throughput_smape']:.1f} %, "
                 f"ITL {obj['itl_mean_smape']:.1f} %")
        if obj["loss"] < best["loss"]:
            best.update(loss=obj["loss"], res=res)
        return obj["loss"]

    latency = profile_from_dict(base).latency
    additive, refine = fit_on_replay(fit_rows, latency, loss_of)
    best_loss = refine["best_loss"]
    frontend = fit_frontend(fit_rows, best["res"])
    # adapter_ms by rank: the fit half's ranks, and the estimator family's (rank 8) with the other constants kept
    by_rank = {int(r): additive["adapter_ms"] for r in fit_rows["max_lora_rank"].dropna().unique()}
    est_rank, est_adapter, est_record = fit_estimator_rank(runs, model, latency, additive)
    if est_rank is not None and est_rank not in by_rank:
        by_rank[est_rank] = est_adapter
    record = {
        "command": f"lora-opt calibrate-e2e --model {model}",
        "fit_half": FIT_HALF[model], "fit_runs": int(len(fit_rows)), "report_runs": int(len(report_rows)),
        "params": {"slot_share": None, "prefill_share": None, "ttft_frontend_ms": frontend[0],
                   "ttft_frontend_per_running_ms": frontend[1], "step_overhead_ms": 0.0, "additive": additive,
                   "adapter_ms_by_rank": dict(sorted(by_rank.items()))},
        "lora_form": "additive", "additive_fit": refine, "estimator_rank_fit": est_record,
        "objective": "mean of throughput and mean-ITL SMAPE on the fit half",
        "fit_half_loss": best_loss, "search": trace,
        "observed_inflight_cap_fit_half": observed_inflight_cap(fit_rows),
        "wall_s": time.perf_counter() - t0,
    }
    prof = with_e2e_params(base, None, None, frontend, 0.0, additive, by_rank)
    written = write_fitted_profile(prof_path, header, prof, record)
    return {**record, "profile_written": written}


#: what a ``fit.e2e`` record holds that is not a result of the fit (it differs on every run)
RUN_ONLY_KEYS = ("wall_s",)


def same_fit(a, b, rel: float = 1e-9) -> bool:
    """Whether two fit records (nested dicts, lists, numbers) hold the same values up to float noise
    (``rel``: a replay's SMAPE can differ in its last bits with the order of a sum)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_fit(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_fit(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            return False
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)
    return a == b


def write_fitted_profile(path: Path, header: str, prof: dict, record: dict) -> bool:
    """``prof`` with ``record`` as its ``fit.e2e``, written in the profile style
    (``lora_opt.calibration.profile_io``) unless the file already holds that fit: a rerun whose
    record equals the one there (:func:`same_fit`; its wall time aside) leaves the profile
    byte-identical, a changed value changes only its lines and the record's.  Whether the file
    was written."""
    def fitted(rec):
        return {k: v for k, v in (rec or {}).items() if k not in RUN_ONLY_KEYS}

    if path.is_file():
        old = ((read_config_file(path, "profile") or {}).get("fit") or {}).get("e2e")
        if old is not None and same_fit(fitted(old), fitted(record)):
            return False
    prof = dict(prof)
    prof["fit"] = {**(prof.get("fit") or {}), "e2e": record}
    return write_profile(path, header, prof)


def fit_models(model: str | None, runs_csv=realruns.REAL_RUNS_CSV, workers: int | None = None,
               on_fit=None) -> list[dict]:
    """``lora-opt calibrate-e2e``: :func:`fit_model` for ``model``, or for every bundled model with fit-half runs
    in ``runs_csv`` (a model without any is skipped with a warning; named, it is an error).  ``on_fit(model,
    record)`` is called as each model is fitted (the command prints a line each)."""
    if FROM_WHEEL:    # it rewrites the bundled profiles: they are the checkout's files, not site-packages'
        raise InputError("calibrate-e2e rewrites the bundled profiles (configs/profiles/): run it in a checkout "
                         "installed with pip install -e .")
    models = [model] if model else sorted(FIT_HALF)
    records = []
    for m in models:
        if m not in FIT_HALF:
            raise InputError(f"--model {m!r}: allowed values: {', '.join(sorted(FIT_HALF))}")
        log.info(f"{m}: replaying its fit-half runs on the twin once per candidate (a line each)")
        try:
            rec = fit_model(m, runs_csv, workers=workers)
        except NoFitRuns as exc:
            if model:
                raise
            log.warning(f"{exc}: skipped")      # every model: those with runs in this CSV
            continue
        records.append(rec)
        if on_fit is not None:
            on_fit(m, rec)
    return records
