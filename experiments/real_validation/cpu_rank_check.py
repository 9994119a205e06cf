"""Does vLLM's CPU build cost an adapter at its own rank or at ``--max-lora-rank``?  (issue 24's open question)

    python experiments/real_validation/cpu_rank_check.py     # ~2 min: one real server, 48 lone requests

One real vLLM 0.32 server (the tier's probe-size model, ``--max-lora-rank 32 --max-loras 4``) serving adapters of
ranks 8, 16 and 32; the TTFT of lone 256- and 1,024-token prompts through each (and the base model), 3 each, two
rounds.  Measured 2026-12-02 (ms): base 140-158 / 603-699; r8 1,533-1,893 / 7,030-8,201; r16 1,472-1,738 /
7,114-7,796; r32 1,449-1,683 / 7,358-7,974 -- the same for every rank: slots are padded to the max rank, as the
twin assumes.  The same rank-32 prompt took 1,127 ms (256 tokens) in the probe's own launch; read then as launch-to-launch
variance, it is not: ``cpu_launch_check.py`` finds the same costs in every launch, with a spread of one prompt
within a launch of about +-15 %.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from cpu_tier import server_env, tier_dir

from lora_opt.emulate.client import server_prompt_tokens
from lora_opt.probe.launch import LaunchedServer, parse_serve_command
from lora_opt.probe.measure import ttft_runs


def main() -> None:
    t = json.loads((tier_dir() / "tier-probe.json").read_text())
    ad = t["adapters"]
    line = (f"vllm serve {t['model']} --served-model-name probe-llama --host 127.0.0.1 --port 18777 "
            "--max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 2048 --enforce-eager --dtype bfloat16 "
            "--block-size 128 --no-enable-prefix-caching --enable-lora --max-loras 4 --max-lora-rank 32 "
            f"--max-cpu-loras 4 --lora-modules r8={ad['r8-a']['path']} r16={ad['r16-a']['path']} "
            f"r32={ad['r32-a']['path']}")
    cmd = parse_serve_command(line)
    cmd.env.update(server_env())
    srv = LaunchedServer(cmd, server_cmd=None, log_path=Path("cpu_rank_check.log"), health_timeout_s=420)
    if not srv.start():
        raise SystemExit(f"the server did not start: {srv.log_tail()}")
    try:
        prompts = asyncio.run(server_prompt_tokens(srv.url))
        for rnd in range(2):
            for model in ("probe-llama", "r8", "r16", "r32"):
                for p in (256, 1024):
                    ttfts, note = asyncio.run(ttft_runs(srv.url, model, p, 3, 1.0, seed=p + rnd, prompts=prompts))
                    print(f"round {rnd} {model:12s} {p:5d} tokens: TTFT ms {[round(x) for x in ttfts]} {note}", flush=True)
    finally:
        srv.stop()


if __name__ == "__main__":       # run as a script: its folder is on the path (cpu_tier)
    main()
