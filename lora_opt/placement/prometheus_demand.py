"""Demand read from Prometheus: each adapter's request rate and the requests' lengths over a window,
from the gateway's per-adapter series under the Gateway API Inference Extension's names (its endpoint
picker exports them; so does ``lora-opt emulate``'s router: :mod:`lora_opt.emulate.router_metrics`),
through Prometheus' HTTP API (``/api/v1/query``, PromQL):

- rate of adapter a: ``increase(inference_model_request_total{model_name=a}[W]) / W`` (Prometheus
  extrapolates the counter to the window's ends);
- lengths: the mean of ``inference_model_input_tokens`` / ``_output_tokens`` (``increase`` of ``_sum``
  over ``_count``) and their spread from the histogram's buckets (each bucket at its midpoint: coarse,
  the buckets are powers of 2), fleet-wide (the twin draws every adapter's lengths from one model) and
  per adapter (reported).

Every query is evaluated at one instant (the same ``time``), so the numbers are of one window.  The
problems a user meets are errors naming them: a server that does not answer, no series of the
gateway's metric, series that stopped (the gateway is not scraped any more), a window shorter than
two scrape intervals (``increase`` needs two samples in it)."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from lora_opt.errors import InputError
from lora_opt.placement.workload_file import Workload
from twin.scenario import LengthConfig

REQUESTS = "inference_model_request_total"
INPUT_TOKENS = "inference_model_input_tokens"
OUTPUT_TOKENS = "inference_model_output_tokens"
#: seconds one HTTP call to Prometheus may take
TIMEOUT_S = 30.0
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")


def parse_duration(text: str, where: str = "--window") -> float:
    """Seconds of a Prometheus duration (``1h``, ``90s``, ``1h30m``)."""
    if not isinstance(text, str) or not text or _DURATION.sub("", text):
        raise InputError(f"{where}: {text!r} is not a duration (a number and a unit: ms, s, m, h, d, w, y; e.g. 1h, 15m)")
    seconds = sum(int(n) * _UNITS[u] for n, u in _DURATION.findall(text))
    if seconds <= 0:
        raise InputError(f"{where}: must be > 0, got {text!r}")
    return seconds


@dataclass(frozen=True)
class PrometheusDemand:
    """What the gateway's series say about one window."""

    url: str
    """The Prometheus server asked."""
    window: str
    """The window, as given (PromQL duration)."""
    window_s: float
    """The window in seconds."""
    at: float
    """The instant every query was evaluated at (Unix seconds): the window's end."""
    scrape_interval_s: float
    """The longest scrape interval of Prometheus' active targets."""
    rates: dict[str, float]
    """Model name -> requests per second over the window."""
    requests: float
    """Requests in the window (all models; extrapolated, so not always whole)."""
    lengths: dict | None
    """Fleet-wide mean_in, std_in, mean_out, std_out (None: no response carried token counts)."""
    per_model_lengths: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Model name -> (mean input, mean output tokens)."""

    def summary(self) -> str:
        """What was read, in one line (``place`` and ``replan --prometheus`` print it)."""
        lengths = (f"; lengths in {self.lengths['mean_in']:.0f} +- {self.lengths['std_in']:.0f}, out "
                   f"{self.lengths['mean_out']:.0f} +- {self.lengths['std_out']:.0f} tokens" if self.lengths
                   else "; no token counts (the workload's lengths kept)")
        return (f"rates from {self.url}: {self.requests:,.0f} requests of {len(self.rates)} model(s) over the last "
                f"{self.window} (scrape interval {self.scrape_interval_s:g} s){lengths}")


class Prometheus:
    """Prometheus' HTTP API at ``url`` (plain HTTP GETs; no proxy from the environment)."""

    def __init__(self, url: str):
        parts = urllib.parse.urlparse(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InputError(f"--prometheus: {url!r} is not an http(s) URL of a Prometheus server")
        self.url = url.rstrip("/")
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    def get(self, path: str, **params) -> dict:
        """``data`` of a successful API answer; InputError for an unreachable server or an API error."""
        query = urllib.parse.urlencode(params)
        where = f"{self.url}{path}"
        try:
            with self._open(f"{where}?{query}" if query else where, timeout=TIMEOUT_S) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read())
            except ValueError:
                raise InputError(f"--prometheus: {where} answered HTTP {exc.code}: is {self.url} a Prometheus server?") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(f"--prometheus: the Prometheus server at {self.url} does not answer ({reason})") from None
        except ValueError:
            raise InputError(f"--prometheus: {where} did not answer JSON: is {self.url} a Prometheus server?") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else body
            kind = body.get("errorType") if isinstance(body, dict) else None
            raise InputError(f"--prometheus: {where} refused {params.get('query') or 'the request'!r}: "
                             f"{kind + ': ' if kind else ''}{error}")
        return body.get("data") or {}

    def query(self, promql: str, at: float) -> list[tuple[dict, float]]:
        """(labels, value) of an instant query's vector (a scalar: one row with no labels); a query Prometheus
        refuses (a PromQL error: ``bad_data``; a timeout) is an :class:`InputError` naming it and why."""
        data = self.get("/api/v1/query", query=promql, time=f"{at:.3f}")
        if data.get("resultType") == "scalar":
            return [({}, float(data["result"][1]))]
        return [(row.get("metric", {}), float(row["value"][1])) for row in data.get("result", [])]

    def scrape_interval_s(self) -> float:
        """The longest scrape interval of the active targets (``/api/v1/targets``)."""
        targets = self.get("/api/v1/targets", state="active").get("activeTargets", [])
        intervals = [parse_duration(t["scrapeInterval"], "scrapeInterval") for t in targets if t.get("scrapeInterval")]
        if not intervals:
            raise InputError(f"--prometheus: {self.url} scrapes no target (its /api/v1/targets lists none active)")
        return max(intervals)


