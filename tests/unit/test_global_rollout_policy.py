"""What a failed wave does to the regions a global rollout changed before it (flows/global_rollout.py
``on_failure``), with the regional runs recorded instead of started: the integration tests
(tests/integration/test_regions.py) run the real ones."""

from __future__ import annotations

import pytest

from modelops.regions import RegionPlan
from tasks.regions import RegionRun


@pytest.fixture
def runs(monkeypatch):
    """The regional runs `_roll_back` starts, as ``(region, flow, parameters)``; region "r3"'s
    rollback fails."""
    import flows.global_rollout as g

    started = []

    def region_run(plan, region, flow, parameters, key=""):
        started.append((region, flow, parameters))
        state = "FAILED" if region == "r3" else "COMPLETED"
        return RegionRun(region, flow, state, "rollback failed: no package" if state == "FAILED" else "ok")

    monkeypatch.setattr(g, "region_run_task", region_run)
    return started


def _plan(on_failure: str) -> RegionPlan:
    return RegionPlan.model_validate({"regions": [{"name": n, "work_pool": f"p-{n}"} for n in ("r1", "r2", "r3")],
                                      "on_failure": on_failure})


def test_keep_leaves_earlier_waves_on_the_new_version(runs):
    from flows.global_rollout import _after_failure

    said = _after_failure(_plan("keep"), "m", {"r1": "1", "r2": "1"}, ["r1", "r2"], "k", [])
    assert said == "r1, r2 keep the new version (on_failure: keep)" and runs == []


def test_rollback_sends_each_changed_region_back_to_its_earlier_default(runs):
    from flows.global_rollout import _after_failure

    rows: list[dict] = []
    said = _after_failure(_plan("rollback"), "m", {"r1": "1", "r2": None, "r3": "4"}, ["r1", "r2", "r3"], "k", rows)
    assert runs == [("r1", "rollback", {"model_id": "m", "to_version": "1"}),
                    ("r3", "rollback", {"model_id": "m", "to_version": "4"})]
    assert said == ("r1 rolled back to 1; r2 keeps it (it served no earlier version); r3 NOT rolled back (rollback "
                    "failed: no package): run `modelops rollback m` there")
    assert [r["wave"] for r in rows] == ["undo", "undo"]


def test_nothing_changed_before_the_failure_is_said(runs):
    from flows.global_rollout import _after_failure

    assert _after_failure(_plan("rollback"), "m", {}, [], "k", []) == "no other region was changed" and runs == []


@pytest.fixture
def waves(monkeypatch):
    """The global flow's body with its regional runs recorded, as ``(region, flow)``: r1 served the
    version before this run; a bake in a region of ``sour`` fails."""
    import logging

    import flows.global_rollout as g

    started, sour, finished = [], set(), {"r1"}

    class Done:
        def __init__(self, run: RegionRun):
            self.run = run

        def result(self) -> RegionRun:
            return self.run

    def region_run(plan, region, flow, parameters, key=""):
        started.append((region, flow))
        ok = not (flow == "bake-version" and region in sour)
        return RegionRun(region, flow, "COMPLETED" if ok else "FAILED", "ok" if ok else "error ratio 0.4")

    region_run.submit = lambda *a, **k: Done(region_run(*a, **k))
    monkeypatch.setattr(g, "region_run_task", region_run)
    monkeypatch.setattr(g, "load_plan", lambda: RegionPlan.model_validate(
        {"regions": [{"name": n, "work_pool": f"p-{n}"} for n in ("r1", "r2", "r3")], "bake_s": 1}))
    monkeypatch.setattr(g, "check_region_deployments", lambda plan: None)
    monkeypatch.setattr(g, "default_versions", lambda plan, model_id: {"r1": "2", "r2": "1", "r3": "1"})
    monkeypatch.setattr(g, "finished_regions", lambda plan, manifest: set(finished))
    monkeypatch.setattr(g, "publish_markdown", lambda *a, **k: None)
    monkeypatch.setattr(g, "get_run_logger", lambda: logging.getLogger("test"))
    return started, sour, finished


def _run_global():
    from flows.global_rollout import global_rollout
    from modelops import parse_manifest

    return global_rollout.fn(parse_manifest({"model_id": "m", "version": "2", "source": "/w", "task": "embed"}))


def test_a_region_done_before_is_baked_again_before_the_next_wave(waves):
    started, _, _ = waves
    state = _run_global()
    assert state.is_completed(), state.message
    assert [s for s in started if s[1] != "materialize-weights"] == [
        ("r1", "bake-version"), ("r2", "model-lifecycle"), ("r3", "model-lifecycle"),
        ("r2", "bake-version"), ("r3", "bake-version")]
    assert "skipped r1: done before" in state.message


def test_a_region_done_before_that_fails_its_bake_stops_the_waves_and_is_left_as_it_was(waves):
    started, sour, _ = waves
    sour.add("r1")
    state = _run_global()
    assert state.is_failed()
    assert [s for s in started if s[1] != "materialize-weights"] == [("r1", "bake-version")]  # no rollback, no wave 2
    assert "wave 1's bake failed in r1: error ratio 0.4" in state.message
    assert "r1 served 2 before this run: left as it is (`modelops rollback m` there rolls it back)" in state.message


def test_nothing_is_baked_when_every_region_was_done_before(waves):
    started, _, finished = waves
    finished.update({"r2", "r3"})
    state = _run_global()
    assert state.is_completed(), state.message
    assert [s for s in started if s[1] != "materialize-weights"] == []
