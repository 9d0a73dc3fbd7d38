"""EngineWatch on real processes: a child of this test named like Triton's Python backend stub
(prctl PR_SET_NAME), stopped, continued, left as a zombie with an exit code, killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from runtime.frontend.engine_watch import EngineWatch, describe_exit, proc_state

# The child renames itself as tritonserver's stubs are named (comm is cut at 15 characters).
STUB = ("import ctypes, sys, time\n"
        "ctypes.CDLL('libc.so.6').prctl(15, b'triton_python_backend_stub', 0, 0, 0)\n"
        "print('up', flush=True)\n"
        "line = sys.stdin.readline()\n"
        "sys.exit(int(line or 0))\n")


@pytest.fixture
def stub():
    proc = subprocess.Popen([sys.executable, "-c", STUB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _until(watch: EngineWatch, kind: str, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while (state := watch.check()).kind != kind and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def test_a_stub_that_exits_with_a_code_is_dead_and_judged_deterministic(stub):
    watch = EngineWatch(os.getpid())
    assert watch.check().kind == "alive" and watch.stubs == [stub.pid]
    stub.stdin.write("3\n")
    stub.stdin.flush()
    state = _until(watch, "dead")  # not reaped: a zombie whose exit status /proc still holds
    assert state.kind == "dead" and not state.transient
    assert state.cause.endswith(f"(Triton's Python backend stub, pid {stub.pid}) ended: exit code 3")
    assert watch.check() is state  # dead stays dead
    assert stub.wait() == 3


def _exit(proc, code: int) -> None:
    proc.stdin.write(f"{code}\n")
    proc.stdin.flush()
    while (proc_state(proc.pid) or ("Z",))[0] != "Z":
        time.sleep(0.02)


def test_a_stub_that_exits_0_while_loading_is_triton_s_own_doing_and_forgotten(stub):
    auto_complete = subprocess.Popen([sys.executable, "-c", STUB], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
    try:
        assert auto_complete.stdout.readline().strip() == "up"
        watch = EngineWatch(os.getpid())
        assert watch.check().kind == "alive" and watch.stubs == sorted([stub.pid, auto_complete.pid])
        _exit(auto_complete, 0)  # loading: Triton ends the stub that ran auto_complete_config
        assert watch.check().kind == "alive" and watch.stubs == [stub.pid]
        watch.beating = True  # the instance turned ready: the zombie left from loading is no death
        assert watch.check().kind == "alive" and watch.stubs == [stub.pid]
        _exit(stub, 3)
        assert watch.check().cause.endswith(f"pid {stub.pid}) ended: exit code 3")
    finally:
        auto_complete.wait()


def test_a_stub_that_exits_0_once_serving_is_dead(stub):
    watch = EngineWatch(os.getpid())
    assert watch.check().kind == "alive"
    watch.beating = True
    _exit(stub, 0)
    state = watch.check()
    assert state.kind == "dead" and state.cause.endswith("ended: exit code 0")


def test_a_stub_killed_from_outside_is_dead_and_judged_transient(stub):
    watch = EngineWatch(os.getpid())
    assert watch.check().kind == "alive"
    os.kill(stub.pid, signal.SIGKILL)
    state = _until(watch, "dead")
    assert (state.kind, state.transient) == ("dead", True) and state.cause.endswith("ended: killed by SIGKILL")


def test_a_stopped_stub_is_stalled_until_continued(stub):
    watch = EngineWatch(os.getpid())
    assert watch.check().kind == "alive"
    os.kill(stub.pid, signal.SIGSTOP)
    state = _until(watch, "stalled")
    assert state.kind == "stalled" and "is stopped" in state.cause and not state.serving
    os.kill(stub.pid, signal.SIGCONT)
    assert _until(watch, "alive").kind == "alive"


def test_a_stale_heartbeat_is_a_stall_only_once_the_engine_served(stub, tmp_path):
    beat = tmp_path / "engine-heartbeat"
    beat.touch()
    old = time.time() - 10
    os.utime(beat, (old, old))
    watch = EngineWatch(os.getpid(), beat, stall_s=4)
    assert watch.check().kind == "alive"  # still loading: no beats expected yet
    watch.beating = True
    state = watch.check()
    assert state.kind == "stalled" and state.cause == "the engine loop made no progress for 10 s (wedged)"
    beat.touch()
    assert watch.check().kind == "alive"


def test_no_stub_yet_is_starting_and_counts_as_serving():
    watch = EngineWatch(os.getpid())
    state = watch.check()
    assert (state.kind, state.serving) == ("starting", True) and watch.stubs == []


@pytest.mark.parametrize("status, words, transient", [
    (3 << 8, "exit code 3", False), (0, "exit code 0", False), (signal.SIGSEGV, "killed by SIGSEGV", False),
    (signal.SIGTERM, "killed by SIGTERM", True), (None, "its exit status is unknown (already reaped)", False)])
def test_exit_statuses_are_described_in_words(status, words, transient):
    assert describe_exit(status) == (words, transient)


def test_proc_state_of_a_gone_process_is_none():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert proc_state(proc.pid) is None
    assert proc_state(os.getpid())[0] in "RS"