def _by_model(rows) -> dict[str, float]:
    return {labels.get("model_name", ""): v for labels, v in rows if math.isfinite(v)}


def _spread(buckets: list[tuple[dict, float]]) -> float:
    """Standard deviation of a cumulative histogram (``le`` -> count), each bucket at its midpoint."""
    edges = sorted((float(labels["le"]), v) for labels, v in buckets if labels.get("le") not in (None, "+Inf"))
    if not edges:
        return 0.0
    le = np.array([e for e, _ in edges])
    counts = np.diff(np.array([0.0] + [c for _, c in edges]))
    counts = np.maximum(counts, 0.0)
    lo = np.concatenate([[0.0], le[:-1]])
    mid = (lo + le) / 2
    n = counts.sum()
    if n <= 0:
        return 0.0
    mean = float((mid * counts).sum() / n)
    return float(math.sqrt(max(0.0, float((counts * (mid - mean) ** 2).sum() / n))))


def _check_series(prom: Prometheus, window: str, at: float, interval: float) -> None:
    """No series at all, or series that stopped: errors that say which."""
    now = prom.query(f"max(timestamp({REQUESTS}))", at)
    if now and math.isfinite(now[0][1]):
        age = at - now[0][1]
        if age > 3 * interval + 5:
            raise InputError(f"--prometheus: the series {REQUESTS} are stale: their last sample is {age:.0f} s old "
                             f"(scrape interval {interval:g} s); is the gateway still scraped?")
        return
    seen = prom.query(f"count(last_over_time({REQUESTS}[{window}]))", at)
    if seen and seen[0][1] > 0:
        raise InputError(f"--prometheus: the series {REQUESTS} stopped within the window ({window}): none now; is "
                         "the gateway still scraped (its target down)?")
    raise InputError(f"--prometheus: {prom.url} has no series {REQUESTS} (the gateway's per-adapter request counter: "
                     "the Gateway API Inference Extension's endpoint picker, or lora-opt emulate's router /metrics): "
                     "is the gateway scraped?")


