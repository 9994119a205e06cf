"""A placement's router configuration, for the routers that have one (``lora-opt place --emit-router``).

- ``gateway``: the Kubernetes Gateway API Inference Extension, API ``inference.networking.x-k8s.io/
  v1alpha2`` (the endpoint picker ``twin.routers``' ``lora-affinity`` models is of that API's
  generation).  One ``InferencePool`` per *replica set* -- the GPUs an adapter is placed on -- whose
  selector is a label every GPU of the set carries (``lora-opt.io/pool-K: "true"``; a GPU in
  several sets carries several labels), and one ``InferenceModel`` per adapter naming its pool:
  the pool's endpoint picker then chooses among the adapter's replicas only (the fleet twin's
  ``--router lora-affinity`` with static adapters).  Each pool names its own endpoint picker
  (``extensionRef``: an EPP serves one pool).  Fields as in the project's v1alpha2 API reference
  and sample manifests: InferencePool ``spec.targetPortNumber``, ``spec.selector`` (a label map),
  ``spec.extensionRef.name``; InferenceModel ``spec.modelName``, ``spec.criticality``,
  ``spec.poolRef.name``, ``spec.targetModels[].name/weight``.
- ``vllm-router``: vLLM's router (PyPI ``vllm-router``; flags checked against ``vllm-router
  --help`` of 0.1.17): ``vllm-router --host H --port P --worker-urls URL... --policy POLICY`` for
  the policies the fleet twin also has (``round_robin``, ``power_of_two``, ``consistent_hash``).
  It forwards any request to any worker, so it fits only a placement with every adapter on every
  GPU (``lora-opt search --deployment every-gpu``); for any other it is refused.  (Which request
  field its ``consistent_hash`` hashes is vllm-router's own; the twin hashes the adapter id.)

Dead instances: both are set to eject and re-admit as ``lora-opt emulate``'s router does
(:class:`HealthChecks`' defaults): vllm-router through its own
``--health-check-*`` / ``--health-*-threshold`` flags and ``--retry-max-retries`` (one try per GPU:
measured on 0.1.17, a refused connection is sent to the next worker -- with retries off every request
to a dead worker is a 500); the Gateway API through each vLLM pod's readiness probe (the endpoint picker
only picks ready pods), written as a snippet in the manifests' header.  One difference is said where it
is written: vllm-router also re-sends a request a worker answered with an error, which lora-opt's router
never does (a request that reached an instance may have run).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from lora_opt.errors import InputError
from lora_opt.placement.plan import Placement, PlacementError
from twin.flags import release_key

#: the Gateway API Inference Extension's API version the manifests are written in
GATEWAY_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
#: the vllm-router release whose --help the command was checked against
VLLM_ROUTER_VERSION = "0.1.17"
#: fleet-twin router -> vllm-router --policy (the policies both have)
VLLM_ROUTER_POLICIES = {"round-robin": "round_robin", "power-of-two": "power_of_two",
                        "consistent-hash": "consistent_hash"}
#: --emit-router's choices: the router and, for vllm-router, the fleet-twin policy
ROUTER_CONFIGS = ("gateway", *(f"vllm-router:{p}" for p in VLLM_ROUTER_POLICIES))
#: the label a GPU of replica set K carries
POOL_LABEL = "lora-opt.io/pool-{k}"


#: seconds between two tries of a request that reached no instance (:attr:`HealthChecks.retry_for_s`)
RETRY_BACKOFF_S = 0.5


@dataclass(frozen=True)
class HealthChecks:
    """How a router finds dead instances and takes them back: ``lora-opt emulate``'s router
    (``--health-*``; :mod:`lora_opt.emulate.router_health`) and the configurations written here (vllm-router's
    flags of the same names, the pods' readiness probe)."""

    interval_s: float = 2.0
    """Seconds between two active checks of every instance's ``/health``; 0: no active checks (a refused
    connection still sends the request elsewhere, but nothing is ejected, as nothing could re-admit it)."""
    timeout_s: float = 2.0
    """Seconds a check waits for the answer; a longer wait is a failed check."""
    failure_threshold: int = 3
    """Failed checks in a row that eject an instance (a refused connection ejects at once)."""
    success_threshold: int = 2
    """Passed checks in a row that re-admit an ejected instance."""
    endpoint: str = "/health"
    """The path checked, under the instance's root (its URL without ``/v1``): vLLM's ``/health``."""
    retry_for_s: float = 0.0
    """Seconds a request that reached no instance (every one of its adapter's refused the connection, or none
    is routed) is tried again, every :data:`RETRY_BACKOFF_S`, before the router answers it with an error: an
    instance relaunched within this time serves it.  0: answered at once.  A request sent to an instance is
    never tried again."""

    def __post_init__(self):
        for name, lo in (("interval_s", 0.0), ("timeout_s", 0.001), ("retry_for_s", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                raise InputError(f"health checks: {name} must be a finite number >= {lo:g}, got {v!r}")
        for name in ("failure_threshold", "success_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"health checks: {name} must be an integer >= 1, got {v!r}")
        if not self.endpoint.startswith("/"):
            raise InputError(f"health checks: endpoint must be a path starting with '/', got {self.endpoint!r}")

    @property
    def active(self) -> bool:
        return self.interval_s > 0



def replica_sets(p: Placement) -> list[tuple[tuple[int, ...], list[str]]]:
    """(GPUs, adapter ids) per distinct set of GPUs an adapter is routed to, in first-seen order."""
    sets: dict[tuple[int, ...], list[str]] = {}
    for a in p.adapters:
        gpus = tuple(sorted({g for g, w in p.routes.get(a.id, []) if w > 0}))
        if gpus:
            sets.setdefault(gpus, []).append(a.id)
    return list(sets.items())


def _k8s_name(text: str) -> str:
    """A DNS-1123 label from ``text`` (lower case, [a-z0-9-], at most 63 characters)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:63].rstrip("-") or "x"


def _yaml_scalar(value) -> str:
    # JSON strings are YAML scalars: adapter ids with ':' or '#' stay strings
    return json.dumps(value) if isinstance(value, str) else str(value)


def gateway_manifests(p: Placement, *, name: str = "lora-opt", port: int = 8000, vllm_release: str | None = None) -> str:
    """InferencePool + InferenceModel manifests (multi-document YAML) for ``p``'s replica sets; the
    header says which labels each GPU's pod must carry and, for ``vllm_release`` (the release the launch
    commands are written for), what the endpoint picker must be told to read its metrics
    (:func:`endpoint_picker_notes`)."""
    sets = replica_sets(p)
    if not sets:
        raise PlacementError("router config gateway: no adapter is routed to a GPU")
    base = _k8s_name(name)
    labels: dict[int, list[str]] = {g: [] for g in range(len(p.gpus))}
    docs, used = [], set()
    for k, (gpus, ids) in enumerate(sets):
        label = POOL_LABEL.format(k=k)
        for g in gpus:
            labels[g].append(f'{label}: "true"')
        pool = f"{base}-pool-{k}"
        docs.append("\n".join([f"apiVersion: {GATEWAY_API_VERSION}", "kind: InferencePool", "metadata:",
                               f"  name: {pool}", "spec:", f"  targetPortNumber: {port}", "  selector:",
                               f'    {label}: "true"', "  extensionRef:", f"    name: {pool}-epp"]))
        for aid in ids:
            obj = _k8s_name(f"{base}-{aid}")
            while obj in used:              # two ids that sanitise alike
                obj = _k8s_name(f"{obj[:55]}-{len(used)}")
            used.add(obj)
            docs.append("\n".join([f"apiVersion: {GATEWAY_API_VERSION}", "kind: InferenceModel", "metadata:",
                                   f"  name: {obj}", "spec:", f"  modelName: {_yaml_scalar(aid)}",
                                   "  criticality: Critical", "  poolRef:", f"    name: {pool}", "  targetModels:",
                                   f"  - name: {_yaml_scalar(aid)}", "    weight: 100"]))
    head = [f"# generated by lora-opt place: Gateway API Inference Extension {GATEWAY_API_VERSION}",
            f"# {len(sets)} InferencePool(s), one per set of GPUs an adapter is placed on; {len(p.adapters)} InferenceModel(s).",
            f"# Every pod's vLLM listens on port {port} (targetPortNumber; vllm/gpuN.sh, for one host, uses {port}+N).",
            "# Label each GPU's vLLM pod (vllm/gpuN.sh) with its pools' labels:"]
    head += [f"#   GPU {g}: {', '.join(ls) or '(no pool)'}" for g, ls in labels.items()]
    h = HealthChecks()
    head += ["# The endpoint picker only picks ready pods: give each vLLM container this readiness probe (what",
             "# lora-opt emulate's router does: ejected after failed /health checks, re-admitted after passing ones):",
             "#   readinessProbe:",
             f"#     httpGet: {{path: {h.endpoint}, port: {port}}}",
             f"#     periodSeconds: {math.ceil(h.interval_s)}",
             f"#     timeoutSeconds: {math.ceil(h.timeout_s)}",
             f"#     failureThreshold: {h.failure_threshold}",
             f"#     successThreshold: {h.success_threshold}"]
    head += [f"# {line}" for line in endpoint_picker_notes(vllm_release)]
    return "\n".join(head) + "\n---\n" + "\n---\n".join(docs) + "\n"


#: the v1alpha2 endpoint picker's default metric names (its -totalQueuedRequestsMetric,
#: -kvCacheUsagePercentageMetric, -loraInfoMetric flags), those of vLLM's V0/0.8-era /metrics
EPP_DEFAULT_METRICS = {"-totalQueuedRequestsMetric": "vllm:num_requests_waiting",
                       "-kvCacheUsagePercentageMetric": "vllm:gpu_cache_usage_perc",
                       "-loraInfoMetric": "vllm:lora_requests_info"}
#: what vLLM 0.32 and 0.33 export instead (0.32: measured on the CPU build's vllm/v1/metrics/loggers.py, which
#: has only vllm:kv_cache_usage_perc; 0.33: no vllm:gpu_* metric at all -- shared/reference/vllm_http_surface.md)
EPP_METRICS_FROM_032 = {"-kvCacheUsagePercentageMetric": "vllm:kv_cache_usage_perc"}


def endpoint_picker_notes(vllm_release: str | None) -> list[str]:
    """What an endpoint picker of the manifests' API generation needs to serve ``vllm_release``'s instances:
    the metric flags whose defaults that release does not export, and what it reads differently."""
    if vllm_release is None:
        return []
    key = release_key(vllm_release)
    if key is None or key < (0, 32):
        return []
    flags = " ".join(f"{k} {v}" for k, v in EPP_METRICS_FROM_032.items())
    return [f"vLLM {vllm_release} exports no {EPP_DEFAULT_METRICS['-kvCacheUsagePercentageMetric']} (the picker's "
            f"default): run each pool's endpoint picker with {flags},",
            "else it never reads a pod's KV-cache use.  From 0.32 vllm:lora_requests_info lists the same adapters in "
            "running_lora_adapters and",
            "waiting_lora_adapters (those with a request that has produced output): the picker counts each such adapter "
            "twice against",
            "max_lora, so it sees a pod full at half its slots -- the fleet twin judged the picker on 0.8.5's labels "
            "(one list each)."]


#: what a vllm-router consistent_hash deployment needs from its clients (measured on 0.1.17,
#: experiments/fleet_router/ and experiments/deployment_live_example/): it hashes X-Session-ID, then other
#: headers and body fields, else the whole body -- without the header every request goes to a random worker
#: and the adapters thrash every GPU's slots (the README's pick: p99 TTFT 5.2 s live where the twin judged 0.2 s)
CONSISTENT_HASH_NOTE = ("# consistent_hash: lora-opt judged adapter affinity (each adapter on one worker): clients must "
                        "send the adapter id\n# as the X-Session-ID header -- without it vllm-router hashes the whole "
                        "body and sends every request to a random\n# worker. Its hash ring is not the twin's: which "
                        "adapters share a worker differs from what was judged.\n")


def vllm_router_command(p: Placement, policy: str, *, host: str = "127.0.0.1", base_port: int = 8000,
                        port: int = 30000) -> list[str]:
    """argv of ``vllm-router`` in front of ``p``'s GPUs (GPU i at ``base_port + i``) with the fleet-twin
    ``policy``; PlacementError unless every adapter is routed to every GPU."""
    if policy not in VLLM_ROUTER_POLICIES:
        raise PlacementError(f"router config vllm-router: policy {policy!r} not allowed; allowed values: "
                             f"{', '.join(VLLM_ROUTER_POLICIES)}")
    every = tuple(range(len(p.gpus)))
    partial = [gpus for gpus, _ in replica_sets(p) if gpus != every]
    if partial or not p.gpus:
        n = sum(len(ids) for gpus, ids in replica_sets(p) if gpus != every)
        raise PlacementError(f"router config vllm-router: it sends any request to any GPU, but {n} adapter(s) are "
                             "on only some GPUs; use gateway (one pool per replica set), or a placement with every "
                             "adapter on every GPU (lora-opt search --deployment every-gpu)")
    h = HealthChecks()
    return ["vllm-router", "--host", host, "--port", str(port), "--worker-urls",
            *(f"http://{host}:{base_port + g}" for g in every), "--policy", VLLM_ROUTER_POLICIES[policy],
            "--health-check-endpoint", h.endpoint, "--health-check-interval-secs", str(math.ceil(h.interval_s)),
            "--health-check-timeout-secs", str(math.ceil(h.timeout_s)),
            "--health-failure-threshold", str(h.failure_threshold),
            "--health-success-threshold", str(h.success_threshold), "--retry-max-retries", str(max(2, len(every)))]


def router_files(p: Placement, which: str, *, host: str = "127.0.0.1", base_port: int = 8000,
                 vllm_release: str | None = None) -> dict[str, str]:
    """File name (under the output directory) -> text, for ``--emit-router which`` in front of instances of
    ``vllm_release``."""
    import shlex

    if which == "gateway":
        return {"router/inference-pools.yaml": gateway_manifests(p, port=base_port, vllm_release=vllm_release)}
    if which.startswith("vllm-router:"):
        policy = which.split(":", 1)[1]
        argv = vllm_router_command(p, policy, host=host, base_port=base_port)
        return {"router/vllm-router.sh": f"#!/bin/sh\n# generated by lora-opt place; vllm-router {VLLM_ROUTER_VERSION} "
                                         "flags\n# dead workers: ejected after failed /health checks and re-admitted "
                                         "after passing ones, as lora-opt emulate's router;\n# --retry-max-retries: "
                                         "a refused request tries the next worker (vllm-router also re-sends one a "
                                         "worker answered with an error,\n# which lora-opt's router never does)\n"
                                         + (CONSISTENT_HASH_NOTE if policy == "consistent-hash" else "")
                                         + f"exec {shlex.join(argv)}\n"}
    raise PlacementError(f"--emit-router: {which!r} not allowed; allowed values: {', '.join(ROUTER_CONFIGS)}")
