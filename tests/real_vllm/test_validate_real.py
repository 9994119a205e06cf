"""``lora-opt validate`` against a real vLLM (the tier's shared server: vLLM 0.32 CPU build,
``--max-model-len 512``): a request log with requests whose prompt + output exceed max_model_len.
The measurement is written whatever the twin does; the twin gets the requests as vLLM admits them
(0.32 clamps ``max_tokens``; a prompt of max_model_len is refused with 400); a twin that cannot run
leaves the measurement, the reason and exit status 5.

The twin runs the bundled H100 profile (the tiny CPU model has none): its numbers are not compared
here, only that it ran on the requests vLLM admitted."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "llama-3.1-8b-h100-64gb"
ADAPTERS = ["r8-a", "r16-a", "r32-a"]
#: the shared server's flags (conftest.vllm_server), as the placement's GPU
GPU = {"max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 4, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
       "gpu_memory_utilization": 0.9, "max_model_len": 512}
#: (arrival s, adapter, prompt, max_tokens): 6 that fit, 2 whose sum (600) exceeds 512 (vLLM 0.32 serves
#: them with max_tokens clamped to 212), 1 whose prompt is max_model_len (refused: 400)
LOG = [(0.0, "r8-a", 64, 16), (0.5, "r16-a", 300, 300), (1.0, "r32-a", 64, 16), (1.5, "r8-a", 512, 8),
       (2.0, "r16-a", 32, 24), (2.5, "r32-a", 300, 300), (3.0, "r8-a", 100, 20), (3.5, "r16-a", 48, 16),
       (4.0, "r32-a", 64, 12)]
#: the replayed window: the log's 4 s and time for 212 tokens of decode on 2 busy cores
DURATION_S = 45


def _placement(tmp_path: Path, max_model_len: int, rank_of: dict) -> Path:
    adapters = [{"id": a, "rank": rank_of[a], "rate": 0.5} for a in ADAPTERS]
    gpu = {**GPU, "max_model_len": max_model_len}
    d = tmp_path / f"placement-{max_model_len}"
    d.mkdir()
    (d / "placement.json").write_text(json.dumps({"profile": PROFILE, "policy": "test", "adapters": adapters,
                                                  "gpus": [gpu], "routes": {a: [[0, 1.0]] for a in ADAPTERS}}))
    engine = {k: GPU[k] for k in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "max_model_len")}
    (d / "workload.yaml").write_text(yaml.safe_dump({
        "profile": PROFILE, "rho": 0.9, "adapters": adapters, "engine": engine,
        "evaluation": {"arrivals": {"process": "poisson"}, "lengths": {"source": "mean", "mean_in": 64, "mean_out": 16},
                       "duration_s": DURATION_S, "seed": 1}}))
    return d


def _log(path: Path, rows) -> Path:
    path.write_text("timestamp_s,adapter,input_tokens,output_tokens\n"
                    + "".join(f"{t:.3f},{a},{i},{o}\n" for t, a, i, o in rows))
    return path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _validate(placement: Path, url: str, log: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_opt.cli", "validate", str(placement / "placement.json"),
                           "--endpoints", url, "--workload", str(placement / "workload.yaml"), "--history", str(log),
                           "--duration", str(DURATION_S), "--speed", "1", "--scrape-s", "2", "--workers", "1",
                           "--no-track", "--out", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=DURATION_S + 240)


def _rows(out: Path) -> list[dict]:
    with open(out / "requests.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_validate_writes_the_measurement_of_requests_over_max_model_len(tier, vllm_server, tmp_path):
    """Prompt + max_tokens over 512: vLLM 0.32 serves them cut to 212 tokens; the prompt of 512 is
    refused (400, vLLM's message kept).  Exit 3 (a request failed); real.json, bench.json,
    requests.csv, timeseries.csv; the twin ran on the 8 requests vLLM admitted, clamped as vLLM did."""
    ranks = {a: tier["adapters"][a]["rank"] for a in ADAPTERS}
    placement = _placement(tmp_path, 512, ranks)
    out = tmp_path / "out"
    r = _validate(placement, vllm_server.url, _log(tmp_path / "log.csv", LOG), out)
    assert r.returncode == 3, r.stderr + r.stdout
    for name in ("real.json", "bench.json", "requests.csv", "timeseries.csv", "twin.json", "comparison.json"):
        assert (out / name).is_file(), name
    real = json.loads((out / "real.json").read_text())
    info = real["info"]
    assert info["versions"]["0"].startswith("0.32")
    assert info["prompt_tokens"].endswith(")") and "/tokenize" in info["prompt_tokens"]   # ids from the server
    assert info["admission"]["per_gpu"]["0"] == {
        "max_model_len": 512, "max_model_len_from": "endpoint", "vllm_version": info["versions"]["0"],
        "version_from": "endpoint", "clamps_max_tokens": True, "clamped": 2, "refused": 1}
    rows = _rows(out)
    clamped = [x for x in rows if x["admission"] == "clamped"]
    assert len(clamped) == 2
    for x in clamped:          # vLLM's answer: 200, cut at max_model_len (usage says 212)
        assert (x["status"], x["http_status"], x["output_tokens_admitted"], x["output_tokens_received"]) == \
            ("ok", "200", "212", "212"), x
    (refused,) = [x for x in rows if x["admission"] == "refused"]
    assert refused["status"] == "failed" and refused["http_status"] == "400"
    assert refused["error"].startswith("HTTP 400: ") and len(refused["error"]) > len("HTTP 400: ") + 20
    ok = [x for x in rows if x["admission"] == "admitted"]
    assert len(ok) == 6 and all(x["status"] == "ok" and x["output_tokens_received"] == x["output_tokens"] for x in ok)
    assert real["failed"] == 1 and real["completed"] == 8
    bench = json.loads((out / "bench.json").read_text())
    assert bench["completed"] == 8 and bench["failed"] == 1
    assert bench["total_output_tokens"] == sum(int(x["output_tokens_received"]) for x in rows if x["status"] == "ok")
    twin = json.loads((out / "twin.json").read_text())
    assert info["twin"] == {"status": "ok"} and twin["requests"] == 8 and twin["completed"] == 8
    # the twin served the clamped lengths: its tokens are the measured ones
    served = sum(int(x["input_tokens"]) + int(x["output_tokens_received"]) for x in rows if x["status"] == "ok")
    assert abs(twin["throughput_tok_s"] * DURATION_S - served) < 1e-6 * served
    # ingest: the measurement as a real-runs row (the twin-side columns come from the placement)
    ingested = tmp_path / "rows.csv"
    r = subprocess.run([sys.executable, "-m", "lora_opt.cli", "ingest", str(out), "--label", "real", "--out",
                        str(ingested)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    (row,) = list(csv.DictReader(ingested.open()))
    assert row["completed"] == "8" and row["failed"] == "1" and row["experiment"] == "ingested/real"
    print(f"real vLLM: {real['completed']} ok, mean TTFT {real['ttft_ms']['mean']:.1f} ms, mean ITL "
          f"{real['itl_ms']['mean']:.2f} ms, throughput {real['throughput_tok_s']:.1f} tok/s; clamped requests' e2e "
          f"{', '.join(x['e2e_ms'][:7] for x in clamped)} ms")


def test_a_twin_that_cannot_run_leaves_the_measurement_and_exit_5(tier, vllm_server, tmp_path):
    """The placement says max_model_len 256, the server serves 512: requests of 200 + 200 tokens are
    served live and cannot enter the twin.  Exit 5: the measurement is written, the reason in
    twin_error.json."""
    ranks = {a: tier["adapters"][a]["rank"] for a in ADAPTERS}
    placement = _placement(tmp_path, 256, ranks)
    rows = [(0.0, "r8-a", 200, 200), (0.5, "r16-a", 32, 16), (1.0, "r32-a", 48, 16)]
    out = tmp_path / "out"
    r = _validate(placement, vllm_server.url, _log(tmp_path / "log.csv", rows), out)
    assert r.returncode == 5, r.stderr + r.stdout
    real = json.loads((out / "real.json").read_text())
    assert real["completed"] == 3 and real["failed"] == 0
    assert [x["output_tokens_received"] for x in _rows(out)] == ["200", "16", "16"]
    error = json.loads((out / "twin_error.json").read_text())
    assert "exceeds max_model_len 256" in error["reason"] and real["info"]["twin"]["reason"] == error["reason"]
    assert not (out / "twin.json").exists() and "Traceback" not in r.stderr
