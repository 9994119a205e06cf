"""The real-vLLM loop's report (experiments/real_validation/cpu_report.py): the drift table compares the
loop's profile (probe before the measurements) with the one fitted on the probe after them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _report_module():
    spec = importlib.util.spec_from_file_location("cpu_report", ROOT / "experiments" / "real_validation" / "cpu_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _profile(path: Path, base: float, jump8: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"latency": {"base_ms": base, "per_seq_ms": 0.5, "per_token_ms": 0.3,
                                                "per_ctx_ktoken_ms": 2.0,
                                                "lora": {8: {"jump": jump8, "prefill_share": 3.0}}}}))


def test_drift_table_before_after_and_change(tmp_path):
    report = _report_module()
    before = tmp_path / "configs" / "profile.yaml"
    _profile(before, 10.0, 0.5)
    assert report.drift(tmp_path, before) == ([], {})          # no probe after: no table
    _profile(tmp_path / "probe-after" / "profile.yaml", 12.0, 0.25)
    lines, changes = report.drift(tmp_path, before)
    assert lines[0] == "| coefficient | before | after | change |"
    assert "| base_ms | 10 | 12 | +20.0 % |" in lines and "| LoRA r8 jump | 0.5 | 0.25 | -50.0 % |" in lines
    assert changes["per_seq_ms"] == 0.0 and changes["LoRA r8 prefill_share"] == 0.0
