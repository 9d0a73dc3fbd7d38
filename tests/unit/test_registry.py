import pytest

from modelops import ManifestError, Registry, parse_manifest

M = {"model_id": "m", "version": "1", "source": "s3://b/m/1/", "task": "embed"}


@pytest.fixture
def registry(tmp_path):
    return Registry(f"sqlite:///{tmp_path / 'r.db'}")


def test_announcement_is_recorded_once(registry):
    row, created = registry.record_announcement(parse_manifest(M))
    again, created_again = registry.record_announcement(parse_manifest(M))
    assert (created, created_again) == (True, False)
    assert row.id == again.id and len(registry.versions("m")) == 1
    assert registry.get_version("m", "1").state == "provisioning"


def test_versions_are_immutable(registry):
    registry.record_announcement(parse_manifest(M))
    with pytest.raises(ManifestError, match="already announced with a different manifest"):
        registry.record_announcement(parse_manifest({**M, "source": "s3://b/other/"}))


def test_retired_version_announced_again_goes_back_to_provisioning(registry):
    registry.record_announcement(parse_manifest(M))
    registry.set_state("m", "1", "retired", "stack stopped")
    registry.record_announcement(parse_manifest(M))
    v = registry.get_version("m", "1")
    assert (v.state, v.reason) == ("provisioning", "")


def test_status_shape_and_weights(registry):
    registry.record_announcement(parse_manifest(M))
    registry.add_instance("m", "1", "m-1-1", "/tmp/log")
    registry.update_instance("m-1-1", state="running", pid=123, endpoints={"openai": "http://127.0.0.1:1/v1"})
    registry.set_weights("m", {"1": 100})
    registry.set_state("m", "1", "serving")
    assert registry.status() == {"models": [{"model_id": "m", "versions": [{
        "version": "1", "state": "serving", "weight": 100, "strategy": "auto", "reason": "",
        "endpoints": {"m-1-1": {"openai": "http://127.0.0.1:1/v1"}}, "pids": {"m-1-1": 123}}]}]}
    registry.update_instance("m-1-1", state="stopped")
    assert registry.status()["models"][0]["versions"][0]["endpoints"] == {}


def test_bad_weight_and_state_rejected(registry):
    registry.record_announcement(parse_manifest(M))
    with pytest.raises(ValueError, match="0..100"):
        registry.set_weights("m", {"1": 101})
    with pytest.raises(ValueError, match="state must be one of"):
        registry.set_state("m", "1", "running")
    with pytest.raises(KeyError, match="not in the registry"):
        registry.set_state("m", "9", "serving")
