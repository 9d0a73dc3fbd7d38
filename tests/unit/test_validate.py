"""The validate stage (tasks/validate.py): an announcement is checked against the platform and
its source, then recorded; a refused one records nothing; re-announcing is idempotent, a draining
version is never silently brought back, and a failure later in the flow is recorded on the
version with its stage."""

from __future__ import annotations

import pytest

from modelops.errors import ManifestError
from tests.conftest import parsed_manifest


@pytest.fixture
def weights(tmp_path):
    """A local source folder with what a model's weights need (config.json, a weights file)."""
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["BertModel"]}')
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def test_a_valid_announcement_is_recorded_and_a_changed_one_refused(home, weights):
    from modelops import Registry, get_settings
    from tasks.validate import validate

    registry = Registry(get_settings().registry)
    done = validate(parsed_manifest(source=str(weights)), flow_run_id="run-1")
    assert (done.nothing_to_do, done.files) == ("", 2)
    row = registry.get_version("m", "1")
    assert row.state == "provisioning"
    with pytest.raises(ManifestError, match="already announced with a different manifest .*announce a new version"):
        validate(parsed_manifest(source=str(weights), engine_args={"max_model_len": 128}))
    assert registry.get_version("m", "1").manifest == row.manifest  # the first one stands


def test_a_refused_announcement_records_nothing(home, tmp_path):
    from modelops import Registry, get_settings
    from tasks.validate import validate

    registry = Registry(get_settings().registry)
    with pytest.raises(ManifestError):
        validate(parsed_manifest(source=str(tmp_path / "nowhere")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ManifestError):
        validate(parsed_manifest(source=str(empty)))
    assert registry.get_version("m", "1") is None


def test_a_draining_version_is_left_alone(home, weights):
    from modelops import Registry, get_settings
    from tasks.validate import nothing_to_do, validate

    registry = Registry(get_settings().registry)
    manifest = parsed_manifest(source=str(weights))
    validate(manifest)
    registry.set_state("m", "1", "draining", "replaced by 2 (red-black)")
    said = nothing_to_do(manifest, registry)
    assert "is draining (replaced by 2 (red-black)); nothing changed: announce a new version" in said
    assert validate(manifest).nothing_to_do == said


def test_a_later_failure_is_recorded_with_its_stage(home, weights):
    from modelops import Registry, get_settings
    from tasks.validate import record_failure_task, validate

    registry = Registry(get_settings().registry)
    manifest = parsed_manifest(source=str(weights))
    record_failure_task.fn(manifest, "provision", "no free port")  # never recorded: a no-op
    assert registry.get_version("m", "1") is None
    validate(manifest)
    record_failure_task.fn(manifest, "provision", "no free port")
    row = registry.get_version("m", "1")
    assert (row.state, row.reason) == ("failed", "provision: no free port")
