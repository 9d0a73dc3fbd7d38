"""Retire a version: off the router first, then its instances drained and removed.

The one place a version leaves service: after a red-black or a manual rollback committed
(:func:`retire_replaced`, the flows' ``retire`` stage) and when cleanup finds it idle
(:mod:`tasks.cleanup`).
"""

from __future__ import annotations

import logging

from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.registry import Registry
from tasks import backends
from tasks.traffic.interface import Router, commit_routes

__all__ = ["retire_replaced", "retire_replaced_task", "retire_version"]

log = logging.getLogger(__name__)


def retire_version(registry: Registry, router: Router, model_id: str, version: str, reason: str, *,
                   drain_and_stop) -> None:
    """Mark ``version`` retired (with ``reason``), apply the routes without it, then drain and
    remove each of its instances (``drain_and_stop(instance name)``: SIGTERM, readiness false,
    in-flight requests finished). Off the router before the drain, so no new request (not even
    a version-pinned one) is sent to an instance that is shutting down.

    Raises:
        TrafficError: the router refused the routes (the instances are then left running).
    """
    registry.set_state(model_id, version, "retired", reason)
    commit_routes(registry, router)
    for inst in registry.instances(model_id, version):
        drain_and_stop(inst.name)
    log.info("retired %s %s: %s", model_id, version, reason)


def retire_replaced(model_id: str, new: str, old: list[str], registry: Registry, router: Router, *,
                    drain_and_stop, how: str = "red-black") -> list[str]:
    """After a committed change (``how``: red-black, manual rollback): retire the replaced
    versions that are still draining at weight 0 (:func:`retire_version`); a version that moved
    on since (announced again, promoted) is left alone. Returns the versions retired."""
    done = []
    for v in old:
        row = registry.get_version(model_id, v)
        if row is None or row.state != "draining" or row.weight != 0:
            continue  # moved on since (e.g. announced again): not ours to retire
        retire_version(registry, router, model_id, v, f"replaced by {new} ({how})", drain_and_stop=drain_and_stop)
        done.append(v)
    return done


@task(name="retire_replaced", retries=2, retry_delay_seconds=3, timeout_seconds=600, tags=["modelops"],
      cache_policy=NO_CACHE)
def retire_replaced_task(model_id: str, new: str, replaced: list[str], how: str = "red-black") -> list[str]:
    """After the rollout committed (still under the model's rollout lock): retire the versions
    it replaced, on the settings' backends. Safe to retry: a version already retired is skipped."""
    registry, router, provider = backends.parts()
    return retire_replaced(model_id, new, replaced, registry, router, drain_and_stop=provider.stop, how=how)
