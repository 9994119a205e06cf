"""The estimator constants a probe identifies, side by side for two profiles (a known one and the one
``lora-opt calibrate`` fitted on probe rows), with the relative error of each.

``python -m lora_opt.probe.compare KNOWN.yaml FITTED.yaml [--max-loras A]`` prints the table.
The LoRA jump is compared at ``A`` slots (``LoraOverheadSpec.jump_at``: what a server with ``A`` slots
pays; the probe measures it at its launch's ``max_loras``).
"""
from __future__ import annotations

import argparse
import sys

from twin.profile import Profile, load_profile


def constants(p: Profile, ranks: list[int], max_loras: int) -> dict[str, float]:
    """The probe-identified constants of ``p`` (the LoRA ones at ``ranks``, the loads at those ranks)."""
    lat = p.latency
    out = {"decode base_ms": lat.base_ms, "decode per_seq_ms": lat.per_seq_ms,
           "decode per_ctx_ktoken_ms": lat.per_ctx_ktoken_ms, "prefill per_token_ms": lat.per_token_ms}
    for r in ranks:
        lora = lat.lora_for_rank(r)
        out[f"lora r{r} jump (at {max_loras} slots)"] = lora.jump_at(max_loras)
        out[f"lora r{r} slope"] = lora.slope
    for r in ranks:
        out[f"load r{r} cpu_to_gpu_ms"] = p.loading.cpu_ms(r)
        out[f"load r{r} disk_to_cpu_ms"] = p.loading.disk_ms(r)
    return out


def compare(known: Profile, fitted: Profile, max_loras: int) -> list[tuple[str, float, float, float]]:
    """(constant, known, recovered, relative error) for every constant the fitted profile has a rank for."""
    ranks = sorted(fitted.latency.lora)
    k, f = constants(known, ranks, max_loras), constants(fitted, ranks, max_loras)
    return [(name, k[name], f[name], f[name] / k[name] - 1.0 if k[name] else float("nan")) for name in k]


def table(rows: list[tuple[str, float, float, float]]) -> str:
    lines = [f"{'constant':<34} {'known':>12} {'recovered':>12} {'error':>8}"]
    for name, k, f, e in rows:
        lines.append(f"{name:<34} {k:>12.6g} {f:>12.6g} {e * 100:>+7.2f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("known")
    ap.add_argument("fitted")
    ap.add_argument("--max-loras", type=int, default=16, help="slots the LoRA jump is compared at (default 16)")
    a = ap.parse_args(argv)
    rows = compare(load_profile(a.known), load_profile(a.fitted), a.max_loras)
    # a command-line entry point (python -m ...): the table is its result, written to stdout
    sys.stdout.write(table(rows) + f"\nlargest |error|: {max(abs(e) for *_, e in rows) * 100:.2f} %\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
