"""The scaling policy (modelops/scaling.py) and the autoscaler's TTFT window (tasks/autoscale/signals.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelops import ManifestError, parse_manifest
from modelops.scaling import TOLERANCE, Recommender, Scaling, desired_instances
from tasks.autoscale.signals import InstanceSample, TtftWindow

GEN = {"model_id": "m", "version": "1", "source": "s3://b/m/", "task": "generate"}


@pytest.mark.parametrize(("scaling", "expected"), [
    ({"min": 3, "max": 2}, "scaling: min (3) is above max (2); set min <= max"),
    ({"max": 2}, "scaling: target: required when max (2) is above min (1)"),
    ({"max": 2, "target": {"queue": 1}}, "scaling.target: 'queue' is not a scaling signal; use one of waiting, "
                                         "kv_cache, ttft_p90_s"),
    ({"max": 2, "target": {"waiting": 1, "kv_cache": 0.5}}, "scaling.target: got {'waiting': 1, 'kv_cache': 0.5}: "
                                                             "give one signal"),
    ({"max": 2, "target": "waiting"}, "scaling.target: got 'waiting': give one signal and its value"),
    ({"max": 2, "target": {"kv_cache": 1.5}}, "scaling.target.kv_cache: Input should be less than or equal to 1"),
    ({"max": 2, "target": {"waiting": float("inf")}}, "scaling.target.waiting: Input should be a finite number"),
    ({"min": 0, "max": 3}, "scaling: target: required when max (3) is above 1 (min 0 alone scales between 0 and 1"),
    ({"mx": 2}, "scaling.mx: unknown field; allowed: min, max, target, scale_up_window_s, scale_down_window_s"),
    ({"max": 2, "target": {"waiting": 2}, "scale_down_window_s": -1},
     "scaling.scale_down_window_s: Input should be greater than or equal to 0"),
    ({"max": 2, "target": {"waiting": 2}, "scale_up_window_s": 7200},
     "scaling.scale_up_window_s: Input should be less than or equal to 3600"),
    ({"min": -1}, "scaling: min: -1 instances; give 0 or more"),
    ({"min": 0, "target": {"waiting": 2}}, "scaling: target: waiting 2 does nothing with min 0 and max 1"),
    ({"min": 2}, "scaling: min (2) is above max (1)"),  # max defaults to 1
    # YAML `true` is not a count or a value: `max: true` would silently turn autoscaling off.
    ({"min": True, "max": 4, "target": {"waiting": 2}}, "scaling.min: Input should be a valid integer"),
    ({"max": True, "target": {"waiting": 2}}, "scaling.max: Input should be a valid integer"),
    ({"max": 2, "target": {"waiting": True}}, "scaling.target.waiting: Input should be a valid number"),
    ({"max": 2, "target": {"waiting": None}}, "scaling.target: waiting: no value; give the requests waiting"),
    ({"max": 2, "target": {"waiting": 2, "kv_cache": None}}, "scaling.target: got {'waiting': 2, 'kv_cache': None}"),
])
def test_bad_scaling_policies_are_refused_naming_the_field(scaling, expected):
    with pytest.raises(ManifestError) as e:
        parse_manifest({**GEN, "scaling": scaling})
    assert expected in str(e.value)


def test_xgboost_models_are_not_autoscaled_on_vllm_signals():
    from tests.unit.test_manifest import XGB

    for scaling in ({"max": 2, "target": {"waiting": 1}}, {"min": 1, "max": 4}):  # not "give a target" first
        with pytest.raises(ManifestError, match="scaling: the autoscaler's signals are vLLM's; framework xgboost"):
            parse_manifest({**XGB, "scaling": scaling})
    assert parse_manifest({**XGB, "scaling": {"min": 2, "max": 2}}).scaling.min == 2


def test_scaling_max_above_the_platform_cap_is_refused_at_announce(monkeypatch):
    from tasks.package import preflight

    monkeypatch.setenv("MODELOPS_AUTOSCALE_MAX_INSTANCES", "4")
    with pytest.raises(ManifestError, match=r"scaling.max: 5 instances is above this platform's cap \(4, "
                                            r"MODELOPS_AUTOSCALE_MAX_INSTANCES\)"):
        preflight(parse_manifest({**GEN, "scaling": {"max": 5, "target": {"waiting": 1}}}))


def test_a_policy_survives_the_registry_round_trip():
    m = parse_manifest({**GEN, "scaling": {"max": 3, "target": {"ttft_p90_s": 1.5}, "scale_up_window_s": 0}})
    assert m.model_dump()["scaling"]["target"] == {"ttft_p90_s": 1.5}  # the one signal, no nulls
    again = type(m).model_validate_json(m.model_dump_json())
    assert again == m and str(again.scaling.target) == "ttft_p90_s 1.5" and again.scaling.autoscaled


policies = st.builds(
    lambda lo, extra, target: Scaling(min=lo, max=lo + extra, target={"waiting": target}),
    st.integers(1, 8), st.integers(0, 8), st.floats(0.1, 50))


@given(policies, st.integers(1, 16), st.floats(0, 500))
def test_the_hpa_rule_stays_within_bounds_and_within_tolerance_keeps_the_count(policy, current, signal):
    if not policy.autoscaled:
        return
    n = desired_instances(policy, current, signal)
    assert policy.min <= n <= policy.max
    ratio = signal / policy.target.value
    if abs(ratio - 1) <= TOLERANCE:
        assert n == policy.clamp(current)
    else:  # the HPA's ceil(current × ratio), clamped
        assert n == policy.clamp(math.ceil(round(current * ratio, 9)))


@given(policies, st.integers(1, 16), st.floats(0, 100), st.floats(0, 100))
def test_the_hpa_rule_is_monotone_in_the_signal(policy, current, a, b):
    if policy.autoscaled:
        lo, hi = sorted((a, b))
        assert desired_instances(policy, current, lo) <= desired_instances(policy, current, hi)


def test_no_recommendation_without_a_target():
    with pytest.raises(ValueError, match="no recommendation without a target"):
        desired_instances(Scaling(), 1, 3.0)


POLICY = Scaling(min=1, max=4, target={"waiting": 2}, scale_up_window_s=10, scale_down_window_s=60)


def test_a_burst_shorter_than_the_up_window_starts_nothing():
    r = Recommender(POLICY)
    for t in range(0, 10, 2):  # 0..8 s: asks for 3
        r.observe(t, 3)
        assert r.decide(t, 1) == 1
    r.observe(10, 3)
    assert r.decide(10, 1) == 3  # the whole up window asked for 3 or more
    r.observe(12, 1)
    assert r.decide(12, 1) == 1  # its lowest recommendation is now 1


def test_scale_down_takes_the_highest_recommendation_of_the_down_window():
    r = Recommender(POLICY)
    for t in range(0, 61, 2):
        r.observe(t, 3 if t == 30 else 1)
    assert r.decide(60, 4) == 3  # a peak 30 s ago holds 3
    for t in range(62, 93, 2):
        r.observe(t, 1)
    assert r.decide(92, 3) == 1


@settings(max_examples=200)
@given(st.lists(st.tuples(st.floats(0.1, 5), st.integers(1, 4)), min_size=1, max_size=60), st.integers(1, 4))
def test_decisions_wait_for_a_covered_window_and_stay_within_bounds(steps, current):
    r = Recommender(POLICY)
    t = 0.0
    for dt, desired in steps:
        t += dt
        r.observe(t, desired)
        n = r.decide(t, current)
        assert POLICY.min <= n <= POLICY.max
        if n > current:
            assert t - steps[0][0] >= POLICY.scale_up_window_s - 1e-9
        if n < current:
            assert t - steps[0][0] >= POLICY.scale_down_window_s - 1e-9
    r.reset()
    assert r.decide(t, current) == current  # nothing seen since the reset: no change


def test_a_count_outside_the_bounds_goes_back_at_once():
    r = Recommender(POLICY)
    assert r.decide(0, 6) == 4
    assert Recommender(Scaling(min=2, max=2)).decide(0, 1) == 2


BOUNDS = (0.1, 0.5, 1.0, 2.5, math.inf)


def _sample(counts):
    total, cum = 0.0, {}
    for le, c in zip(BOUNDS, counts):
        total += c
        cum[le] = total
    return InstanceSample(waiting=0, kv_cache=0, ttft=cum)


def test_ttft_p90_counts_only_the_requests_of_the_window():
    w = TtftWindow(window_s=30)
    w.add(0, {"a": _sample([100, 0, 0, 0, 0])})  # 100 fast requests before the window
    assert w.p90() == 0.0  # one read: nothing added yet (idle)
    w.add(10, {"a": _sample([100, 0, 10, 0, 0])})
    assert w.p90() == 1.0  # the 10 new ones took up to 1 s
    w.add(45, {"a": _sample([100, 0, 10, 0, 0])})  # nothing new for 35 s
    assert w.p90() == 0.0


def test_ttft_p90_sums_instances_and_survives_a_restart():
    w = TtftWindow(window_s=30)
    w.add(0, {"a": _sample([50, 0, 0, 0, 0]), "b": _sample([0, 0, 0, 0, 0])})
    w.add(5, {"a": _sample([0, 0, 0, 0, 8]), "b": _sample([2, 0, 0, 0, 0])})  # a restarted: counts from 0
    # 2 fast + 8 past every finite bound: p90 lies in +Inf, read as the largest finite bound
    assert w.p90() == 2.5
    w.add(6, {"b": _sample([2, 0, 0, 0, 0])})  # a left: forgotten, b's 2 fast requests remain
    assert w.p90() == 0.1
