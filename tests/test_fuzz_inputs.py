"""Fuzzing every input lora-opt reads (issue 12): Hypothesis generates scenario, workload, grid,
placement and request-log documents -- valid ones, then mutated (wrong types, non-finite and huge
numbers, unknown keys, deep nesting, YAML alias bombs and duplicate keys, binary bytes, truncation)
-- and CLI flag values, and runs them through the parsers and, for small valid ones, the commands
in-process.  Every outcome must be a valid result or the documented clean error
(``lora_opt.errors.BAD_INPUT``, exit status 2): no other exception, no hang (a per-input time
limit), and a refused input may not allocate more than ``MEMORY_LIMIT`` (tracemalloc's peak).

The default run is short (``FAST`` examples a category); ``pytest -m slow`` runs ``SLOW`` a
category and prints the table of outcomes the Reliability page (docs/reliability.md) quotes.  The same table:
``python tests/test_fuzz_inputs.py [EXAMPLES]``.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lora_opt.cli import main
from lora_opt.errors import BAD_INPUT
from lora_opt.placement.plan import Placement, placement_problems
from lora_opt.placement.workload_file import load_request_log, load_workload, workload_from_dict
from lora_opt.surrogates.dataset import load_grid
from twin.profile import load_profile
from twin.scenario import load_scenario

PROFILE = "llama-3.1-8b-h100-64gb"
REPO = Path(__file__).resolve().parents[1]
FAST, SLOW = 12, 300
#: the most a refused input may allocate (bytes, tracemalloc's peak), and the time an input may take (s)
MEMORY_LIMIT = 1 << 30
TIME_LIMIT_S = 60
#: category -> outcome -> count; mutation kind -> outcome -> count; category -> peak bytes of a refused input
OUTCOMES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
KINDS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
PEAK: dict[str, int] = collections.defaultdict(int)

# ---- valid documents ---------------------------------------------------------------------------
small_rate = st.floats(0.01, 1.0)
rank = st.sampled_from([1, 8, 16, 32, 64])
engine = st.fixed_dictionaries({}, optional={"max_num_seqs": st.integers(1, 512),
                                             "gpu_memory_utilization": st.floats(0.5, 1.0),
                                             "max_num_batched_tokens": st.integers(2048, 8192)})
scenario_doc = st.fixed_dictionaries(
    {"profile": st.just(PROFILE),
     "adapters": st.lists(st.fixed_dictionaries({"count": st.integers(1, 4), "rank": rank, "rate": small_rate}),
                          min_size=1, max_size=3),
     "duration_s": st.floats(1.0, 20.0)},
    optional={"engine": engine, "rho": st.floats(0.1, 1.0), "seed": st.integers(0, 1000),
              "arrivals": st.fixed_dictionaries({"process": st.sampled_from(["poisson", "lognormal", "nonstationary"])}),
              "lengths": st.sampled_from(["sharegpt", "arxiv", "mean"]) | st.fixed_dictionaries(
                  {"source": st.just("normal"), "mean_in": st.floats(10, 500), "mean_out": st.floats(10, 300)}),
              "early_stop": st.booleans(), "timeseries_interval_s": st.floats(0.5, 5.0),
              "client": st.fixed_dictionaries({"max_inflight": st.integers(1, 100)})})
ident = st.from_regex(r"[a-z][a-z0-9_\-]{0,10}", fullmatch=True)
workload_doc = st.fixed_dictionaries(
    {"profile": st.just(PROFILE),
     "adapters": st.lists(st.one_of(
         st.fixed_dictionaries({"id": ident, "rank": rank, "rate": small_rate},
                               optional={"path": ident.map(lambda s: f"/models/{s}")}),
         st.fixed_dictionaries({"count": st.integers(1, 5), "rank": rank, "rate": small_rate},
                               optional={"prefix": ident.map(lambda s: s + "-"),
                                         "path_template": st.just("/models/{id}")})),
         min_size=1, max_size=4)},
    optional={"rho": st.floats(0.1, 1.0), "engine": engine, "name": ident,
              "evaluation": st.fixed_dictionaries({}, optional={"duration_s": st.floats(1, 60),
                                                                "seed": st.integers(0, 100)}),
              "meta": st.dictionaries(ident, st.integers() | ident, max_size=3)})
grid_doc = st.fixed_dictionaries(
    {"profile": st.just(PROFILE), "ranks": st.lists(st.sampled_from([8, 16, 32]), min_size=1, max_size=3),
     "rates": st.lists(small_rate, min_size=1, max_size=4), "groups": st.integers(1, 3),
     "served": st.lists(st.integers(1, 64), min_size=1, max_size=4),
     "max_loras": st.lists(st.integers(1, 64), min_size=1, max_size=4)},
    optional={"duration_s": st.floats(1, 60), "shard_size": st.integers(1, 100), "sample": st.integers(1, 50),
              "seed": st.integers(0, 100), "early_stop": st.booleans(), "lengths": st.just("sharegpt"),
              "engine": st.just({"max_num_seqs": 256, "max_num_batched_tokens": 2048}),
              "load_band": st.just([0, 100000]), "workloads": st.integers(1, 5)})


@st.composite
def placement_doc(draw):
    n_ad, n_gpu = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    adapters = [{"id": f"a{k}", "rank": draw(st.sampled_from([8, 16])), "rate": draw(small_rate),
                 "path": draw(st.none() | st.just(f"/m/a{k}"))} for k in range(n_ad)]
    gpus = [{"max_loras": 8, "max_lora_rank": 16, "max_cpu_loras": 8, "max_num_seqs": 256,
             "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9, "max_model_len": 4096}
            for _ in range(n_gpu)]
    routes = {a["id"]: [[draw(st.integers(0, n_gpu - 1)), 1.0]] for a in adapters}
    return {"profile": PROFILE, "policy": "fuzz", "meta": {}, "adapters": adapters, "gpus": gpus, "routes": routes}


log_row = st.tuples(st.floats(0, 1000), st.sampled_from(["s-0", "s-1", "s-2"]), st.integers(1, 2000),
                    st.integers(1, 500))
request_log_doc = st.lists(log_row, min_size=1, max_size=20)

# ---- mutations ---------------------------------------------------------------------------------
WRONG = ["x", "", [], {}, True, None, [1, 2], {"a": 1}, "1e3", "-"]
NONFINITE = [math.nan, math.inf, -math.inf]
HUGE = [10**9, 10**30, 2**63, -(2**63) - 1, 1e300, -1e300, 1e-300, 0, -1, 10**400]
STRINGS = ["a\nb", "-flag", "a=b", "a,b", "../x", "{x}", "{0}", "\x00", "\u2028", "é" * 300, "$(id)"]
BOMB = ("bomb: &a [x,x,x,x,x,x,x,x,x,x]\nb2: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nb3: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
        "b4: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\nb5: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
        "b6: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\nb7: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]\n")
DOC_KINDS = ("wrong-type", "non-finite", "huge-number", "bad-string", "unknown-key", "deep-nesting", "drop-key")
TEXT_KINDS = ("alias-bomb", "alias-in-value", "duplicate-key", "binary", "non-utf8", "truncated")


def _paths(doc, prefix=()):
    """Every (path, value) of a nested document."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


