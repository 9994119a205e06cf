"""Simulator invariants (hypothesis), determinism, start-up memory check, metric definitions."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twin
from small_scenarios import small_scenario
from twin.scenario import scenario_from_dict
from twin.simulate import weighted_stats
from twin.workload import generate_requests

scenarios = st.fixed_dictionaries({
    "max_loras": st.integers(1, 6),
    "cpu_extra": st.integers(0, 4),
    "max_num_seqs": st.integers(1, 48),
    "max_num_batched_tokens": st.sampled_from([64, 256, 1024]),
    "groups": st.lists(st.tuples(st.integers(1, 5), st.sampled_from([8, 16, 32]),
                                 st.floats(0.05, 3.0)), min_size=1, max_size=3),
    "process": st.sampled_from(["poisson", "lognormal", "nonstationary"]),
    "lengths": st.sampled_from(["sharegpt", "mean", "sharegpt-8k"]),
    "policy": st.sampled_from(["lru", "fifo"]),
    "seed": st.integers(0, 10_000),
    "profile": st.sampled_from(["llama-3.1-8b-h100-64gb", "tests/data/profile-0.33.yaml", "llama-2-7b-h100-64gb"]),
    "client": st.sampled_from([{}, {"max_inflight": 5, "overflow": "drop"}, {"max_inflight": 7, "overflow": "wait"}]),
})


def _build(p):
    return scenario_from_dict(_build_dict(p))


def _build_dict(p):
    return {
        "profile": p["profile"],
        "engine": {"max_loras": p["max_loras"], "max_cpu_loras": p["max_loras"] + p["cpu_extra"],
                   "max_lora_rank": 32, "max_num_seqs": p["max_num_seqs"],
                   # vLLM 0.5.0 (no chunked prefill) requires a budget of at least max_model_len
                   "max_num_batched_tokens": 4096 if p["profile"].startswith("llama-2") else p["max_num_batched_tokens"],
                   "adapter_cache_policy": p["policy"]},
        "adapters": [{"count": c, "rank": r, "rate": q} for c, r, q in p["groups"]],
        "arrivals": {"process": p["process"]},
        "lengths": {"source": p["lengths"]},
        "duration_s": 40, "seed": p["seed"], "client": p["client"],
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_invariants_hold_every_step(p):
    """Every arrived request is finished, running or waiting; KV in use <= capacity; distinct
    adapters in the LoRA set <= max_loras; resident adapters <= max_loras (GPU) and max_cpu_loras
    (CPU); no request produces more than its output tokens; the clock only moves forward.
    (Checked inside the engine after every step; a violation raises AssertionError.)"""
    sc = _build(p)
    res = twin.simulate(sc, check_invariants=True)
    assert res.status == "ok"
    assert res.completed <= res.arrived


@settings(max_examples=15, deadline=None)
@given(scenarios)
def test_finished_requests_produced_exactly_their_tokens(p):
    sc = _build(p)
    req = generate_requests(sc, sc.resolved_engine(sc.load_profile()).max_model_len)
    res = twin.simulate(sc, requests=req)
    # completed requests' output tokens are exactly the sum of their out_len
    assert res.total_output_tokens <= int(req.out_len.sum())
    if res.completed == res.arrived:
        assert res.total_output_tokens == int(req.out_len.sum())
        assert res.total_input_tokens == int(req.in_len.sum())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios, st.floats(1.0, 40.0))
def test_least_work_bounds_the_engine_time_of_finished_requests(p, load_x):
    """The early stop's work bound is a lower bound: the least work (twin.simulate.least_work_s)
    of the requests finished by T never exceeds T (their steps all ran before T), however
    overloaded the engine (rates scaled by load_x)."""
    from twin.simulate import least_work_s
    p = {**p, "groups": [(c, r, q * load_x) for c, r, q in p["groups"]]}
    sc = _build(p)
    prof = sc.load_profile()
    eng = sc.resolved_engine(prof)
    req = generate_requests(sc, eng.max_model_len)
    res = twin.simulate(sc, requests=req)
    work = least_work_s(prof.latency, eng, req.in_len, req.out_len)
    assert work is not None and np.all(work > 0)
    assert work[res.samples["done"]].sum() <= sc.duration_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios, st.floats(1.0, 40.0))
def test_early_stop_never_changes_the_starvation_verdict(p, load_x):
    """With early stop on, a run stops only when starvation is certain: same verdict as the full
    run; a run that does not stop is the full run, bit for bit."""
    p = {**p, "groups": [(c, r, q * load_x) for c, r, q in p["groups"]]}
    full = twin.simulate(_build(p))
    stop = twin.simulate(scenario_from_dict({**_build_dict(p), "early_stop": True}))
    assert stop.starving == full.starving
    if stop.stopped_early_s is None:
        assert str(stop.to_dict()) == str(full.to_dict())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios, st.floats(1.0, 40.0), st.sampled_from([5.0, 15.0]))
def test_graced_early_stop_never_fails_a_run_the_graced_verdict_passes(p, load_x, grace):
    """With stop_grace_s, a run stops only when the requests arriving before T - grace certainly
    get < rho of their tokens served by T (the judge of evaluate / greedy-plus)."""
    from lora_opt.placement.evaluate import served_fraction
    p = {**p, "groups": [(c, r, q * load_x) for c, r, q in p["groups"]]}
    full = twin.simulate(_build(p))
    stop = twin.simulate(scenario_from_dict({**_build_dict(p), "early_stop": True}), stop_grace_s=grace)
    if stop.stopped_early_s is not None:
        assert served_fraction(full, full.duration_s, grace) < 0.9
        assert served_fraction(stop, stop.duration_s, grace) < 0.9


def test_work_bound_stops_earlier_than_the_token_cap_alone(monkeypatch):
    """An overloaded run (~3x what the engine serves): the per-request work bound certifies
    starvation well before the token-rate cap alone (cheapest full prefill step) does."""
    import importlib
    simulate_mod = importlib.import_module("twin.simulate")
    over = small_scenario(adapters=[{"count": 8, "rank": 16, "rate": 5.0}], duration_s=900, early_stop=True,
                          engine={"max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_loras": 8})
    both = twin.simulate(scenario_from_dict(over))
    monkeypatch.setattr(simulate_mod, "work_buckets", lambda lat, eng, i, o: simulate_mod.NO_WORK_BOUND)
    cap_only = twin.simulate(scenario_from_dict(over))
    assert both.starving and cap_only.starving
    assert both.stopped_early_s < 0.7 * cap_only.stopped_early_s


def test_same_seed_same_result_and_seed_matters():
    sc = scenario_from_dict(small_scenario())
    a, b = twin.simulate(sc).to_dict(), twin.simulate(sc).to_dict()
    assert a == b
    c = twin.simulate(scenario_from_dict(small_scenario(seed=2))).to_dict()
    assert c != a


def test_oom_is_a_result_not_an_exception():
    # 256 slots of rank 32 on a 64 GB H100: the KV cache cannot hold one 131072-token request
    sc = scenario_from_dict(small_scenario(engine={"max_loras": 256, "max_lora_rank": 32}))
    res = twin.simulate(sc)
    assert res.status == "oom" and res.completed == 0 and res.starving
    assert "max_model_len" in res.oom_reason or "do not fit" in res.oom_reason
    assert set(res.to_dict()) == set(twin.simulate.__globals__["RESULT_KEYS"])


def test_result_json_keys_exact():
    from twin.simulate import RESULT_KEYS
    res = twin.simulate(scenario_from_dict(small_scenario()))
    d = res.to_dict()
    assert tuple(d) == RESULT_KEYS
    for k in ("ttft_ms", "itl_ms", "tpot_ms"):
        assert set(d[k]) == {"mean", "median", "p99"}


def test_lora_gate_limits_distinct_adapters_and_starves_outsiders():
    """One slot, two adapters with steady traffic: under the 0.33 rule (set = all running
    requests) the adapter holding the slot always has a running request, so the other one is
    skipped forever -- the starvation risk of reference §3.1. Two slots serve both."""
    over = dict(profile="tests/data/profile-0.33.yaml", adapters=[{"count": 2, "rank": 8, "rate": 2.0}],
                duration_s=120)
    one = twin.simulate(scenario_from_dict(small_scenario(**over, engine={"max_loras": 1, "max_cpu_loras": 2})),
                        check_invariants=True)
    two = twin.simulate(scenario_from_dict(small_scenario(**over, engine={"max_loras": 2})),
                        check_invariants=True)
    assert one.starving and one.completed < 0.6 * one.arrived
    assert not two.starving and two.completed > 0.9 * two.arrived


def test_weighted_stats_equal_numpy_on_expanded_sample():
    rng = np.random.default_rng(0)
    v = rng.lognormal(3, 1, 50)
    c = rng.integers(1, 20, 50)
    got = weighted_stats(v, c)
    x = np.repeat(v, c)
    assert got["mean"] == pytest.approx(x.mean())
    assert got["median"] == pytest.approx(np.median(x))
    assert got["p99"] == pytest.approx(np.percentile(x, 99))


def test_more_load_more_throughput_until_saturation():
    base = small_scenario(duration_s=300, engine={"max_num_batched_tokens": 2048, "max_num_seqs": 256,
                                                  "max_loras": 10})
    lo = twin.simulate(scenario_from_dict({**base, "adapters": [{"count": 10, "rank": 8, "rate": 0.1}]}))
    hi = twin.simulate(scenario_from_dict({**base, "adapters": [{"count": 10, "rank": 8, "rate": 0.4}]}))
    assert hi.throughput_tok_s > 3 * lo.throughput_tok_s
    assert not lo.starving and not hi.starving


def test_early_stop_is_recorded_and_only_when_certain():
    over = small_scenario(adapters=[{"count": 8, "rank": 8, "rate": 50.0}], duration_s=600,
                          early_stop=True, engine={"max_num_batched_tokens": 256})
    res = twin.simulate(scenario_from_dict(over))
    assert res.stopped_early_s is not None and res.starving
    full = twin.simulate(scenario_from_dict({**over, "early_stop": False}))
    assert full.stopped_early_s is None and full.starving
    ok = twin.simulate(scenario_from_dict(small_scenario(early_stop=True)))
    assert ok.stopped_early_s is None


def test_timeseries_shape():
    res = twin.simulate(scenario_from_dict(small_scenario()), timeseries=True)
    ts = res.timeseries
    assert set(ts) == {"time_s", "running", "waiting", "kv_usage", "loaded_adapters"}
    assert len(ts["time_s"]) == 61
    assert (ts["kv_usage"] <= 1).all() and (ts["loaded_adapters"] <= 4).all()


@settings(max_examples=25, deadline=None)
@given(scenarios)
def test_fast_forward_changes_nothing(p):
    """Skipping identical decode steps gives the same numbers, bit for bit, as stepping."""
    sc = _build(p)
    a = twin.simulate(sc, fast_forward=False, timeseries=True)
    b = twin.simulate(sc, fast_forward=True, timeseries=True)
    assert a.to_dict() == b.to_dict() and a.steps == b.steps
    for k in a.timeseries:
        assert np.array_equal(a.timeseries[k], b.timeseries[k])


def test_client_cap_drops_or_holds_excess_requests():
    over = dict(adapters=[{"count": 4, "rank": 8, "rate": 20.0}], duration_s=60)
    free = twin.simulate(scenario_from_dict(small_scenario(**over)), check_invariants=True)
    drop = twin.simulate(scenario_from_dict(small_scenario(**over, client={"max_inflight": 50})),
                         check_invariants=True)
    wait = twin.simulate(scenario_from_dict(small_scenario(**over, client={"max_inflight": 50, "overflow": "wait"})),
                         check_invariants=True)
    assert free.dropped == 0 and wait.dropped == 0 and drop.dropped > 0
    assert drop.running_mean + drop.waiting_mean <= 50 and wait.running_mean + wait.waiting_mean <= 50
    # held requests count their time at the client in TTFT; dropped ones are not measured at all
    assert wait.ttft_ms["median"] > drop.ttft_ms["median"]


def test_frontend_ttft_terms_add_to_every_first_token(tmp_path):
    import yaml
    from twin.paths import PROFILES_DIR
    prof = yaml.safe_load((PROFILES_DIR / "llama-3.1-8b-h100-64gb.yaml").read_text())
    prof["latency"]["ttft_frontend_ms"] = 0.0
    prof["latency"]["ttft_frontend_per_running_ms"] = 0.0
    p0 = tmp_path / "p0.yaml"
    p0.write_text(yaml.safe_dump(prof))
    prof["latency"]["ttft_frontend_ms"] = 7.0
    p1 = tmp_path / "p1.yaml"
    p1.write_text(yaml.safe_dump(prof))
    a = twin.simulate(scenario_from_dict(small_scenario(profile=str(p0))))
    b = twin.simulate(scenario_from_dict(small_scenario(profile=str(p1))))
    assert b.ttft_ms["mean"] == pytest.approx(a.ttft_ms["mean"] + 7.0)
    assert b.itl_ms == a.itl_ms and b.throughput_tok_s == a.throughput_tok_s


def test_v0_budget_below_max_model_len_is_a_config_error():
    import pytest
    from twin import ScenarioError
    with pytest.raises(ScenarioError, match="max_num_batched_tokens.*max_model_len"):
        twin.simulate(scenario_from_dict(small_scenario(profile="llama-2-7b-h100-64gb")))


def test_client_cap_of_one_serves_one_request_at_a_time():
    sc = scenario_from_dict(small_scenario(client={"max_inflight": 1, "overflow": "wait"}))
    res = twin.simulate(sc, check_invariants=True)
    assert res.status == "ok" and 0 < res.completed < res.arrived and res.running_mean <= 1


def test_certain_starvation_stops_before_drawing_requests(small):
    """Twice the engine's maximum token rate over 192k expected Poisson requests: the result
    is certain at t = 0 (no request drawn); a full run agrees."""
    import twin
    from twin.scenario import scenario_from_dict
    sc = scenario_from_dict(small(adapters=[{"count": 8, "rank": 16, "rate": 40.0}], duration_s=600,
                                  engine={"max_num_seqs": 256, "max_num_batched_tokens": 2048},
                                  early_stop=True))
    r = twin.simulate(sc)
    assert r.stopped_early_s == 0.0 and r.starving and r.steps == 0
    assert r.arrived == round(8 * 40.0 * 600)
    full = twin.simulate(scenario_from_dict({**small(adapters=[{"count": 8, "rank": 16, "rate": 40.0}],
                                                     duration_s=600,
                                                     engine={"max_num_seqs": 256, "max_num_batched_tokens": 2048}),
                                             "early_stop": False}))
    assert full.starving and full.throughput_tok_s < 0.5 * full.incoming_token_rate
    lighter = twin.simulate(scenario_from_dict(small(duration_s=600, early_stop=True)))
    assert lighter.steps > 0                     # below the bound: simulated as before


@pytest.mark.parametrize("lengths", [{"source": "sharegpt"}, {"source": "mean", "mean_in": 300, "mean_out": 100}])
def test_pre_draw_certificate_fires_near_the_cap_and_is_sound(small, lengths):
    """The compute-free starvation certificate (twin.simulate._certain_without_replay) fires at
    1.15 x the token-rate cap / rho with tens of thousands of expected requests (not only at 2 x):
    no request is drawn, and the full replay it spares does starve.  At 1.02 x it does not fire
    (requests are drawn; the replay's own early stop may still end the run at once)."""
    import twin
    from twin.scenario import scenario_from_dict
    from twin.simulate import max_token_rate
    base = small(duration_s=300, lengths=lengths, engine={"max_num_seqs": 256, "max_num_batched_tokens": 2048})
    sc0 = scenario_from_dict(base)
    prof = sc0.load_profile()
    eng = sc0.resolved_engine(prof)
    cap = max_token_rate(prof, eng.max_num_batched_tokens, eng.max_lora_rank, eng.max_loras)
    mean_tokens = 416.0 if lengths["source"] == "sharegpt" else 400.0
    for factor, certain in ((1.15, True), (1.02, False)):
        rate = factor * cap / sc0.rho / mean_tokens / 10              # 10 adapters
        adapters = [{"count": 10, "rank": 16, "rate": rate}]
        assert rate * 10 * sc0.duration_s > 20_000
        stop = twin.simulate(scenario_from_dict({**base, "adapters": adapters, "early_stop": True}))
        assert (stop.samples is None) == certain, factor          # None: no request was drawn
        if certain:
            assert stop.starving and stop.stopped_early_s == 0.0 and stop.steps == 0
            full = twin.simulate(scenario_from_dict({**base, "adapters": adapters}))
            assert full.starving and full.throughput_tok_s < sc0.rho * full.incoming_token_rate


@settings(max_examples=200, deadline=None)
@given(n_seqs=st.integers(1, 512), extra_tokens=st.integers(0, 4096), ctx=st.integers(0, 400_000),
       n_distinct=st.integers(0, 300), max_loras=st.integers(1, 384), rank=st.sampled_from([8, 16, 32, 64]),
       profile=st.sampled_from(["llama-3.1-8b-h100-64gb", "qwen-2.5-7b-h100-64gb", "llama-2-7b-h100-64gb",
                                "tests/data/profile-0.33.yaml", "tests/data/profile-cpu-knee.yaml",
                                "tests/data/profile-additive.yaml"]))
def test_engine_step_time_is_the_profile_step_model(n_seqs, extra_tokens, ctx, n_distinct, max_loras, rank,
                                                     profile):
    """The Numba kernel's step time and ``LatencySpec.model_ms`` + ``scheduler_ms`` (the one
    documented formula) agree, with the arguments ``twin.simulate`` passes."""
    from twin.engine_cost import step_seconds
    from twin.simulate import kernel_latency
    lat = twin.load_profile(profile).latency
    n_distinct = min(n_distinct, max_loras, n_seqs)
    n_tokens = n_seqs + extra_tokens
    coefs = kernel_latency(lat, rank, max_loras)
    kernel = step_seconds(coefs, n_seqs, n_tokens, ctx, n_distinct, 0, 0, 0.0) * 1000.0
    model = lat.model_ms(n_seqs, n_tokens, ctx, n_distinct, rank, max_loras) + lat.scheduler_ms(0, 0)
    assert kernel == pytest.approx(model, rel=1e-12)


def _state(sc, requests=None):
    from twin.simulate import engine_state
    prof = sc.load_profile()
    eng = sc.resolved_engine(prof)
    _, kv_tokens, _ = prof.startup_check(eng)
    req = requests if requests is not None else generate_requests(sc, eng.max_model_len)
    return engine_state(sc, prof, eng, req, kv_tokens), req


def _same_requests(a, b):
    for name in ("first_token_s", "running_at_first_token", "finish_s", "dropped"):
        x, y = getattr(a, name), getattr(b, name)
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), name
    for name in ("steps", "preemptions", "loads_cpu", "loads_disk", "n_samples", "n_dropped"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("over", [{}, {"profile": "llama-2-7b-h100-64gb", "engine": {"max_num_batched_tokens": 8192}},
                                  {"profile": "tests/data/profile-0.33.yaml", "client": {"max_inflight": 6}},
                                  {"engine": {"max_loras": 2, "max_cpu_loras": 3, "adapter_cache_policy": "fifo"}}])
def test_stepping_from_python_equals_run_engine(over):
    """Driving the step function one scheduler step at a time from Python gives the same
    per-request first-token and finish times (and counters) as run_engine with its fast forward."""
    from twin.engine import DONE, STEPPED, results, run_engine, step
    sc = scenario_from_dict(small_scenario(**over, duration_s=30))
    whole, _ = _state(sc)
    expected = run_engine(whole, False, True)
    assert type(expected).__name__ == "KernelRun" and expected._fields[:3] == ("first_token_s", "running_at_first_token",
                                                                                "finish_s")
    s, _ = _state(sc)
    outcomes = []
    while (o := step(s)) < DONE:
        outcomes.append(o)
    assert outcomes.count(STEPPED) > 100
    _same_requests(results(s), expected)


def test_requests_appended_to_a_live_state_as_they_arrive():
    """The online pattern: the state starts with no request and each one is appended
    (add_request, arrays grown on the way) once the clock reaches its arrival -- or, when every
    appended request is in, as the next arrival an idle engine sleeps until.  Stepping it gives
    the same times as the offline run over all requests."""
    from twin.engine import DONE, results, run_engine, step
    from twin.engine_state import add_request
    from twin.workload import Requests
    sc = scenario_from_dict(small_scenario(duration_s=30))
    offline, req = _state(sc)
    expected = run_engine(offline, False, True)
    s, _ = _state(sc, Requests(arrival=req.arrival[:0], adapter=req.adapter[:0], in_len=req.in_len[:0],
                               out_len=req.out_len[:0]))
    k = 0
    while True:
        while k < len(req) and (req.arrival[k] <= s.t or s.next_arr == s.n_req):
            add_request(s, req.arrival[k], req.in_len[k], req.out_len[k], req.adapter[k])
            k += 1
        if step(s) >= DONE and k == len(req):
            break
    assert s.n_req == len(req) > 100
    _same_requests(results(s), expected)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_time_series_read_as_vllm_gauges(p):
    """A sample is the state the last step left, before the arrivals since (vLLM publishes its gauges once a
    step): a run in which no request ever waited has no sample with one waiting -- an idle engine's next
    arrival used to be counted as waiting -- and every sample's running count is one the engine had."""
    sc = scenario_from_dict({**_build_dict(p), "timeseries_interval_s": 0.5})
    res = twin.simulate(sc, timeseries=True)
    ts = res.timeseries
    if res.waiting_mean == 0.0:
        assert not ts["waiting"].any()
    assert (ts["running"] >= 0).all() and (ts["running"] <= sc.engine.max_num_seqs).all()
