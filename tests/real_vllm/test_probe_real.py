"""``lora-opt probe`` (smoke plan, ``--launch``) and ``lora-opt calibrate`` against a real vLLM 0.32 (the
tier's CPU build and tiny model, a 4,096-token vocabulary, ``--max-model-len 512``).

The probe launches the tier's ``vllm serve`` command twice (LoRA off; rank 8 with generated adapter names
on the tier's rank-8 adapter) and measures every family.  What must hold on a real server:

* every prompt is accepted: token ids from the server's own ``/tokenize`` (ids up to ~20,000 are out of
  this vocabulary) and no longer than its ``max_model_len`` leaves room for the output (the smoke
  plan asks for 512- and 2,048-token prompts);
* no row is ``ok`` with a cost <= 0; a failed or noisy row says why (a failure: the HTTP status and
  the server's message);
* calibrate on the rows writes a profile whose every cost is positive, or refuses with exit 2 and a
  message naming the rows (tiny model on 2 shared cores: some costs may not be resolvable).

About 3-4 minutes on an idle 2-core machine (two vLLM start-ups of ~60 s each).
"""
from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import yaml

from real_vllm_tier import HEALTH_TIMEOUT_S, free_port, tier_command

from lora_opt.cli import main as cli_main
from twin.profile import load_profile

BASE_PROFILE = "llama-3.1-8b-h100-64gb"


def _launch_line(tier: dict) -> str:
    """The tier's serve command as a user gives it to ``probe --launch`` (environment first); the CPU
    backend's default block size (128) is kept: it refuses 16."""
    cmd = tier_command(tier, adapters=[], port=free_port(), max_model_len=512, max_num_seqs=16)
    return shlex.join([f"{k}={v}" for k, v in cmd.env.items()] + cmd.argv())


def _positive_costs(path) -> list[str]:
    """The profile's costs that are not positive (``name = value``); a LoRA slope may be 0 (calibrate keeps
    it only when an F-test against the jump alone demands it: vLLM's CPU LoRA ops cost the same for 1 or 16
    distinct adapters, so on a noisy run either outcome is right), never negative."""
    p = load_profile(str(path))
    lat = p.latency
    costs = {"base_ms": lat.base_ms, "per_seq_ms": lat.per_seq_ms, "per_ctx_ktoken_ms": lat.per_ctx_ktoken_ms,
             "per_token_ms": lat.per_token_ms}
    for rank, lora in lat.lora.items():
        costs[f"lora r{rank} jump"] = lora.jump
        if lora.slope < 0:
            costs[f"lora r{rank} slope"] = lora.slope
    # a CPU->slot copy within the probe's noise is 0 ms and said so in the fit (calibrate warns too)
    unresolved = (yaml.safe_load(Path(path).read_text()).get("fit", {}).get("estimators", {}).get("loading", {})
                  .get("cpu_to_gpu_unresolved_ranks", []))
    for rank, v in p.loading.cpu_to_gpu_ms.items():
        if not (v == 0 and rank in unresolved):
            costs[f"cpu_to_gpu_ms r{rank}"] = v
    for rank, v in p.loading.disk_to_cpu_ms.items():
        costs[f"disk_to_cpu_ms r{rank}"] = v
    return [f"{k} = {v}" for k, v in costs.items() if not v > 0]


def test_probe_smoke_and_calibrate_on_real_vllm(tier, tmp_path, capsys):
    out = tmp_path / "probe"
    rc = cli_main(["probe", "--launch", _launch_line(tier), "--plan", "smoke", "--model", "tiny-llama",
                   "--vllm-version", tier["vllm_version"],
                   "--adapter-path", tier["dir"] + "/adapters/r{rank}-a", "--health-timeout", f"{HEALTH_TIMEOUT_S:g}",
                   "--out", str(out), "--no-track"])
    printed = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    rows = list(csv.DictReader((out / "rows.csv").open()))
    report = json.dumps(summary["not_ok"], indent=1) + printed.err[-3000:]
    assert rc in (0, 3), report                                   # 3: some rows noisy or failed
    assert summary["version"].startswith("0.32"), summary["version"]
    assert summary["max_model_len"] == 512 and "/tokenize" in summary["prompts"], summary["prompts"]
    # every family that sends prompts measured something: nothing refused for its prompts (adapter loads
    # may be within their noise on a busy machine, and then say so)
    for family in ("kv", "decode", "prefill", "lora"):
        counts = summary["families"][family]
        assert counts["ok"] + counts.get("noisy", 0) >= 1, (family, report)
    for r in rows:
        assert "out of vocabulary" not in r["probe_note"] and "maximum context length" not in r["probe_note"], r
        if r["status"] == "ok" and r["probe_family"] in ("decode", "lora"):
            assert float(r["probe_step_ms"]) > 0, r
        if r["status"] == "ok" and r["probe_family"] == "loading":      # a load above 3 sd of its noise
            assert float(r["probe_load_ms_per_adapter"]) > 3 * float(r["probe_load_noise_ms"]) > 0, r
        if r["status"] != "ok":
            assert r["probe_note"], r                             # a failure or noise always says why
    prompts = {int(r["probe_prompt_tokens"]) for r in rows if r["probe_family"] in ("decode", "prefill")}
    assert max(prompts) <= 510, prompts                           # cut to max_model_len minus the output

    fitted = tmp_path / "fitted.yaml"
    rc = cli_main(["calibrate", "--runs", str(out / "rows.csv"), "--model", BASE_PROFILE, "--out", str(fitted),
                   "--no-track"])
    err = capsys.readouterr().err
    if rc == 0:
        assert not _positive_costs(fitted), _positive_costs(fitted)
    else:
        # a clean refusal: exit 2, one message naming the rows, no traceback, nothing written
        assert rc == 2 and "Traceback" not in err and "LinAlgError" not in err, err
        assert "lora-opt calibrate: error:" in err and any(r["run_name"] in err for r in rows), err
        assert not fitted.exists()
    print(f"probe rows: {summary['families']}; calibrate exit {rc}: {err.strip()[:600]}")