@st.composite
def mutated(draw, doc_strategy, text_ok: bool = True):
    """(kind, document or text/bytes): valid, a document mutation or a text mutation."""
    doc = json.loads(json.dumps(draw(doc_strategy)))
    kind = draw(st.sampled_from(("valid",) * 3 + DOC_KINDS + (TEXT_KINDS if text_ok else ())))
    if kind == "valid":
        return kind, doc
    if kind in TEXT_KINDS:
        text = yaml.safe_dump(doc)
        if kind == "alias-bomb":
            return kind, BOMB + text
        if kind == "alias-in-value":
            path = draw(st.sampled_from([p for p, _ in _paths(doc) if p and isinstance(p[-1], str)]))
            return kind, BOMB.replace("\n", "\n  ").join(["x_: \n  ", ""]) + "\n" + yaml.safe_dump(
                _set(doc, path, "__ALIAS__")).replace("__ALIAS__", "*g")
        if kind == "duplicate-key":
            key = draw(st.sampled_from(sorted(doc)))
            return kind, text + f"{key}: {json.dumps(doc[key])}\n"
        if kind == "binary":
            return kind, draw(st.binary(min_size=1, max_size=200))
        if kind == "non-utf8":
            return kind, text.encode()[:draw(st.integers(0, len(text)))] + b"\xff\xfe\xc3" + text.encode()
        return kind, text[:draw(st.integers(0, len(text)))]
    paths = [p for p, _ in _paths(doc)]
    path = draw(st.sampled_from(paths))
    pools = {"wrong-type": WRONG, "non-finite": NONFINITE, "huge-number": HUGE, "bad-string": STRINGS}
    if kind in pools:
        return kind, _set(doc, path, draw(st.sampled_from(pools[kind])))
    if kind == "deep-nesting":
        depth = draw(st.sampled_from([10, 70, 1000]))
        value = "x"
        for _ in range(depth):
            value = [value]
        return kind, _set(doc, path, value)
    containers = [p for p, v in _paths(doc) if isinstance(v, dict)]
    target = draw(st.sampled_from(containers))
    node = doc
    for k in target:
        node = node[k]
    if kind == "unknown-key":
        node[draw(st.sampled_from(["colour", "rates", "1", "max_num_seq", "<<"]))] = 1
    elif node:
        node.pop(draw(st.sampled_from(sorted(node))))
    return kind, doc


