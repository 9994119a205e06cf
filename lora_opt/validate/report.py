"""A validation run end to end: the placement's requests (``evaluate``'s, same seeds and
routing) sent to live endpoints, the measured run in the evaluate schema beside the twin's
prediction on the same requests (as the endpoints admit them: :mod:`twin.admission`),
SMAPE per metric and per GPU, the per-request CSV, the scraped time series, plots, and one MLflow
run in experiment ``validation``.  Every file is written atomically; what was measured is written
before the twin runs, so neither a twin that cannot run (``twin_error.json``, exit 5) nor Ctrl-C
loses it."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import math
from pathlib import Path

import numpy as np

from lora_opt.emulate.client import PromptTokens
from lora_opt.errors import EXIT_INTERRUPTED, EXIT_NOT_ACCEPTABLE, EXIT_OK, EXIT_TWIN_FAILED
from lora_opt.io import atomic_write_bytes, atomic_write_json, atomic_write_rows, atomic_write_text
from lora_opt.placement.evaluate import (GRACE_S, Criterion, evaluate_placement, evaluation_from_results,
                                         route_requests, workload_requests)
from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import Workload
from lora_opt.smape import smape
from lora_opt.tracking import log_dir, log_flat_metrics, tracked_run
from twin.admission import Admission, admit, clamps_max_tokens
from lora_opt.validate.live import (SERIES_COLUMNS, emulator_lags, endpoint_prompt_tokens, endpoint_versions,
                                   replay_and_scrape, send_lateness_ms, series_rows)
from lora_opt.validate.measure import REQUEST_COLUMNS, bench_summary, gpu_result, request_rows
from twin.profile import load_profile

log = logging.getLogger(__name__)

#: the metrics compared per GPU (key in the per-GPU comparison)
COMPARED = ("throughput_tok_s", "ttft_mean_ms", "ttft_p99_ms", "itl_mean_ms", "itl_p99_ms", "completed",
            "running_mean", "waiting_mean", "kv_usage_mean")


def _series_mean(t: np.ndarray, v: np.ndarray, T: float) -> float:
    m = (t <= T) & np.isfinite(v)
    return float(v[m].mean()) if m.any() else math.nan


def _gpu_metrics(ev_gpu: dict, series: dict | None, T: float) -> dict:
    out = {"throughput_tok_s": ev_gpu["throughput_tok_s"], "completed": float(ev_gpu["completed"])}
    for k in ("ttft", "itl"):
        d = ev_gpu[f"{k}_ms"] or {}
        out[f"{k}_mean_ms"] = d.get("mean") if d.get("mean") is not None else math.nan
        out[f"{k}_p99_ms"] = d.get("p99") if d.get("p99") is not None else math.nan
    for k in ("running", "waiting", "kv_usage"):
        out[f"{k}_mean"] = _series_mean(series["time_s"], series[k], T) if series else math.nan
    return out


def compare(real_ev: dict, twin_ev: dict, real_series: dict, twin_series: dict) -> dict:
    """SMAPE (:func:`lora_opt.smape.smape`, missing values left out) per metric (over the GPUs), per GPU (over
    the metrics) and of the fleet's totals; the compared values beside it."""
    T = real_ev["duration_s"]
    real = {g["gpu"]: _gpu_metrics(g, real_series.get(g["gpu"]), T) for g in real_ev["per_gpu"] if g["arrived"]}
    twin = {g["gpu"]: _gpu_metrics(g, twin_series.get(g["gpu"]), T) for g in twin_ev["per_gpu"] if g["gpu"] in real}
    gpus = sorted(real)
    per_metric = {m: smape([twin[g][m] for g in gpus], [real[g][m] for g in gpus]) for m in COMPARED}
    per_gpu = {str(g): smape([twin[g][m] for m in COMPARED], [real[g][m] for m in COMPARED]) for g in gpus}
    fleet = {"throughput_tok_s": smape([twin_ev["throughput_tok_s"]], [real_ev["throughput_tok_s"]])}
    for k in ("ttft_ms", "itl_ms"):
        for s in ("mean", "p99"):
            fleet[f"{k[:-3]}_{s}_ms"] = smape([twin_ev[k][s] if twin_ev[k][s] is not None else math.nan],
                                              [real_ev[k][s] if real_ev[k][s] is not None else math.nan])
    return {"smape_per_metric": per_metric, "smape_per_gpu": per_gpu, "smape_fleet": fleet,
            "real": {str(g): real[g] for g in gpus}, "twin": {str(g): twin[g] for g in gpus}}


