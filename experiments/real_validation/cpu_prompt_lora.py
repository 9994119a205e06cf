"""Is prefill through LoRA dearer per token than decode on the real CPU server (issue 24)?  From the stored probe
rows only (no server):

    python experiments/real_validation/cpu_prompt_lora.py

Per probe (``cpu/probe``: the loop's profile; ``cpu/probe-after``: its own), the LoRA cost per prompt token that
each lone prompt through an adapter (family ``ttft_lora``, <= 400 tokens) implies -- its TTFT less the profile's
base, LoRA-off prefill and ``step_ms`` -- against the fitted ``token_ms`` (which the decode windows dominate).
Exploratory; the numbers in the issue's note.
"""
from __future__ import annotations

import csv
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "experiments" / "real_validation" / "cpu"
PROFILES = {"probe": ROOT / "configs" / "profiles" / "probe-llama-cpu-vllm032.yaml", "probe-after": CPU / "probe-after" / "profile.yaml"}


def prompt_lora(name: str) -> list[str]:
    lat = yaml.safe_load(PROFILES[name].read_text())["latency"]
    out = [f"{name}: base {lat['base_ms']:.2f} ms, per_token {lat['per_token_ms']:.3f} ms"]
    for row in csv.DictReader(open(CPU / name / "rows.csv")):
        if not row["experiment"].endswith("/ttft_lora") or float(row["probe_prompt_tokens"]) > 400:
            continue
        rank, tokens, ttft = int(float(row["max_lora_rank"])), int(float(row["probe_prompt_tokens"])), float(row["probe_ttft_ms"])
        lora = lat["lora"][rank]
        per_token = (ttft - lat["base_ms"] - lat["per_token_ms"] * tokens - lora.get("step_ms", 0.0)) / tokens
        out.append(f"  r{rank} p{tokens}: {per_token:.2f} ms LoRA per prompt token vs token_ms {lora['token_ms']:.2f}")
    return out


def main() -> int:
    for name in PROFILES:
        print("\n".join(prompt_lora(name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
