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


def test_drift_sitting_spread_tells_slow_drift_from_round_to_round_noise(monkeypatch):
    """experiments/real_validation/cpu_drift.py's summary: a speed that steps once (neighbours agree) has a
    small round-to-round change and a large sitting spread; rounds left out (None) do not count."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments" / "real_validation"))
    import cpu_drift

    slow = cpu_drift.spread([10.0, 10.0, None, 10.0, 10.0, 20.0, 20.0, 20.0])
    assert slow["n"] == 7 and slow["max_over_min"] == 2.0 and slow["neighbour_median_rel_change"] == 0.0
    assert slow["first_third_vs_last_third"] == 1.0
    noisy = cpu_drift.spread([10.0, 20.0, 10.0, 20.0, 10.0, 20.0])
    assert noisy["neighbour_median_rel_change"] >= 0.5 and abs(noisy["first_third_vs_last_third"]) < 1.0
    assert cpu_drift.spread([1.0, None]) == {"n": 1}
    md = cpu_drift.report([{}], {"minutes": 1, "every_s": 20, "started": "now",
                                 "spread": {m: slow for m in cpu_drift.MEASURES}})
    assert "| lora_step_ms | 7 | 10.0 | 10.0 - 20.0 | 2.00 |" in md


def test_speed_check_factors_recover_a_known_slowdown(monkeypatch):
    """experiments/real_validation/cpu_checked.py: a check whose measures are the profile's own predictions
    with the LoRA-off costs 1.2x, the LoRA costs below the knee 1.5x and above it 0.8x gives those factors
    back, and the profile scaled by them predicts the check exactly; a measure the client could not resolve
    (None) leaves its factor at 1."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments" / "real_validation"))
    import cpu_checked

    profile = yaml.safe_load((ROOT / "configs" / "profiles" / "probe-llama-cpu-vllm032.yaml").read_text())
    want = {"dense": 1.2, "lora": 1.5, "above": 0.8}
    chk = {"base_step_ms": 1.0, "base_ctx_k": 1.0, "lora_step_ms": 1.0, "lora_ctx_k": 1.1,
           **{f"ttft_{p}_ms": 1.0 for p in cpu_checked.LONE_PROMPTS}}
    pred = cpu_checked.predicted(profile, 16, 2048, chk)
    assert pred["ttft_640_ms"][2] > 0 and pred["ttft_192_ms"][2] == 0 and pred["base_step_ms"][1:] == (0.0, 0.0)
    chk.update({k: want["dense"] * d + want["lora"] * lo + want["above"] * hi for k, (d, lo, hi) in pred.items()})
    got = cpu_checked.speed_factors(profile, 16, 2048, chk)
    assert all(abs(got[k] - want[k]) < 1e-9 for k in want), got
    again = cpu_checked.predicted(cpu_checked.scaled_profile(profile, got), 16, 2048, chk)
    assert all(abs(sum(again[k]) - chk[k]) < 1e-6 * chk[k] for k in pred)
    assert cpu_checked.speed_factors(profile, 16, 2048, {**chk, "ttft_640_ms": None})["above"] == 1.0
