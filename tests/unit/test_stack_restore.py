"""``modelops up``'s restore (tasks/restore.py) of a version whose policy scales to zero: back at zero,
routed to the hold, no instance started. The real registry, local provider and HAProxy; the runtime
image and the sealed package are stand-ins (what restore checks of them is tested with real ones in
tests/integration/test_engine_faults.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from modelops import get_settings
from modelops.manifest import parse_manifest
from modelops.registry import Registry
from tasks.materialize.sources import COMPLETION_RECORD
from tasks.traffic.haproxy import HAProxyRouter

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed (make haproxy)")


def test_a_min_0_version_comes_back_at_zero_behind_the_hold(home, monkeypatch):
    from tasks.restore import restore_stopped

    settings = get_settings()
    registry = Registry(settings.registry)
    registry.record_announcement(parse_manifest({"model_id": "m", "version": "1", "source": "s3://b/m/",
                                                 "task": "generate", "scaling": {"min": 0, "max": 1}}))
    registry.set_weights("m", {"1": 100})
    registry.set_state("m", "1", "stopped")  # what modelops down recorded
    weights = settings.fsx_dir / "m" / "1" / COMPLETION_RECORD
    weights.parent.mkdir(parents=True)
    weights.write_text("{}")
    monkeypatch.setattr("tasks.image.build_runtime_image", lambda *a: SimpleNamespace(lock_hash="h"))
    monkeypatch.setattr("tasks.restore.sealed_package", lambda *a: object())
    monkeypatch.setattr("tasks.restore.check_package_runtime", lambda *a: None)
    router = HAProxyRouter(settings)
    try:
        (restored,) = restore_stopped(settings, say=lambda line: None)
        assert (restored.ok, restored.weight) == (True, 100)
        v = registry.get_version("m", "1")
        assert (v.state, v.weight) == ("serving", 100) and registry.instances("m") == []  # nothing started
        assert "server hold__m__1 unix@" in router.cfg.read_text()  # its requests are held until one starts
        assert router.weights() == {("m", "hold__m__1"): 100}
    finally:
        router.stop()
