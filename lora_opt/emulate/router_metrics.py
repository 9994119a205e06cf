"""The router's own ``/metrics``: per-adapter request, token and latency series under the Gateway API
Inference Extension's names (its endpoint picker, API v1alpha2), so a Prometheus that scrapes a fleet's
gateway -- this router or the real one -- answers the same PromQL (:mod:`lora_opt.placement.prometheus_demand`).

Series (labels ``model_name`` = the request's model, ``target_model_name`` = the model sent to the
instance: the same here, the router rewrites no model):

- ``inference_model_request_total`` (counter): requests received;
- ``inference_model_request_error_total`` (counter, + ``error_code``: the HTTP status, or
  ``stream_error`` for a stream that ended with an error event);
- ``inference_model_input_tokens`` / ``inference_model_output_tokens`` (histograms): the response's
  ``usage`` (``prompt_tokens`` / ``completion_tokens``), as the endpoint picker reads it -- a stream
  carries usage only when its client asked for it (``stream_options.include_usage``; ``vllm bench
  serve`` and lora-opt's clients do); a response without usage adds to neither;
- ``inference_model_request_duration_seconds`` (histogram): wall seconds from the request's arrival at
  the router to its response's end;
- ``inference_model_running_requests`` (gauge, ``model_name``): requests whose response has not ended.

Token buckets are the endpoint picker's own (powers of 2 from 8 to 2^20, with its 32778 in place of
32768); the duration buckets are lora-opt's (the picker's are not documented in the sources read)."""
from __future__ import annotations

import re
import time

#: the endpoint picker's token-count buckets (its metrics test: 1, 8, 16, ... 2^20; 32778 sic)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
                 262144, 524288, 1048576)
#: request duration buckets (s)
DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
                    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 600.0, 1200.0, 3600.0)
_USAGE = re.compile(rb'"usage":\s*\{[^}]*?"prompt_tokens":\s*(\d+)[^}]*?"completion_tokens":\s*(\d+)')


def usage_of(data: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of the last non-null ``usage`` in a body or SSE text."""
    found = _USAGE.findall(data)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


class RouterMetrics:
    """The series above, in a registry of their own (one per router)."""

    def __init__(self):
        # prometheus_client only where a router runs
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "target_model_name")
        self.requests = Counter("inference_model_request", "Inference model requests received.", labels,
                                registry=self.registry)
        self.errors = Counter("inference_model_request_error", "Inference model requests that failed.",
                              (*labels, "error_code"), registry=self.registry)
        self.input_tokens = Histogram("inference_model_input_tokens", "Input token count per request.", labels,
                                      buckets=TOKEN_BUCKETS, registry=self.registry)
        self.output_tokens = Histogram("inference_model_output_tokens", "Output token count per request.", labels,
                                       buckets=TOKEN_BUCKETS, registry=self.registry)
        self.duration = Histogram("inference_model_request_duration_seconds", "Request duration through the router.",
                                  labels, buckets=DURATION_BUCKETS, registry=self.registry)
        self.running = Gauge("inference_model_running_requests", "Requests whose response has not ended.",
                             ("model_name",), registry=self.registry)

    def known(self, models) -> None:
        """Series at 0 for ``models`` (the adapters the router routes): a counter that appears only with
        its first requests hides them from ``increase()`` (Prometheus' first sample of it would hold them)."""
        for name in models:
            self.requests.labels(name, name)
            self.input_tokens.labels(name, name)
            self.output_tokens.labels(name, name)
            self.duration.labels(name, name)
            self.running.labels(name)

    def start(self, model: str | None) -> tuple[str, float]:
        """A request arrived: counted; returns what :meth:`end` needs."""
        name = model or ""
        self.requests.labels(name, name).inc()
        self.running.labels(name).inc()
        return name, time.perf_counter()

    def end(self, started: tuple[str, float], status: int, usage: tuple[int, int] | None = None,
            stream_error: bool = False) -> None:
        """Its response ended with ``status`` (``usage``: its token counts, when it carried them)."""
        name, t0 = started
        self.running.labels(name).dec()
        self.duration.labels(name, name).observe(time.perf_counter() - t0)
        if status >= 400 or stream_error:
            self.errors.labels(name, name, "stream_error" if status < 400 else str(status)).inc()
        if usage is not None:
            self.input_tokens.labels(name, name).observe(usage[0])
            self.output_tokens.labels(name, name).observe(usage[1])

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)
