"""tasks/traffic/gates.py: the instances' metric text, histogram quantiles and gate verdicts."""

from tasks.traffic.gates import Snapshot, evaluate, histogram_quantile, interpolated_quantile, parse_prometheus

METRICS = """# HELP nv_inference_request_success x
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 90
nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 10
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.1",model_name="m"} 50.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="m"} 99.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
"""


def test_metrics_text_and_quantiles():
    m = parse_prometheus(METRICS)
    assert m["nv_inference_request_failure"] == [({"model": "m", "reason": "BACKEND", "version": "1"}, 10.0)]
    buckets = {float(lb["le"]): v for lb, v in m["vllm:e2e_request_latency_seconds_bucket"]}
    assert histogram_quantile(0.5, buckets) == 0.1 and histogram_quantile(0.99, buckets) == 0.5
    assert histogram_quantile(0.999, buckets) == float("inf") and histogram_quantile(0.99, {}) is None


def test_gate_verdicts():
    kw = {"max_error_ratio": 0.01, "max_p99_ratio": 3.0, "min_requests": 20}
    ok = evaluate(Snapshot(100, 0, {0.1: 100}), Snapshot(100, 0, {0.1: 100}), 0, **kw)
    assert ok.passed and ok.error_ratio == 0 and ok.requests_new == 100
    failing = evaluate(Snapshot(95, 5, {}), Snapshot(100, 0, {}), 0, **kw)
    assert not failing.passed and "error ratio 0.050 > 0.01 (5 of 100 requests failed)" in failing.reason
    router = evaluate(Snapshot(99, 0, {}), Snapshot(100, 0, {}), 1, **kw)
    assert router.passed  # 1 of 100 is at the threshold, not above it
    assert not evaluate(Snapshot(98, 0, {}), Snapshot(100, 0, {}), 2, **kw).passed
    slow = evaluate(Snapshot(100, 0, {0.1: 10, 1.0: 100}), Snapshot(100, 0, {0.1: 100, 1.0: 100}), 0, **kw)
    assert not slow.passed and "p99 latency 1.000 s > 3.0 × the old version's 0.100 s" in slow.reason
    few = evaluate(Snapshot(5, 0, {0.1: 1, 1.0: 5}), Snapshot(100, 0, {0.1: 100}), 0, **kw)
    assert few.passed  # too few requests to judge latency
    empty = evaluate(Snapshot(0, 0, {}), Snapshot(0, 0, {}), 0, **kw)
    assert empty.passed and empty.requests_new == 0  # default: no traffic, nothing to refuse
    strict = evaluate(Snapshot(0, 0, {}), Snapshot(100, 0, {}), 0, **kw, require_requests=1)
    assert not strict.passed and strict.reason.startswith("0 requests reached the new version in the window")
    assert evaluate(Snapshot(5, 0, {}), Snapshot(0, 0, {}), 0, **kw, require_requests=5).passed
    assert not evaluate(Snapshot(4, 0, {}), Snapshot(0, 0, {}), 0, **kw, require_requests=5).passed
    all_failed = evaluate(Snapshot(0, 3, {}), Snapshot(0, 0, {}), 0, **kw, require_requests=5)
    assert all_failed.reason == "error ratio 1.000 > 0.01 (3 of 3 requests failed)"


def test_interpolated_quantiles_follow_prometheus():
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert interpolated_quantile(0.5, buckets) == 0.1  # at a bound
    assert abs(interpolated_quantile(0.7, buckets) - 0.3) < 1e-9  # halfway through (0.1, 0.5]
    assert abs(interpolated_quantile(0.25, buckets) - 0.05) < 1e-9  # the lowest bucket starts at 0
    assert interpolated_quantile(0.9, {0.1: 1.0, float("inf"): 10.0}) == 0.1  # in +Inf: the highest finite bound
    assert interpolated_quantile(0.9, {}) is None and interpolated_quantile(0.9, {1.0: 0.0}) is None


def _ttft(fast: float, slow: float) -> dict[float, float]:
    """A TTFT histogram of ``fast`` requests at 50 ms and ``slow`` at 400 ms (vLLM's bounds)."""
    return {0.06: fast, 0.25: fast, 0.5: fast + slow, float("inf"): fast + slow}


def test_a_canary_that_doubles_time_to_first_token_fails_its_gate_even_when_p99_passes():
    kw = {"max_error_ratio": 0.01, "max_p99_ratio": 3.0, "min_requests": 20, "max_ttft_p90_ratio": 1.5,
          "max_itl_p90_ratio": 1.5}
    old = Snapshot(40, 0, {1.0: 40}, _ttft(40, 0), {0.025: 400})
    slower = Snapshot(40, 0, {1.0: 40}, _ttft(20, 20), {0.025: 400})  # same whole-request p99
    gate = evaluate(slower, old, 0, **kw)
    assert not gate.passed and gate.reason.startswith("time to first token p90 ")
    assert "> 1.5 × the old version's 0.054 s in the same window" in gate.reason
    assert gate.ttft_p90_old_s == 0.054 and gate.ttft_p90_new_s > 2 * gate.ttft_p90_old_s
    assert evaluate(old, old, 0, **kw).passed
    itl_slow = evaluate(Snapshot(40, 0, {1.0: 40}, _ttft(40, 0), {0.025: 0, 0.05: 400}), old, 0, **kw)
    assert not itl_slow.passed and itl_slow.reason.startswith("inter-token latency p90 ")
    assert (itl_slow.itl_p90_new_s, itl_slow.itl_p90_old_s) == (0.0475, 0.0225)  # 90 % into (0.025, 0.05], (0, 0.025]
    # too few observations on a side: not judged; no limit given: not judged
    assert evaluate(Snapshot(10, 0, {}, _ttft(5, 5)), Snapshot(10, 0, {}, _ttft(10, 0)), 0, **kw).passed
    assert evaluate(slower, old, 0, **{**kw, "max_ttft_p90_ratio": None}).passed