def real_series_by_gpu(rows: list[dict]) -> dict[int, dict]:
    """The measured time series (``timeseries.csv`` rows) as arrays, per GPU: ``{gpu: {column: array}}``."""
    out: dict[int, dict] = {}
    for g in sorted({r["gpu"] for r in rows}):
        mine = [r for r in rows if r["gpu"] == g]
        out[g] = {k: np.array([r[k] for r in mine], float) for k in SERIES_COLUMNS if k != "gpu"}
    return out


#: the twin's series are recorded this often (simulated seconds) and read at the instants the real server
#: was scraped, so both sides are sampled at the same moments of the same requests: 30 scrapes of a 150-s
#: run move a light run's running mean by ~13 % with where they fall, and the scrapes drift off a regular
#: grid (~0.1 s a round), so a twin sampled on its own grid differed by that much from its own time average
TWIN_SERIES_S = 0.1


def at_instants(series: dict, times: np.ndarray) -> dict:
    """``series`` (``time_s`` ascending) read at ``times``: at each, the last sample at or before it."""
    t = np.asarray(series["time_s"], float)
    idx = np.clip(np.searchsorted(t, times, side="right") - 1, 0, len(t) - 1)
    return {"time_s": np.asarray(times, float), **{k: np.asarray(v)[idx] for k, v in series.items() if k != "time_s"}}


def _twin_series(raw: list[dict], real_series: dict, scrape_s: float, T: float) -> dict[int, dict]:
    """Each GPU's twin series read where the real one was scraped (a GPU without a real series: every
    ``scrape_s`` from 0 to ``T``)."""
    out = {}
    for r in raw:
        if not r.get("timeseries"):
            continue
        real = real_series.get(r["gpu"])
        times = real["time_s"] if real is not None and len(real["time_s"]) else np.arange(0.0, T + 1e-9, scrape_s)
        out[r["gpu"]] = at_instants({k: np.asarray(v, float) for k, v in r["timeseries"].items()}, times)
    return out


def plot_gpu(g: int, real: dict | None, twin: dict | None, req_rows: list[dict], twin_raw: dict | None) -> bytes:
    """PNG: real vs twin over time on GPU ``g``: running, waiting, KV usage, TTFT by arrival."""
    # matplotlib only where plots are drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    for ax, key, label in zip(axes, ("running", "waiting", "kv_usage"), ("running", "waiting", "KV cache usage")):
        if twin is not None:
            ax.plot(twin["time_s"], twin[key], label="twin", color="tab:blue")
        if real is not None:
            ax.plot(real["time_s"], real[key], "o-", ms=3, label="real", color="tab:orange")
        ax.set_title(f"GPU {g}: {label}")
        ax.set_xlabel("time (s)")
        ax.legend()
    ax = axes[3]
    if twin_raw is not None and twin_raw.get("samples"):
        s = twin_raw["samples"]
        ax.plot(s["arrival_s"][s["done"]], s["ttft_ms"], ".", ms=3, label="twin", color="tab:blue")
    ok = [r for r in req_rows if r["gpu"] == g and r["status"] == "ok"]
    ax.plot([r["arrival_s"] for r in ok], [r["ttft_ms"] for r in ok], ".", ms=3, label="real", color="tab:orange")
    ax.set_title(f"GPU {g}: TTFT by arrival")
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _real_evaluation(p: Placement, wl: Workload, records, req, target, series: dict, T: float, grace_s: float,
                     speed: float, refused: np.ndarray | None = None) -> dict:
    """The measured evaluation, per GPU as the twin's.  Requests the server refused by its admission
    rules (``refused``: a 400 before any work) are no load on the GPU: left out of its arrivals and
    incoming tokens, as the twin never gets them, and counted as failed."""
    res = []
    refused = np.zeros(len(target), bool) if refused is None else np.asarray(refused, bool)
    for g in range(len(p.gpus)):
        s = series.get(g)
        pre = 0
        if s is not None and len(s["preemptions_total"]) > 1:
            pre = int(np.nanmax(s["preemptions_total"]) - np.nanmin(s["preemptions_total"]))
        res.append(gpu_result(g, records, req, np.flatnonzero((target == g) & ~refused), speed, T, pre, wl.rho))
        res[-1]["failed"] += int(((target == g) & refused).sum())
    lost = target < 0
    lost_tokens = float((req.in_len[lost].astype(np.int64) + req.out_len[lost]).sum())
    ev = evaluation_from_results(p, wl, res, req, T, grace_s, Criterion(rho=wl.rho), int(lost.sum()), lost_tokens)
    for g, r in zip(ev["per_gpu"], res):
        g["failed"] = r["failed"]
    ev["failed"] = sum(r["failed"] for r in res)
    ev["gpus_unreachable"] = sum(r["status"] == "unreachable" for r in res)
    return ev


