"""Undo a traffic change: snapshot a model's versions before it, restore them after a failure.

The lifecycle's and rollback's transactions call these from their ``on_rollback`` hooks
(:mod:`tasks.traffic.rollout`, :mod:`tasks.traffic.promote`, :mod:`tasks.traffic.rollback`);
:func:`rollback_incomplete` checks afterwards that the router agrees with the registry.
"""

from __future__ import annotations

import logging

from modelops.registry import Registry
from tasks import backends
from tasks.traffic.interface import Router, commit_routes

__all__ = ["restore_snapshot", "restore_traffic", "rollback_incomplete", "snapshot_traffic"]

log = logging.getLogger(__name__)

Snapshot = dict[str, tuple[str, int]]
"""``{version: (state, weight)}`` of every version of a model."""


def snapshot_traffic(registry: Registry, model_id: str) -> Snapshot:
    """``{version: (state, weight)}`` of every version of the model, for :func:`restore_traffic`."""
    return {v.version: (v.state, v.weight) for v in registry.versions(model_id)}


def restore_traffic(model_id: str, new: str | None, before: Snapshot, registry: Registry, router: Router, *,
                    drain_and_stop, reason: str) -> None:
    """Undo a traffic change: every version in ``before`` (read before the change) gets back its
    state and weight, except ``new`` (the version that was rolled out, None for a pure default
    move), which gets weight 0 and state failed; the router is re-applied (weights only), then
    ``new``'s instances are drained and removed (``drain_and_stop(instance name)``).

    Raises:
        TrafficError: the router refused the restored routes.
    """
    others = {v: sw for v, sw in before.items() if v != new}
    registry.set_weights(model_id, {**({new: 0} if new else {}), **{v: w for v, (_, w) in others.items()}})
    now = {v.version: v.state for v in registry.versions(model_id)}
    for v, (state, _) in others.items():
        if now.get(v) != state:  # unchanged versions keep their recorded reason
            registry.set_state(model_id, v, state)  # type: ignore[arg-type]
    if new:
        registry.set_state(model_id, new, "failed", reason)
    commit_routes(registry, router)
    log.warning("traffic of %s restored to %s: %s", model_id, {v: w for v, (_, w) in others.items()}, reason)
    if new:
        for inst in registry.instances(model_id, new):
            drain_and_stop(inst.name)
        commit_routes(registry, router)


def restore_snapshot(model_id: str, before: Snapshot) -> None:
    """Put every version of the model back to its ``(state, weight)`` in ``before`` (a default
    move undone: nothing is failed or drained), on the settings' backends. Raises TrafficError as
    :func:`restore_traffic`."""
    registry, router, provider = backends.parts()
    restore_traffic(model_id, None, before, registry, router, drain_and_stop=provider.stop, reason="")


def rollback_incomplete(model_id: str, version: str) -> str:
    """After a transaction's rollback: ``""`` when the router agrees with the registry about
    ``version`` (no router weight on its servers while the registry gives it 0, and no weight on
    a version that is not serving), else what is still wrong."""
    registry, router, _ = backends.parts()
    row = registry.get_version(model_id, version)
    if row is None:
        return ""
    if row.weight > 0 and row.state != "serving":
        return f"the registry still gives {version} weight {row.weight} ({row.state})"
    if row.weight == 0 and router.is_running():
        names = {i.name for i in registry.instances(model_id, version)}
        live = {n: w for (m, n), w in router.weights().items() if m == model_id and n in names and w > 0}
        if live:
            return f"the router still sends {version} traffic ({live}) though the registry gives it weight 0"
    return ""
