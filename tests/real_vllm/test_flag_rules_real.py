"""vLLM 0.32's own resolution of ``max_num_seqs`` / ``max_num_batched_tokens`` -- the tier's CPU
build's ``EngineArgs.create_engine_config`` for the OpenAI server -- against the twin's 0.32 rules
(``twin.flag_rules``: vllm/engine/arg_utils.py:3136-3180, vllm/config/scheduler.py:328), each case
resolved from the defaults vLLM itself takes on this machine.
"""
from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

from real_vllm_tier import tier_env

from twin.errors import ScenarioError
from twin.flag_rules import flag_rules
from twin.flags import EngineFlags, resolve_flags

#: flags as set (the rest left to vLLM) -> what vLLM 0.32 makes of them
CASES = {"defaults": {}, "budget_128": {"max_num_batched_tokens": 128}, "seqs_4096": {"max_num_seqs": 4096},
         "seqs_1_len_1024": {"max_num_seqs": 1, "max_model_len": 1024}}

PROBE = textwrap.dedent("""
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    out = {}
    for name, flags in json.loads(sys.argv[2]).items():
        try:
            s = EngineArgs(model=sys.argv[1], **flags).create_engine_config(UsageContext.OPENAI_API_SERVER).scheduler_config
            out[name] = [s.max_num_seqs, s.max_num_batched_tokens]
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
""")


def test_the_twins_032_rules_are_vllm_032s(tier):
    r = subprocess.run([str(Path(tier["bin"]) / "python"), "-c", PROBE, tier["model"], json.dumps(CASES)],
                       env=tier_env(tier), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    real = json.loads(r.stdout.strip().splitlines()[-1])
    seqs, tokens = real["defaults"]
    defaults = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens,
                "max_model_len": tier["dims"]["max_position_embeddings"]}
    for name, flags in CASES.items():
        try:
            eng = resolve_flags(EngineFlags(**flags), defaults, flag_rules("0.32.0+cpu"))
            twin = [eng.max_num_seqs, eng.max_num_batched_tokens]
        except ScenarioError as exc:
            assert "must be greater than or equal to max_num_seqs" in str(exc)
            twin = "refused"
        expected = real[name] if isinstance(real[name], list) else "refused"
        if expected == "refused":
            assert "must be greater than or equal to max_num_seqs" in real[name], real[name]
        assert twin == expected, (name, real[name])
    assert real["budget_128"] == [128, 128] and real["seqs_1_len_1024"] == [1, 1024]     # the clamp and the cap
