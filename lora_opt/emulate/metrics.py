"""``/metrics``: vLLM V1's Prometheus names, labels and histogram buckets, fed by the online engine.

Gauges and counters the kernel keeps (running, waiting, KV usage, preemptions, LoRA usage) are
read at scrape time; request histograms are observed as tokens reach their streams.  Every time is
in *simulated* seconds -- what vLLM itself would report -- so at ``--speed 10`` a TTFT of 0.5 s in
the histogram took 0.05 s of wall time.  Labels: ``model_name`` (the served model) and ``engine``
("0"), as vLLM V1.
"""
from __future__ import annotations

import time

# vLLM V1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class EngineMetrics:
    """One instance's registry: histograms observed by the engine (it is the engine's
    ``observer``), gauges and counters collected from it at scrape time."""

    def __init__(self, model_name: str, adapter_ids: list[str], max_loras: int):
        # prometheus_client only where an emulator runs (start-up of other commands)
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": "0"}
        self.adapter_ids, self.max_loras = adapter_ids, max_loras
        self.engine = None
        names = ["model_name", "engine"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.registry.register(_EngineCollector(self))

    # ---- the engine's observer -------------------------------------------------------------
    def first_token(self, req, ttft: float) -> None:
        self.ttft.observe(ttft)

    def token(self, req, itl: float) -> None:
        self.itl.observe(itl)

    def queued(self, req, queue_s: float) -> None:
        self.queue.observe(queue_s)

    def finished(self, req) -> None:
        self.e2e.observe(req.last_t - req.arrival)

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, metrics: EngineMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m, eng = self.m, self.m.engine
        names, values = list(m.labels), list(m.labels.values())
        if eng is None:
            return
        g = eng.gauges()
        st = eng.stats

        def gauge(name, doc, value):
            f = GaugeMetricFamily(name, doc, labels=names)
            f.add_metric(values, value)
            return f

        def counter(name, doc, value):
            f = CounterMetricFamily(name, doc, labels=names)
            f.add_metric(values, value)
            return f

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", g["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g["kv_usage"])
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", g["preemptions"])
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                 labels=[*names, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            ok.add_metric([*values, reason], st.success[reason])
        yield ok
        # vLLM: PrometheusStatLogger.log_metrics_info("cache_config", ...) labels the gauge with every
        # field of CacheConfig (CacheConfig.metrics_info(): str(value) of each) plus "engine"; the
        # field set changes between versions, so the emulator emits the fields every V1 version has,
        # as vLLM formats them (the commands lora-opt emits pass --disable-prefix-caching)
        labels = {"block_size": str(eng.profile.memory.block_size),
                  "gpu_memory_utilization": str(eng.eng["gpu_memory_utilization"]), "cache_dtype": "auto",
                  "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
                  "enable_prefix_caching": "False", "num_gpu_blocks": str(g["kv_blocks"]), "engine": m.labels["engine"]}
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=list(labels))
        cache.add_metric(list(labels.values()), 1.0)
        yield cache
        running, waiting = eng.lora_usage()
        ids = ["", *m.adapter_ids]              # index 0: base-model requests (no adapter)
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        info.add_metric([str(m.max_loras), ",".join(ids[a] for a in waiting.nonzero()[0] if a),
                         ",".join(ids[a] for a in running.nonzero()[0] if a)], time.time())
        yield info
