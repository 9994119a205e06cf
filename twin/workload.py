"""Requests of a scenario: arrival times, adapter of each request, prompt and output lengths.

Every draw comes from ``numpy.random.default_rng`` seeded from ``scenario.seed`` (one child
stream for arrivals, one for lengths, one for the trace mapping), so a scenario always produces the
same requests.

Length model ``sharegpt`` (the distribution of the papers' real runs).  The real runs sampled
ShareGPT V3 with vLLM's benchmark rules (prompt 4..1024 tokens, output >= 4, prompt + output <=
2048) and average 223 prompt / 193 output tokens per completed request (``total_input_tokens /
completed`` over the unsaturated real runs, Llama-3 tokenizer).  We model prompt and output as
independent log-normals with the *shape* (log-std) of ShareGPT measured on the bundled 8k-filtered
ShareGPT file after the same benchmark filter (sigma_in = 1.397, sigma_out = 1.017, correlation of
logs -0.03), truncated by the same rules, and *locations* solved so that the truncated means are
223 / 193.  ``fit_sharegpt_locations()`` recomputes the two constants below.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from twin.arrivals import PROCESSES
from twin.bundled_data import LENGTH_FILES, TRACES
from twin.errors import ScenarioError
from twin.scenario import Scenario

SHAREGPT_SIGMA_IN = 1.397
SHAREGPT_SIGMA_OUT = 1.017
SHAREGPT_TARGET_MEANS = (223.0, 193.0)
# Solved by fit_sharegpt_locations() (deterministic, seed 0, 400k draws).
SHAREGPT_MU_IN = 5.0858
SHAREGPT_MU_OUT = 4.7925
PROMPT_MIN, PROMPT_MAX, OUTPUT_MIN, TOTAL_MAX = 4, 1024, 4, 2048

# Accepted trace layouts: (time column, unit, prompt column, output column)
TRACE_LAYOUTS = (
    ("TIMESTAMP", "datetime", "ContextTokens", "GeneratedTokens"),
    ("timestamp_ms", "ms", "input_length", "output_length"),
    ("timestamp_s", "s", "input_tokens", "output_tokens"),
)


@dataclass
class Requests:
    """Requests sorted by arrival time."""

    arrival: np.ndarray   # float64 seconds
    adapter: np.ndarray   # int32 adapter index
    in_len: np.ndarray    # int32 prompt tokens
    out_len: np.ndarray   # int32 output tokens (>= 1)

    def __len__(self) -> int:
        return int(self.arrival.shape[0])


# ---- lengths ---------------------------------------------------------------------------------
def _sharegpt_draw(rng: np.random.Generator, n: int, mu_in: float, mu_out: float):
    """n (prompt, output) pairs from the truncated log-normal model (rejection sampling)."""
    ins, outs, have = [np.empty(0, np.int64)], [np.empty(0, np.int64)], 0   # n may be 0
    while have < n:
        m = max(64, int((n - have) * 1.3))
        i = np.rint(rng.lognormal(mu_in, SHAREGPT_SIGMA_IN, m)).astype(np.int64)
        o = np.rint(rng.lognormal(mu_out, SHAREGPT_SIGMA_OUT, m)).astype(np.int64)
        keep = (i >= PROMPT_MIN) & (i <= PROMPT_MAX) & (o >= OUTPUT_MIN) & (i + o <= TOTAL_MAX)
        ins.append(i[keep])
        outs.append(o[keep])
        have += int(keep.sum())
    return np.concatenate(ins)[:n], np.concatenate(outs)[:n]


def fit_sharegpt_locations(n: int = 400_000, seed: int = 0) -> tuple[float, float]:
    """Solve (mu_in, mu_out) so the truncated model's means are SHAREGPT_TARGET_MEANS."""
    from scipy.optimize import least_squares

    def resid(mu):
        i, o = _sharegpt_draw(np.random.default_rng(seed), n, mu[0], mu[1])
        return [i.mean() / SHAREGPT_TARGET_MEANS[0] - 1, o.mean() / SHAREGPT_TARGET_MEANS[1] - 1]

    sol = least_squares(resid, x0=[4.8, 4.9], diff_step=1e-3)
    return float(sol.x[0]), float(sol.x[1])


