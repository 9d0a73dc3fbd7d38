"""The rollout lock (tasks/lock.py) on its registry layer (no Prefect API): held while the body
runs and renewed, released on exit even when the body fails, waited for and then refused naming
its holder, taken over from a dead holder, and refused to all but the experiment's commands while
an experiment runs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from modelops.errors import TrafficError
from modelops.registry import Registry


@pytest.fixture
def lock(home, monkeypatch):
    """tasks.lock on the registry alone, with a short lease; yields (module, registry)."""
    from modelops.settings import get_settings
    from tasks import lock as module

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr(module, "LEASE_S", 0.4)  # renewed every 0.1 s
    return module, Registry(get_settings().registry)


def test_the_lock_is_renewed_while_held_and_released_on_exit(lock):
    from modelops.registry import RolloutLock

    lock, registry = lock
    with lock.rollout_lock("m", "run-a", wait_s=0):
        with registry.session() as s:
            first = s.get(RolloutLock, "m").renewed_at
        time.sleep(0.5)
        with registry.session() as s:
            assert s.get(RolloutLock, "m").renewed_at > first
        with pytest.raises(TrafficError, match="another rollout of m is in progress: run-a"):
            with lock.rollout_lock("m", "run-b", wait_s=0):
                pass
    with registry.session() as s:
        assert s.get(RolloutLock, "m") is None  # released on exit




def test_a_failing_body_still_releases_the_lock(lock):
    lock, registry = lock
    with pytest.raises(RuntimeError, match="provisioning failed"):
        with lock.rollout_lock("m", "run-a", wait_s=0):
            raise RuntimeError("provisioning failed")
    with lock.rollout_lock("m", "run-b", wait_s=0):  # free again
        pass


def test_a_second_holder_waits_for_the_first_then_goes_on(lock):
    lock, registry = lock
    told, order = [], []
    released = threading.Event()

    def first():
        with lock.rollout_lock("m", "run-a", wait_s=0):
            order.append("a in")
            released.wait(5)
            order.append("a out")

    t = threading.Thread(target=first)
    t.start()
    while not order:
        time.sleep(0.01)
    threading.Timer(1.5, released.set).start()
    with lock.rollout_lock("m", "run-b", wait_s=10, on_wait=told.append):
        order.append("b in")
    t.join()
    assert order == ["a in", "a out", "b in"]
    assert len(told) == 1 and told[0].startswith("waiting for the rollout of m held by run-a")  # once, naming it


def test_a_dead_holders_lock_is_taken_over(lock):
    lock, registry = lock
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid of this host that no longer runs
    assert registry.try_lock_rollout("m", "crashed-run", gone.pid) == ""
    with lock.rollout_lock("m", "run-b", wait_s=0):
        assert registry.try_lock_rollout("m", "run-c", os.getpid() + 1_000_000) != ""  # held by run-b now


def test_while_an_experiment_runs_only_its_commands_take_the_lock(lock):
    from modelops.experiments import Arm, ExperimentSpec
    from tests.conftest import parsed_manifest

    lock, registry = lock
    for v in ("1", "2"):
        registry.record_announcement(parsed_manifest(version=v))
        registry.set_state("m", v, "serving")
    registry.start_experiment("m", ExperimentSpec((Arm("1", 50), Arm("2", 50)), "user", "1"))
    with pytest.raises(TrafficError, match="an experiment runs on m .*experiment stop m --keep"):
        with lock.rollout_lock("m", "a rollout", wait_s=0):
            pass
    with lock.rollout_lock("m", "modelops experiment stop", wait_s=0, experiment_ok=True):
        pass
