"""cleanup: retire versions that no longer take default traffic, always keeping the latest.

A version is idle when it is draining (weight 0, replaced by a rollout) for at least
``idle_after_s``. Retiring stops its instances and removes it from the router; the newest
serving version of each model is never touched.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import task

from modelops.registry import Registry
from modelops.settings import get_settings
from tasks.provision.local import LocalProvider
from tasks.traffic.haproxy import HAProxyRouter
from tasks.traffic.interface import routes_from_registry

__all__ = ["cleanup_idle_versions", "cleanup_task", "idle_versions"]


def idle_versions(registry: Registry, idle_after_s: float, model_id: str | None = None) -> list[tuple[str, str]]:
    """``[(model_id, version)]`` of draining versions idle for ``idle_after_s`` seconds,
    excluding each model's newest serving version."""
    now = datetime.now(UTC)
    out = []
    by_model: dict[str, list] = {}
    for v in registry.versions(model_id):
        by_model.setdefault(v.model_id, []).append(v)
    for mid, versions in by_model.items():
        serving = [v for v in versions if v.state == "serving"]
        latest = serving[-1].version if serving else None
        for v in versions:
            updated = v.updated_at if v.updated_at.tzinfo else v.updated_at.replace(tzinfo=UTC)
            if v.state == "draining" and v.weight == 0 and v.version != latest and (now - updated).total_seconds() >= idle_after_s:
                out.append((mid, v.version))
    return out


def cleanup_idle_versions(idle_after_s: float = 600.0, model_id: str | None = None) -> list[tuple[str, str]]:
    """Retire idle versions (see :func:`idle_versions`); return what was retired."""
    settings = get_settings()
    registry = Registry(settings.registry)
    targets = idle_versions(registry, idle_after_s, model_id)
    if not targets:
        return []
    for mid, version in targets:
        registry.set_state(mid, version, "retired", f"idle for ≥ {idle_after_s:.0f} s")
    HAProxyRouter(settings).apply(routes_from_registry(registry))  # off the router before stopping
    provider = LocalProvider(settings, registry)
    for mid, version in targets:
        for inst in registry.instances(mid, version):
            provider.stop(inst.name)
    return targets


@task(name="cleanup", retries=1, retry_delay_seconds=5, timeout_seconds=300, tags=["modelops"])
def cleanup_task(model_id: str | None = None, idle_after_s: float = 600.0) -> list[tuple[str, str]]:
    """Prefect task around :func:`cleanup_idle_versions`."""
    from prefect import get_run_logger

    retired = cleanup_idle_versions(idle_after_s, model_id)
    get_run_logger().info("cleanup: retired %s" if retired else "cleanup: nothing idle to retire%s",
                          retired or "")
    return retired