def read_demand(url: str, window: str, at: float | None = None) -> PrometheusDemand:
    """The demand of the ``window`` ending ``at`` (default: now) from the Prometheus at ``url``."""
    window_s = parse_duration(window)
    prom = Prometheus(url)
    at = time.time() if at is None else float(at)
    interval = prom.scrape_interval_s()
    if window_s < 2 * interval:
        raise InputError(f"--window: {window} is shorter than two scrape intervals ({2 * interval:g} s; Prometheus "
                         f"scrapes every {interval:g} s): a rate needs two samples in the window")
    _check_series(prom, window, at, interval)
    counts = _by_model(prom.query(f"sum by (model_name) (increase({REQUESTS}[{window}]))", at))
    rates = {m: max(0.0, c) / window_s for m, c in counts.items()}
    stats = {}
    for name, metric in (("in", INPUT_TOKENS), ("out", OUTPUT_TOKENS)):
        s = _by_model(prom.query(f"sum by (model_name) (increase({metric}_sum[{window}]))", at))
        n = _by_model(prom.query(f"sum by (model_name) (increase({metric}_count[{window}]))", at))
        buckets = prom.query(f"sum by (le) (increase({metric}_bucket[{window}]))", at)
        stats[name] = (s, n, buckets)
    total_n = sum(stats["in"][1].values())
    lengths = None
    if total_n > 0:
        lengths = {f"mean_{k}": sum(stats[k][0].values()) / max(sum(stats[k][1].values()), 1e-12) for k in ("in", "out")}
        lengths.update({f"std_{k}": _spread(stats[k][2]) for k in ("in", "out")})
    per_model = {m: (stats["in"][0].get(m, 0.0) / n, stats["out"][0].get(m, 0.0) / max(stats["out"][1].get(m, 0.0), 1e-12))
                 for m, n in stats["in"][1].items() if n > 0}
    return PrometheusDemand(url=prom.url, window=window, window_s=window_s, at=at, scrape_interval_s=interval,
                            rates=rates, requests=float(sum(max(0.0, c) for c in counts.values())), lengths=lengths,
                            per_model_lengths=per_model)


def workload_from_demand(wl: Workload, demand: PrometheusDemand, where: str = "--prometheus") -> Workload:
    """``wl``'s adapters (ids, ranks), engine and rho with the window's rates (an adapter with no
    request in it: rate 0) and, when the responses carried token counts, its lengths (``normal``
    with the window's means and spreads).  A model the window saw that ``wl`` does not have is an
    error (its rank is unknown: give it in a workload file)."""
    ids = {a.id for a in wl.adapters}
    unknown = sorted(m for m, r in demand.rates.items() if m not in ids and r > 0)
    if unknown:
        raise InputError(f"{where}: requests for model(s) not in the workload: "
                         f"{', '.join(repr(u)[1:-1][:60] for u in unknown[:5])}{' ...' if len(unknown) > 5 else ''} "
                         "(a new adapter needs a workload file that gives its rank; base-model traffic is not an "
                         "adapter's demand)")
    if not any(demand.rates.get(i, 0.0) > 0 for i in ids):
        raise InputError(f"{where}: no request for any adapter in the window ({demand.window} ending "
                         f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(demand.at))})")
    adapters = tuple(dataclasses.replace(a, rate=float(demand.rates.get(a.id, 0.0))) for a in wl.adapters)
    evaluation = wl.evaluation
    if demand.lengths is not None:
        lengths = LengthConfig(source="normal", mean_in=demand.lengths["mean_in"], std_in=demand.lengths["std_in"],
                               mean_out=demand.lengths["mean_out"], std_out=demand.lengths["std_out"])
        evaluation = dataclasses.replace(evaluation, lengths=lengths)
    meta = {**wl.meta, "rates_from_prometheus": demand.url, "prometheus_window": demand.window,
            "prometheus_window_end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(demand.at)),
            "prometheus_requests": round(demand.requests, 3), "prometheus_scrape_interval_s": demand.scrape_interval_s,
            "lengths_from_prometheus": demand.lengths is not None}
    return dataclasses.replace(wl, adapters=adapters, evaluation=evaluation, meta=meta)
