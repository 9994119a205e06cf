"""``lora-opt simulate``: one vLLM instance described by a scenario file, on the twin."""
from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from lora_opt.cli.conventions import SEED
from lora_opt.io import atomic_write_bytes, atomic_write_text


def register(sub) -> None:
    s = sub.add_parser("simulate", help="simulate one vLLM instance described by a scenario file")
    s.add_argument("scenario", help="scenario YAML/JSON, or a bundled scenario by name (example)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    s.add_argument("--timeseries", metavar="FILE",
                   help="write time, running, waiting, KV usage, loaded adapters (CSV or .parquet)")
    s.add_argument("--seed", type=SEED, help="override the scenario's seed")
    s.add_argument("--early-stop", action="store_true",
                   help="stop as soon as starvation is certain (recorded in stopped_early_s)")
    s.set_defaults(run=run)


def _fmt_stats(s: dict) -> str:
    if s.get("mean") is None:
        return "n/a"
    return f"mean {s['mean']:9.1f}   median {s['median']:9.1f}   p99 {s['p99']:9.1f}"


def print_summary(res, sc, out=None) -> None:
    """The human-readable summary of one simulation result (to ``out``, default: stdout as it is now)."""
    w = (out or sys.stdout).write
    e = res.engine
    w(f"profile {sc.profile}   max_loras {e.max_loras}   max_lora_rank {e.max_lora_rank}   "
      f"max_cpu_loras {e.max_cpu_loras}   max_num_seqs {e.max_num_seqs}   "
      f"max_num_batched_tokens {e.max_num_batched_tokens}\n")
    if res.status == "oom":
        w(f"verdict     FAILS TO START: OOM at start-up: {res.oom_reason}\n")
        w(f"incoming    {res.incoming_token_rate:,.0f} tok/s over {res.arrived} requests -- nothing served\n")
        return
    need = sc.rho * res.incoming_token_rate
    if res.starving:
        w(f"verdict     STARVING: throughput {res.throughput_tok_s:,.0f} tok/s < rho x incoming = "
          f"{sc.rho} x {res.incoming_token_rate:,.0f} = {need:,.0f} tok/s\n")
    else:
        w(f"verdict     not starving: throughput {res.throughput_tok_s:,.0f} tok/s >= rho x incoming = "
          f"{sc.rho} x {res.incoming_token_rate:,.0f} = {need:,.0f} tok/s\n")
    if res.stopped_early_s is not None:
        w(f"            stopped early at {res.stopped_early_s:,.0f} s: starvation was certain; rates below are "
          f"over the whole {res.throughput_span_s:,.0f} s window (a lower bound of the full run's)\n")
    w(f"requests    {res.completed:,} completed of {res.arrived:,} arrived in {res.duration_s:,.0f} s\n")
    w(f"throughput  {res.throughput_tok_s:,.1f} tok/s  (input {res.input_throughput:,.1f}, "
      f"output {res.output_throughput:,.1f})\n")
    w(f"TTFT ms     {_fmt_stats(res.ttft_ms)}\n")
    w(f"ITL ms      {_fmt_stats(res.itl_ms)}\n")
    w(f"TPOT ms     {_fmt_stats(res.tpot_ms)}\n")
    w(f"batch       running {res.running_mean:.1f}, waiting {res.waiting_mean:.1f} (time means); "
      f"preemptions {res.preemptions:,}\n")
    w(f"adapters    loads CPU->GPU {res.adapter_loads_cpu:,}, disk->CPU {res.adapter_loads_disk:,}; "
      f"KV cache {res.kv_cache_tokens:,} tokens\n")
    w(f"twin        {res.steps:,} steps in {res.wall_s:.2f} s\n")


def run(args: argparse.Namespace) -> int:
    # imports inside run: only the command that runs pays for them (start-up time)
    import twin

    sc = twin.load_scenario(args.scenario)
    overrides = {}
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.early_stop:
        overrides["early_stop"] = True
    if overrides:
        from twin.scenario import replace
        sc = replace(sc, **overrides)
    res = twin.simulate(sc, timeseries=bool(args.timeseries))
    if args.timeseries and res.timeseries is not None:
        import pandas as pd  # heavy optional dependency: only with --timeseries
        path = Path(args.timeseries)
        df = pd.DataFrame(res.timeseries)
        if path.suffix == ".parquet":
            buf = io.BytesIO()
            df.to_parquet(buf, index=False)
            atomic_write_bytes(path, buf.getvalue())       # whole or absent
        else:
            atomic_write_text(path, df.to_csv(index=False))
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        print_summary(res, sc)
        if args.timeseries:
            print(f"time series -> {args.timeseries}")
    return 0