def _write(payload, suffix: str, tmp: Path) -> Path:
    f = tmp / f"input{suffix}"
    if isinstance(payload, bytes):
        f.write_bytes(payload)
    elif isinstance(payload, str):
        f.write_text(payload)
    else:
        text = json.dumps(payload) if suffix == ".json" else _yaml_dump(payload)
        f.write_text(text)
    return f


def _yaml_dump(doc) -> str:
    try:
        return yaml.safe_dump(doc, allow_unicode=False)
    except (yaml.YAMLError, RecursionError, ValueError):
        return json.dumps(doc)


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    def on_alarm(signum, frame):
        raise _Timeout(f"input took longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_case(category: str, kind: str, fn) -> str:
    """Run ``fn()``; record and return its outcome: 'ok' or 'clean error' (anything else fails)."""
    tracemalloc.start()
    try:
        with _time_limit(TIME_LIMIT_S):
            fn()
        outcome = "ok"
    except BAD_INPUT:
        outcome = "clean error"
    except SystemExit as exc:             # argparse inside main() never gets here: main returns 2
        raise AssertionError(f"{category}/{kind}: SystemExit {exc.code}") from None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if outcome == "clean error":
        PEAK[category] = max(PEAK[category], peak)
        assert peak < MEMORY_LIMIT, f"{category}/{kind}: refused after allocating {peak / 2**20:.0f} MiB"
    OUTCOMES[category][outcome] += 1
    KINDS[kind][outcome] += 1
    return outcome


def _fuzz(n: int):
    # no shrinking: a failure is reported as found (shrinking CLI runs takes minutes)
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


# ---- the properties, one per category ------------------------------------------------------------
def scenario_case(case):
    kind, doc = case
    with tempfile.TemporaryDirectory() as d:
        f = _write(doc, ".yaml", Path(d))
        if run_case("scenario", kind, lambda: load_scenario(f)) != "ok":
            return
        sc = load_scenario(f)
        if sum(g.count * (g.rate or 0) for g in sc.adapters) * sc.duration_s < 5_000:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                rc = main(["simulate", str(f), "--json"])
            assert rc in (0, 2), rc
            if rc == 0:
                res = json.loads(out.getvalue())
                assert res["status"] in ("ok", "oom") and math.isfinite(res["throughput_tok_s"])


def workload_case(case):
    kind, doc = case
    with tempfile.TemporaryDirectory() as d:
        f = _write(doc, ".yaml", Path(d))
        run_case("workload", kind, lambda: load_workload(f))


def grid_case(case):
    kind, doc = case
    with tempfile.TemporaryDirectory() as d:
        f = _write(doc, ".yaml", Path(d))

        def parse():
            _, grid = load_grid(f)
            grid.size()
            grid.points(50)
        run_case("grid", kind, parse)


def placement_case(case):
    kind, doc = case
    with tempfile.TemporaryDirectory() as d:
        f = _write(doc, ".json", Path(d))
        run_case("placement", kind, lambda: placement_problems(Placement.load(f), load_profile(PROFILE)))


LOG_WORKLOAD = workload_from_dict({"profile": PROFILE, "adapters": [
    {"count": 3, "rank": 8, "rate": 0.1, "prefix": "s-"}]})
CELLS = ["nan", "inf", "-inf", "1e300", "-5", "0", "3000000000", "", "x", "1.5", "s-9", "\x00", "2024-01-01", '"']


@st.composite
def request_log(draw):
    rows = [list(map(str, r)) for r in draw(request_log_doc)]
    header = ["timestamp_s", "adapter", "input_tokens", "output_tokens"]
    kind = draw(st.sampled_from(("valid", "valid", "bad-cell", "bad-cell", "drop-column", "binary", "non-utf8",
                                 "truncated")))
    if kind == "bad-cell":
        r, c = draw(st.integers(0, len(rows) - 1)), draw(st.integers(0, 3))
        rows[r][c] = draw(st.sampled_from(CELLS))
    elif kind == "drop-column":
        header[draw(st.integers(0, 3))] = "other"
    text = ",".join(header) + "\n" + "".join(",".join(r) + "\n" for r in rows)
    if kind == "binary":
        return kind, draw(st.binary(min_size=1, max_size=300))
    if kind == "non-utf8":
        return kind, text.encode() + b"\xff\xfe,\xc3\n"
    if kind == "truncated":
        return kind, text[:draw(st.integers(0, len(text)))]
    return kind, text


def request_log_case(case):
    kind, text = case
    with tempfile.TemporaryDirectory() as d:
        f = _write(text, ".csv", Path(d))
        run_case("request log", kind, lambda: load_request_log(LOG_WORKLOAD, f))


FLAG_COMMANDS = {
    "evaluate": (["evaluate", "/nonexistent/placement.json"],
                 ["--grace-s", "--duration-s", "--time-scale", "--start-s", "--seed", "--workers"]),
    "place": (["place", "--workload", "/nonexistent/w.yaml", "--gpus", "2"],
              ["--gpus", "--margin", "--verify-s", "--ttft-p99-s"]),
    "search": (["search", "--workload", "/nonexistent/w.yaml", "--gpus", "2"],
               ["--rho", "--ttft-slo-ms", "--itl-slo-ms", "--attainment", "--trials", "--timeout-s", "--workers"]),
    "pareto": (["pareto", "--workload", "/nonexistent/w.yaml"], ["--gpus", "--rhos", "--attainment", "--trials",
                                                                "--ref-latency-ms"]),
    "simulate": (["simulate", "/nonexistent/s.yaml"], ["--seed"]),
    "dataset": (["dataset", "--grid", "/nonexistent/g.yaml", "--out", "/nonexistent/d"], ["--limit", "--workers"]),
}
flag_value = st.one_of(st.sampled_from(["nan", "NaN", "inf", "-inf", "1e309", "-0", "0", "-1", "1e300", "1e9",
                                        "9" * 30, "x", "", "0x10", "1_000", " 5", "5e-324"]),
                       st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str))


