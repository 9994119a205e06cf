"""The real-vLLM loop's script (experiments/real_validation/cpu_loop.py) end to end on the tier's probe-size
model: one workload placed, its emitted command launched on real vLLM 0.32, validated against the twin with
the bundled CPU profile, and the report written (slow: ~2 min; needs the probe-size model:
``LORA_OPT_VLLM_TIER_PROBE=1 bash tools/vllm_tier/build.sh``)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from real_vllm_tier import ROOT, tier_dir


@pytest.mark.slow
def test_cpu_loop_validates_one_workload_and_reports(tmp_path):
    if not (tier_dir() / "tier-probe.json").is_file():
        pytest.skip("the probe-size model is not built: LORA_OPT_VLLM_TIER_PROBE=1 bash tools/vllm_tier/build.sh")
    out = tmp_path / "cpu"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "real_validation" / "cpu_loop.py"),
                           "--stages", "validate", "report", "--workloads", "light", "--duration", "30",
                           "--out", str(out), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "validation.json").read_text())
    assert set(runs) == {"light-fit", "light-report"}
    for name, run in runs.items():
        real, twin = run["comparison"]["real"]["0"], run["comparison"]["twin"]["0"]
        assert real["completed"] > 0 and twin["completed"] > 0, name
        assert math.isfinite(run["comparison"]["smape_per_metric"]["throughput_tok_s"]), name
        # the launched command is the one place emitted for vLLM 0.32, with the profile's block size
        line = (out / "validation" / name / "placement" / "vllm" / "serve_commands.txt").read_text()
        assert "--block-size 128" in line and "--no-enable-prefix-caching" in line
    report = (out / "REPORT.md").read_text()
    assert "| light-report |" in report and "throughput:" in report