def validate_placement(p: Placement, wl: Workload, urls: dict[int, str], out: str | Path, *, speed: float = 1.0,
                       scrape_s: float = 5.0, workers: int | None = None, meta: dict | None = None,
                       tracking_uri: str | None = None, track: bool = True,
                       progress: bool = True, requests=None) -> tuple[dict, int]:
    """Replay ``wl``'s evaluation traffic (``evaluate``'s requests and routing) on the endpoints
    ``urls`` (GPU -> URL), compare with the twin, write everything under ``out`` and log one
    MLflow run.  The measurement is on disk before the twin runs (``requests.csv``,
    ``timeseries.csv``, ``real.json``, ``bench.json``); the twin gets the requests as the endpoints
    admit them (:func:`admit_requests`).  (summary, exit status: ``EXIT_OK``,
    ``EXIT_NOT_ACCEPTABLE`` when requests failed, ``EXIT_TWIN_FAILED`` when the twin could not run
    -- the measurement and the reason (``twin_error.json``) are written --, ``EXIT_INTERRUPTED``
    after Ctrl-C).  ``requests``: these requests instead of the workload's evaluation traffic (a
    request log), replayed on both sides."""
    out = Path(out)
    T = wl.evaluation.duration_s
    grace_s = min(GRACE_S, T / 2)
    req = requests if requests is not None else workload_requests(wl, min(g.max_model_len for g in p.gpus))
    target = route_requests(p, req, wl.evaluation.seed)
    models = [a.id for a in p.adapters]
    versions = endpoint_versions(urls)
    accepts = endpoint_prompt_tokens(urls)
    limits = {g: a.max_model_len for g, a in accepts.items()}
    # one model behind every endpoint (the placement's): the first pool of ids one of them gave
    prompts = next((a for a in accepts.values() if a.ids), PromptTokens())
    if progress:
        log.info(f"replaying {len(req):,} requests over {T:g} s (x{speed:g}: {T / speed:,.0f} s of wall time) "
                 f"on {len(urls)} endpoint(s); Ctrl-C stops and writes what was measured")
    records, scrapes, interrupted = replay_and_scrape(urls, req, target, models, speed=speed, end_s=T,
                                                      scrape_s=scrape_s, prompts=prompts)
    # what was measured goes to disk first: nothing computed after this point can lose it
    url_of = [urls.get(g, "") for g in range(len(p.gpus))]
    admitted, admission, admission_info = admit_requests(p, req, target, versions, limits)
    rows = request_rows(records, req, target, url_of, models, speed, admission)
    srows = series_rows(scrapes)
    atomic_write_rows(out / "requests.csv", rows, REQUEST_COLUMNS)
    atomic_write_rows(out / "timeseries.csv", srows, SERIES_COLUMNS)
    late = send_lateness_ms(records)
    lags = emulator_lags(urls)
    _warn_if_late(late, lags, speed)
    real_series = real_series_by_gpu(srows)
    real_ev = _real_evaluation(p, wl, records, admitted, target, real_series, T, grace_s, speed,
                               admission.refused)
    bench = bench_summary(records, rows, speed, T)
    info = {**(meta or {}), "speed": speed, "scrape_s": scrape_s, "duration_s": T, "seed": wl.evaluation.seed,
            "profile": p.profile, "lengths": wl.evaluation.lengths.source, "requests": int(len(req)), "endpoints": {str(g): u for g, u in urls.items()},
            "versions": {str(g): v for g, v in versions.items()}, "interrupted": interrupted,
            "client_send_late_wall_ms": late, "emulator_late_wall_ms": {str(g): v for g, v in lags.items()},
            "admission": admission_info, "prompt_tokens": prompts.source if prompts.ids else
            "; ".join(sorted({a.source for a in accepts.values()})), "twin": {"status": "running"}}
    _write_real(out, info, real_ev, bench)
    twin_raw: list = []
    twin_ev = comparison = twin_series = None
    try:
        twin_ev, comparison, twin_series, twin_raw = twin_side(p, wl, admitted, admission.refused, target, T, grace_s,
                                                               scrape_s, workers, real_ev, real_series)
    except Exception as exc:   # noqa: BLE001 - whatever stops the twin, the measurement stays (and says why)
        log.debug("the twin step failed", exc_info=True)
        info["twin"] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        twin_ev = comparison = None
    else:
        info["twin"] = {"status": "ok"}
    _write_real(out, info, real_ev, bench)
    if twin_ev is None:
        _write_twin_failure(out, info["twin"]["reason"])
        write_plots(out, rows, real_series, {}, [], set(real_series))
    else:
        write_twin(out, twin_ev, comparison, twin_series, twin_raw)
        write_plots(out, rows, real_series, twin_series, twin_raw,
                     set(real_series) | {int(k) for k in comparison["real"]})
    status = (EXIT_INTERRUPTED if interrupted else EXIT_TWIN_FAILED if twin_ev is None
              else EXIT_NOT_ACCEPTABLE if bench["failed"] else EXIT_OK)
    summary = {"info": info, "real": real_ev, "twin": twin_ev, "comparison": comparison, "bench": bench,
               "exit_status": status}
    if twin_ev is None:
        log.error(f"the twin could not run on the measured requests: {info['twin']['reason']}; the measurement is "
                  f"written ({out}/real.json, bench.json, requests.csv, timeseries.csv; the reason in "
                  f"{out}/twin_error.json)")
    if track:
        log_run(summary, out, tracking_uri)
    return summary, status


