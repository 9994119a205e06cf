"""The differential conformance suite: every case of ``conformance_cases`` sent to the tier's real
vLLM 0.32 (the shared session server) and to one ``lora-opt emulate`` started with the same flags
(``--max-model-len``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``, ``--max-num-seqs``,
``--lora-modules``, the served name, the model directory, runtime LoRA updating on,
``--vllm-version`` the tier's), compared case for case on what a client can tell (status, error
envelope / type / param / message, SSE framing, usage, ``/v1/models``, ``/version``, ``/tokenize``,
runtime (un)loading).

The one difference left on purpose (:data:`DOCUMENTED_DIFFERENCES`, and docs/emulate.md): a runtime
load of an adapter whose rank is above ``--max-lora-rank`` -- vLLM 0.32 answers 500, a server error
for a client's mistake; the emulator refuses it with 400.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conformance_cases import CASES, lora_cases, observe, oversized_rank_case, shape
from real_vllm_tier import start_emulator_like

ROOT = Path(__file__).resolve().parents[2]
#: simulated seconds per wall second (the suite's longest request: ~500 tokens)
SPEED = 10
#: cases where the emulator differs from vLLM 0.32 on purpose: case id -> what the emulator answers
DOCUMENTED_DIFFERENCES = {
    "load_rank_above_max": {"status": 400, "envelope": "nested", "type": "BadRequestError", "param": "lora_path",
                            "code": 400, "message": "LoRA rank 64 is greater than max_lora_rank 32."},
}
_PLACEHOLDER_TIER = {"adapters": {n: {"path": "-"} for n in ("r8-a", "r8-b", "r16-a", "r16-b", "r32-a", "r32-b")}}
CASE_IDS = [c.id for c in CASES] + [c.id for c in lora_cases(_PLACEHOLDER_TIER)] + ["load_rank_above_max"]


def _client():
    import httpx
    return httpx.Client(timeout=120, trust_env=False)


def _served_adapters(url: str) -> list[str]:
    """The adapters the real server serves now, in its /v1/models order (another test may have
    reloaded one: vLLM lists it last then)."""
    with _client() as c:
        return [m["id"] for m in c.get(url + "/v1/models").json()["data"] if m.get("parent")]


@pytest.fixture(scope="module")
def emulator(tier, vllm_server, tmp_path_factory):
    try:
        import tokenizers  # noqa: F401  -- the emulator counts text with the model's tokenizer only with it
    except ImportError:
        hint = "the conformance suite needs the tokenizers package: pip install -e '.[tokenizer]' (part of [dev])"
        if os.environ.get("CI"):
            pytest.fail(hint)
        pytest.skip(hint)
    # the adapters in the order the real server lists them now (a reload moves one last)
    server = start_emulator_like(tier, vllm_server.cmd, tmp_path_factory.mktemp("emulator") / "emulate.log",
                                 adapters=_served_adapters(vllm_server.url), speed=SPEED)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def oversized_adapter(tier, tmp_path_factory) -> str:
    """A copy of a rank-32 adapter whose adapter_config.json says rank 64 (above --max-lora-rank 32):
    vLLM reads the rank from the config before it loads the weights."""
    dst = tmp_path_factory.mktemp("adapters") / "r64"
    shutil.copytree(tier["adapters"]["r32-a"]["path"], dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(r=64, lora_alpha=128)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def answers(tier, vllm_server, emulator, oversized_adapter) -> dict:
    """Case id -> (real vLLM's shape, the emulator's shape, both raw answers), every case sent to
    both in the table's order (the runtime-LoRA rows depend on the rows before them)."""
    out = {}
    t0 = time.time()
    with _client() as c:
        for case in CASES + lora_cases(tier) + [oversized_rank_case(oversized_adapter)]:
            real, emu = observe(c, vllm_server.url, case), observe(c, emulator, case)
            out[case.id] = (shape(case, real), shape(case, emu), real, emu)
    print(f"conformance: {len(out)} cases in {time.time() - t0:.1f} s")
    return out


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_emulator_answers_as_real_vllm(answers, case_id):
    real, emu, real_raw, emu_raw = answers[case_id]
    if case_id in DOCUMENTED_DIFFERENCES:
        assert real["status"] == 500, f"vLLM no longer answers {case_id} with 500: {real} (update docs/emulate.md)"
        assert emu == DOCUMENTED_DIFFERENCES[case_id]
        return
    assert emu == real, (f"{case_id}: the emulator differs from real vLLM\n  real: {real}\n  emu:  {emu}\n"
                         f"  real body: {real_raw['text'][:600]}\n  emu body:  {emu_raw['text'][:600]}")


def test_every_error_is_json_never_a_traceback(answers):
    """No case -- deeply nested JSON, bad content types included -- gets a 5xx or a non-JSON body
    from the emulator."""
    for case_id, (_, emu, _, emu_raw) in answers.items():
        assert emu["status"] < 500, (case_id, emu)
        if emu["status"] >= 400:
            json.loads(emu_raw["text"])
