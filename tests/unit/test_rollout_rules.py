"""Strategy, weight plan and idle-version rules, on a real SQLite registry."""

from datetime import UTC, datetime, timedelta

import pytest

import modelops
from modelops import Registry, parse_manifest
from modelops.registry import ModelVersion
from tasks.cleanup import idle_versions
from tasks.traffic.shift import plan_weights, resolve_strategy


def _m(version, task="embed", strategy="auto"):
    return parse_manifest({"model_id": "m", "version": version, "source": "s3://b/m/", "task": task,
                           "strategy": strategy})


@pytest.fixture
def registry(tmp_path):
    return Registry(f"sqlite:///{tmp_path / 'r.db'}")


def _serve(registry, manifest, weight=100):
    registry.record_announcement(manifest)
    registry.set_state(manifest.model_id, manifest.version, "serving")
    registry.set_weights(manifest.model_id, {manifest.version: weight})


def test_first_version_takes_all_traffic(registry):
    assert resolve_strategy(_m("1"), registry) == "first"
    assert plan_weights(_m("1"), registry, "first") == {"1": 100}


def test_same_schema_is_red_black_changed_schema_is_versioned(registry):
    _serve(registry, _m("1"))
    assert resolve_strategy(_m("2"), registry) == "red-black"
    assert plan_weights(_m("2"), registry, "red-black") == {"2": 100, "1": 0}
    assert resolve_strategy(_m("3", task="generate"), registry) == "versioned"
    assert plan_weights(_m("3", task="generate"), registry, "versioned") == {"3": 0}
    assert resolve_strategy(_m("4", strategy="versioned"), registry) == "versioned"


def test_idle_versions_keep_the_latest(registry):
    _serve(registry, _m("1"), weight=0)
    registry.set_state("m", "1", "draining")
    _serve(registry, _m("2"))
    assert idle_versions(registry, idle_after_s=3600) == []  # drained just now
    with registry.session() as s:
        s.get(ModelVersion, registry.get_version("m", "1").id).updated_at = datetime.now(UTC) - timedelta(hours=2)
    assert idle_versions(registry, idle_after_s=3600) == [("m", "1")]
    assert idle_versions(registry, idle_after_s=3600, model_id="other") == []


def test_public_surface_is_deliberate():
    assert sorted(modelops.__all__) == [
        "HealthCheckError", "Manifest", "ManifestError", "MaterializeError", "ModelopsError", "PackageError",
        "ProvisionError", "Registry", "RuntimeImageError", "Settings", "TrafficError", "get_settings",
        "load_manifest", "parse_manifest",
    ]
