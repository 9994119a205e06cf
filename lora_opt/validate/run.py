"""``lora-opt validate``'s work as one call: ``validate(ValidateOptions(...))`` loads the placement and the
workload it was made for, then replays the workload's requests (or a request log's) on the endpoints once
(:func:`lora_opt.validate.report.validate_placement`), K times to judge the twin against the server's own
spread (:mod:`lora_opt.validate.repeats`, one more MLflow run for the K), or sends nothing and runs the twin
again on a stored run (:mod:`lora_opt.validate.retwin`).  ``validate_report`` is what the command prints."""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lora_opt.errors import EXIT_TWIN_FAILED, InputError
from lora_opt.io import atomic_write_json
from lora_opt.placement.evaluate import evaluation_table, with_evaluation, workload_from_placement
from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import Workload, load_request_log, load_workload
from lora_opt.tracking import log_command_run
from lora_opt.validate.live import resolve_endpoints
from lora_opt.validate.repeats import noise_lines, noise_table, wait_idle
from lora_opt.validate.report import placement_hash, validate_placement
from lora_opt.validate.retwin import retwin

log = logging.getLogger(__name__)

#: the request-source fields a stored run fixes: ``twin_only`` refuses them
REQUEST_FIELDS = ("arrivals", "trace", "history", "mapping", "time_scale", "start_s", "lengths", "duration", "seed")


@dataclass(frozen=True)
class ValidateOptions:
    """What ``validate`` does: the placement, where its traffic goes (``endpoints``) or which stored run the
    twin runs again on (``twin_only``), the requests, and the replay's settings."""

    placement: str
    """``placement.json`` written by ``lora-opt place`` (or the directory holding it)."""
    endpoints: list[str] | None = None
    """``router.json`` (adapter -> endpoints, as ``place --emit-vllm`` writes it), or one URL per GPU
    (``http://HOST:PORT[/v1]``) in GPU order: one per GPU of the placement or one per used GPU
    (:func:`lora_opt.validate.live.resolve_endpoints`).  Exactly one of this and ``twin_only``."""
    twin_only: str | None = None
    """Send nothing: run the twin again on the requests of the validation stored in this directory (an
    earlier ``out``) with the placement's profile as it is now, compare with what was measured there and
    rewrite the twin's files there.  The stored run fixes the requests: no field of ``REQUEST_FIELDS``."""
    workload: str | None = None
    """Workload file (its evaluation section: arrivals, lengths, seed); None: Poisson at the placement's
    rates."""
    arrivals: str | None = None
    """Arrival process (``twin.scenario.ARRIVAL_PROCESSES``), as evaluate takes it."""
    trace: str | None = None
    """Trace to replay (a bundled one or a CSV); implies arrivals ``trace``."""
    history: str | None = None
    """Request log (``place --history``'s) whose requests are replayed on the endpoints and on the twin."""
    mapping: str | None = None
    """Trace requests -> adapters (``twin.scenario.TRACE_MAPPINGS``)."""
    time_scale: float | None = None
    """Trace: multiply inter-arrival times (< 1 = more load)."""
    start_s: float | None = None
    """Trace: skip this many (scaled) seconds."""
    lengths: str | None = None
    """Length model (``twin.scenario.LENGTH_SOURCES``)."""
    duration: float | None = None
    """Replayed (simulated) seconds (None: the workload's; with ``history``: the log's span)."""
    seed: int | None = None
    """Seed of arrivals, lengths and routing draws (None: the workload's)."""
    speed: float = 1.0
    """Simulated seconds per wall second: the endpoints are ``lora-opt emulate --speed X`` (1: real time,
    what a real vLLM needs)."""
    scrape_s: float = 5.0
    """Scrape each endpoint's ``/metrics`` every this many (simulated) seconds."""
    repeats: int | None = None
    """Replay the same requests this many (>= 2) times (``out/repeat-1`` .. ``repeat-K``, the endpoints
    drained between them) and judge the twin against the server's own spread (``out/noise.json``)."""
    out: str = "validation"
    """Output directory."""
    gpu: str = ""
    """The GPU's name, recorded with the run (e.g. H100-80GB)."""
    workers: int | None = None
    """Parallel twin simulations (None: all cores; ``twin_only`` passes it on as given)."""
    track: bool = True
    """Log MLflow runs (experiment ``validation``): one per replay, and one for the K repeats."""
    tracking_uri: str | None = None
    """MLflow tracking URI (None: the configured one, ``lora_opt.tracking.resolve_tracking_uri``)."""
    progress: bool = False
    """Say what is being replayed (an INFO line) as the replay starts."""
    on_repeat: Callable[[str], None] | None = field(default=None, compare=False)
    """Called with each repeat's line (``repeat k/K: ...``) as that repeat finishes (the command prints it);
    the lines are also in ``ValidateOutcome.repeat_lines``."""

    def __post_init__(self):
        if (self.endpoints is None) == (self.twin_only is None):
            raise InputError("validate: give the endpoints or a stored run (twin_only), one of them")


