"""Experiments (modelops/experiments.py, tasks/traffic/experiment.py): arms parsed and refused,
the router's sticky split by key (real HAProxy, stand-in instances of versions 1 and 2 of model
m) against the arm the core predicts, the rollout lock while one runs, and stopping it."""

from __future__ import annotations

import json
import os
import zlib

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelops.experiments import Arm, ExperimentSpec, arm_of, bucket_of, parse_arms, parse_key
from modelops.histograms import quantile_interval, wilson_interval
from tests.conftest import parsed_manifest

haproxy = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


def test_arms_are_refused_naming_what_to_change():
    serving = {"1", "2", "3"}
    assert parse_arms("1:50, 2:50", serving) == (Arm("1", 50), Arm("2", 50))
    for text, says in (("1:50,2:40", "sum to 90"), ("1:50,1:50", "named twice"), ("1:100", "at least two"),
                       ("1:0,2:100", "1 to 99"), ("1:50,4:50", "4 is not serving"), ("1=50,2:50", "VERSION:PERCENT"),
                       ("1:x,2:50", "VERSION:PERCENT")):
        with pytest.raises(ValueError, match=says) as e:
            parse_arms(text, serving)
        assert str(e.value).startswith("--arms")


def test_keys_are_the_body_user_or_a_header():
    assert parse_key("user") == "user" and parse_key("header:X-User-Id") == "header:x-user-id"
    for bad in ("body", "header:", "header:X User", "cookie:id"):
        with pytest.raises(ValueError, match="--key"):
            parse_key(bad)


@given(st.binary(min_size=1, max_size=300))
def test_the_arm_of_a_key_follows_its_bucket_and_long_keys_go_to_the_default(key):
    spec = ExperimentSpec((Arm("1", 30), Arm("2", 70)), "user", "2")
    arm = arm_of(spec, key)
    if len(key) > 256:
        assert arm == "2"
    else:
        assert arm == ("1" if zlib.crc32(key) % 100 < 30 else "2") and bucket_of(key) == zlib.crc32(key) % 100
    assert arm_of(spec, None) == arm_of(spec, b"") == "2"


def test_intervals_hold_their_estimate_and_narrow_with_more_data():
    assert wilson_interval(0, 40)[0] == 0.0 and wilson_interval(40, 40)[1] == 1.0  # exactly, not 3e-17 off
    low, high = wilson_interval(5, 100)
    assert low < 0.05 < high and wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(50, 1000)[1] - wilson_interval(50, 1000)[0] < high - low
    few = {0.1: 5, 0.5: 10, 1.0: 20, float("inf"): 20}
    many = {le: 100 * c for le, c in few.items()}
    lo, est, hi = quantile_interval(0.5, few)
    assert lo <= est <= hi and est == pytest.approx(0.5)
    assert quantile_interval(0.5, many)[2] - quantile_interval(0.5, many)[0] < hi - lo
    assert quantile_interval(0.9, {}) is None


