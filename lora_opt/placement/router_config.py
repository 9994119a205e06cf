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
"""
from __future__ import annotations

import json
import re

from lora_opt.placement.plan import Placement, PlacementError

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


def gateway_manifests(p: Placement, *, name: str = "lora-opt", port: int = 8000) -> str:
    """InferencePool + InferenceModel manifests (multi-document YAML) for ``p``'s replica sets; the
    header says which labels each GPU's pod must carry."""
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
    return "\n".join(head) + "\n---\n" + "\n---\n".join(docs) + "\n"


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
    return ["vllm-router", "--host", host, "--port", str(port), "--worker-urls",
            *(f"http://{host}:{base_port + g}" for g in every), "--policy", VLLM_ROUTER_POLICIES[policy]]


def router_files(p: Placement, which: str, *, host: str = "127.0.0.1", base_port: int = 8000) -> dict[str, str]:
    """File name (under the output directory) -> text, for ``--emit-router which``."""
    import shlex

    if which == "gateway":
        return {"router/inference-pools.yaml": gateway_manifests(p, port=base_port)}
    if which.startswith("vllm-router:"):
        argv = vllm_router_command(p, which.split(":", 1)[1], host=host, base_port=base_port)
        return {"router/vllm-router.sh": f"#!/bin/sh\n# generated by lora-opt place; vllm-router {VLLM_ROUTER_VERSION} "
                                         f"flags\nexec {shlex.join(argv)}\n"}
    raise PlacementError(f"--emit-router: {which!r} not allowed; allowed values: {', '.join(ROUTER_CONFIGS)}")