@dataclass
class ValidateOutcome:
    """What ``validate`` did."""

    mode: str
    """``replay`` (once), ``repeats`` (K replays) or ``twin-only`` (the twin again on a stored run)."""
    code: int
    """The exit status (``lora_opt.errors``: 0 every request succeeded, 3 some failed, 5 the twin step failed
    -- with repeats: the twin ran in fewer than 2 --, 130 Ctrl-C)."""
    placement: Path
    """The placement file validated."""
    profile: str
    """The placement's profile."""
    out: str
    """Where the outputs are, as given: the output directory, or the stored run (``twin-only``)."""
    urls: dict[int, str] = field(default_factory=dict)
    """GPU -> endpoint URL (none for ``twin-only``)."""
    summary: dict | None = None
    """``replay``: :func:`~lora_opt.validate.report.validate_placement`'s summary; ``twin-only``:
    :func:`~lora_opt.validate.retwin.retwin`'s."""
    repeats: int = 0
    """``repeats``: the replays run."""
    twin_ran: int = 0
    """``repeats``: in how many of them the twin ran."""
    noise: dict | None = None
    """``repeats``: :func:`~lora_opt.validate.repeats.noise_table` (None: the twin ran in fewer than 2)."""
    repeat_lines: list[str] = field(default_factory=list)
    """``repeats``: one line per replay, as ``on_repeat`` got them."""


def _load(options: ValidateOptions) -> tuple[Path, Placement, Workload]:
    """The placement file, the placement, and the workload (given, or the placement's), checked to list the
    same adapters."""
    path = Path(options.placement)
    if path.is_dir():
        path = path / "placement.json"
    if not path.is_file():
        raise InputError(f"placement file not found: {options.placement}")
    p = Placement.load(path)
    wl = load_workload(options.workload) if options.workload else workload_from_placement(p)
    if [a.id for a in wl.adapters] != [a.id for a in p.adapters]:
        raise InputError("placement and workload list different adapters (ids or order); validate the placement "
                         "with the workload it was made for")
    return path, p, wl


def validate(options: ValidateOptions) -> ValidateOutcome:
    """``lora-opt validate`` as one call: the placement's traffic replayed on the endpoints and compared with
    the twin (once, or ``options.repeats`` times), or the twin again on a stored run (``options.twin_only``);
    the files written, the MLflow runs logged.  Bad input raises ``InputError``."""
    path, p, wl = _load(options)
    if options.twin_only:
        return _twin_only(options, path, p, wl)
    requests = None
    if options.history:
        requests, span = log_requests(wl, options.history, options.duration)
        wl = with_evaluation(wl, duration_s=options.duration or span, seed=options.seed)
    else:
        wl = with_evaluation(wl, process=options.arrivals, trace=options.trace, mapping=options.mapping,
                             time_scale=options.time_scale, start_s=options.start_s, lengths=options.lengths,
                             duration_s=options.duration, seed=options.seed)
    urls = resolve_endpoints(p, options.endpoints)
    meta = {"placement": str(path), "placement_hash": placement_hash(path), "gpu": options.gpu,
            "workload": wl.name, "requests_from": options.history or options.trace or wl.evaluation.arrivals.process}
    if options.repeats:
        return _repeats(options, p, wl, urls, meta, requests)
    summary, status = _replay(options, p, wl, urls, Path(options.out), meta, requests)
    return ValidateOutcome("replay", status, path, p.profile, options.out, urls, summary)


def _replay(options: ValidateOptions, p: Placement, wl: Workload, urls: dict[int, str], out: Path, meta: dict,
            requests) -> tuple[dict, int]:
    return validate_placement(p, wl, urls, out, speed=options.speed, scrape_s=options.scrape_s,
                              workers=options.workers, meta=meta, tracking_uri=options.tracking_uri,
                              track=options.track, progress=options.progress, requests=requests)


def _repeats(options: ValidateOptions, p: Placement, wl: Workload, urls: dict[int, str], meta: dict,
             requests) -> ValidateOutcome:
    """K replays of the same requests, then the twin judged against the server's own spread."""
    out, k_all = Path(options.out), options.repeats
    done = ValidateOutcome("repeats", 0, Path(meta["placement"]), p.profile, options.out, urls, repeats=k_all)
    comparisons, statuses = [], []
    for k in range(1, k_all + 1):
        if k > 1 and not wait_idle(urls):
            log.warning("repeat %d: the endpoints still had requests after 600 s of waiting; replaying anyway", k)
        summary, status = _replay(options, p, wl, urls, out / f"repeat-{k}", {**meta, "repeat": k}, requests)
        statuses.append(status)
        if summary["comparison"] is not None:
            comparisons.append(summary["comparison"])
        b = summary["bench"]
        done.repeat_lines.append(f"repeat {k}/{k_all}: {b['completed']:,} ok, {b['failed']:,} failed -> "
                                 f"{out}/repeat-{k}/")
        if options.on_repeat is not None:
            options.on_repeat(done.repeat_lines[-1])
    done.twin_ran = len(comparisons)
    if len(comparisons) < 2:
        done.code = max(statuses + [EXIT_TWIN_FAILED])
        return done
    done.noise, done.code = noise_table(comparisons), max(statuses)
    atomic_write_json(out / "noise.json", done.noise, indent=1, default=float)
    log_command_run("validation", f"{wl.name} x{k_all}", params={"placement": meta["placement"],
                    "repeats": k_all, "noise_factor": done.noise["noise_factor"]},
                    metrics={m: {k: v for k, v in e.items() if k != "within_noise"}
                             for m, e in done.noise["per_metric"].items()},
                    artifacts=[str(out / "noise.json")], seeds={"evaluation": wl.evaluation.seed},
                    tracking_uri=options.tracking_uri, track=options.track)
    return done