def _chat(settings, headers=None, **body) -> httpx.Response:
    return httpx.post(f"{settings.router_url}/chat/completions", headers=headers or {}, timeout=10,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


@haproxy
def test_each_key_always_gets_the_arm_the_core_predicts(two_versions):
    from tasks.traffic.experiment import start_experiment

    registry, router, settings, _ = two_versions
    spec = ExperimentSpec((Arm("1", 50), Arm("2", 50)), "header:x-user-id", "1")
    start_experiment(registry, router, "m", spec)
    got: dict[str, set[str]] = {}
    with httpx.Client(timeout=10) as client:
        for i in range(200):
            for _ in range(3):
                r = client.post(f"{settings.router_url}/chat/completions", headers={"X-User-Id": f"user-{i}"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                got.setdefault(f"user-{i}", set()).add(r.headers["x-model-version"])
    assert all(len(v) == 1 for v in got.values())  # sticky
    assert all(v == {arm_of(spec, k.encode())} for k, v in got.items())  # HAProxy's crc32 is zlib's
    share_2 = sum(v == {"2"} for v in got.values()) / len(got)
    assert 0.35 < share_2 < 0.65
    # No key, an empty one, or one over 256 bytes: the default arm; a pinned request goes where it names.
    for headers in ({}, {"X-User-Id": ""}, {"X-User-Id": "x" * 10_000}, {"X-User-Id": "x" * 257}):
        assert _chat(settings, headers).headers["x-model-version"] == "1"
    assert _chat(settings, {"X-User-Id": "user-0", "X-Model-Version": "2"}).headers["x-model-version"] == "2"
    metrics = httpx.get(f"http://127.0.0.1:{settings.router_port}/metrics", timeout=5).text
    counted = {line.split("} ")[0]: float(line.split("} ")[1]) for line in metrics.splitlines()
               if line.startswith("modelops_router_experiment_requests_total{")}
    assert counted['modelops_router_experiment_requests_total{model="m",version="1",assigned="default"'] == 4
    assert sum(n for k, n in counted.items() if 'assigned="key"' in k) == 600


@haproxy
def test_the_body_user_keys_an_experiment_as_sent(two_versions):
    from tasks.traffic.experiment import start_experiment

    registry, router, settings, _ = two_versions
    spec = ExperimentSpec((Arm("1", 20), Arm("2", 80)), "user", "1")
    start_experiment(registry, router, "m", spec)
    for i in range(40):
        user = f"alice-{i}"
        assert _chat(settings, user=user).headers["x-model-version"] == arm_of(spec, json.dumps(user).encode())


@haproxy
def test_rollouts_wait_while_an_experiment_runs_and_stop_keeps_one_arm(two_versions):
    from modelops.errors import TrafficError
    from tasks.lock import rollout_lock
    from tasks.traffic.experiment import compare_arms, start_experiment, stop_experiment

    registry, router, settings, _ = two_versions
    spec = ExperimentSpec((Arm("1", 50), Arm("2", 50)), "header:x-user-id", "1")
    start_experiment(registry, router, "m", spec)
    with pytest.raises(ValueError, match="already"):
        start_experiment(registry, router, "m", spec)
    with pytest.raises(TrafficError, match="experiment stop m --keep"):
        with rollout_lock("m", holder="a rollout", wait_s=0):
            pass
    assert not registry.try_lock_rollout("m", "probe", os.getpid())  # the refused holder let it go
    registry.unlock_rollout("m", "probe")
    for i in range(20):
        _chat(settings, {"X-User-Id": f"u{i}"})
    stats = {a.version: a for a in compare_arms(registry, registry.experiment("m"),
                                                httpx.get(f"http://127.0.0.1:{settings.router_port}/metrics").text)}
    assert stats["1"].by_key + stats["2"].by_key == 20 and stats["1"].by_default == 0
    # Tokens since the start, per arm (the stand-ins count 3 in and 5 out per chat answer).
    assert all((a.prompt_tokens, a.generation_tokens) == (3 * a.by_key, 5 * a.by_key) for a in stats.values())
    from tasks.traffic.experiment import experiment_markdown

    report = experiment_markdown(registry.experiment("m"), list(stats.values()))
    assert f"| 2 | 50 % | {stats['2'].by_key} | 0 |" in report and f"| {5 * stats['2'].by_key} |" in report
    with pytest.raises(ValueError, match="--keep"):
        stop_experiment(registry, router, "m", "3")
    stop_experiment(registry, router, "m", "2")
    assert registry.experiment("m") is None and registry.get_version("m", "2").weight == 100
    replaced = registry.get_version("m", "1")
    assert (replaced.state, replaced.reason) == ("draining", "the experiment on m ended keeping 2")
    assert {_chat(settings, {"X-User-Id": f"u{i}"}).headers["x-model-version"] for i in range(20)} == {"2"}
    with rollout_lock("m", holder="a rollout", wait_s=0):  # free again
        pass


def test_the_cli_refuses_bad_experiments_before_anything_changes(home):
    import subprocess
    import sys
    from pathlib import Path

    from modelops import Registry, get_settings

    registry = Registry(get_settings().registry)
    for version in ("1", "2"):
        registry.record_announcement(parsed_manifest(version=version))
        registry.set_state("m", version, "serving")
    cli = str(Path(sys.executable).parent / "modelops")

    def run(*args):
        return subprocess.run([cli, "experiment", *args], capture_output=True, text=True, timeout=120)

    for args, says in ((["--arms", "1:50,2:40"], "--arms: the shares sum to 90"),
                       (["--arms", "1:50,3:50"], "--arms: version 3 is not serving"),
                       (["--arms", "1:50,2:50", "--key", "cookie"], "--key"),
                       (["--arms", "1:50,2:50", "--default", "3"], "--default")):
        r = run("start", "m", *args)
        assert r.returncode == 2 and says in r.stderr, r.stderr
    assert registry.experiments("m", running=False) == []
    assert "no experiment runs" in run("status").stdout
    r = run("stop", "m", "--keep", "1")
    assert r.returncode == 2 and "no experiment runs on m" in r.stderr


def test_a_router_that_cannot_split_by_key_refuses_to_start_one(home):
    from modelops import Registry, get_settings
    from modelops.errors import TrafficError
    from tasks.traffic.experiment import start_experiment
    from tasks.traffic.gateway_api import GatewayAPIRouter

    registry = Registry(get_settings().registry)
    spec = ExperimentSpec((Arm("1", 50), Arm("2", 50)), "user", "1")
    with pytest.raises(TrafficError, match="HAProxy router only"):
        start_experiment(registry, GatewayAPIRouter.__new__(GatewayAPIRouter), "m", spec)
    assert registry.experiments("m", running=False) == []


@haproxy
def test_the_routers_counts_of_an_experiment_survive_its_reloads(two_versions):
    from tasks.traffic.experiment import compare_arms, start_experiment, stop_experiment
    from tasks.traffic.interface import ModelRoute, Server, routes_from_registry

    registry, router, settings, instances = two_versions
    start_experiment(registry, router, "m", ExperimentSpec((Arm("1", 50), Arm("2", 50)), "header:x-user-id", "1"))
    for i in range(12):
        _chat(settings, {"X-User-Id": f"u{i}"})
    _chat(settings)  # no key: the default arm
    worker = router._worker_pid()
    other = ModelRoute("n", {"1": (Server("n-1-1", instances["1"].url.removeprefix("http://"), 100),)})
    router.apply([*routes_from_registry(registry), other])  # another model's route: a reload
    assert router._worker_pid() != worker
    for i in range(12, 20):
        _chat(settings, {"X-User-Id": f"u{i}"})
    arms = compare_arms(registry, registry.experiment("m"), router.experiment_metrics())
    assert sum(a.by_key for a in arms) == 20 and sum(a.by_default for a in arms) == 1
    stop_experiment(registry, router, "m", "1")
    start_experiment(registry, router, "m", ExperimentSpec((Arm("1", 50), Arm("2", 50)), "header:x-user-id", "1"))
    fresh = compare_arms(registry, registry.experiment("m"), router.experiment_metrics())
    assert sum(a.by_key + a.by_default for a in fresh) == 0  # a new experiment counts from its own start
