"""``lora-opt place --emit-router``: the Gateway API Inference Extension manifests (one pool per
replica set) and vllm-router's command line (only where every adapter is on every GPU)."""
import pytest
import yaml

from lora_opt.placement.plan import Adapter, Placement, PlacementError
from lora_opt.replan.router_config import (GATEWAY_API_VERSION, gateway_manifests, replica_sets, router_files,
                                              vllm_router_command)
from lora_opt.placement.workload_file import workload_from_dict
from lora_opt.search.deployments import every_gpu_placement
from twin.profile import load_profile

P = "llama-3.1-8b-h100-64gb"


def _placement():
    wl = workload_from_dict({"profile": P, "adapters": [{"count": 4, "rank": 8, "rate": 0.5}]})
    p = every_gpu_placement(wl, load_profile(P), 3, 4)
    ids = [a.id for a in p.adapters]
    routes = {ids[0]: [(0, 1.0)], ids[1]: [(1, 1.0)], ids[2]: [(0, 0.5), (2, 0.5)], ids[3]: [(1, 1.0)]}
    return Placement(profile=P, adapters=[*p.adapters[:3], Adapter("Sql_Lora:v2", 8, 0.5)], gpus=p.gpus,
                     routes={**{k: v for k, v in routes.items() if k != ids[3]}, "Sql_Lora:v2": [(1, 1.0)]})


def test_gateway_manifests_have_one_pool_per_replica_set_and_one_model_per_adapter():
    p = _placement()
    assert [g for g, _ in replica_sets(p)] == [(0,), (1,), (0, 2)]
    text = gateway_manifests(p)
    docs = [d for d in yaml.safe_load_all(text) if d]
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    models = [d for d in docs if d["kind"] == "InferenceModel"]
    assert all(d["apiVersion"] == GATEWAY_API_VERSION for d in docs) and len(pools) == 3 and len(models) == 4
    assert pools[2]["spec"] == {"targetPortNumber": 8000, "selector": {"lora-opt.io/pool-2": "true"},
                                "extensionRef": {"name": "lora-opt-pool-2-epp"}}
    by_model = {m["spec"]["modelName"]: m for m in models}
    odd = by_model["Sql_Lora:v2"]          # an id that is no k8s name: kept as the model name, sanitised as the object's
    assert odd["metadata"]["name"] == "lora-opt-sql-lora-v2" and odd["spec"]["poolRef"] == {"name": "lora-opt-pool-1"}
    assert odd["spec"]["targetModels"] == [{"name": "Sql_Lora:v2", "weight": 100}]
    assert '#   GPU 0: lora-opt.io/pool-0: "true", lora-opt.io/pool-2: "true"' in text    # GPU 0 is in two sets


def test_vllm_router_only_for_every_adapter_on_every_gpu():
    wl = workload_from_dict({"profile": P, "adapters": [{"count": 4, "rank": 8, "rate": 0.5}]})
    argv = vllm_router_command(every_gpu_placement(wl, load_profile(P), 2, 4), "power-of-two")
    assert argv == ["vllm-router", "--host", "127.0.0.1", "--port", "30000", "--worker-urls", "http://127.0.0.1:8000",
                    "http://127.0.0.1:8001", "--policy", "power_of_two", "--health-check-endpoint", "/health",
                    "--health-check-interval-secs", "2", "--health-check-timeout-secs", "2",
                    "--health-failure-threshold", "3", "--health-success-threshold", "2", "--retry-max-retries", "2"]
    with pytest.raises(PlacementError, match="4 adapter.*on only some GPUs"):
        vllm_router_command(_placement(), "round-robin")
    with pytest.raises(PlacementError, match="allowed values: round-robin, power-of-two, consistent-hash"):
        vllm_router_command(_placement(), "lora-affinity")
    assert list(router_files(every_gpu_placement(wl, load_profile(P), 2, 4), "vllm-router:consistent-hash")) == [
        "router/vllm-router.sh"]


def test_place_cli_emits_the_gateway_config_and_refuses_vllm_router_before_writing(tmp_path, capsys):
    from lora_opt.cli import main
    wfile = tmp_path / "w.yaml"
    wfile.write_text(yaml.safe_dump({"profile": P, "adapters": [{"count": 12, "rank": 8, "rate": 0.5}]}))
    out = tmp_path / "o"
    assert main(["place", "--workload", str(wfile), "--gpus", "4", "--policy", "greedy", "--out", str(out),
                 "--emit-router", "gateway"]) == 0
    docs = [d for d in yaml.safe_load_all((out / "router" / "inference-pools.yaml").read_text()) if d]
    assert sum(d["kind"] == "InferenceModel" for d in docs) == 12
    capsys.readouterr()
    out2 = tmp_path / "o2"
    rc = main(["place", "--workload", str(wfile), "--gpus", "4", "--policy", "greedy", "--out", str(out2),
               "--emit-router", "vllm-router:round-robin"])
    err = capsys.readouterr().err
    placed_on_all = rc == 0            # one GPU holding every adapter: vllm-router fits
    assert placed_on_all or (rc == 2 and "on only some GPUs" in err and not (out2 / "placement.json").exists())


def test_a_consistent_hash_router_file_tells_clients_to_send_the_adapter_as_the_session_key():
    # vllm-router 0.1.17 hashes X-Session-ID, else the whole body: without the header the README's pick ran at p99
    # TTFT 5.2 s live where the twin judged 0.2 s (experiments/deployment_live_example); with it, 178 ms
    wl = workload_from_dict({"profile": P, "adapters": [{"count": 4, "rank": 8, "rate": 0.5}]})
    p = every_gpu_placement(wl, load_profile(P), 2, 4)
    text = router_files(p, "vllm-router:consistent-hash")["router/vllm-router.sh"]
    assert "X-Session-ID" in text and text.rstrip().splitlines()[-1].startswith("exec vllm-router")
    assert "X-Session-ID" not in router_files(p, "vllm-router:round-robin")["router/vllm-router.sh"]
