"""Versioned deployments: move a model's default route to a version that is fully ready.

Each (model_id, version) is its own deployment; consumers pin one with ``X-Model-Version``.
Unpinned requests go to the default version (weight 100). :func:`promote` moves the default in
one weight-only router change, only when every instance of the version is ready (the provider's
:meth:`~tasks.provision.interface.Provider.is_ready`); the
previous default keeps serving pinned traffic (weight 0) until cleanup retires it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from modelops.errors import TrafficError
from modelops.registry import Registry
from modelops.settings import get_settings
from tasks import backends
from tasks.provision.interface import Provider
from tasks.traffic.interface import Router, commit_routes
from tasks.traffic.undo import restore_snapshot, snapshot_traffic

__all__ = ["overlap_instance_hours", "promote", "promote_task"]

log = logging.getLogger(__name__)


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def overlap_instance_hours(registry: Registry, model_id: str, version: str) -> float:
    """Instance-hours during which ``version`` ran beside other serving versions of the model:
    every running instance of the model counted from the moment ``version``'s first instance
    started (the cost of keeping both versions up), up to now."""
    mine = [i for i in registry.instances(model_id, version)]
    if not mine:
        return 0.0
    since = min(_utc(i.created_at) for i in mine)
    now = datetime.now(UTC)
    running = [i for v in registry.versions(model_id) if v.state == "serving"
               for i in registry.instances(model_id, v.version) if i.state == "running"]
    return round(sum((now - max(since, _utc(i.created_at))).total_seconds() for i in running) / 3600, 4)


def promote(model_id: str, version: str, registry: Registry | None = None, router: Router | None = None,
            reason: str | None = None, provider: Provider | None = None) -> dict:
    """Make ``version`` the model's default (weight 100); other serving versions keep pinned traffic.

    ``reason`` is recorded on the previous default (default: "default moved to <version> (promote)").

    Returns:
        ``{"default": version, "previous": [...], "overlap_instance_hours": float}``.

    Raises:
        TrafficError: the version is not serving, or an instance of it is not ready.
    """
    settings = get_settings()
    registry = registry or Registry(settings.registry)
    router = router or backends.router(settings)
    row = registry.get_version(model_id, version)
    if row is None or row.state != "serving":
        state = row.state if row is not None else "not announced"
        raise TrafficError(f"{model_id} {version} is {state}; only a serving version can become the default")
    instances = [i for i in registry.instances(model_id, version) if i.state == "running"]
    if not instances:
        raise TrafficError(f"{model_id} {version} has no running instance")
    provider = provider or backends.provider(settings, registry)
    for inst in instances:
        if not provider.is_ready(inst):
            raise TrafficError(f"{model_id} {version}: instance {inst.name} is not ready; not promoting")
    # Only the previous default (weight > 0) steps down; other versioned deployments are untouched.
    others = [v.version for v in registry.versions(model_id)
              if v.state == "serving" and v.version != version and v.weight > 0]
    registry.set_weights(model_id, {version: 100, **{v: 0 for v in others}})
    for v in others:  # still routed for pinned requests; cleanup retires them once idle
        registry.set_state(model_id, v, "draining", reason or f"default moved to {version} (promote)")
    commit_routes(registry, router)
    hours = overlap_instance_hours(registry, model_id, version)
    log.info("%s: default is now %s (was %s); overlap so far %.4f instance-hours", model_id, version, others, hours)
    return {"default": version, "previous": others, "overlap_instance_hours": hours}


from prefect import task
from prefect.cache_policies import NO_CACHE


# No Prefect retries: inside a transaction a failed attempt rolls the whole transaction back.
@task(name="promote", retries=0, timeout_seconds=600, tags=["modelops"], cache_policy=NO_CACHE)
def promote_task(model_id: str, version: str, reason: str | None = None) -> dict:
    """Prefect task around :func:`promote`. Inside a transaction, its ``on_rollback`` hook puts
    back the states and weights it found."""
    from prefect import get_run_logger
    from prefect.transactions import get_transaction


    registry = Registry(get_settings().registry)
    if (txn := get_transaction()) is not None:
        txn.set("promote_before", (model_id, snapshot_traffic(registry, model_id)))
    result = promote(model_id, version, registry, reason=reason)
    get_run_logger().info("%s: default is now %s (previous: %s)", model_id, version, result["previous"])
    return result


@promote_task.on_rollback
def _undo_promote(txn) -> None:
    """Transaction rollback: the default route as it was before."""

    restore_snapshot(*txn.get("promote_before"))
