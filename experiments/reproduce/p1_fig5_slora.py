"""First paper, Fig. 5 (second paper, Fig. 13): the adapter caching problem exists under S-LoRA too --
throughput against served adapters peaks (Max_pack, the crosses) and then falls, by less than
under vLLM.

Real only: the bundled S-LoRA runs on the papers' cluster (``data/real_runs/real_runs_slora_fork.csv``:
Llama-2-7B, rank 32, 250 input / 231 output tokens, 32-768 adapters at 0.0125-0.4 req/s each).  The
twin models vLLM, not S-LoRA's unified memory pool, so there is no "ours" beyond re-deriving the
paper's reading of these measurements (Max_pack with the papers' 0.9 criterion, drop after the peak).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import REPO, Context, Row, md_table, pyplot, save_figure

NAME = "p1_fig5_slora"
TITLE = "First paper Fig. 5: optimal served adapters under S-LoRA (real runs)"
PAPER = "first"
QUICK = True

RHO = 0.9


def load() -> pd.DataFrame:
    d = pd.read_csv(REPO / "data" / "real_runs" / "real_runs_slora_fork.csv")
    d = d[d["status"] == "ok"].copy()
    d["throughput"] = d["input_throughput"] + d["output_throughput"]
    d["incoming"] = d["aggregate_request_rate"] * (d["total_input_tokens"] + d["total_output_tokens"]) / d["completed"]
    return d


def per_rate(d: pd.DataFrame) -> list[dict]:
    out = []
    for rate, g in d.groupby("request_rate_per_adapter"):
        g = g.sort_values("num_adapters")
        ok = g[g["throughput"] >= RHO * g["incoming"]]
        best = ok.loc[ok["throughput"].idxmax()] if len(ok) else None
        peak = g["throughput"].max()
        last = g.iloc[-1]
        out.append({"rate": float(rate), "max_pack_adapters": float(best["num_adapters"]) if best is not None else np.nan,
                    "max_pack_tok_s": float(best["throughput"]) if best is not None else np.nan,
                    "peak_tok_s": float(peak), "last_adapters": float(last["num_adapters"]),
                    "last_tok_s": float(last["throughput"]), "drop_pct": 100 * (1 - last["throughput"] / peak),
                    "peaks_inside": bool(g["throughput"].idxmax() != g.index[-1])})
    return out


def _figure(d: pd.DataFrame, rows: list[dict], ctx: Context) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        g = d[d["request_rate_per_adapter"] == r["rate"]].sort_values("num_adapters")
        line = ax.plot(g["num_adapters"], g["throughput"], marker=".", label=f"{r['rate']} req/s")[0]
        if np.isfinite(r["max_pack_adapters"]):
            ax.plot(r["max_pack_adapters"], r["max_pack_tok_s"], "x", ms=12, mew=2, c=line.get_color())
    ax.set(xlabel="served adapters", ylabel="throughput (tok/s)", title="S-LoRA, Llama-2-7B rank 32 (real); x = Max_pack")
    ax.legend(fontsize=7)
    return save_figure(fig, ctx)


def run(ctx: Context) -> Row:
    d = load()
    rows = per_rate(d)
    table = md_table(["rate per adapter", "Max_pack adapters", "Max_pack tok/s", "peak tok/s", "largest N run",
                      "throughput there", "drop after the peak %", "peak inside the sweep"],
                     [[r["rate"], r["max_pack_adapters"], r["max_pack_tok_s"], r["peak_tok_s"], r["last_adapters"],
                       r["last_tok_s"], r["drop_pct"], r["peaks_inside"]] for r in rows])
    inside = [r for r in rows if r["peaks_inside"]]
    drops = [r["drop_pct"] for r in inside]
    metrics = {f"rate_{r['rate']}.{k}": float(v) for r in rows for k, v in r.items()
               if k != "rate" and isinstance(v, (int, float))}
    packs = ", ".join(f"{r['max_pack_adapters']:.0f}" for r in rows)
    rates = ", ".join(f"{r['rate']:g}" for r in rows)
    return Row(
        name=NAME, title=TITLE,
        paper_value="the optimum (crosses) exists under S-LoRA too; throughput falls only 15-20 % past it",
        ours="(real data only: the twin models vLLM, not S-LoRA's unified pool)",
        real=(f"Max_pack at {packs} adapters for {rates} req/s; past the peak throughput falls "
              f"{min(drops):.0f}-{max(drops):.0f} % by the largest N ({len(inside)} of {len(rows)} rates peak inside the sweep)"),
        verdict="reproduced" if len(inside) >= len(rows) - 1 and max(drops) <= 25 else "partly",
        why=(f"re-derived from the bundled S-LoRA runs: the peak is interior for {len(inside)} of {len(rows)} rates "
             f"and the fall after it ({min(drops):.0f}-{max(drops):.0f} %) matches the paper's 15-20 % at the high "
             f"rates; no twin comparison (S-LoRA is not modelled)"),
        metrics=metrics, params={"rho": RHO, "source": "data/real_runs/real_runs_slora_fork.csv"},
        figure=_figure(d, rows, ctx), table_md=table)
