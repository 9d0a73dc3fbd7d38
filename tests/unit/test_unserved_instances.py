"""A lifecycle run cancelled before its version serves (no transaction rollback runs) leaves no
instance running for nobody: flows/lifecycle.py's hook and
tasks.provision.task.stop_unserved_instances, and Provider.stop_each beneath it, on the local
provider with real processes."""

import subprocess
from types import SimpleNamespace

import pytest
from prefect.states import State

from flows.lifecycle import _ended_early
from modelops import Registry, get_settings, parse_manifest
from tasks.provision.task import stop_unserved_instances


def _version(registry: Registry, version: str, state: str, weight: int) -> subprocess.Popen:
    """Version ``version`` of model m in ``state`` with one running instance: a real process."""
    registry.record_announcement(parse_manifest({"model_id": "m", "version": version, "source": "s3://b/m/",
                                                 "task": "embed"}))
    registry.set_state("m", version, state)
    registry.set_weights("m", {version: weight})
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    registry.add_instance("m", version, f"m-{version}-1", "")
    registry.update_instance(f"m-{version}-1", state="running", pid=proc.pid)
    return proc


def test_a_run_ended_before_serving_stops_its_instance_and_fails_the_version(home):
    registry = Registry(get_settings().registry)
    serving = _version(registry, "1", "serving", 100)
    started = _version(registry, "2", "provisioning", 0)
    shifting = _version(registry, "3", "provisioning", 10)  # mid-traffic: rollback decides, not the hook
    try:
        run = SimpleNamespace(parameters={"manifest": {"model_id": "m", "version": "2"}}, name="m-2", id="x")
        _ended_early(None, run, State(type="CANCELLING", name="Cancelling"))  # as Prefect calls it
        assert started.wait(timeout=30) is not None
        v2 = registry.get_version("m", "2")
        assert v2.state == "failed" and "flow run m-2 was cancelled before the version served" in v2.reason
        assert [i.state for i in registry.instances("m", "2", live=False)] == ["stopped"]
        # Nothing else is touched: the serving version, and a provisioning one that has weight.
        assert stop_unserved_instances("m", "1", "cancelled") == [] and serving.poll() is None
        assert stop_unserved_instances("m", "3", "cancelled") == [] and shifting.poll() is None
        assert registry.get_version("m", "3").state == "provisioning"
        # Again (a second hook, a retry): nothing left to stop.
        assert stop_unserved_instances("m", "2", "cancelled") == []
        # A run with no usable manifest parameter is ignored.
        _ended_early(None, SimpleNamespace(parameters={}, name="r", id="y"), State(type="CANCELLED", name="Cancelled"))
    finally:
        for p in (serving, started, shifting):
            p.kill()
            p.wait()


def test_stop_each_stops_every_instance_it_can_and_names_the_ones_it_cannot(home):
    from modelops.errors import ProvisionError
    from tasks import backends

    registry = Registry(get_settings().registry)
    a, b = _version(registry, "1", "serving", 100), _version(registry, "2", "serving", 0)
    heard: list[str] = []
    try:
        with pytest.raises(ProvisionError, match=r"could not stop: m-9-1: .*no instance named 'm-9-1'") as e:
            backends.provider().stop_each(["m-1-1", "m-9-1", "m-2-1"], heard.append)
        assert "m-1-1" not in str(e.value) and "m-2-1" not in str(e.value)
        # Both real instances were stopped all the same, and each was announced.
        assert a.wait(timeout=30) is not None and b.wait(timeout=30) is not None
        assert sorted(heard) == ["instance m-1-1: stopped", "instance m-2-1: stopped"]
        assert [i.state for i in registry.instances("m", live=False)] == ["stopped", "stopped"]
        assert backends.provider().stop_each([]) == []
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
