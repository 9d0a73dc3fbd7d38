"""Process helpers shared by the local stack and the local provider."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["pid_alive", "stop_process_group"]


def pid_alive(pid: int | None) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def stop_process_group(pid: int, timeout: float = 40.0) -> bool:
    """SIGTERM the group leader ``pid`` (a serving instance then drains: readiness false,
    in-flight requests finished, tritonserver stopped), wait up to ``timeout`` seconds for it
    to exit, then SIGKILL what is left of its process group.

    Returns:
        True if the process existed.
    """
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers of the group (tritonserver, stubs)
    except ProcessLookupError:
        pass
    return True
