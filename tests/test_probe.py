"""``lora-opt probe`` on ``lora-opt emulate`` running a KNOWN profile, then ``lora-opt calibrate`` on the
rows: the identification pipeline end to end without a GPU.  The known profile is the bundled Llama-3.1
one with LoRA constants at ranks 8/16/32/64 and load tables made up for the test (so nothing of them
can come from the bundled profile the fit keeps its model dimensions from).

* the key test (slow, ~100 s): the quick plan, 4 launches of the emulator at speed 1; every
  constant the probe identifies within 5 % of the known profile;
* a smoke variant in the default run (~25 s): the smoke plan at speed 2 (one rank), the CLI path,
  the start-up family (an emulator refusing to start), the MLflow run;
* units: the serve command's parsing and re-flagging, the window arithmetic, KV from /metrics;
* what cannot fool the probe (issue 23): windows without measurable gaps and loads <= 0 or within
  their noise are ``noisy``; failure notes carry the HTTP status and the server's message; prompts
  are drawn from the server's /tokenize ids and cut to its max_model_len (stub servers, fakes).
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd
import pytest
import yaml

from test_emulate import ROOT, Emulator, _env, _free_port

from lora_opt.calibration.probe_fit import calibrate_probe, is_probe_table
from lora_opt.cli import main as cli_main
from lora_opt.emulate.client import Record, prompt_ids, server_error, server_prompt_tokens
from lora_opt.placement.plan import Placement
from lora_opt.placement.vllm_launch import serve_command
from lora_opt.probe.compare import compare, table
from lora_opt.probe.launch import EMULATOR_IMPLIED_FLAGS, parse_serve_command, read_launch
from lora_opt.probe.measure import failure_note, kv_tokens_from_metrics, load_verdict, window_noise, window_step
from twin.profile import load_profile, profile_to_dict

BASE = "llama-3.1-8b-h100-64gb"
KNOWN_LORA = {8: (0.30, 0.020), 16: (0.36, 0.024), 32: (0.45, 0.030), 64: (0.60, 0.040)}
KNOWN_LOADING = {"cpu_to_gpu_ms": {8: 6.6, 16: 8.0, 32: 11.0, 64: 17.0},
                 "disk_to_cpu_ms": {8: 68.0, 16: 92.0, 32: 139.0, 64: 232.0}}


def known_profile(path, per_seq_ms: float | None = None) -> str:
    d = profile_to_dict(load_profile(BASE))
    d["name"], d["fit"] = "probe-known", {}
    if per_seq_ms is not None:
        d["latency"]["per_seq_ms"] = per_seq_ms
    d["latency"]["lora"] = {r: {"jump": j, "slope": s, "n_sat": math.inf, "ref_max_loras": 16.0, "slot_share": 0.0,
                                "prefill_share": 0.25} for r, (j, s) in KNOWN_LORA.items()}
    d["loading"] = KNOWN_LOADING
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(path)


def launch_line(port: int) -> str:
    return (f"CUDA_VISIBLE_DEVICES=0 vllm serve meta-llama/Llama-3.1-8B-Instruct --host 127.0.0.1 --port {port} "
            "--enable-lora --max-loras 4 --max-lora-rank 16 --max-model-len 8192 --max-num-seqs 64 "
            "--max-num-batched-tokens 2048 --gpu-memory-utilization 0.9 --block-size 16 --scheduling-policy fcfs "
            "--disable-prefix-caching --no-async-scheduling --lora-modules a=adapters/a")


def _probe(tmp_path, plan: str, speed: float, *extra, per_seq_ms: float | None = None) -> tuple[int, str]:
    known = known_profile(tmp_path / "known.yaml", per_seq_ms)
    server = f"{sys.executable} -m lora_opt.cli emulate --profile {known} --speed {speed:g}"
    rc = cli_main(["probe", "--launch", launch_line(_free_port()), "--server-cmd", server, "--speed", f"{speed:g}",
                   "--plan", plan, "--model", "probe-known", "--out", str(tmp_path / "probe"), *extra])
    return rc, known


# ---- the key test ------------------------------------------------------------------------------
@pytest.mark.slow
def test_quick_probe_recovers_known_profile_within_5_percent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    import lora_opt.probe.plan as probe_mod
    quick = probe_mod.PLANS["quick"]
    # + the start-up family: 16 slots start; 4096 slots of rank 64 (~1.5 TB) are refused as vLLM would
    monkeypatch.setitem(probe_mod.PLANS, "quick", type(quick)(**{**quick.__dict__, "startup_max_loras": (16, 4096)}))
    rc, known = _probe(tmp_path, "quick", 1.0, "--no-track")
    summary = json.loads((tmp_path / "probe" / "summary.json").read_text())
    assert summary["families"]["startup"] == {"ok": 1, "failed": 1}
    assert rc == 3, capsys.readouterr()                    # the refused start-up is a failed row
    assert all(v["failed"] == 0 for k, v in summary["families"].items() if k != "startup")
    fitted = tmp_path / "fitted.yaml"
    assert cli_main(["calibrate", "--runs", str(tmp_path / "probe" / "rows.csv"), "--model", BASE,
                     "--out", str(fitted)]) == 0
    rows = compare(load_profile(known), load_profile(str(fitted)), max_loras=16)
    print(table(rows))
    assert len(rows) == 4 + 2 * 4 + 2 * 4                  # decode 3 + prefill 1, LoRA and loads at 4 ranks
    bad = [(n, e) for n, _, _, e in rows if not abs(e) <= 0.05]
    assert not bad, table(rows)


# ---- the default-run variant -------------------------------------------------------------------
def test_smoke_probe_calibrate_and_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    # a window the client could not resolve is marked noisy (issue 23: never ok), and the remedy the
    # probe prints is to run again: a plumbing test on a shared 2-core machine does so, up to 3 times
    # (seen in a clean CI run: one adapter-load row within its own noise at speed 2)
    for attempt in range(3):
        base = tmp_path / f"try{attempt}"
        base.mkdir()
        uri = f"sqlite:///{base / 'mlflow.db'}"
        # the 8B's 0.034 ms a sequence (0.3 ms at batch 16 and speed 2) is inside a smoke window's noise: calibrate
        # rightly refused a fit of 0 on a clean CI run (stop 28). A plumbing test needs a per-sequence cost its
        # four decode windows resolve, so its synthetic truth has 0.25 ms (the 7B's measured value); the 5 % claim
        # on the 8B's own costs is the slow test's
        rc, known = _probe(base, "smoke", 2.0, "--tracking-uri", uri, per_seq_ms=0.25)
        summary = json.loads((base / "probe" / "summary.json").read_text())
        if not any(v.get("noisy") for v in summary["families"].values()):
            break
    tmp_path, out = base, base / "probe"
    assert rc == 0 and {k: v["failed"] for k, v in summary["families"].items()} == \
        {"kv": 0, "decode": 0, "prefill": 0, "lora": 0, "ttft_lora": 0, "loading": 0}
    assert is_probe_table(out / "rows.csv")
    prof = calibrate_probe(out / "rows.csv", BASE, tmp_path / "fitted.yaml")
    assert set(prof["latency"]["lora"]) == {8} and set(prof["loading"]["cpu_to_gpu_ms"]) == {8}
    # the adapter's prefill share is fitted from lone prompts through it (plumbing: on the H100 profile an
    # adapter adds ~2 ms to a 1,024-token TTFT, within this run's noise at speed 2)
    assert prof["fit"]["estimators"]["lora_prefill_share"]["n_points"] == 2
    assert 0 <= prof["latency"]["lora"][8]["prefill_share"] < 5
    rows = {n: e for n, _, _, e in compare(load_profile(known), load_profile(str(tmp_path / "fitted.yaml")), 8)}
    # a plumbing check (2 LoRA points, short windows at speed 2): the 5 % claim is the slow test's
    assert abs(rows["decode base_ms"]) < 0.05 and abs(rows["load r8 disk_to_cpu_ms"]) < 0.05
    assert abs(rows["lora r8 jump (at 8 slots)"]) < 0.15
    # both launches reported their KV (vllm:cache_config_info); the emulator runs the base profile's
    # memory model, so the check is exact
    kv = prof["fit"]["kv_check"]
    assert kv["kv_r8"]["measured"] < kv["kv_no_lora"]["measured"]
    assert kv["kv_r8"]["rel_error"] == kv["kv_no_lora"]["rel_error"] == 0.0

    import mlflow
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["probe"], output_format="list")
    assert len(runs) == 1 and runs[0].data.params["plan"] == "smoke"
    assert runs[0].data.metrics["rows.lora.ok"] == 3                 # B 8 at 1 and 8 adapters; B 1 at one
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id)}
    assert {"rows.csv", "summary.json", "logs"} <= arts


# ---- units -------------------------------------------------------------------------------------
def test_emitted_command_parsed_and_reflagged(tmp_path):
    (tmp_path / "placement.json").write_text(json.dumps(
        {"profile": BASE, "policy": "t", "adapters": [{"id": "a", "rank": 8, "rate": 1.0}],
         "gpus": [{"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 2, "max_num_seqs": 32,
                   "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}],
         "routes": {"a": [[0, 1.0]]}}))
    p = Placement.load(tmp_path / "placement.json")
    line = "CUDA_VISIBLE_DEVICES=0 " + " ".join(serve_command(p, 0, "m", port=8123))   # as place --emit-vllm
    (tmp_path / "serve_commands.txt").write_text(line + "\n")
    cmd = read_launch(str(tmp_path / "serve_commands.txt"))
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0"} and cmd.port == 8123 and cmd.host == "127.0.0.1"
    new = cmd.with_options(drop=("--lora-modules",), max_lora_rank=32, lora_modules=["x=p", "y=p"])
    argv = new.argv()
    assert argv[:2] == ["vllm", "serve"] and argv[argv.index("--max-lora-rank") + 1] == "32"
    assert argv[argv.index("--lora-modules") + 1:argv.index("--lora-modules") + 3] == ["x=p", "y=p"]
    emu = new.argv("lora-opt emulate --profile P")
    assert emu[:4] == ["lora-opt", "emulate", "--profile", "P"]
    assert not set(EMULATOR_IMPLIED_FLAGS) & set(emu) and "--block-size" not in emu
    with pytest.raises(Exception, match="vllm serve MODEL"):
        parse_serve_command("python -m something --port 1")


def test_window_step_recovers_a_known_step_function():
    """Streams whose tokens come at step ends of a step time linear in the context: the window's
    mean step and mean context satisfy the same line (front-end delays differ per stream)."""
    b, p, out, speed = 6, 100, 80, 1.0
    base, per_ctx = 0.010, 0.00005 / 1000          # s, s per context token
    t, clock = [[] for _ in range(b)], 0.0
    for step in range(out + 3):                    # streams start 0..2 steps apart (prefills)
        started = [k for k in range(b) if step >= k % 3]
        ctx = sum(p + (step - k % 3) - 1 for k in started)
        clock += base + per_ctx * ctx
        for k in started:
            if len(t[k]) < out:
                t[k].append(clock + 0.001 * k)
    recs = [Record(0.0, p, out, token_times=tk, status=200) for tk in t]
    w = window_step(recs, p, speed)
    assert w["ok"] and w["burst_share"] == 0.0
    assert w["step_ms"] == pytest.approx(1000 * (base + per_ctx * w["ctx_ktokens"] * 1000), rel=2e-3)


def test_kv_tokens_from_vllm_metrics():
    text = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'num_gpu_blocks="20780",num_cpu_blocks="0"} 1.0\n')
    assert kv_tokens_from_metrics(text) == 20780 * 16
    assert np.isnan(kv_tokens_from_metrics("vllm:num_requests_running 0\n"))


# ---- the runbook -------------------------------------------------------------------------------
@pytest.mark.slow
def test_runbook_dry_run_on_emulator(tmp_path):
    """experiments/real_validation/run.py end to end with lora-opt emulate standing in for vllm serve:
    place -> probe -> launch the fleet -> validate -> ingest -> calibrate, the MLflow runs, the bundle."""
    import subprocess
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    server = f"{sys.executable} -m lora_opt.cli emulate --profile {BASE} --speed 1"
    # 4 GPUs: the example workload's SLO needs 4 since the additive LoRA cost (issue 36; 3 is infeasible)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "real_validation" / "run.py"), "--gpus", "4",
                           "--plan", "smoke", "--duration", "20", "--speed", "1", "--server-cmd", server,
                           "--out", str(tmp_path / "rv"), "--tracking-uri", uri, "--gpu-name", "emulated"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rv = tmp_path / "rv"
    summary = json.loads((rv / "summary.json").read_text())
    assert summary["exit"]["calibrate"] == 0 and summary["exit"]["probe"] in (0, 3)
    assert set(summary["step_s"]) == {"place", "probe", "launch", "validate", "ingest", "calibrate"}
    for f in ("probe/rows.csv", "validation/comparison.json", "ingested_rows.csv", "fitted_profile.yaml",
              "profile_vs_probe.txt", "environment.json"):
        assert (rv / f).is_file(), f
    assert (tmp_path / "rv_send_back.tar.gz").is_file()
    import mlflow
    mlflow.set_tracking_uri(uri)
    for exp in ("probe", "validation", "real_validation", "calibrate"):     # every step in the run's store
        assert len(mlflow.search_runs(experiment_names=[exp], output_format="list")) == 1, exp


@pytest.mark.slow
def test_live_endpoint_modes(tmp_path, monkeypatch):
    """--endpoint: a server without adapters gets the decode and prefill families; one with adapters
    the LoRA family and lone prompts through an adapter (``ttft_lora``) at the rank it is told (vLLM does
    not report it) -- no loading family: a running server's residency is not the probe's to arrange."""
    known = known_profile(tmp_path / "known.yaml")
    port = _free_port()
    emu = Emulator(["--profile", known, "--port", str(port), "--speed", "2", "--max-model-len", "8192"])
    try:
        rc = cli_main(["probe", "--endpoint", f"http://127.0.0.1:{port}", "--plan", "smoke", "--speed", "2",
                       "--model", "x", "--max-num-batched-tokens", "2048", "--out", str(tmp_path / "a"), "--no-track"])
    finally:
        assert emu.stop() == 0
    fams = json.loads((tmp_path / "a" / "summary.json").read_text())["families"]
    assert rc == 0 and set(fams) == {"kv", "decode", "prefill"}
    port = _free_port()
    emu = Emulator(["--profile", known, "--port", str(port), "--speed", "2", "--max-model-len", "8192",
                    "--max-loras", "8", "--max-lora-rank", "16", "--lora-modules", *[f"a{i}=p" for i in range(8)]])
    try:
        assert cli_main(["probe", "--endpoint", f"http://127.0.0.1:{port}", "--plan", "smoke", "--model", "x",
                         "--speed", "2", "--out", str(tmp_path / "b"), "--no-track"]) == 2   # rank missing
        rc = cli_main(["probe", "--endpoint", f"http://127.0.0.1:{port}", "--plan", "smoke", "--speed", "2",
                       "--model", "x", "--max-lora-rank", "16", "--out", str(tmp_path / "b"), "--no-track"])
    finally:
        assert emu.stop() == 0
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    fams = summary["families"]
    assert rc == 0 and set(fams) == {"kv", "lora", "ttft_lora"}, fams
    # the smoke plan: lora at batch 8 with 1 and 8 adapters + its one-adapter window at batch 1; ttft_lora at
    # 256 and 1,024 prompt tokens; every row measured (a noisy one was retried and kept, never failed)
    from lora_opt.probe.plan import PLANS
    smoke = PLANS["smoke"]
    assert sum(fams["lora"].values()) == len(smoke.lora_distinct) + len(smoke.lora_step_windows) == 3
    assert sum(fams["ttft_lora"].values()) == len(smoke.lora_prefill_prompts) == 2
    assert fams["lora"]["failed"] == fams["ttft_lora"]["failed"] == 0 and fams["ttft_lora"]["ok"] == 2
    rows = pd.read_csv(tmp_path / "b" / "rows.csv")
    assert set(rows.loc[rows["probe_family"] == "ttft_lora", "run_name"]) == {"ttft_lora_r16_p256", "ttft_lora_r16_p1024"}


# ---- what cannot fool the probe (issue 23): unmeasurable windows and loads are noisy -----------
def _window(times_per_stream, prompt=100):
    return window_step([Record(0.0, prompt, len(t), token_times=list(t), status=200) for t in times_per_stream],
                       prompt, 1.0)


def test_a_window_whose_tokens_came_in_one_read_is_noisy_never_ok(monkeypatch):
    """All tokens of every stream in one read: every gap is 0, the 'step' 0.0 ms -- not a measurement."""
    import lora_opt.probe.plan as probe_mod

    one_read = [[5.0] * 40 for _ in range(4)]
    w = _window(one_read)
    assert w["ok"] and w["step_ms"] == 0.0 and w["positive_gaps"] == 0
    assert window_noise(w).startswith("no measurable token gaps")

    runs = []

    async def fake_batch_run(url, models, b, p, out, seed=0, prompts=None):
        runs.append(seed)
        return [Record(0.0, p, out, token_times=[5.0] * out, status=200) for _ in range(b)]
    monkeypatch.setattr(probe_mod, "batch_run", fake_batch_run)
    w = probe_mod.measured_window("http://x", ["m"], 4, 100, 40, 1.0, seed=0)
    assert len(runs) == 1 + probe_mod.RETRIES                     # retried, then kept as noisy
    row = probe_mod._step_row(probe_mod.ProbeContext("m", 1.0, {}), "decode", "decode_b4_p100", w, 4, 0, 100, 40)
    assert row["status"] == "noisy" and "no measurable token gaps" in row["probe_note"]


def test_window_noise_names_each_reason():
    clean = {"positive_gaps": 100, "gaps": 100, "step_ms": 10.0, "burst_share": 0.0, "stream_spread": 0.0}
    assert window_noise(clean) == ""
    assert "<= 0" in window_noise({**clean, "step_ms": 0.0})
    assert "<= 0" in window_noise({**clean, "step_ms": -1.0})
    assert "bursts" in window_noise({**clean, "burst_share": 0.9})
    assert "disagreed" in window_noise({**clean, "stream_spread": 0.5})
    # a few timed gaps among many zero ones: still not resolved
    assert window_noise({**clean, "positive_gaps": 2}).startswith("no measurable")


def test_load_at_or_below_zero_or_within_its_noise_is_noisy(monkeypatch):
    warm = [30.0, 31.0, 29.0, 30.5, 29.5] * 4
    assert "<= 0" in load_verdict([x - 12.0 for x in warm], warm)["noisy"]        # the issue's -12 ms
    assert "<= 0" in load_verdict(warm, warm)["noisy"]
    v = load_verdict([x + 1.0 for x in warm[::-1]], [30.0, 35.0, 25.0, 33.0, 27.0] * 4)  # 1 ms, wide spread
    assert v["load_ms"] == pytest.approx(1.0) and "within its noise" in v["noisy"]
    v = load_verdict([x + 100.0 for x in warm], warm)
    assert v["noisy"] == "" and v["load_ms"] == pytest.approx(100.0) and v["n"] == 20
    assert v["noise_ms"] == pytest.approx(math.hypot(*[1.2533 * 1.4826 * 0.5 / math.sqrt(20)] * 2), rel=1e-3)
    # one request the machine held up does not move a median
    v2 = load_verdict([x + 100.0 for x in warm[:-1]] + [5000.0], warm)
    assert v2["load_ms"] == pytest.approx(100.0) and v2["noisy"] == ""

    import lora_opt.probe.plan as probe_mod

    async def fake_cycles(url, cycles, speed, *, seed=0, prompts=None):
        assert cycles == {"warm": ["g0", "g1"], "cpu": ["g0", "g1", "c0"], "disk": ["g0", "g1", "c0", "c1", "d0"]}
        return {"ok": True, "cpu": load_verdict([x - 12.0 for x in warm], warm),      # cpu: -12 ms; disk: clear
                "disk": load_verdict([x + 40.0 for x in warm], warm)}
    monkeypatch.setattr(probe_mod, "cycle_load_ms", fake_cycles)
    ctx = probe_mod.ProbeContext("m", 1.0, {"max_lora_rank": 8, "enable_lora": True})
    rows = {r["run_name"]: r for r in probe_mod.loading_family("http://x", ctx, ["g0", "g1"], ["c0", "c1"], ["d0", "d1"],
                                                               lambda: None)}
    assert rows["load_cpu_r8"]["status"] == "noisy" and "<= 0" in rows["load_cpu_r8"]["probe_note"]
    assert rows["load_cpu_r8"]["probe_load_ms_per_adapter"] == pytest.approx(-12.0)
    assert rows["load_disk_r8"]["status"] == "ok" and rows["load_disk_r8"]["probe_note"] == ""
    assert rows["load_disk_r8"]["probe_load_ms_per_adapter"] == pytest.approx(40.0)


def test_unresolved_cpu_load_is_zero_and_said(tmp_path):
    """A disk load resolved and its CPU->slot copy not (a CPU server's few-ms copy within the noise): the
    copy is 0, the disk load keeps its whole cost, and the profile's notes say so."""
    from lora_opt.calibration.probe_fit import fit_loading
    runs = pd.DataFrame([
        {"experiment": "digital_twin_dynamic/estimators/probe/loading", "run_name": "load_cpu_r8", "status": "noisy",
         "probe_load_kind": "cpu", "max_lora_rank": 8, "probe_load_ms_per_adapter": 0.4},
        {"experiment": "digital_twin_dynamic/estimators/probe/loading", "run_name": "load_disk_r8", "status": "ok",
         "probe_load_kind": "disk", "max_lora_rank": 8, "probe_load_ms_per_adapter": 7.5}])
    fit = fit_loading(runs)
    assert fit.params == {"cpu_to_gpu_ms": {8: 0.0}, "disk_to_cpu_ms": {8: 7.5}}
    assert fit.extra["cpu_to_gpu_unresolved_ranks"] == [8]


# ---- failure notes carry the HTTP status and the server's message ------------------------------
def test_failure_notes_carry_status_and_server_message():
    nested = (b'HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 120\r\n\r\n'
              b'{"error":{"message":"Token id 8038 is out of vocabulary","type":"BadRequestError",'
              b'"param":"prompt","code":400}}')
    assert server_error(400, nested) == "HTTP 400: BadRequestError: Token id 8038 is out of vocabulary (param prompt)"
    flat = (b'HTTP/1.1 404 Not Found\r\ncontent-length: 99\r\n\r\n{"object":"error","message":"The model `x` does '
            b'not exist.","type":"NotFoundError","param":null,"code":404}')
    assert server_error(404, flat) == "HTTP 404: NotFoundError: The model `x` does not exist."
    # vLLM 0.32 answers an out-of-vocabulary prompt of a *streamed* request 200 + an error event
    chunk = b'data: {"error": {"message": "Token id 8038 is out of vocabulary", "type": "BadRequestError", ' \
            b'"param": null, "code": 400}}\n\n'
    sse = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + f"{len(chunk):x}\r\n".encode() + chunk
           + b"\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    assert server_error(200, sse) == "HTTP 200: BadRequestError: Token id 8038 is out of vocabulary"
    assert server_error(502, b"HTTP/1.1 502 Bad Gateway\r\n\r\n<html>bad gateway</html>") == \
        "HTTP 502: <html>bad gateway</html>"
    failed = Record(0.0, 10, 5, status=400, error=server_error(400, nested))
    fine = Record(0.0, 10, 5, status=200, token_times=[1.0, 1.1, 1.2, 1.3, 1.4])
    w = window_step([fine, failed], 10, 1.0)
    assert not w["ok"] and "HTTP 400: BadRequestError: Token id 8038 is out of vocabulary" in w["why"]
    short = Record(0.0, 500, 64, status=200, token_times=[1.0] * 12)
    assert "ended after 12 of 64 tokens" in failure_note([short])


# ---- prompts within the server's vocabulary and max_model_len ----------------------------------
class _StubServer:
    """/v1/models (max_model_len 512) and, when ``tokenize``, /tokenize answering ids 4..203."""

    def __init__(self, tokenize: bool):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def _json(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._json(200, {"object": "list", "data": [
                    {"id": "tiny", "parent": None, "max_model_len": 512},
                    {"id": "a", "parent": "tiny", "max_model_len": None}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if tokenize:
                    self._json(200, {"count": 400, "max_model_len": 512, "tokens": list(range(4, 204)) * 2})
                else:
                    self._json(404, {"detail": "Not Found"})

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_prompts_come_from_the_servers_tokenizer_and_fit_max_model_len():
    import asyncio

    stub = _StubServer(tokenize=True)
    try:
        pt = asyncio.run(server_prompt_tokens(stub.url))
    finally:
        stub.close()
    assert pt.max_model_len == 512 and pt.ids == tuple(range(4, 204)) and "/tokenize" in pt.source
    for k in range(50):
        ids = pt.prompt(k, 300)
        assert len(ids) == 300 and set(ids) <= set(pt.ids)
    assert pt.prompt(1, 64) != pt.prompt(2, 64) and pt.prompt(1, 64) == pt.prompt(1, 64)
    assert pt.longest(64, 2048) == 448 and pt.longest(2, 256) == 256
    stub = _StubServer(tokenize=False)
    try:
        pt = asyncio.run(server_prompt_tokens(stub.url))
    finally:
        stub.close()
    assert pt.ids == () and pt.max_model_len == 512 and "HTTP 404" in pt.source
    assert pt.prompt(3, 5) == prompt_ids(3, 5) == [100 + (3 * 7919 + j) % 20000 for j in range(5)]   # unchanged


def test_endpoint_mode_sends_no_prompt_longer_than_max_model_len(monkeypatch, tmp_path):
    """--endpoint on a server with max_model_len 512: the plan's 512/2048-token prompts are cut so that
    prompt + output fit (the issue: prefill prompts of 2,048 tokens went to a 512-token server)."""
    import lora_opt.probe.plan as probe_mod
    import lora_opt.probe.run as run_mod
    from lora_opt.emulate.client import PromptTokens
    from lora_opt.probe.plan import PLANS, ProbeOptions

    sent = []

    async def fake_batch_run(url, models, b, p, out, seed=0, prompts=None):
        sent.append(("decode", p, out))
        return [Record(0.0, p, out, token_times=[0.01 * j + 0.0001 * k for j in range(out)], status=200)
                for k in range(b)]

    async def fake_ttft(url, model, p, reps, speed, seed=0, prompts=None):
        sent.append(("prefill", p, 2))
        return [1.0 + p / 1000] * reps, ""
    monkeypatch.setattr(probe_mod, "batch_run", fake_batch_run)
    monkeypatch.setattr(probe_mod, "ttft_runs", fake_ttft)
    monkeypatch.setattr(run_mod, "server_info", lambda url: {
        "version": "0.32.0", "base": "tiny", "adapters": [], "kv_tokens": 1e6, "max_model_len": 512,
        "prompts": PromptTokens((1, 2, 3), 512, "3 ids from POST /tokenize")})
    rows, info = run_mod.probe_endpoint("http://x", ProbeOptions(plan=PLANS["smoke"], model="m", progress=False))
    assert sent and all(p + out <= 512 for _, p, out in sent), sent
    assert {p for f, p, _ in sent if f == "prefill"} == {256, 510}
    assert {r["probe_prompt_tokens"] for r in rows if r["probe_family"] == "decode"} == {32, 448}
    assert info["max_model_len"] == 512 and info["prompts"] == "3 ids from POST /tokenize"


def test_tokens_merged_into_one_chunk_are_counted():
    """vLLM's front end, behind its engine, sends several steps' tokens in one chunk (a real vLLM 0.32
    stream of 64 tokens came as 62 chunks): with ``return_token_ids`` each chunk's ids are counted."""
    import asyncio
    import http.server
    import threading
    import time

    from lora_opt.emulate.client import stream_one

    events = [b'data: {"choices":[{"index":0,"text":"a","prompt_token_ids":[9,9],"token_ids":[5]}]}',
              b'data: {"choices":[{"index":0,"text":"bcd","token_ids":[6, 7, 8]}]}',
              b'data: {"choices":[{"index":0,"text":"","token_ids":[],"finish_reason":"length"}]}',
              b'data: {"choices":[{"index":0,"text":"e"}]}', b"data: [DONE]"]
    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for ev in events:                     # one write per event, the second split in two
                for part in ((ev[:30], ev[30:]) if b"bcd" in ev else (ev,)):
                    self.wfile.write(part)
                    self.wfile.flush()
                    time.sleep(0.002)
                self.wfile.write(b"\n\n")

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        counted, plain = Record(0.0, 2, 5), Record(0.0, 2, 5)
        asyncio.run(stream_one("127.0.0.1", port, "/v1/completions", "m", counted, time.perf_counter(), [1, 2],
                         count_token_ids=True))
        asyncio.run(stream_one("127.0.0.1", port, "/v1/completions", "m", plain, time.perf_counter(), [1, 2]))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert bodies[0]["return_token_ids"] is True and "return_token_ids" not in bodies[1]
    assert len(counted.token_times) == 5 and counted.done_marker and counted.error == ""   # 1 + 3 + 0 + 1 (no ids)
    assert len(set(counted.token_times[1:4])) == 1                                       # merged: one arrival
    assert len(plain.token_times) == 4                                                    # one per chunk


def test_launch_commands_are_checked_against_the_chosen_vllm_release(tmp_path):
    """probe --launch --vllm-version: every command it would start is checked against that release's
    recorded vllm serve options before any starts (a 0.33 spelling refused for 0.32, nothing launched)."""
    from lora_opt.cli import main
    from lora_opt.probe.launch import parse_serve_command
    from lora_opt.probe.plan import PLANS
    from lora_opt.probe.run import launch_commands

    base = parse_serve_command("vllm serve m --port 18999 --max-model-len 512 --disable-prefix-caching")
    names = list(launch_commands(base, PLANS["full"], "a/r{rank}"))
    assert names[0] == "no_lora" and "rank_8" in names and any(n.startswith("startup_a") for n in names)
    cmd = "vllm serve m --port 18999 --max-model-len 512 --disable-prefix-caching"
    assert main(["probe", "--launch", cmd, "--plan", "smoke", "--model", "m", "--vllm-version", "0.32",
                 "--out", str(tmp_path / "p"), "--no-track"]) == 2
    assert not (tmp_path / "p" / "logs").exists()
    assert main(["probe", "--launch", cmd, "--plan", "smoke", "--model", "m", "--vllm-version", "9.1",
                 "--out", str(tmp_path / "q"), "--no-track"]) == 2
