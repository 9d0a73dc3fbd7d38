import contextlib

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
        "framework": "vllm", "execution_mode": "embedded",
        "endpoints": {"m-1-1": {"openai": "http://127.0.0.1:1/v1"}}, "pids": {"m-1-1": 123},
        "instances": {"m-1-1": {"state": "running", "restarts": 0, "last_exit": ""}},
        "scaling": {"min": 1, "max": 1, "target": None, "scale_up_window_s": 10.0, "scale_down_window_s": 120.0},
        "last_scale": None}]}]}
    registry.update_instance("m-1-1", state="stopped")
    assert registry.status()["models"][0]["versions"][0]["endpoints"] == {}


def test_status_shows_the_latest_scale_decision_of_each_version(registry):
    registry.record_announcement(parse_manifest({**M, "task": "generate", "scaling": {
        "max": 3, "target": {"waiting": 2}}}))
    first = registry.record_scale("m", "1", 1, 2, "waiting", 4.5, "waiting 4.5 per instance against target 2")
    registry.finish_scale(first, "done", 61.2)
    second = registry.record_scale("m", "1", 2, 3, "waiting", 6.0, "waiting 6 per instance against target 2")
    registry.finish_scale(second, "failed", 3.0, "instance m-1-3 exited during startup; next try in 30 s")
    (version,) = registry.status()["models"][0]["versions"]
    assert version["scaling"]["target"] == {"waiting": 2.0} and version["scaling"]["max"] == 3
    last = version["last_scale"]
    assert (last["before"], last["after"], last["outcome"], last["seconds"]) == (2, 3, "failed", 3.0)
    assert last["detail"] == "instance m-1-3 exited during startup; next try in 30 s"
    assert [d.outcome for d in registry.scale_decisions("m")] == ["failed", "done"]
    with pytest.raises(KeyError, match="no scale decision 99"):
        registry.finish_scale(99, "done", 1.0)


def test_bad_weight_and_state_rejected(registry):
    registry.record_announcement(parse_manifest(M))
    with pytest.raises(ValueError, match="0..100"):
        registry.set_weights("m", {"1": 101})
    with pytest.raises(ValueError, match="state must be one of"):
        registry.set_state("m", "1", "running")
    with pytest.raises(KeyError, match="not in the registry"):
        registry.set_state("m", "9", "serving")


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_rollout_lock_same_host_is_judged_by_pid(registry):
    import os

    me = os.getpid()
    assert registry.try_lock_rollout("m", "run-a", me, host="node-1") == ""
    held = registry.try_lock_rollout("m", "run-b", 1, host="node-1")
    assert held.startswith(f"run-a (pid {me} on node-1, since ")
    assert registry.try_lock_rollout("m", "run-a", me, host="node-1") == ""  # the same holder again: a no-op
    # the same name from another process (a `cleanup (pid N)` in another pod) is another holder
    assert registry.try_lock_rollout("m", "run-a", me, host="node-2").startswith("run-a (pid ")
    registry.unlock_rollout("m", "run-b", host="node-1", pid=1)  # not the holder: no effect
    assert registry.try_lock_rollout("m", "run-b", 1, host="node-1") != ""
    registry.unlock_rollout("m", "run-a", host="node-1", pid=me)
    assert registry.try_lock_rollout("m", "run-c", _dead_pid(), host="node-1") == ""
    # run-c's process is gone: on its own host that is enough to take the lock over at once
    assert registry.try_lock_rollout("m", "run-d", me, host="node-1") == ""


def test_rollout_lock_other_host_is_judged_by_its_lease(registry):
    from modelops.registry import RolloutLock

    # Another pod's pid may not exist here, or may be one of ours: only its heartbeat counts.
    a = {"host": "pod-a", "pid": _dead_pid()}
    assert registry.try_lock_rollout("m", "run-a", a["pid"], host="pod-a") == ""
    assert registry.try_lock_rollout("m", "run-b", 1, host="pod-b", lease_s=60).startswith("run-a (pid ")
    assert registry.renew_rollout_lock("m", "run-a", **a)
    assert not registry.renew_rollout_lock("m", "run-b", host="pod-b", pid=1)
    assert not registry.renew_rollout_lock("m", "run-a")  # this process is not run-a's
    with registry.session() as s:
        s.get(RolloutLock, "m").renewed_at -= 61  # run-a missed its lease
    assert registry.try_lock_rollout("m", "run-b", 1, host="pod-b", lease_s=60) == ""
    assert not registry.renew_rollout_lock("m", "run-a", **a)  # the old holder learns it lost the lock
    with registry.session() as s:
        row = s.get(RolloutLock, "m")
        assert (row.holder, row.host) == ("run-b", "pod-b")


