"""The twin side of a stored validation run, again: after a recalibration, compare the new profile with
what was measured, request for request, without sending a request.  The requests, their routing and
their admission are rebuilt from the run's own record (``real.json``'s ``info``: seed, duration, the
endpoints' versions and ``max_model_len``) exactly as ``validate`` built them; the measured side
(``real.json``, ``timeseries.csv``, ``requests.csv``) is read back, never changed.  Writes what
``validate`` writes for the twin (``twin.json``, ``comparison.json``, ``twin_timeseries.csv``, the plots)."""
from __future__ import annotations

import csv
from pathlib import Path

from lora_opt.errors import InputError
from lora_opt.placement.evaluate import GRACE_S, route_requests, with_evaluation, workload_requests
from lora_opt.placement.plan import Placement
from lora_opt.placement.workload_file import Workload
from lora_opt.validate.live import SERIES_COLUMNS
from lora_opt.validate.report import admit_requests, real_series_by_gpu, twin_side, write_plots, write_twin
from twin.parsing import read_json_file
from twin.scenario import ARRIVAL_PROCESSES

#: what a stored run must hold
STORED = ("real.json", "timeseries.csv", "requests.csv")


def _csv_rows(path: Path, ints: tuple[str, ...] = ("gpu",)) -> list[dict]:
    """A CSV's rows with ``ints`` as int and every other parseable value as float (as validate wrote them)."""
    out = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            r: dict = {}
            for k, v in row.items():
                try:
                    r[k] = int(v) if k in ints else float(v)
                except (TypeError, ValueError):
                    r[k] = v
            out.append(r)
    return out


def retwin(run_dir: str | Path, p: Placement, wl: Workload, *, workers: int | None = 1, write: bool = True) -> dict:
    """Run the twin again on the requests of the validation stored in ``run_dir`` (``validate --out``) with
    the placement's profile as it is now; rewrites the twin's files there (``write``; False: nothing is
    written, e.g. a what-if profile).  ``wl``: the workload the run was validated with (its evaluation
    section; seed and duration are taken from the run).  (summary with ``comparison``, ``twin``, ``real``,
    ``info``, and ``twin_raw``: each GPU's raw twin result, its requests' samples.)"""
    run = Path(run_dir)
    missing = [n for n in STORED if not (run / n).is_file()]
    if missing:
        raise InputError(f"--twin-only {run_dir}: not a stored validation run (missing {', '.join(missing)}); "
                         "it is the --out directory of an earlier lora-opt validate")
    stored = read_json_file(run / "real.json", "stored validation", InputError, allow_nan=True)
    info = stored.pop("info")
    if info.get("requests_from") not in ARRIVAL_PROCESSES:
        raise InputError(f"--twin-only {run_dir}: the run replayed {info.get('requests_from')!r}, not the workload's "
                         f"generated arrivals ({', '.join(ARRIVAL_PROCESSES)}); rerun validate with that log instead")
    wl = with_evaluation(wl, duration_s=info["duration_s"], seed=info["seed"])
    req = workload_requests(wl, min(g.max_model_len for g in p.gpus))
    if len(req) != info["requests"]:
        raise InputError(f"--twin-only {run_dir}: the workload gives {len(req):,} requests, the run sent "
                         f"{info['requests']:,}: not the workload (or placement) the run was validated with")
    target = route_requests(p, req, wl.evaluation.seed)
    per_gpu = info["admission"]["per_gpu"]
    versions = {int(g): v for g, v in info["versions"].items()}
    limits = {int(g): d["max_model_len"] if d.get("max_model_len_from") == "endpoint" else None
              for g, d in per_gpu.items()}
    admitted, admission, _ = admit_requests(p, req, target, versions, limits)
    series_rows = _csv_rows(run / "timeseries.csv")
    real_series = real_series_by_gpu([{k: r[k] for k in SERIES_COLUMNS} for r in series_rows])
    T = float(info["duration_s"])
    twin_ev, comparison, twin_series, twin_raw = twin_side(
        p, wl, admitted, admission.refused, target, T, min(GRACE_S, T / 2), float(info["scrape_s"]), workers,
        stored, real_series)
    if not write:
        return {"comparison": comparison, "twin": twin_ev, "real": stored, "info": info, "twin_raw": twin_raw}
    write_twin(run, twin_ev, comparison, twin_series, twin_raw)
    write_plots(run, _csv_rows(run / "requests.csv", ("request", "gpu")), real_series, twin_series, twin_raw,
                 set(real_series) | {int(k) for k in comparison["real"]})
    return {"comparison": comparison, "twin": twin_ev, "real": stored, "info": info, "twin_raw": twin_raw}
