"""Real clients against real vLLM 0.32 and against ``lora-opt emulate`` started with the same flags:
the official ``openai`` package (a dev dependency) and ``vllm bench serve`` (from the tier's venv),
then ``lora-opt ingest`` of both ``vllm bench serve`` results.

The emulator is started from the shared real server's own ``vllm serve`` command (``tier_command``)
the way ``probe --launch --server-cmd`` starts one: the same options, less those it has no analogue
for (``--enable-lora``: always on) and the CPU build's ``--enforce-eager`` / ``--dtype``; plus the
tier's model directory (vocabulary, tokenizer, chat template) and the vLLM version it imitates."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from real_vllm_tier import EMULATOR_PROFILE as PROFILE
from real_vllm_tier import ROOT, start_emulator_like, tier_command

from lora_opt.probe.launch import LaunchedServer

BENCH_ADAPTERS = ["r8-a", "r16-a", "r32-a"]
#: vllm bench serve: a few dozen short requests (each run ~5 s plus ~12 s to import vLLM)
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, RATE = 24, 32, 16, 6


@pytest.fixture(scope="module")
def emulator(tier, tmp_path_factory) -> LaunchedServer:
    server = start_emulator_like(tier, tier_command(tier), tmp_path_factory.mktemp("emu") / "emulate.log")
    try:
        yield server
    finally:
        server.stop()


def _openai_session(url: str) -> dict:
    """What the official client sees of a server: the models, a completion, a stream with usage, a chat
    completion, a clamped request, and the exceptions of three refusals."""
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    seen: dict = {"models": [m.id for m in c.models.list().data]}
    r = c.completions.create(model="r8-a", prompt="the quick brown fox", max_tokens=8, extra_body={"ignore_eos": True})
    seen["completion"] = (r.object, r.model, r.choices[0].finish_reason, r.usage.completion_tokens)
    chunks = list(c.completions.create(model="r16-a", prompt="hello there", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [x for x in chunks if x.choices]
    seen["stream"] = (len(text_chunks), text_chunks[-1].choices[0].finish_reason, chunks[-1].choices,
                      chunks[-1].usage.completion_tokens if chunks[-1].usage else None)
    ch = c.chat.completions.create(model="r32-a", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                   extra_body={"ignore_eos": True})
    seen["chat"] = (ch.object, ch.choices[0].message.role, ch.choices[0].finish_reason, ch.usage.completion_tokens)
    # prompt + max_tokens = 600 > max_model_len 512: served, cut at the context (vLLM >= 0.32)
    r = c.completions.create(model="r8-a", prompt=list(range(10, 310)), max_tokens=300, extra_body={"ignore_eos": True})
    seen["over_max_model_len"] = (r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens)
    for name, kw in (("max_tokens_alone_too_long", {"model": "r8-a", "prompt": "x", "max_tokens": 600}),
                     ("prompt_of_max_model_len", {"model": "r8-a", "prompt": list(range(10, 522)), "max_tokens": 4}),
                     ("unknown_model", {"model": "no-such-adapter", "prompt": "x", "max_tokens": 4})):
        try:
            c.completions.create(**kw)
            seen[name] = "accepted"
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            seen[name] = (type(e).__name__, e.status_code, body.get("type"), body.get("param"))
    return seen


def test_the_openai_client_sees_the_same_from_vllm_and_the_emulator(tier, vllm_server, emulator):
    real, emulated = _openai_session(vllm_server.url), _openai_session(emulator.url)
    assert real == emulated
    assert real["models"] == [tier["served_model_name"], *tier["adapters"]]
    assert real["completion"] == ("text_completion", "r8-a", "length", 8)
    assert real["stream"] == (6, "length", [], 6)
    assert real["chat"] == ("chat.completion", "assistant", "length", 5)
    assert real["over_max_model_len"] == ("length", 300, 212)
    assert real["max_tokens_alone_too_long"][:2] == ("BadRequestError", 400)
    assert real["prompt_of_max_model_len"][:2] == ("BadRequestError", 400)
    assert real["unknown_model"] == ("NotFoundError", 404, "NotFoundError", "model")


def _bench_serve(tier: dict, url: str, out: Path, name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"})
    argv = [str(Path(tier["bin"]) / "vllm"), "bench", "serve", "--base-url", url, "--model", tier["served_model_name"],
            "--tokenizer", tier["model"], "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS), "--request-rate", str(RATE),
            "--seed", "1", "--ignore-eos", "--lora-modules", *BENCH_ADAPTERS, "--save-result", "--result-dir", str(out),
            "--result-filename", f"{name}.json"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=out, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / f"{name}.json").read_text())


def test_vllm_bench_serve_on_vllm_and_the_emulator_then_ingest(tier, vllm_server, emulator, tmp_path):
    """``vllm bench serve`` (random dataset, 24 prompts of 32 + 16 tokens over 3 adapters at 6 req/s)
    runs to the end against both; ``lora-opt ingest`` turns both results into real-runs rows with the
    placement's flags and adapters."""
    results = {side: _bench_serve(tier, server.url, tmp_path, side)
               for side, server in (("vllm", vllm_server), ("emulator", emulator))}
    for side, res in results.items():
        assert res["completed"] == NUM_PROMPTS and res["failed"] == 0, side
        assert res["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, side          # --ignore-eos
        assert res["mean_ttft_ms"] > 0 and res["mean_itl_ms"] > 0, side
    # the placement of the server's GPU: its flags, and the adapters bench serve spread the requests over
    adapters = [{"id": a, "rank": tier["adapters"][a]["rank"], "rate": 1.0} for a in BENCH_ADAPTERS]
    gpu = {"max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 4, "max_num_seqs": 16,
           "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 512}
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"profile": PROFILE, "policy": "test", "adapters": adapters, "gpus": [gpu],
                                     "routes": {a: [[0, 1.0]] for a in BENCH_ADAPTERS}}))
    rows_csv = tmp_path / "rows.csv"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "ingest", str(tmp_path / "vllm.json"),
                        str(tmp_path / "emulator.json"), "--placement", str(placement), "--label", "clients",
                        "--out", str(rows_csv)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    import pandas as pd
    rows = pd.read_csv(rows_csv)
    assert len(rows) == 2 and set(rows["experiment"]) == {"ingested/clients"}
    assert list(rows["completed"]) == [NUM_PROMPTS, NUM_PROMPTS] and (rows["status"] == "ok").all()
    assert list(rows["total_output_tokens"]) == [NUM_PROMPTS * OUTPUT_LEN] * 2
    assert (rows["n_served_adapters"] == 3).all() and (rows["max_loras"] == 2).all()
    assert list(rows["adapter_rates"]) == [" ".join([f"{RATE / 3:.6g}"] * 3)] * 2     # bench serve's rate, split
    for side, (_, row) in zip(("vllm", "emulator"), rows.iterrows()):
        assert row["mean_ttft_ms"] == pytest.approx(results[side]["mean_ttft_ms"]), side
    print("vllm bench serve (mean TTFT / ITL ms, tok/s): "
          + "; ".join(f"{s} {x['mean_ttft_ms']:.1f} / {x['mean_itl_ms']:.2f}, {x['total_token_throughput']:.0f}"
                      for s, x in results.items()))
