"""``/metrics``: vLLM V1's Prometheus names, labels and histogram buckets, fed by the online engine.

Gauges and counters the kernel keeps (running, waiting, KV usage, preemptions, LoRA usage) are
read at scrape time; request histograms are observed as tokens reach their streams.  Every time is
in *simulated* seconds -- what vLLM itself would report -- so at ``--speed 10`` a TTFT of 0.5 s in
the histogram took 0.05 s of wall time.  Labels: ``model_name`` (the served model) and ``engine``
("0"), as vLLM V1.

What depends on the imitated vLLM version (``vllm_version``, the Instance's: set by
``lora_opt.emulate.server.Instance.configure``), measured on vLLM 0.32 (the CPU build of the real-vLLM test
tier) and read in 0.33's source:

- ``vllm:lora_requests_info`` (every version): one series per label set ever seen, never removed,
  its value the Unix time of its last update; no series before the engine's first step; updated
  while the engine steps (an idle engine leaves the newest series as it was).  From 0.32 both
  adapter labels hold the same list: every adapter with an unfinished request that has produced
  output (running, or preempted back to waiting), in first-seen order -- vLLM learns of a request's
  QUEUED / SCHEDULED events only with its first output, so a request that has waited from the start
  is in neither label.  Before (0.8.5): adapters with running / with waiting requests.
- ``vllm:request_success_total``: from 0.32 ``finished_reason`` has stop, length, abort, error and
  repetition; in 0.32 a client's disconnect is not counted as ``abort`` (measured: the abort path
  skips the finished-request stats).
- ``vllm:cache_config_info``: from 0.32 the labels are 0.32's CacheConfig fields.
"""
from __future__ import annotations

import time

from twin.flags import release_key


