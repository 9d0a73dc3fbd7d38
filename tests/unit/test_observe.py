"""Stage bookkeeping and the rollout report (tasks/observe.py); the events and artifacts
themselves are checked on a real Prefect server in tests/integration/test_operations.py."""

import pytest

from modelops import Registry, parse_manifest
from modelops.settings import get_settings
from tasks import observe
from tasks.observe import InjectedFailure, Stages, endpoints_text, rollout_report, weights_text


@pytest.fixture
def emitted(monkeypatch):
    events = []
    monkeypatch.setattr(observe, "emit_stage_event", lambda *a, **k: events.append(a))
    return events


def test_stages_time_and_emit_each_outcome(emitted):
    stages = Stages("m", "2")
    with stages.run("package") as row:
        row["detail"] = "sealed"
    with pytest.raises(RuntimeError, match="port taken"), stages.run("provision"):
        raise RuntimeError("port taken")
    assert [(r["stage"], r["outcome"], r["detail"]) for r in stages.rows] == [
        ("package", "completed", "sealed"), ("provision", "failed", "port taken")]
    assert [(e[2], e[3]) for e in emitted] == [("package", "completed"), ("provision", "failed")]
    assert emitted[1][5] == "port taken" and all(e[:2] == ("m", "2") for e in emitted)
    assert stages.failed["stage"] == "provision"
    assert "| provision | failed |" in stages.table() and stages.table().count("\n") == 3


def test_fail_stage_setting_fails_that_stage_only(emitted, monkeypatch):
    monkeypatch.setenv("MODELOPS_FAIL_STAGE", "health")
    stages = Stages("m", "1")
    with stages.run("provision"):
        pass
    with pytest.raises(InjectedFailure, match=r"injected failure at stage health \(setting MODELOPS_FAIL_STAGE=health\)"), \
            stages.run("health"):
        raise AssertionError("the body must not run")
    assert [r["outcome"] for r in stages.rows] == ["completed", "failed"]


def test_rollout_report_names_the_cause_first_and_the_weights_last(emitted, home):
    registry = Registry(get_settings().registry)
    for version, weight in (("1", 0), ("2", 100)):
        registry.record_announcement(parse_manifest({"model_id": "m", "version": version, "source": "/x",
                                                     "task": "embed"}))
        registry.set_state("m", version, "serving" if weight else "draining")
        registry.set_weights("m", {version: weight})
    stages = Stages("m", "2")
    with stages.run("traffic"):
        pass
    rollout = {"steps": [{"weight": 5, "gate": {"passed": True, "requests_new": 0, "errors_new": 0}},
                         {"weight": 10, "gate": {"passed": True, "requests_new": 40, "errors_new": 0,
                                                  "p99_new_s": 0.05, "p99_old_s": 0.04}},
                         {"weight": 25, "gate": {"passed": False, "reason": "error ratio 0.2 > 0.01"}}],
               "rollback_s": 0.08}
    text = rollout_report("m", "2", stages, outcome="failed", cause="traffic failed:\n rolled back",
                          strategy="red-black", why="the I/O schema equals the serving version (1)", rollout=rollout)
    lines = text.splitlines()
    assert lines[0] == "**failed**: traffic failed: rolled back"
    assert "| 5 | pass (no traffic) | 0 | 0 | - / - | - / - | - / - |" in lines
    assert "| 10 | pass | 40 | 0 | 0.05 / 0.04 | - / - | - / - |" in lines
    assert "| 25 | error ratio 0.2 > 0.01 | - | - | - / - | - / - | - / - |" in lines
    assert "weights restored in 0.08 s" in text and "red-black: the I/O schema equals" in text
    assert lines[-1] == "1: 0% (draining), 2: 100% (serving)"


def test_weights_and_endpoints_read_as_text_not_python_reprs():
    assert weights_text({"4": 100, "3": 0}) == "3: 0%, 4: 100%" and weights_text({}) == "none"
    text = endpoints_text({"openai": "http://127.0.0.1:1/v1", "metrics": "http://127.0.0.1:1/metrics"})
    assert text == "openai `http://127.0.0.1:1/v1`, metrics `http://127.0.0.1:1/metrics`"
    assert "{" not in text and "'" not in text