def twin_side(p: Placement, wl: Workload, admitted, refused: np.ndarray, target: np.ndarray, T: float, grace_s: float,
              scrape_s: float, workers: int | None, real_ev: dict, real_series: dict):
    """The twin on the requests the endpoints admitted (a refused one never reaches an engine), routed as
    they were, and its comparison with the measurement: (twin evaluation, comparison, twin series, raw)."""
    keep = ~refused
    twin_req = dataclasses.replace(admitted, **{f.name: np.ascontiguousarray(getattr(admitted, f.name)[keep])
                                                for f in dataclasses.fields(admitted)})
    twin_raw: list = []
    twin_ev = evaluate_placement(p, wl, requests=twin_req, duration_s=T, workers=workers, progress=False,
                                 grace_s=grace_s, timeseries_s=min(scrape_s, TWIN_SERIES_S), raw=twin_raw,
                                 gpu_of=target[keep])
    twin_series = _twin_series(twin_raw, real_series, scrape_s, T)
    return twin_ev, compare(real_ev, twin_ev, real_series, twin_series), twin_series, twin_raw


def _profile_version(profile: str) -> str | None:
    """The vLLM version a profile was measured on, or None when it cannot be read."""
    try:
        return load_profile(profile).vllm_version
    except Exception:  # noqa: BLE001 - only a fallback for endpoints that do not say their version
        return None


