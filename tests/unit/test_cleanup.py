"""tasks/cleanup.py: which versions are idle, on a real SQLite registry."""

from datetime import UTC, datetime, timedelta

from modelops import Registry
from modelops.registry import ModelVersion
from tasks.cleanup import idle_versions
from tests.conftest import parsed_manifest


def _serve(registry, version: str, weight: int) -> None:
    registry.record_announcement(parsed_manifest(version=version))
    registry.set_state("m", version, "serving")
    registry.set_weights("m", {version: weight})


def test_idle_versions_keep_the_latest(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    _serve(registry, "1", weight=0)
    registry.set_state("m", "1", "draining")
    _serve(registry, "2", weight=100)
    assert idle_versions(registry, idle_after_s=3600) == []  # drained just now
    with registry.session() as s:
        s.get(ModelVersion, registry.get_version("m", "1").id).updated_at = datetime.now(UTC) - timedelta(hours=2)
    assert idle_versions(registry, idle_after_s=3600) == [("m", "1")]
    assert idle_versions(registry, idle_after_s=3600, model_id="other") == []