def _twin_only(options: ValidateOptions, path: Path, p: Placement, wl: Workload) -> ValidateOutcome:
    given = [f for f in REQUEST_FIELDS if getattr(options, f) is not None]
    if given:
        raise InputError(f"--twin-only takes the stored run's requests; drop --{given[0].replace('_', '-')}")
    res = retwin(options.twin_only, p, wl, workers=options.workers)
    return ValidateOutcome("twin-only", 0, path, p.profile, options.twin_only, summary=res)


def log_requests(wl: Workload, path: str, duration: float | None):
    """The request log's requests (those arriving before ``duration``) and its span."""
    _, req, span = load_request_log(wl, path)
    keep = req.arrival < (duration or span)
    return dataclasses.replace(req, **{f.name: np.ascontiguousarray(getattr(req, f.name)[keep])
                                       for f in dataclasses.fields(req)}), span


def validate_report(done: ValidateOutcome, as_json: bool = False) -> str:
    """What ``lora-opt validate`` prints after the work (with repeats, after each repeat's line): the
    summary as text, or (``as_json``) as one JSON object."""
    if done.mode == "twin-only":
        return _twin_only_report(done, as_json)
    if done.mode == "repeats":
        return _repeats_report(done, as_json)
    summary = done.summary
    if as_json:
        return json.dumps({k: summary[k] for k in ("info", "comparison", "bench", "exit_status")}, default=str)
    b, c, info = summary["bench"], summary["comparison"], summary["info"]
    adm = info["admission"]
    lines = [f"validate {done.placement} on {len(done.urls)} endpoint(s) "
             f"({', '.join(sorted(set(info['versions'].values())))})"
             f": {info['requests']:,} requests, {b['completed']:,} ok, {b['failed']:,} failed, "
             f"{b['unfinished']:,} unfinished at the window's end"
             + (f", {b['not_sent']:,} not sent" if b["not_sent"] else "")]
    if adm["clamped"] or adm["refused"]:
        lines.append(f"over max_model_len: {adm['clamped']:,} request(s) served with max_tokens clamped, "
                     f"{adm['refused']:,} refused by the endpoints' rules (vLLM's; left out of the twin)")
    lines += ["real:", evaluation_table(summary["real"])]
    if summary["twin"] is None:
        lines += [f"twin: could not run: {info['twin']['reason']}",
                  f"wrote {done.out}/ (real.json, bench.json, requests.csv, timeseries.csv, plots/; the twin's "
                  "failure: twin_error.json)"]
    else:
        lines += ["twin (same requests, as the endpoints admit them):", evaluation_table(summary["twin"]),
                  "SMAPE % per metric (over GPUs): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_per_metric"].items()),
                  "SMAPE % of the fleet: " + ", ".join(f"{k} {v:.1f}" for k, v in c["smape_fleet"].items()),
                  f"wrote {done.out}/ (real.json, twin.json, comparison.json, bench.json, requests.csv, "
                  "timeseries.csv, plots/)"]
    if info["interrupted"]:
        lines.append("interrupted: the outputs hold what was measured until Ctrl-C")
    return "\n".join(lines)


def _repeats_report(done: ValidateOutcome, as_json: bool) -> str:
    if done.noise is None:
        return f"the twin ran in {done.twin_ran} of {done.repeats} repeats: no spread to judge it against"
    if as_json:
        return json.dumps({"noise": done.noise, "exit_status": done.code}, default=float)
    return "\n".join([f"the server against itself ({done.twin_ran} repeats of the same requests) and the twin "
                      "against the real median, SMAPE % over the GPUs:", *noise_lines(done.noise),
                      f"wrote {Path(done.out)}/noise.json"])


def _twin_only_report(done: ValidateOutcome, as_json: bool) -> str:
    c = done.summary["comparison"]
    if as_json:
        return json.dumps({"comparison": c}, default=str)
    return "\n".join([f"validate --twin-only {done.out}: the twin again on the run's "
                      f"{done.summary['info']['requests']:,} requests (profile {done.profile})",
                      "SMAPE % per metric (over GPUs): " + ", ".join(f"{k} {v:.1f}"
                                                                    for k, v in c["smape_per_metric"].items()),
                      f"wrote {done.out}/ (twin.json, comparison.json, twin_timeseries.csv, plots/)"])
