"""``lora-opt apply``'s steps against a real vLLM 0.32 (the tier's shared server, runtime LoRA updating
on): a load and an unload through vLLM's own endpoints, a drain read from its real ``/metrics``, and a
stop that real vLLM cannot take over HTTP (left to its operator).  The server is left as found."""
from __future__ import annotations

import json

from lora_opt.apply.executor import ApplyOptions
from lora_opt.apply.run import apply_plan
from lora_opt.errors import EXIT_OK
from lora_opt.placement.plan import Adapter, GPUConfig, Placement


def test_apply_steps_on_real_vllm(tier, vllm_server, tmp_path):
    url = vllm_server.url
    path = tier["adapters"]["r8-b"]["path"]
    name = "apply-extra-r8"
    steps = [{"step": 1, "action": "load", "instance": "gpu0",
              "request": {"method": "POST", "url": f"{url}/v1/load_lora_adapter",
                          "json": {"lora_name": name, "lora_path": path}}},
             {"step": 2, "action": "drain", "instance": "gpu0"},
             {"step": 3, "action": "unload", "instance": "gpu0",
              "request": {"method": "POST", "url": f"{url}/v1/unload_lora_adapter", "json": {"lora_name": name}}},
             {"step": 4, "action": "stop", "instance": "gpu0"}]
    p = Placement("llama-3.1-8b-h100-64gb", [Adapter(name, 8, 1.0)],
                  [GPUConfig(max_loras=2, max_lora_rank=32, max_cpu_loras=4, max_num_seqs=16,
                             max_num_batched_tokens=2048, gpu_memory_utilization=0.9, max_model_len=512)],
                  {name: [(0, 1.0)]}, policy="test")
    p.save(tmp_path / "placement.json")
    (tmp_path / "plan.json").write_text(json.dumps({
        "steps": steps, "endpoints": {"gpu0": url},
        "instances": [{"instance": "gpu0", "current_gpu": 0, "action": "keep"}]}))
    summary, code = apply_plan(tmp_path, opts=ApplyOptions(poll_s=0.05), out=tmp_path / "out", track=False)
    assert code == EXIT_OK, summary["steps"]
    assert [s["status"] for s in summary["steps"]] == ["ok", "ok", "ok", "left"], summary["steps"]
    assert "added successfully" in summary["steps"][0]["detail"]
    assert "removed successfully" in summary["steps"][2]["detail"]
    assert "HTTP 404" in summary["steps"][3]["detail"]           # real vLLM has no /emulator/shutdown
    assert vllm_server.proc.poll() is None                        # and it is still serving
