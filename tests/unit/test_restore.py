"""Undoing traffic changes (tasks/traffic/rollout.py, rollback.py) on a real registry and a real
HAProxy in front of small HTTP servers: the transaction hooks' building blocks."""

import pytest

from modelops import Registry, get_settings, parse_manifest
from modelops.errors import TrafficError
from tasks.traffic.interface import routes_from_registry
from tasks.traffic.rollback import plan_rollback
from tasks.traffic.retire import retire_replaced
from tasks.traffic.undo import restore_traffic, rollback_incomplete, snapshot_traffic
from tests.unit.test_haproxy import _backend, _post, router  # noqa: F401  (router is a fixture)

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


def _serving(registry: Registry, version: str, weight: int, backend) -> None:
    registry.record_announcement(parse_manifest({"model_id": "m", "version": version, "source": "/x", "task": "embed"}))
    registry.add_instance("m", version, f"m-{version}-1", "")
    registry.update_instance(f"m-{version}-1", state="running", pid=__import__("os").getpid(),
                             endpoints={"openai": f"http://127.0.0.1:{backend.server_port}/v1"})
    registry.set_state("m", version, "serving")
    registry.set_weights("m", {version: weight})


def test_restore_after_a_full_shift_puts_the_old_version_back(router):  # noqa: F811
    registry = Registry(get_settings().registry)
    b1, b2 = _backend("v1"), _backend("v2")
    _serving(registry, "1", 100, b1)
    before = snapshot_traffic(registry, "m")
    _serving(registry, "2", 100, b2)  # the shift: 2 takes everything, 1 is replaced
    registry.set_weights("m", {"1": 0})
    registry.set_state("m", "1", "draining", "replaced by 2 (red-black)")
    router.ensure_running(routes_from_registry(registry))
    assert _post("m").json() == {"served_by": "v2"}
    stopped = []
    restore_traffic("m", "2", before, registry, router, drain_and_stop=stopped.append, reason="rolled back: verify")
    assert [(v.version, v.state, v.weight) for v in registry.versions("m")] == [("1", "serving", 100),
                                                                                ("2", "failed", 0)]
    assert registry.get_version("m", "1").reason == "" and stopped == ["m-2-1"]
    assert router.weights()[("m", "m-1-1")] > 0 and ("m", "m-2-1") not in router.weights()  # 2 left the router
    assert {_post("m").json()["served_by"] for _ in range(20)} == {"v1"}
    assert rollback_incomplete("m", "2") == ""


def test_restore_keeps_a_version_that_served_before_and_others_reasons(router):  # noqa: F811
    registry = Registry(get_settings().registry)
    b1, b3 = _backend("v1"), _backend("v3")
    _serving(registry, "1", 100, b1)
    registry.record_announcement(parse_manifest({"model_id": "m", "version": "2", "source": "/x", "task": "embed"}))
    registry.set_state("m", "2", "failed", "health: it broke")
    _serving(registry, "3", 0, b3)  # a versioned deployment, pinned only
    router.ensure_running(routes_from_registry(registry))
    before = snapshot_traffic(registry, "m")
    registry.set_weights("m", {"3": 100, "1": 0})  # a promote of 3 ...
    registry.set_state("m", "1", "draining", "default moved to 3 (promote)")
    router.apply(routes_from_registry(registry))
    stopped = []
    restore_traffic("m", None, before, registry, router, drain_and_stop=stopped.append, reason="")  # ... undone
    assert [(v.version, v.state, v.weight, v.reason) for v in registry.versions("m")] == [
        ("1", "serving", 100, ""), ("2", "failed", 0, "health: it broke"), ("3", "serving", 0, "")]
    assert stopped == [] and {_post("m").json()["served_by"] for _ in range(10)} == {"v1"}
    assert _post("m", "3").json() == {"served_by": "v3"}  # still pinned-reachable


