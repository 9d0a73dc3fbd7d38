"""tasks/traffic/gates.py: the instances' metric text, histogram quantiles and gate verdicts."""

from tasks.traffic.gates import Snapshot, evaluate, histogram_quantile, parse_prometheus

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