def admit_requests(p: Placement, req, target: np.ndarray, versions: dict[int, str],
                   limits: dict[int, int | None]):
    """The requests as each GPU's endpoint admits them (:func:`twin.admission.admit`):
    its ``max_model_len`` from ``/v1/models`` (else the placement's), the clamping rule of the
    version its ``/version`` says (else the profile's; else today's vLLM, which clamps).
    (requests with the admitted output lengths -- refused ones keep theirs --, the per-request
    :class:`Admission`, the per-GPU summary for ``real.json``'s ``info.admission``)."""
    out_len = req.out_len.astype(np.int64)
    refused = np.zeros(len(req), bool)
    clamped = np.zeros(len(req), bool)
    per_gpu = {}
    profile_version = None
    for g in range(len(p.gpus)):
        sel = np.flatnonzero(target == g)
        if not len(sel):
            continue
        version, version_from = versions.get(g), "endpoint"
        clamps = clamps_max_tokens(version)
        if clamps is None:
            profile_version = profile_version or _profile_version(p.profile)
            version, version_from = profile_version, f"profile {p.profile}"
            clamps = clamps_max_tokens(version)
        if clamps is None:
            version, version_from, clamps = None, "none known: assumed to clamp, as vLLM >= 0.32", True
        mml = limits.get(g)
        mml_from = "endpoint" if mml else "placement"
        mml = mml or p.gpus[g].max_model_len
        if mml != p.gpus[g].max_model_len:
            log.warning(f"GPU {g}: the endpoint serves max_model_len {mml}, the placement says "
                        f"{p.gpus[g].max_model_len}: what the endpoint admits follows its own")
        a = admit(req.in_len[sel], req.out_len[sel], mml, clamps)
        out_len[sel], refused[sel], clamped[sel] = a.out_len, a.refused, a.clamped
        per_gpu[str(g)] = {"max_model_len": int(mml), "max_model_len_from": mml_from, "vllm_version": version,
                           "version_from": version_from, "clamps_max_tokens": bool(clamps),
                           "clamped": int(a.clamped.sum()), "refused": int(a.refused.sum())}
    admission = Admission(out_len=np.where(refused, req.out_len, out_len), refused=refused, clamped=clamped)
    admitted = dataclasses.replace(req, out_len=np.ascontiguousarray(admission.out_len, req.out_len.dtype))
    return admitted, admission, {"clamped": int(clamped.sum()), "refused": int(refused.sum()), "per_gpu": per_gpu}


#: wall ms of client send lateness (p99) or emulated first-token lateness (mean), x speed, above which a warning
#: says the machine, not the server, is in the numbers
LATE_WARN_SIM_MS = 50.0


def _warn_if_late(late: dict, lags: dict, speed: float) -> None:
    """Say so when the client could not keep time (an oversubscribed machine): TTFT is timed from
    the actual send, as ``vllm bench serve`` does, but a late send shifts the server's schedule;
    and when an emulated endpoint stepped late, its tokens -- hence TTFT -- came late."""
    if late["p99"] * speed > LATE_WARN_SIM_MS:
        log.warning(f"the client sent late: p99 {late['p99']:.1f} ms of wall time (x{speed:g} = "
                    f"{late['p99'] * speed:.0f} simulated ms) after the arrival times; TTFT is timed from the "
                    "actual send (as vllm bench serve does); a busy machine: lower --speed")
    worst = max((v["first_token_late_ms"].get("mean", 0.0) for v in lags.values()), default=0.0)
    if worst * speed > LATE_WARN_SIM_MS:
        log.warning(f"an emulated endpoint sent first tokens late: mean {worst:.1f} ms of wall time (x{speed:g} = "
                    f"{worst * speed:.0f} simulated ms) after their due time; TTFT includes that; lower --speed")


def _write_real(out: Path, info: dict, real_ev: dict, bench: dict) -> None:
    """The measured run: ``real.json`` (the evaluate schema, ``info`` with the run's facts and the
    twin's status) and ``bench.json`` (``vllm bench serve``'s result format)."""
    atomic_write_json(out / "real.json", {"info": info, **real_ev})
    atomic_write_json(out / "bench.json", {"backend": "openai", "endpoint_type": "openai", "label": "lora-opt validate",
                                           "model_id": info["profile"], "num_prompts": info["requests"],
                                           "request_rate": "trace", "burstiness": None, "max_concurrency": None,
                                           **bench, "lora_opt_validate": info})