def test_router_disagreeing_with_the_registry_is_reported(router):  # noqa: F811
    registry = Registry(get_settings().registry)
    b1, b2 = _backend("v1"), _backend("v2")
    _serving(registry, "1", 0, b1)
    _serving(registry, "2", 100, b2)
    router.ensure_running(routes_from_registry(registry))
    registry.set_weights("m", {"2": 0, "1": 100})  # the registry was restored, the router was not
    registry.set_state("m", "2", "failed", "x")
    assert "the router still sends 2 traffic" in rollback_incomplete("m", "2")


def test_retire_only_what_is_still_replaced(router):  # noqa: F811
    registry = Registry(get_settings().registry)
    b1, b2, b3 = _backend("v1"), _backend("v2"), _backend("v3")
    _serving(registry, "1", 0, b1)
    registry.set_state("m", "1", "draining", "replaced by 3")
    _serving(registry, "2", 0, b2)  # replaced too, but promoted again since: not retired
    _serving(registry, "3", 100, b3)
    router.ensure_running(routes_from_registry(registry))
    stopped = []
    retire_replaced("m", "3", ["1", "2"], registry, router, drain_and_stop=stopped.append)
    assert [(v.version, v.state) for v in registry.versions("m")] == [("1", "retired"), ("2", "serving"),
                                                                      ("3", "serving")]
    assert stopped == ["m-1-1"]


def test_rollback_target_is_the_newest_earlier_version_that_served(home):
    registry = Registry(get_settings().registry)
    for version, state in (("1", "retired"), ("2", "draining"), ("3", "failed"), ("4", "provisioning"),
                           ("5", "serving")):
        registry.record_announcement(parse_manifest({"model_id": "m", "version": version, "source": "/x",
                                                     "task": "embed"}))
        registry.set_state("m", version, state)
    registry.set_weights("m", {"5": 100})
    registry.add_instance("m", "2", "m-2-1", "")
    registry.update_instance("m-2-1", state="running", pid=__import__("os").getpid())
    plan = plan_rollback("m")
    assert (plan.to, plan.current, plan.package, plan.task) == ("2", ("5",), None, "embed")  # live: weights only
    with pytest.raises(TrafficError, match="m 3 failed"):
        plan_rollback("m", "3")
    with pytest.raises(TrafficError, match="m 4 never served"):
        plan_rollback("m", "4")
    with pytest.raises(TrafficError, match="m 1 has no running instance and its package is gone"):
        plan_rollback("m", "1")
    with pytest.raises(TrafficError, match="already the default"):
        plan_rollback("m", "5")
    with pytest.raises(TrafficError, match="not in the registry"):
        plan_rollback("nope")


def test_a_rollback_to_a_version_whose_weights_were_evicted_is_refused_before_any_change(home, tmp_path):
    """Its package is sealed but its FSx copy is gone: refused at planning (it used to start an
    instance that failed 20 s later on the missing weights folder)."""
    from modelops.archive import seal
    from tasks.materialize import COMPLETION_RECORD

    registry = Registry(get_settings().registry)
    for version, state in (("1", "retired"), ("2", "serving")):
        registry.record_announcement(parse_manifest({"model_id": "m", "version": version, "source": "/x",
                                                     "task": "embed"}))
        registry.set_state("m", version, state)
    registry.set_weights("m", {"2": 100})
    seal({"model_repository/m/config.pbtxt": b"x"}, get_settings().packages_dir / "m" / "1",
         {"model_id": "m", "version": "1", "triton_model": "m", "task": "embed"})
    with pytest.raises(TrafficError, match="weights were evicted from the FSx cache"):
        plan_rollback("m", "1")
    with pytest.raises(TrafficError, match="its package and its weights on FSx"):
        plan_rollback("m")
    copy = get_settings().fsx_dir / "m" / "1"
    copy.mkdir(parents=True)
    (copy / COMPLETION_RECORD).write_text('{"files": {}}')
    assert plan_rollback("m", "1").package is not None
