"""Is the LoRA prefill cost on vLLM's CPU build a property of the launch (noise), of ``--max-loras`` or of
``--enforce-eager``?

    python experiments/real_validation/cpu_launch_check.py     # ~10 min: six real servers
    python experiments/real_validation/cpu_launch_check.py --only compiled    # two of them
    python experiments/real_validation/cpu_launch_check.py --only emitted     # the mixed-ranks server's command
    python experiments/real_validation/cpu_launch_check.py --only knee        # the prompt-length sweeps

Session 10 saw the same rank-32 256-token prompt take 1,127 ms in the probe's launch (``--max-loras 16``) and
1,450-1,680 ms in ``cpu_rank_check.py``'s (``--max-loras 4``) and called it launch-to-launch variance; the two
launches differed in ``--max-loras``.  This launches the same two commands twice each, alternating (4, 16, 4,
16), and times lone prompts through the base model and through rank-8 and rank-32 adapters
(``--max-lora-rank 32``); then twice without ``--enforce-eager`` (vLLM compiles the model: what the
commands ``place --emit-vllm`` writes run, and the validation servers ran); then the mixed-ranks validation
server's own emitted command, as it ran (its adapters a8 and a32); then, at ``--max-lora-rank`` 32 and 16, lone
prompts of 64..1,024 tokens through an adapter of that rank (where the LoRA prefill cost bends).  Its output
(``cpu/launch_check.json``) says which it is.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from cpu_tier import server_env, tier_dir

from lora_opt.emulate.client import server_prompt_tokens
from lora_opt.io import atomic_write_json
from lora_opt.probe.launch import LaunchedServer, parse_serve_command, read_launch
from lora_opt.probe.measure import ttft_runs

OUT = Path(__file__).parent / "cpu" / "launch_check.json"
POINTS = (("probe-llama", 256, 3), ("r8", 256, 3), ("r32", 256, 3), ("r32", 1024, 2))


#: (mode, --max-loras) per launch, in order
LAUNCHES = (("eager", 4), ("eager", 16), ("eager", 4), ("eager", 16), ("compiled", 4), ("compiled", 4),
            ("emitted", 6), ("knee", 32), ("knee", 16))
#: (adapter, prompt tokens, repetitions) of the knee launches, per --max-lora-rank
KNEE = {32: [("probe-llama", 256, 2)] + [("r32", p, 3) for p in (64, 128, 160, 192, 224, 256, 320, 384, 512)],
        16: [("probe-llama", 512, 2)] + [("r16", p, 3) for p in (128, 256, 320, 384, 448, 512, 640, 768)]}
EMITTED = Path(__file__).parent / "cpu" / "validation" / "mixed_ranks-report" / "placement" / "vllm" / "serve_commands.txt"


def launch_line(t: dict, max_loras: int, mode: str) -> str:
    ad = t["adapters"]
    eager = "--enforce-eager " if mode == "eager" else ""
    if mode == "knee":          # max_loras is the rank here
        return (f"vllm serve {t['model']} --served-model-name probe-llama --host 127.0.0.1 --port 18778 "
                "--max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 2048 --dtype bfloat16 "
                f"--block-size 128 --no-enable-prefix-caching --enable-lora --max-loras 2 --max-lora-rank {max_loras} "
                f"--max-cpu-loras 2 --lora-modules r{max_loras}={ad[f'r{max_loras}-a']['path']}")
    return (f"vllm serve {t['model']} --served-model-name probe-llama --host 127.0.0.1 --port 18778 "
            f"--max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 2048 {eager}--dtype bfloat16 "
            f"--block-size 128 --no-enable-prefix-caching --enable-lora --max-loras {max_loras} --max-lora-rank 32 "
            f"--max-cpu-loras {max(max_loras, 2)} --lora-modules r8={ad['r8-a']['path']} r32={ad['r32-a']['path']}")


def one_launch(t: dict, mode: str, max_loras: int, k: int) -> dict:
    if mode == "emitted":
        cmd = read_launch(str(EMITTED), 0).with_options(port=18778)
        cmd.env.pop("CUDA_VISIBLE_DEVICES", None)
        names = {"probe-llama": t["model"], "r8": "a8", "r32": "a32"}
    else:
        cmd = parse_serve_command(launch_line(t, max_loras, mode))
        names = {}
    cmd.env.update(server_env())
    srv = LaunchedServer(cmd, server_cmd=None, log_path=OUT.parent / "logs" / f"launch_check_{k}.log",
                         health_timeout_s=420)
    if not srv.start():
        raise SystemExit(f"the server did not start: {srv.log_tail()}")
    try:
        prompts = asyncio.run(server_prompt_tokens(srv.url))
        points = KNEE[max_loras] if mode == "knee" else POINTS
        asyncio.run(ttft_runs(srv.url, names.get(points[-1][0], points[-1][0]), 64, 1, 1.0, seed=1,
                              prompts=prompts))      # warm-up
        res = {}
        for model, p, reps in points:
            ttfts, note = asyncio.run(ttft_runs(srv.url, names.get(model, model), p, reps, 1.0, seed=p, prompts=prompts))
            res[f"{model}@{p}"] = {"ttft_ms": [round(x, 1) for x in ttfts], "median_ms": round(statistics.median(ttfts), 1),
                                   "note": note}
            print(f"launch {k} ({mode}, --max-loras {max_loras}) {model:12s} {p:5d} tokens: TTFT ms "
                  f"{[round(x) for x in ttfts]} {note}", flush=True)
        return {"launch": k, "mode": mode, "max_loras": max_loras, "startup_s": srv.startup_s, "points": res}
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("eager", "compiled", "emitted", "knee"), help="only the launches of this mode (kept: the others')")
    args = ap.parse_args()
    t = json.loads((tier_dir() / "tier-probe.json").read_text())
    old = json.loads(OUT.read_text())["runs"] if OUT.exists() and args.only else []
    runs = [r for r in old if r.get("mode", "eager") != args.only]
    runs += [one_launch(t, mode, ml, k) for k, (mode, ml) in enumerate(LAUNCHES) if args.only in (None, mode)]
    atomic_write_json(OUT, {"what": __doc__.split("\n\n")[0], "runs": sorted(runs, key=lambda r: r["launch"])},
                      indent=1)
    print(f"wrote {OUT}")


if __name__ == "__main__":       # run as a script: its folder is on the path (cpu_tier)
    main()