#: the twin's outputs: a failed twin step removes those of an earlier run in the same directory
TWIN_FILES = ("twin.json", "comparison.json", "twin_timeseries.csv")
TWIN_ERROR_FILE = "twin_error.json"


def write_twin(out: Path, twin_ev, comparison, twin_series, twin_raw) -> None:
    """The twin's half of a validation run directory: ``twin.json``, ``comparison.json``,
    ``twin_timeseries.csv`` (and no twin-failure file)."""
    atomic_write_json(out / "twin.json", twin_ev)
    atomic_write_json(out / "comparison.json", comparison)
    twin_rows = [{"time_s": t, "gpu": g, **{k: s[k][i] for k in ("running", "waiting", "kv_usage")}}
                 for g, s in sorted(twin_series.items()) for i, t in enumerate(s["time_s"])]
    atomic_write_rows(out / "twin_timeseries.csv", twin_rows, ("time_s", "gpu", "running", "waiting", "kv_usage"))
    (out / TWIN_ERROR_FILE).unlink(missing_ok=True)


def _write_twin_failure(out: Path, reason: str) -> None:
    for name in TWIN_FILES:          # a twin of another run beside this measurement would mislead
        (out / name).unlink(missing_ok=True)
    atomic_write_json(out / TWIN_ERROR_FILE, {"status": "failed", "reason": reason, "exit_status": EXIT_TWIN_FAILED,
                                              "measured": ["real.json", "bench.json", "requests.csv", "timeseries.csv"]})


def write_plots(out: Path, rows, real_series: dict, twin_series: dict, twin_raw: list, gpus: set) -> None:
    """Per GPU in ``gpus``: the real and twin time series and latency plots of a validation run."""
    raw_by_gpu = {r["gpu"]: r for r in twin_raw}
    for g in sorted(gpus):
        atomic_write_bytes(out / "plots" / f"gpu{g}.png",
                           plot_gpu(g, real_series.get(g), twin_series.get(g), rows, raw_by_gpu.get(g)))


def placement_hash(path: str | Path) -> str:
    """sha256 of the placement file's bytes (first 16 hex digits)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def log_run(summary: dict, out: Path, tracking_uri: str | None) -> str:
    """One MLflow run in experiment ``validation``: params, real / twin / SMAPE metrics, the output
    directory as artifacts.  Returns the run id."""
    # mlflow only where a run is logged
    import mlflow

    info = summary["info"]
    with tracked_run("validation", run_name=f"validate {info.get('placement_hash', '')}",
                     tracking_uri=tracking_uri, profile=info["profile"], seeds={"evaluation": info["seed"]}) as run:
        mlflow.log_params({
            "placement": str(info.get("placement", "")), "placement_hash": info.get("placement_hash", ""),
            "profile": info["profile"], "seed": info["seed"], "duration_s": info["duration_s"],
            "speed": info["speed"], "gpu": info.get("gpu") or "", "requests": info["requests"],
            "endpoint_version": ",".join(sorted(set(info["versions"].values()))),
            "endpoints": " ".join(info["endpoints"].values())[:500], "interrupted": info["interrupted"],
            "twin_status": info["twin"]["status"], "twin_error": info["twin"].get("reason", "")[:500],
            "clamped": info["admission"]["clamped"], "refused": info["admission"]["refused"]})
        keys = ("throughput_tok_s", "ttft_ms", "itl_ms", "completed", "requests", "gpus_starving", "failed")
        log_flat_metrics("real", {k: summary["real"].get(k) for k in keys})
        if summary["twin"] is not None:          # None: the twin step failed (twin_error param)
            log_flat_metrics("twin", {k: summary["twin"].get(k) for k in keys})
            c = summary["comparison"]
            log_flat_metrics("smape", {"metric": c["smape_per_metric"], "gpu": c["smape_per_gpu"],
                                       "fleet": c["smape_fleet"]})
        log_flat_metrics("bench", {k: v for k, v in summary["bench"].items() if isinstance(v, (int, float))})
        log_dir(out)
        return run.info.run_id
