"""Engine liveness: is the process that runs the model alive and making progress?

The engine (vLLM, or a python-backend model) runs inside Triton's Python backend stub, a child
process of tritonserver. Verified here (tritonserver of nvidia-pytriton, 2026-12-01): when the
stub dies, Triton keeps reporting the model ready, never restarts the stub, answers new requests
"Stub process '<model>_0_0' is not healthy", and requests already in the stub never get an
answer. So the frontend watches the stub itself:

- **dead**: a stub is a zombie that failed, or, once the instance served, any stub seen is gone
  or a zombie. The zombie's exit status is read from ``/proc/<pid>/stat`` (field 52,
  ``exit_code``, the waitpid(2) status; proc(5)): tritonserver leaves a dead stub unreaped.
  While the model loads, Triton itself ends a stub (the one that ran ``auto_complete_config``
  exits 0): that is not a death.
- **stalled**: the stub is stopped (state ``T``/``t``: SIGSTOP, a debugger), or, once the
  instance served, its heartbeat file (touched by the vllm backend's engine loop at least every
  0.5 s, ``MODELOPS_ENGINE_HEARTBEAT``) is older than ``stall_s``: the engine loop is wedged.
  A stalled engine recovers by itself when it moves again (SIGCONT).

``/ready`` is 503 and OpenAI requests are answered 503 while the engine is not alive;
runtime/startup.py stops the instance (non-zero exit) once it is dead.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENGINE_STALL_S", "ENGINE_WEDGED_EXIT_S", "EngineState", "EngineWatch", "describe_exit", "proc_state"]

# A wedged engine loop is "stalled" after this many seconds without a heartbeat: the loop beats
# between engine steps, and one step of a CPU test model takes well under 1 s; /ready must turn
# 503 within 5 s of a wedge (polling adds at most POLL_S). A model whose single engine step can
# take longer (a very long prefill on a slow device) needs MODELOPS_ENGINE_STALL_S above it, or
# its instance leaves the router during that step.
ENGINE_STALL_S = float(os.environ.get("MODELOPS_ENGINE_STALL_S", "4"))
# Stalled this long, the engine counts as dead (judged transient): the instance exits 75 and its
# supervisor (the local one, or the kubelet) starts it again. A SIGSTOP drill of 30 s recovers.
ENGINE_WEDGED_EXIT_S = 60.0
POLL_S = 0.25
_STUB_COMM = "triton_python_b"  # comm is cut at 15 characters: triton_python_backend_stub


def proc_state(pid: int) -> tuple[str, int | None] | None:
    """``(state letter, exit status or None)`` of ``pid`` from ``/proc/<pid>/stat``, or None when
    the process is gone. The exit status (waitpid(2) encoding) is only meaningful for a zombie
    (state ``Z``); kernels before 3.5 lack the field (None)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    # fields[0] is field 3 (state); field 52 (exit_code) is fields[49].
    status = int(fields[49]) if len(fields) > 49 else None
    return fields[0], status


def describe_exit(status: int | None) -> tuple[str, bool]:
    """How a process ended, from its waitpid(2) status: ``(words, transient)``. ``transient`` is
    the judgement whether starting it again may help: killed by SIGKILL or SIGTERM from outside
    (the kernel's OOM killer, an operator) may be; an exit code of its own choosing or a crash
    (SIGSEGV, SIGABRT, ...) repeats the same way."""
    if status is None:
        return "its exit status is unknown (already reaped)", False
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}", False
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}", sig in (signal.SIGKILL, signal.SIGTERM)
    return f"wait status {status}", False


def _children(pid: int) -> list[int]:
    """Child pids of ``pid``: ``/proc/<pid>/task/<tid>/children`` lists the children each
    thread forked (tritonserver forks its stubs from a worker thread, not the main one)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class EngineState:
    """``kind``: ``starting`` (no stub seen yet), ``alive``, ``stalled`` or ``dead``;
    ``cause``: one line saying why when not alive; ``transient``: for ``dead``, whether a
    restart may help (:func:`describe_exit`)."""

    kind: str
    cause: str = ""
    transient: bool = False

    @property
    def serving(self) -> bool:
        return self.kind in ("starting", "alive")


class EngineWatch:
    """Watches the Python backend stub(s) of one tritonserver.

    Args:
        triton_pid: tritonserver's pid (the stubs are its children).
        heartbeat: the file the vllm backend's engine loop touches (absent for python-backend
            models: then only death and stopped processes are seen).
        stall_s: heartbeat age (seconds) that counts as a wedged engine, once ``beating`` is set.
    """

    def __init__(self, triton_pid: int, heartbeat: Path | None = None, stall_s: float = ENGINE_STALL_S) -> None:
        self.triton_pid, self.heartbeat, self.stall_s = triton_pid, heartbeat, stall_s
        self.stubs: list[int] = []
        self.beating = False  # set once the engine has served: loading is not a stall
        self.state = EngineState("starting")

    def check(self) -> EngineState:
        """Look once (a few /proc reads); the result is also kept in :attr:`state`."""
        if self.state.kind == "dead":
            return self.state  # a dead stub is never restarted by Triton
        loading = not self.beating
        if loading or not self.stubs:
            # While the model loads, Triton starts and ends stubs of its own (the one that runs
            # auto_complete_config exits 0 before the instance's stub starts): look afresh.
            self.stubs = sorted(c for c in _children(self.triton_pid) if _comm(c).startswith(_STUB_COMM))
            if not self.stubs:
                self.state = EngineState("starting")
                return self.state
        for pid in list(self.stubs):
            seen = proc_state(pid)
            if seen is None or seen[0] in ("Z", "X"):
                status = seen[1] if seen else None
                if loading and not status:
                    self.stubs.remove(pid)  # ended by Triton while loading (exit 0, or reaped at once)
                    continue
                how, transient = describe_exit(status)
                self.state = EngineState("dead", f"the engine process (Triton's Python backend stub, pid {pid}) "
                                                 f"ended: {how}", transient)
                return self.state
            if seen[0] in ("T", "t"):
                self.state = EngineState("stalled", f"the engine process (pid {pid}) is stopped (SIGSTOP or a "
                                                    "debugger); it serves again once continued")
                return self.state
        if self.beating and self.heartbeat is not None:
            try:
                age = time.time() - self.heartbeat.stat().st_mtime
            except OSError:
                age = 0.0
            if age > self.stall_s:
                self.state = EngineState("stalled", f"the engine loop made no progress for {age:.0f} s (wedged)")
                return self.state
        self.state = EngineState("alive")
        return self.state