# vLLM V1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
#: vllm:lora_requests_info series kept (the newest): vLLM keeps every label set it has seen, which
#: over a long run with many adapters makes every scrape larger; readers take the newest series
LORA_SERIES_KEPT = 100
#: the first release whose lora_requests_info lists one set of adapters in both labels, whose
#: request_success has the error / repetition reasons and whose cache_config_info has 0.32's labels
V1_LORA_STATES = (0, 32)
#: releases that do not count a client's disconnect in request_success_total{finished_reason="abort"}
ABORT_NOT_COUNTED = {(0, 32)}
#: vLLM 0.32's CacheConfig labels of vllm:cache_config_info with the values it shows for flags it
#: was not given (measured); the emulator fills in the ones it models (:meth:`_EngineCollector.cache_labels`)
CACHE_CONFIG_032 = {
    "_block_size_resolved": "True", "block_size": "16", "cache_dtype": "auto", "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": "16", "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "False", "engine": "0", "gpu_memory_utilization": "0.9", "hash_block_size": "None",
    "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
    "kv_cache_max_concurrency": "0.0", "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": "0",
    "kv_offloading_backend": "native", "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32", "num_cpu_blocks": "None",
    "num_gpu_blocks": "0", "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None", "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None", "sliding_window": "None", "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False", "use_replayssm": "False", "user_specified_block_size": "False"}


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
        self.vllm_version = ""
        """The imitated vLLM version (the Instance's)."""
        self.lora_series: dict[tuple, float] = {}
        """vllm:lora_requests_info: label values (max_lora, waiting, running) -> time of last update."""
        self._lora_last: tuple | None = None
        self._lora_steps = 0
        self.with_output: dict[int, set] = {}
        """Adapter index -> its unfinished requests that have produced output, first-seen order."""
        self._aborts_seen = 0
        self._release: tuple = ("", None)
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
        if req.adapter:                         # index 0: base-model requests (no adapter)
            self.forget_aborted()
            reqs = self.with_output.setdefault(req.adapter, set())
            reqs.add(req)
            if len(reqs) == 1:
                self._lora_changed()

    def token(self, req, itl: float) -> None:
        self.itl.observe(itl)

    def queued(self, req, queue_s: float) -> None:
        self.queue.observe(queue_s)

    def finished(self, req) -> None:
        self.e2e.observe(req.last_t - req.arrival)
        self._drop(req.adapter, req)

    def _drop(self, adapter: int, req) -> None:
        reqs = self.with_output.get(adapter)
        if reqs is not None:
            reqs.discard(req)
            if not reqs:                        # vLLM deletes an adapter without requests: re-seen, it goes last
                del self.with_output[adapter]
                self._lora_changed()

    def _lora_changed(self) -> None:
        """The adapters with output changed: vLLM updates the gauge at its next step, so every label
        set the engine passes through gets a series, even between two scrapes."""
        release = self.release()
        if release is not None and release >= V1_LORA_STATES:
            self._set_lora_series(self.lora_labels())

    def _set_lora_series(self, labels: tuple) -> None:
        self.lora_series.pop(labels, None)      # dicts keep insertion order: oldest update first
        self.lora_series[labels] = time.time()
        if len(self.lora_series) > LORA_SERIES_KEPT:
            del self.lora_series[next(iter(self.lora_series))]
        self._lora_last = labels

    def forget_aborted(self) -> None:
        """Take aborted requests out of :attr:`with_output` (the engine tells no observer of aborts:
        looked for whenever its abort count moved)."""
        aborts = self.engine.stats.success["abort"] if self.engine is not None else 0
        if aborts != self._aborts_seen:
            self._aborts_seen = aborts
            for adapter, reqs in list(self.with_output.items()):
                for q in [q for q in reqs if q.aborted]:
                    self._drop(adapter, q)

    def release(self) -> tuple[int, int] | None:
        if self._release[0] != self.vllm_version:          # parsed once per version (read per request)
            self._release = (self.vllm_version, release_key(self.vllm_version))
        return self._release[1]

    def lora_labels(self) -> tuple[str, str, str]:
        """The current (max_lora, waiting_lora_adapters, running_lora_adapters) label values."""
        ids = ["", *self.adapter_ids]            # index 0: base-model requests (no adapter)
        release = self.release()
        if release is not None and release >= V1_LORA_STATES:
            self.forget_aborted()
            both = ",".join(ids[a] for a in self.with_output)
            return str(self.max_loras), both, both
        running, waiting = self.engine.lora_usage()
        return (str(self.max_loras), ",".join(ids[a] for a in waiting.nonzero()[0] if a),
                ",".join(ids[a] for a in running.nonzero()[0] if a))

    def lora_info(self) -> dict[tuple, float]:
        """vllm:lora_requests_info's series after an update at scrape time: the current label set's
        series gets the current time when the engine stepped since the last scrape or the labels
        changed (vLLM updates it at every step); none before the first step."""
        steps = self.engine.stats.steps
        if steps:
            labels = self.lora_labels()
            if steps != self._lora_steps or labels != self._lora_last:
                self._set_lora_series(labels)
            self._lora_steps = steps
        return self.lora_series

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
        release = m.release()
        v1_states = release is not None and release >= V1_LORA_STATES
        ok = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                 labels=[*names, "finished_reason"])
        for reason in ("stop", "length", "abort", "error", "repetition") if v1_states else ("stop", "length", "abort"):
            count = 0 if reason == "abort" and release in ABORT_NOT_COUNTED else st.success.get(reason, 0)
            ok.add_metric([*values, reason], count)
        yield ok
        labels = self.cache_labels(g["kv_blocks"], v1_states)
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=list(labels))
        cache.add_metric(list(labels.values()), 1.0)
        yield cache
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        for label_values, updated in m.lora_info().items():
            info.add_metric(list(label_values), updated)
        yield info

    def cache_labels(self, kv_blocks: int, v1_states: bool) -> dict:
        """vLLM: PrometheusStatLogger.log_metrics_info("cache_config", ...) labels the gauge with every
        field of CacheConfig (CacheConfig.metrics_info(): str(value) of each) plus "engine"; the field
        set changes between versions: 0.32's (:data:`CACHE_CONFIG_032`) from 0.32 on, else the fields
        every V1 version has.  Prefix caching "False": the emulator has none (and the commands
        lora-opt emits turn it off)."""
        eng, engine = self.m.engine, self.m.labels["engine"]
        block = eng.profile.memory.block_size
        labels = {"block_size": str(block), "gpu_memory_utilization": str(eng.eng.gpu_memory_utilization),
                  "cache_dtype": "auto", "is_attention_free": "False", "num_gpu_blocks_override": "None",
                  "sliding_window": "None", "enable_prefix_caching": "False", "num_gpu_blocks": str(kv_blocks),
                  "engine": engine}
        if not v1_states:
            return labels
        tokens = kv_blocks * block
        return {**CACHE_CONFIG_032, **labels, "effective_attention_block_size": str(block),
                "kv_cache_size_tokens": str(tokens),
                "kv_cache_max_concurrency": str(round(tokens / eng.eng.max_model_len, 2))}
