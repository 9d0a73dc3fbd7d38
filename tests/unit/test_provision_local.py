"""tasks/provision/local.py: the cores an instance gets for its ``resources.cpus``
(plan_cores, and LocalProvider reading the live instances' cores from the OS)."""

import math
import os
import subprocess

from hypothesis import given
from hypothesis import strategies as st

from modelops import Registry, get_settings, parse_manifest
from modelops.artifacts import Package
from tasks.provision.local import LocalProvider, plan_cores


@given(cpus=st.floats(min_value=0.01, max_value=64), available=st.sets(st.integers(0, 63), min_size=1, max_size=16),
       held=st.lists(st.sets(st.integers(0, 70), max_size=8), max_size=6))
def test_plan_cores_takes_the_least_held_cores_it_asks_for(cpus, available, held):
    cores = plan_cores(cpus, sorted(available), held)
    assert cores == sorted(set(cores)) and set(cores) <= available
    assert len(cores) == min(len(available), math.ceil(cpus))
    load = {c: sum(c in h for h in held) for c in available}
    others = available - set(cores)
    # None left out is held less, or as much with a lower number.
    assert all((load[c], c) < (load[o], o) for c in cores for o in others)


def test_two_one_core_instances_get_a_core_each_and_a_third_shares():
    assert plan_cores(1, [0, 1], []) == [0]
    assert plan_cores(1, [0, 1], [{0}]) == [1]
    assert plan_cores(1, [0, 1], [{0}, {1}]) == [0]
    assert plan_cores(2, [0, 1], [{0}]) == [0, 1]
    assert plan_cores(0.5, [0, 1], [{0, 1}, {1}]) == [0]
    assert plan_cores(8, [2, 3], []) == [2, 3]  # never more than this process may use
    assert plan_cores(0, [0, 1], [{0}]) == [1]  # at least one (the manifest refuses 0)


def test_the_provider_reads_the_live_instances_cores_from_the_os(home, tmp_path):
    available = sorted(os.sched_getaffinity(0))
    registry = Registry(get_settings().registry)
    registry.record_announcement(parse_manifest({"model_id": "m", "version": "1", "source": "s3://b/m/",
                                                 "task": "embed", "resources": {"cpus": 1}}))
    provider = LocalProvider(registry=registry)
    package = Package(tmp_path, "m", "m", "1", "embed")
    running = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        os.sched_setaffinity(running.pid, {available[0]})
        registry.add_instance("m", "1", "m-1-1", "")
        registry.update_instance("m-1-1", state="running", pid=running.pid)
        expected = [available[1]] if len(available) > 1 else [available[0]]
        assert provider._cores(package, "m-1-2") == expected
        # An instance that asks for no more than the default gets every core there is, up to 2.
        registry.record_announcement(parse_manifest({"model_id": "m", "version": "2", "source": "s3://b/m/",
                                                     "task": "embed"}))
        assert provider._cores(Package(tmp_path, "m", "m", "2", "embed"), "m-2-1") == available[:2]
    finally:
        running.kill()
        running.wait()


def test_instances_and_the_router_never_get_the_prefect_apis_credentials(home, monkeypatch, tmp_path):
    """A model.py or plugin an instance runs, and HAProxy, must not be able to drive the control
    plane: the Prefect auth string the worker's flow run holds stays out of their environments."""
    from modelops.artifacts import RuntimeImage
    from modelops.compat import LOCAL_CPU
    from modelops.tenancy import PREFECT_AUTH_VARS
    from tasks.provision.local import runtime_env
    from tasks.traffic.haproxy import HAProxyRouter

    for var in PREFECT_AUTH_VARS:
        monkeypatch.setenv(var, "modelops:secret")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    image = RuntimeImage(tmp_path, tmp_path / "python", "x", LOCAL_CPU, LOCAL_CPU.vllm)
    for env in (runtime_env(image, get_settings()), HAProxyRouter(get_settings())._env()):
        assert not set(PREFECT_AUTH_VARS) & set(env) and env["PREFECT_API_URL"] == "http://127.0.0.1:1/api"
