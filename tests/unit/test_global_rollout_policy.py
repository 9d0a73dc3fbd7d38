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