def test_a_stale_lock_is_taken_over_once(registry, monkeypatch):
    """Two contenders both judge the holder dead; the compare-and-swap lets one of them in."""
    import threading

    from modelops import process

    assert registry.try_lock_rollout("m", "crashed", _dead_pid(), host="h") == ""
    both_read = threading.Barrier(2)

    def slow_pid_alive(pid: int) -> bool:
        both_read.wait(timeout=10)  # each has read the stale row before either writes
        return False

    monkeypatch.setattr(process, "pid_alive", slow_pid_alive)
    results: dict[str, str] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, registry.try_lock_rollout("m", n, 1,
                                                                                                   host="h")))
               for n in ("run-a", "run-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results.values()) == ["", "another rollout (it took over the stale lock first)"], results


def test_registry_of_an_older_schema_gets_the_new_lock_columns(tmp_path):
    import sqlite3

    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE rollout_locks (model_id VARCHAR(63) NOT NULL PRIMARY KEY, holder VARCHAR(128) "
                     "NOT NULL, pid INTEGER NOT NULL, acquired_at DATETIME NOT NULL)")
        conn.execute("INSERT INTO rollout_locks VALUES ('m', 'old-run', 1, '2026-01-01 00:00:00')")
    registry = Registry(f"sqlite:///{db}")
    Registry(f"sqlite:///{db}")  # a second process on the new schema changes nothing
    assert registry.try_lock_rollout("m", "new-run", 1, host="h").startswith("old-run (pid 1 on ?")  # kept
    with sqlite3.connect(db) as conn:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(rollout_locks)")]
        # an older modelops, which does not know the new columns, can still take a lock
        conn.execute("INSERT INTO rollout_locks (model_id, holder, pid, acquired_at) VALUES "
                     "('m2', 'older', 2, '2026-01-01 00:00:00')")
    assert {"host", "renewed_at"} <= set(cols)


def test_registry_of_an_older_schema_gets_the_instance_restart_columns(tmp_path):
    import sqlite3

    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:  # instances as modelops wrote them before supervisors
        conn.execute("CREATE TABLE instances (id INTEGER NOT NULL PRIMARY KEY, version_id INTEGER NOT NULL, "
                     "name VARCHAR(128) NOT NULL UNIQUE, state VARCHAR(16) NOT NULL, pid INTEGER, "
                     "endpoints_json TEXT NOT NULL, log_path TEXT NOT NULL, created_at DATETIME NOT NULL)")
        conn.execute("INSERT INTO instances VALUES (1, 1, 'm-1-1', 'running', 42, '{}', '', '2026-01-01 00:00:00')")
    registry = Registry(f"sqlite:///{db}")
    registry.update_instance("m-1-1", state="restarting", restarts=1, last_exit="exit status 70: engine died")
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT state, restarts, last_exit FROM instances WHERE name = 'm-1-1'").fetchone()
        # an older modelops, which does not know the new columns, can still record an instance
        conn.execute("INSERT INTO instances (id, version_id, name, state, endpoints_json, log_path, created_at) "
                     "VALUES (2, 1, 'm-1-2', 'starting', '{}', '', '2026-01-01 00:00:00')")
        older = conn.execute("SELECT restarts, last_exit FROM instances WHERE name = 'm-1-2'").fetchone()
    assert row == ("restarting", 1, "exit status 70: engine died") and older == (0, "")


def test_a_file_that_is_no_database_is_named_before_sqlalchemy_opens_it(tmp_path):
    import os
    import sqlite3

    from modelops.errors import RegistryError
    from modelops.registry import sqlite_problem

    db = tmp_path / "registry.db"
    db.write_bytes(b"")  # empty: SQLite makes its database in it
    made = Registry(f"sqlite:///{db}")
    assert sqlite_problem(f"sqlite:///{db}") is None and made.versions() == []
    made._engine.dispose()  # the last connection checkpoints the WAL into the file
    assert sqlite_problem(f"sqlite:///{db}") is None  # now a real one
    assert sqlite_problem(f"sqlite:///{tmp_path / 'not-made-yet.db'}") is None
    assert sqlite_problem("postgresql://u@h/db") is None
    cut = tmp_path / "cut.db"
    cut.write_bytes(db.read_bytes()[:4096])
    assert "cannot be read as a database (database disk image is malformed)" in sqlite_problem(f"sqlite:///{cut}")
    garbage = tmp_path / "garbage.db"  # checked on a process's first Registry() of a URL, as it is migrated
    garbage.write_bytes(b"{}\n" * 10)
    with pytest.raises(RegistryError, match=r"garbage\.db is not a SQLite database \(it begins b'\{\}\\n\{\}\\n"):
        Registry(f"sqlite:///{garbage}")
    # Never opened (a FIFO would block the command for good), named for what it is.
    os.mkfifo(tmp_path / "fifo.db")
    (tmp_path / "dir.db").mkdir()
    (tmp_path / "gone.db").symlink_to(tmp_path / "nowhere" / "x.db")
    assert sqlite_problem(f"sqlite:///{tmp_path / 'fifo.db'}").endswith(
        "fifo.db is not a regular file: remove or rename it, or set MODELOPS_HOME to another folder")
    assert "dir.db is a folder" in sqlite_problem(f"sqlite:///{tmp_path / 'dir.db'}")
    assert "gone.db is a link to " in sqlite_problem(f"sqlite:///{tmp_path / 'gone.db'}")
    # Another program's database is refused and left byte for byte as it was (the engine's first
    # connection would have switched it to WAL, and create_all added the registry's tables).
    other = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(other)) as c:
        c.execute("CREATE TABLE foo (x)")
        c.commit()
    before = other.read_bytes()
    with pytest.raises(RegistryError, match=r"another program's database \(tables: foo\), not a modelops registry"):
        Registry(f"sqlite:///{other}")
    assert other.read_bytes() == before and sorted(p.name for p in tmp_path.glob("other.db*")) == ["other.db"]


def test_a_database_error_is_one_line_with_the_way_out(tmp_path):
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import DBAPIError

    from modelops.registry import database_problem

    db = tmp_path / "registry.db"
    Registry(f"sqlite:///{db}")
    readonly = create_engine(f"sqlite:///file:{db}?mode=ro&uri=true")
    with pytest.raises(DBAPIError) as refused, readonly.begin() as c:
        c.execute(text("CREATE TABLE x (y)"))
    said = database_problem(f"sqlite:///{db}", refused.value)
    assert said == (f"the registry {db} failed: attempt to write a readonly database: modelops writes to it and to "
                    "its folder (SQLite's journal): fix their permissions, or set MODELOPS_HOME")
