"""cleanup: retire versions that no longer take traffic, always keeping the latest.

A version is a candidate when it is draining (weight 0: replaced by a rollout, or no longer the
default after a promote). It is idle when the router has counted no request to any of its
servers (HAProxy ``stot``, default and version-pinned backends) for ``idle_after_s``: each run
records the counters in ``<home>/run/traffic-counters.json`` and when they last moved. A version
never seen by a cleanup run counts from when it was replaced. Never retired: the newest serving
version of a model, a version with weight above 0 (the default).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from prefect import task

from modelops.errors import TrafficError
from modelops.registry import Registry
from modelops.settings import get_settings
from tasks import backends
from tasks.traffic.interface import Router
from tasks.traffic.retire import retire_version

log = logging.getLogger(__name__)

__all__ = ["cleanup_idle_versions", "cleanup_task", "idle_versions", "last_traffic_from_router"]


def idle_versions(registry: Registry, idle_after_s: float, model_id: str | None = None,
                  last_traffic: dict[tuple[str, str], datetime] | None = None) -> list[tuple[str, str]]:
    """``[(model_id, version)]`` of draining versions with weight 0 and no traffic for
    ``idle_after_s`` seconds, excluding each model's newest routed version.

    Args:
        last_traffic: when the router last counted a request for ``(model_id, version)``; a
            version missing here counts from when it was replaced (its registry update time).
    """
    now = datetime.now(UTC)
    last_traffic = last_traffic or {}
    out = []
    by_model: dict[str, list] = {}
    for v in registry.versions(model_id):
        by_model.setdefault(v.model_id, []).append(v)
    for mid, versions in by_model.items():
        routed = [v for v in versions if v.state in ("serving", "draining")]
        latest = routed[-1].version if routed else None  # the newest version still routed
        for v in versions:
            updated = v.updated_at if v.updated_at.tzinfo else v.updated_at.replace(tzinfo=UTC)
            seen = last_traffic.get((mid, v.version), updated)
            if v.state == "draining" and v.weight == 0 and v.version != latest and \
                    (now - max(seen, updated)).total_seconds() >= idle_after_s:
                out.append((mid, v.version))
    return out


def last_traffic_from_router(registry: Registry, router: Router, state_file: Path) -> dict[tuple[str, str], datetime]:
    """When each version last had a request at the router: its servers' request counters now,
    compared with those recorded by the previous run (kept in ``state_file``)."""
    now = datetime.now(UTC)
    try:
        previous = json.loads(state_file.read_text())
    except (OSError, ValueError):
        previous = {}
    current: dict[str, dict] = {}
    for v in registry.versions():
        if v.state not in ("serving", "draining"):
            continue
        key = f"{v.model_id}/{v.version}"
        try:
            counts = router.server_requests(v.model_id)
        except (OSError, TrafficError):
            if key in previous:  # unknown now: keep what was known, never treat it as new
                current[key] = previous[key]
            continue
        total = sum(counts.get(i.name, 0) for i in registry.instances(v.model_id, v.version, live=False))
        before = previous.get(key)
        if before is None:
            last = ""  # first sight: count from when it was replaced
        elif before["requests"] != total:
            last = now.isoformat()  # traffic since the previous run (or a router reload reset it)
        else:
            last = before["last_traffic"]
        current[key] = {"requests": total, "last_traffic": last}
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(current, indent=1, sort_keys=True))
    return {tuple(k.split("/", 1)): datetime.fromisoformat(c["last_traffic"])  # type: ignore[misc]
            for k, c in current.items() if c["last_traffic"]}


def cleanup_idle_versions(idle_after_s: float = 600.0, model_id: str | None = None, *,
                          lock: bool = True) -> list[tuple[str, str]]:
    """Retire idle versions (see :func:`idle_versions`); return what was retired.

    With ``lock`` (the default; False only for a caller that holds the model's rollout lock
    already), a model whose rollout lock is held by a rollout is skipped this time.
    """
    from contextlib import ExitStack

    from tasks.lock import rollout_lock

    settings = get_settings()
    registry, router, provider = backends.parts(settings)
    last = last_traffic_from_router(registry, router, settings.run_dir / "traffic-counters.json") \
        if router.is_running() else {}
    retired = []
    for mid in sorted({m for m, _ in idle_versions(registry, idle_after_s, model_id, last)}):
        with ExitStack() as held:
            if lock:
                try:
                    held.enter_context(rollout_lock(mid, holder=f"cleanup (pid {os.getpid()})", wait_s=0))
                except TrafficError as e:
                    log.info("cleanup: skipping %s this time: %s", mid, e)
                    continue
            # Under the lock, the candidates again: a rollout may have changed them meanwhile.
            targets = idle_versions(registry, idle_after_s, mid, last)
            for _, version in targets:
                retire_version(registry, router, mid, version, f"idle for ≥ {idle_after_s:.0f} s",
                               drain_and_stop=provider.stop)
            retired += targets
    return retired


@task(name="cleanup", retries=1, retry_delay_seconds=5, timeout_seconds=300, tags=["modelops"])
def cleanup_task(model_id: str | None = None, idle_after_s: float = 600.0, lock: bool = True) -> list[tuple[str, str]]:
    """Prefect task around :func:`cleanup_idle_versions`."""
    from prefect import get_run_logger

    retired = cleanup_idle_versions(idle_after_s, model_id, lock=lock)
    get_run_logger().info("cleanup: retired %s" if retired else "cleanup: nothing idle to retire%s",
                          retired or "")
    return retired