_LENGTH_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _length_file(source: str) -> tuple[np.ndarray, np.ndarray]:
    if source not in _LENGTH_CACHE:
        import pandas as pd

        df = pd.read_csv(LENGTH_FILES[source])
        _LENGTH_CACHE[source] = (df["num_prefill_tokens"].to_numpy(np.int64),
                                 df["num_decode_tokens"].to_numpy(np.int64))
    return _LENGTH_CACHE[source]


def draw_lengths(sc: Scenario, rng: np.random.Generator, n: int, max_model_len: int):
    ln = sc.lengths
    if ln.source == "sharegpt":
        i, o = _sharegpt_draw(rng, n, SHAREGPT_MU_IN, SHAREGPT_MU_OUT)
    elif ln.source in LENGTH_FILES:
        fi, fo = _length_file(ln.source)
        idx = rng.integers(0, fi.shape[0], n)
        i, o = fi[idx], fo[idx]
    elif ln.source == "mean":
        mi = ln.mean_in if ln.mean_in is not None else SHAREGPT_TARGET_MEANS[0]
        mo = ln.mean_out if ln.mean_out is not None else SHAREGPT_TARGET_MEANS[1]
        i = np.full(n, int(round(mi)), np.int64)
        o = np.full(n, int(round(mo)), np.int64)
    elif ln.source == "normal":
        i = np.rint(rng.normal(ln.mean_in, ln.std_in, n)).astype(np.int64)
        o = np.rint(rng.normal(ln.mean_out, ln.std_out, n)).astype(np.int64)
    else:  # pragma: no cover - validated earlier
        raise ScenarioError(f"lengths.source: {ln.source!r} has no sampler here")
    return fit_context(i, o, max_model_len)


def fit_context(i, o, max_model_len):
    """Prompt and output lengths (each >= 1) cut to fit ``max_model_len``: the output first to
    ``max_model_len - 1``, then the prompt to what is left (as a client truncating its prompt would)."""
    i = np.maximum(np.asarray(i, np.int64), 1)
    o = np.maximum(np.asarray(o, np.int64), 1)
    # a request must fit the context: shorten the prompt first, as a client truncating it would
    o = np.minimum(o, max_model_len - 1)
    i = np.minimum(i, max_model_len - o)
    return i, o


# ---- arrivals --------------------------------------------------------------------------------
def _synthetic_arrivals(sc: Scenario, rng, rates):
    draw = PROCESSES[sc.arrivals.process]
    times, adapters = [], []
    for k, rate in enumerate(rates):
        t = draw(rng, rate, sc.duration_s, sc.arrivals)
        times.append(t)
        adapters.append(np.full(t.shape[0], k, np.int64))
    return np.concatenate(times), np.concatenate(adapters)


#: a trace CSV's limits: rows, token counts of one request (int32), |timestamp| in seconds
MAX_TRACE_ROWS = 50_000_000
MAX_TRACE_TOKENS = 2**31 - 1
MAX_TRACE_SECONDS = 1e12


