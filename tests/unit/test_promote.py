"""Versioned deployments' promote (tasks/traffic/promote.py) behind the real router (HAProxy) with
stand-in instances: the default moves in one router change and the old default drains, serving
pinned requests; a version that cannot be the default is refused and nothing moves."""

from __future__ import annotations

import httpx
import pytest

from modelops.errors import TrafficError
from tests.conftest import parsed_manifest

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


def _answered_by(settings, **headers) -> str:
    r = httpx.post(f"{settings.router_url}/embeddings", json={"model": "m", "input": "x"}, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-model-version"]


def test_promote_moves_the_default_and_the_old_one_drains_serving_pins(two_versions):
    from tasks.traffic.promote import promote

    registry, router, settings, _ = two_versions
    assert _answered_by(settings) == "1"
    done = promote("m", "2", registry, router)
    assert (done["default"], done["previous"]) == ("2", ["1"]) and done["overlap_instance_hours"] >= 0
    assert {_answered_by(settings) for _ in range(10)} == {"2"}
    assert _answered_by(settings, **{"X-Model-Version": "1"}) == "1"
    old = registry.get_version("m", "1")
    assert (old.state, old.weight, old.reason) == ("draining", 0, "default moved to 2 (promote)")


def test_a_version_that_cannot_be_the_default_is_refused_and_nothing_moves(two_versions):
    from tasks.traffic.promote import promote

    registry, router, settings, _ = two_versions
    registry.record_announcement(parsed_manifest(version="3"))  # announced, never served
    registry.record_announcement(parsed_manifest(version="4"))
    registry.set_state("m", "4", "serving")
    registry.add_instance("m", "4", "m-4-1", "")  # starting: not running yet
    for version, says in (("3", "m 3 is provisioning; only a serving version"), ("9", "m 9 is not announced"),
                          ("4", "m 4 has no running instance")):
        with pytest.raises(TrafficError, match=says):
            promote("m", version, registry, router)
    assert {v.version: v.weight for v in registry.versions("m") if v.state == "serving"} == {"1": 100, "2": 0, "4": 0}
    assert _answered_by(settings) == "1"
