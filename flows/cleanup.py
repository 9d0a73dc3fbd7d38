"""cleanup-idle-versions: the scheduled sweep (cron in prefect.yaml)."""

from __future__ import annotations

from prefect import flow

from tasks.cleanup import cleanup_task

__all__ = ["cleanup_idle_versions"]


@flow(name="cleanup-idle-versions")
def cleanup_idle_versions(idle_after_s: float = 600.0) -> list[tuple[str, str]]:
    """Retire every model's versions idle for ``idle_after_s`` seconds, keeping the latest."""
    return cleanup_task(None, idle_after_s)