def load_trace(name_or_path: str):
    """A trace as a DataFrame: t (seconds from its first request), in_len, out_len; validated."""
    import pandas as pd

    path = TRACES.get(name_or_path, Path(name_or_path))
    if not path.is_file():
        raise ScenarioError(f"arrivals.trace: {str(name_or_path)!r:.200} is neither a bundled trace "
                            f"({', '.join(TRACES)}) nor an existing CSV file")
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False, nrows=MAX_TRACE_ROWS + 1, encoding="utf-8")
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise ScenarioError(f"trace {path}: cannot be read as CSV: {str(exc)[:200]}") from None
    if len(df) > MAX_TRACE_ROWS:
        raise ScenarioError(f"trace {path}: more than {MAX_TRACE_ROWS:,} requests (the limit)")
    layout = next((lay for lay in TRACE_LAYOUTS if set(lay[0:1] + lay[2:]) <= set(df.columns)), None)
    if layout is None:
        raise ScenarioError(f"trace {path}: header {list(df.columns)} matches no known layout; expected "
                            + " or ".join(f"({c[0]}, {c[2]}, {c[3]})" for c in TRACE_LAYOUTS))
    tcol, unit, icol, ocol = layout
    if unit == "datetime":
        t = pd.to_datetime(df[tcol], errors="coerce", format="mixed")
        bad = t.isna()
        tsec = (t - t.min()).dt.total_seconds() if not bad.all() else t
    else:
        tsec = pd.to_numeric(df[tcol], errors="coerce")
        bad = tsec.isna()
        if unit == "ms":
            tsec = tsec / 1000.0
    ins = pd.to_numeric(df[icol], errors="coerce")
    outs = pd.to_numeric(df[ocol], errors="coerce")
    if unit != "datetime":         # inf, -inf and numbers whose span no window reaches are bad too
        bad = bad | ~np.isfinite(tsec.to_numpy(float, na_value=np.nan)) | (tsec.abs() > MAX_TRACE_SECONDS)
    for col, ok in ((tcol, ~bad), (icol, ins.notna() & (ins >= 0) & (ins <= MAX_TRACE_TOKENS)),
                    (ocol, outs.notna() & (outs >= 0) & (outs <= MAX_TRACE_TOKENS))):
        if not ok.all():
            row = int(np.flatnonzero(~ok.to_numpy())[0])
            raise ScenarioError(f"trace {path} line {row + 2}: bad {col} value "
                                f"{str(df[col].iloc[row])[:60]!r} (expected a number >= 0"
                                f"{' or a timestamp' if unit == 'datetime' else ''}"
                                f"{f', tokens <= {MAX_TRACE_TOKENS:,}' if col != tcol else f', |seconds| <= {MAX_TRACE_SECONDS:g}'})")
    if len(df) == 0:
        raise ScenarioError(f"trace {path}: no requests")
    tsec = tsec.to_numpy(float)
    tsec = tsec - tsec.min()
    return pd.DataFrame({"t": tsec, "in_len": ins.to_numpy(np.int64), "out_len": outs.to_numpy(np.int64)})


def _trace_arrivals(sc: Scenario, rng_map, rates):
    a = sc.arrivals
    tr = load_trace(a.trace)
    t = tr["t"].to_numpy() * a.time_scale - a.start_s
    keep = (t >= 0) & (t < sc.duration_s)
    t = t[keep]
    n_ad = len(rates)
    if a.mapping == "uniform":
        adapters = rng_map.integers(0, n_ad, t.shape[0])
    else:
        if a.mapping == "powerlaw":
            # popularity rank of each adapter is a seeded permutation; p_k ~ k^-alpha
            order = rng_map.permutation(n_ad)
            w = np.empty(n_ad)
            w[order] = np.arange(1, n_ad + 1, dtype=float) ** (-a.alpha)
        else:
            w = np.asarray(rates, float)
        adapters = rng_map.choice(n_ad, size=t.shape[0], p=w / w.sum())
    return t, adapters.astype(np.int64), tr["in_len"].to_numpy()[keep], tr["out_len"].to_numpy()[keep]


def generate_requests(sc: Scenario, max_model_len: int) -> Requests:
    """All requests of the scenario that arrive within ``duration_s``, sorted by arrival."""
    _, _, rates = sc.adapter_table()
    s_arr, s_len, s_map = np.random.SeedSequence(sc.seed).spawn(3)
    rng_arr, rng_len, rng_map = (np.random.default_rng(s) for s in (s_arr, s_len, s_map))
    if sc.arrivals.process == "trace":
        t, ad, ti, to = _trace_arrivals(sc, rng_map, rates)
    else:
        t, ad = _synthetic_arrivals(sc, rng_arr, rates)
        ti = to = None
    order = np.argsort(t, kind="stable")
    t, ad = t[order], ad[order]
    n = t.shape[0]
    if sc.lengths.source == "trace":
        i, o = fit_context(ti[order], to[order], max_model_len)
    else:
        i, o = draw_lengths(sc, rng_len, n, max_model_len)
    # int32 keeps a 700k-request hour well under 200 MB
    return Requests(arrival=np.ascontiguousarray(t, np.float64), adapter=ad.astype(np.int32),
                    in_len=i.astype(np.int32), out_len=o.astype(np.int32))
