"""The twin's speed work changes no number: exact results of three seeded reference scenarios, as
made by the twin before that work (``tests/data/twin_golden.json``, written by running this file
with ``--write PATH`` against that older checkout), and the fast ITL statistics equal to the
plain sort-based definition on inputs that exercise its fall-back.  Rewritten once since, on purpose
(2026-12-04): a time-series sample is the state the last step left, before the arrivals since (as vLLM's
gauges read between steps) -- only the ``waiting`` series' digests changed, every other number stayed.

Floats are compared as ``float.hex`` (bit for bit); arrays (time series, raw samples) by the
SHA-256 of their bytes."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).parent / "data" / "twin_golden.json"
#: the Llama-3.1 profile the golden numbers were made with (the factor LoRA form), frozen: the bundled one is
#: additive since issue 36, and a factor-form profile must still give these numbers bit for bit
FACTOR_PROFILE = Path(__file__).parent / "data" / "profile-llama-3.1-factor-2026-12-03.yaml"

#: (name, adapters, max_loras, duration_s, seed, early_stop): the bench's three reference
#: scenarios (2, 10 and 30 req/s), shortened, with seeds other than the bench's
SCENARIOS = [
    ("2 req/s, 8 adapters", [{"count": 8, "rank": 16, "rate": 0.25}], 8, 900, 3, False),
    ("10 req/s, 32 adapters, 16 slots", [{"count": 32, "rank": 16, "rate": 0.3125}], 16, 600, 5, False),
    ("30 req/s, 96 adapters, 32 slots", [{"count": 96, "rank": 16, "rate": 0.3125}], 32, 300, 7, True),
]


def _scenario(adapters, max_loras, duration_s, seed, early_stop):
    from twin.scenario import scenario_dict, scenario_from_dict
    return scenario_from_dict(scenario_dict(
        str(FACTOR_PROFILE), adapters, duration_s=duration_s, seed=seed, early_stop=early_stop,
        engine={"max_lora_rank": 16, "max_num_seqs": 2048, "max_num_batched_tokens": 2048, "max_loras": max_loras}))


def _exact(x):
    """A JSON value that keeps every bit: floats as hex, dicts and lists recursively."""
    if isinstance(x, float):
        return x.hex()
    if isinstance(x, dict):
        return {k: _exact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_exact(v) for v in x]
    return x


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return f"{a.dtype.str}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()


def fingerprint(result) -> dict:
    """Every number of a result: its JSON keys, step/arrival/drop counts, and digests of its time
    series and raw samples."""
    return {"result": _exact(result.to_dict()), "steps": result.steps, "arrived": result.arrived,
            "dropped": result.dropped,
            "timeseries": {k: _digest(v) for k, v in sorted((result.timeseries or {}).items())},
            "samples": {k: _digest(v) for k, v in sorted((result.samples or {}).items())}}


def run_all() -> dict:
    import twin
    return {name: fingerprint(twin.simulate(_scenario(*spec), timeseries=True)) for name, *spec in SCENARIOS}


def test_reference_scenarios_bit_identical_to_golden():
    want = json.loads(GOLDEN.read_text())
    got = run_all()
    for name in want:
        assert got[name] == want[name], name


def _plain_weighted_stats(values, counts):
    """The definition the fast path must equal: argsort, then the same reductions."""
    import math
    total = int(counts.sum())
    order = np.argsort(values)
    v, c = values[order], counts[order]
    cum = np.cumsum(c)

    def at(k):
        return float(v[np.searchsorted(cum, k, side="right")])

    def pct(q):
        pos = q / 100.0 * (total - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return at(lo) + (at(hi) - at(lo)) * (pos - lo)
    return {"mean": float((v * c).sum() / total), "median": pct(50), "p99": pct(99)}


def test_weighted_stats_equals_plain_definition_bit_for_bit():
    """Cases for every path of ``twin.weighted_sort.sorted_pairs``: radix with unique runs, runs of
    equal values with different counts (order-free sum, or argsort), argsort for bad input."""
    from twin.simulate import weighted_stats
    rng = np.random.default_rng(0)
    cases = []
    base = np.round(rng.uniform(5, 80, 5000), 3)                      # many ties
    cases.append((base, rng.integers(1, 5, 5000)))                     # ties with differing counts
    uniq, inv = np.unique(base, return_inverse=True)
    cases.append((base, (inv % 7 + 1).astype(np.int64)))               # ties with equal counts
    cases.append((rng.lognormal(3, 1, 20000), rng.integers(1, 3000, 20000)))
    cases.append((np.array([0.0, -0.0, 1.0, -2.0, 3.0, np.inf]), np.array([1, 2, 3, 4, 5, 6])))
    cases.append((np.array([4.0, np.nan, 1.0]), np.array([1, 1, 1])))
    cases.append((np.full(300, 7.25), np.arange(1, 301)))
    exact = np.arange(5000, dtype=np.float64)                          # integer sums: any order is exact
    exact[10] = exact[11] = 11.0
    cases.append((exact, np.where(np.arange(5000) == 10, 2, 3)))
    close = rng.uniform(10, 20, 8000)                                  # a few ties with different counts
    close[[5, 900, 4000]] = close[[6, 901, 4001]]
    cases.append((close, rng.integers(1, 3000, 8000)))
    cases.append((np.array([2.5]), np.array([3])))
    cases.append((rng.uniform(1, 2, 100), np.zeros(100, np.int64) + (np.arange(100) == 50)))
    for values, counts in cases:
        counts = counts.astype(np.int64)
        got, want = weighted_stats(values, counts), _plain_weighted_stats(values, counts)
        assert json.dumps(_exact(got)) == json.dumps(_exact(want)), (values[:5], counts[:5])
    assert weighted_stats(np.zeros(0), np.zeros(0, np.int64)) == {"mean": None, "median": None, "p99": None}


if __name__ == "__main__":
    # python tests/test_twin_speed_identity.py --write PATH  (with PYTHONPATH at the checkout to record)
    if sys.argv[1:2] == ["--write"]:
        Path(sys.argv[2]).write_text(json.dumps(run_all(), indent=1, sort_keys=True) + "\n")