@st.composite
def flag_case_strategy(draw):
    cmd = draw(st.sampled_from(sorted(FLAG_COMMANDS)))
    base, flags = FLAG_COMMANDS[cmd]
    flag = draw(st.sampled_from(flags))
    return cmd, base + [flag, draw(flag_value)]


def flag_case(case):
    cmd, argv = case
    err = io.StringIO()
    with _time_limit(TIME_LIMIT_S), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(argv)
    # a refused flag (argparse: exit 2) or, past the flags, the missing input file (exit 2)
    assert rc == 2 and "Traceback" not in err.getvalue(), (argv, rc, err.getvalue())
    OUTCOMES["CLI flags"]["clean error"] += 1
    KINDS["flag refused" if "argument --" in err.getvalue() else "flag accepted, then missing file"]["clean error"] += 1


# ---- end to end: `place` and `evaluate` on fuzzed documents, under hard limits -----------------------
class CliRunner:
    """The fork server (tests/fuzz_cli_runner.py) that runs each CLI case in a child limited to
    MEMORY_LIMIT more address space (``RLIMIT_AS``) and TIME_LIMIT_S of wall time."""

    def __init__(self, surrogate: bool):
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fuzz_cli_runner.py")]
                                     + (["--warm-surrogate"] if surrogate else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.surrogate = surrogate
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", f"the fuzz runner did not start: {ready!r}"

    def run(self, argv: list[str]) -> dict:
        self.proc.stdin.write(json.dumps({"argv": argv, "timeout_s": TIME_LIMIT_S, "mem_bytes": MEMORY_LIMIT}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


_RUNNERS: dict[bool, CliRunner] = {}


def cli_runner(surrogate: bool = False) -> CliRunner:
    """One runner per test run (its start-up, ~5 s, or ~20 s warming the surrogate, paid once)."""
    if surrogate not in _RUNNERS:
        _RUNNERS[surrogate] = CliRunner(surrogate)
    return _RUNNERS[surrogate]


atexit.register(lambda: [r.close() for r in _RUNNERS.values()])

#: policies fuzzed by default (no surrogate to load); the long run adds greedy-plus (twin-verified)
PLACE_POLICIES = ["greedy-fast", "dlora", "loraserve", "dlora-capped"]
PLACE_POLICIES_LONG = PLACE_POLICIES + ["greedy-plus", "greedy"]
#: the end-to-end categories' examples in the default run (each is a CLI command in a child)
FAST_E2E = 4


def _no_nan(text: str):
    def refuse(const):
        raise AssertionError(f"{const} in the JSON output")
    return json.loads(text, parse_constant=refuse)


#: the documented exit statuses of a result: place 3 = infeasible, 4 = placed but not deployable;
#: evaluate 3 = evaluated, and a GPU starves or does not start (outputs written all the same)
RESULT_STATUS = {"place": (0, 3, 4), "evaluate": (0, 3)}


def cli_case(category: str, kind: str, argv: list[str], surrogate: bool = False) -> dict:
    """Run ``argv`` in the runner; it must exit with a result's status (``RESULT_STATUS``) or 2 (one
    clean error), with no traceback, within the time and memory limits.  Recorded like ``run_case``."""
    res = cli_runner(surrogate).run(argv)
    what = f"{category}/{kind}: lora-opt {' '.join(argv)}"
    assert not res["killed"], f"{what}: still running after {TIME_LIMIT_S} s"
    assert res["rc"] in RESULT_STATUS[argv[0]] + (2,), f"{what}: exit {res['rc']}\n{res['stderr'][-4000:]}"
    assert "Traceback" not in res["stderr"], f"{what}: a traceback\n{res['stderr'][-4000:]}"
    outcome = "clean error" if res["rc"] == 2 else "ok"
    if outcome == "clean error":
        assert "error:" in res["stderr"], f"{what}: exit 2 without an error message"
        PEAK[category] = max(PEAK[category], res["rss_growth_kib"] * 1024)
    OUTCOMES[category][outcome] += 1
    KINDS[kind][outcome] += 1
    return res


@st.composite
def place_case_strategy(draw, policies):
    return draw(mutated(workload_doc)), draw(st.sampled_from(policies)), draw(st.integers(1, 4)), draw(st.booleans())


def place_case(case):
    (kind, doc), policy, gpus, emit = case
    with tempfile.TemporaryDirectory() as d:
        f, out = _write(doc, ".yaml", Path(d)), Path(d) / "out"
        argv = ["place", "--workload", str(f), "--gpus", str(gpus), "--policy", policy, "--out", str(out),
                "--verify-s", "90", "--json"] + (["--emit-vllm"] if emit else [])
        res = cli_case("place CLI", kind, argv, surrogate=policy in ("greedy-plus", "greedy"))
        if res["rc"] in (0, 4):
            p = Placement.load(out / "placement.json")         # what it wrote is a whole placement
            assert _no_nan(res["stdout"]) and len(p.gpus) <= gpus
            if emit and res["rc"] == 0:
                lines = (out / "vllm" / "serve_commands.txt").read_text().splitlines()
                assert len(lines) == len(p.gpus)
            if res["rc"] == 4:                                 # not deployable: no launch files
                assert not (out / "vllm").exists() and not (out / "router.json").exists()
        elif res["rc"] == 2:
            assert not (out / "placement.json").exists(), "refused, yet a placement was written"


@st.composite
def evaluate_case_strategy(draw):
    return draw(mutated(placement_doc(), text_ok=True)), draw(st.booleans())


def evaluate_case(case):
    (kind, doc), as_directory = case
    with tempfile.TemporaryDirectory() as d:
        f = _write(doc, ".json", Path(d))
        if as_directory:                  # the folder `place` printed, holding placement.json
            f = f.rename(Path(d) / "placement.json").parent
        argv = ["evaluate", str(f), "--workers", "1", "--duration-s", "30", "--grace-s", "10", "--json", "--no-track"]
        res = cli_case("evaluate CLI", kind, argv)
        if res["rc"] in RESULT_STATUS["evaluate"]:
            ev = _no_nan(res["stdout"])
            assert ev["requests"] >= ev["completed"] >= 0 and len(ev["per_gpu"]) >= 1


CASES = {
    "scenario": (mutated(scenario_doc), scenario_case),
    "workload": (mutated(workload_doc), workload_case),
    "grid": (mutated(grid_doc), grid_case),
    "placement": (mutated(placement_doc(), text_ok=True), placement_case),
    "request log": (request_log(), request_log_case),
    "CLI flags": (flag_case_strategy(), flag_case),
    "place CLI": (place_case_strategy(PLACE_POLICIES), place_case),
    "evaluate CLI": (evaluate_case_strategy(), evaluate_case),
}
#: the long run's strategies where they differ (greedy-plus: the surrogate and the twin verification)
LONG_CASES = {"place CLI": (place_case_strategy(PLACE_POLICIES_LONG), place_case)}
E2E = ("place CLI", "evaluate CLI")


def _property(name: str, n: int, long: bool = False):
    strategy, check = (LONG_CASES if long else {}).get(name, CASES[name])
    if name in E2E and not long:
        n = min(n, FAST_E2E)
    return _fuzz(n)(given(strategy)(check))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fuzz_inputs_end_in_a_result_or_a_clean_error(name):
    _property(name, FAST)()


def test_the_cli_runner_enforces_its_limits(tmp_path):
    """The hard limits are real: a command given 64 MiB of address space fails with MemoryError (an
    exit status the fuzz cases refuse), one given 0.5 s of a longer replay is killed."""
    wl = tmp_path / "w.yaml"
    wl.write_text(f"profile: {PROFILE}\nadapters:\n  - {{count: 4, rank: 8, rate: 0.5, prefix: s-}}\n")
    runner = cli_runner()
    assert runner.run(["place", "--workload", str(wl), "--gpus", "1", "--policy", "greedy-fast", "--out",
                       str(tmp_path / "p")])["rc"] == 0
    # 400,000 s at 2 req/s: seconds of work even for the fast twin, killed at 0.5 s
    argv = ["evaluate", str(tmp_path / "p"), "--workers", "1", "--duration-s", "400000", "--json", "--no-track"]
    req = {"argv": argv, "timeout_s": 0.5, "mem_bytes": MEMORY_LIMIT}
    runner.proc.stdin.write(json.dumps(req) + "\n")
    runner.proc.stdin.flush()
    assert json.loads(runner.proc.stdout.readline())["killed"]
    # 20 million requests (within the size limits) need gigabytes: 64 MiB more fails at once
    big = argv[:-3] + ["10000000", "--json", "--no-track"]
    runner.proc.stdin.write(json.dumps({"argv": big, "timeout_s": TIME_LIMIT_S, "mem_bytes": 64 << 20}) + "\n")
    runner.proc.stdin.flush()
    res = json.loads(runner.proc.stdout.readline())
    assert res["rc"] not in (0, 2, 3) and "MemoryError" in res["stderr"], res


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_fuzz_inputs_long(name):
    _property(name, SLOW, long=True)()
    print("\n" + outcome_table())


def outcome_table() -> str:
    """Markdown tables: inputs tried per category and per mutation kind, with their outcomes."""
    lines = ["| category | inputs tried | valid result | clean error (exit 2) | other (traceback, hang) | "
             "peak memory of a refused input |", "|---|---:|---:|---:|---:|---:|"]
    for cat, c in sorted(OUTCOMES.items()):
        tried = c["ok"] + c["clean error"]
        lines.append(f"| {cat} | {tried} | {c['ok']} | {c['clean error']} | 0 | {PEAK[cat] / 2**20:.1f} MiB |")
    lines += ["", "Peak memory: tracemalloc's peak in-process; for the CLI categories the peak RSS growth of the "
              f"forked child, which runs under a hard limit of +{MEMORY_LIMIT / 2**30:g} GiB address space "
              f"(RLIMIT_AS) and {TIME_LIMIT_S} s; a valid result of `place` includes exit 3 (infeasible) "
              "and 4 (placed, not deployable)."]
    lines += ["", "| mutation | inputs tried | valid result | clean error |", "|---|---:|---:|---:|"]
    for kind, c in sorted(KINDS.items()):
        lines.append(f"| {kind} | {c['ok'] + c['clean error']} | {c['ok']} | {c['clean error']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else SLOW
    for name in sorted(CASES):
        _property(name, n, long=True)()
    print(outcome_table())
