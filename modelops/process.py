"""Process helpers shared by the local stack and the local provider."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["file_lock", "free_ports", "pid_alive", "stop_process_group"]


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder) for the body: serializes
    processes on one host or one shared file system; the kernel releases it if the holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


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


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free at the time of the call, chosen below the
    kernel's ephemeral range: a port released by ``bind(0)`` can be taken by any outgoing
    connection before the server that wants it binds it (seen: tritonserver's gRPC port taken
    while a router and a load generator were opening connections)."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(10000, max(10001, low - 1))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports
