"""restore: after a restart of the local stack, serve again every version that was serving.

``modelops down`` stops every instance and records the versions that were serving as
``stopped``, keeping their router weights. ``modelops up`` calls
:func:`restore_stopped`: each stopped version is provisioned again from its sealed package on
this runtime and health-checked (the same checks a rollout runs), then it is ``serving`` again
with the weight it had, and the router gets every route in one apply. Nothing is announced again.
A version that cannot come back (its package or its weights on FSx are gone, its package was
built for another runtime, its instance fails) is ``failed`` at weight 0, with the reason, and
reported. Each version comes back with one instance and the autoscaler brings it to its policy's
``min``; a version whose policy is ``min: 0`` comes back at zero (its package, weights and runtime
checked, no instance): the router holds its first request while the autoscaler starts one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from modelops.artifacts import check_package_runtime, sealed_package
from modelops.errors import ModelopsError
from modelops.registry import Registry
from modelops.settings import Settings, get_settings

__all__ = ["Restored", "restore_stopped", "stop_serving_instances"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """One stopped version after :func:`restore_stopped`: ``ok``, its ``weight`` and, when it is
    not serving again, ``reason``."""

    model_id: str
    version: str
    weight: int
    ok: bool
    reason: str = ""


def stop_serving_instances(settings: Settings | None = None, say: Callable[[str], None] = log.info) -> None:
    """Stop every instance (each drained, all at once). Versions that were serving become
    ``stopped`` with their weights kept, so :func:`restore_stopped` can bring them back; a
    draining one (being replaced) is retired, one still provisioning is failed (announcing it
    again resumes it).

    Raises:
        ProvisionError: an instance could not be stopped (every other one was; the versions are
            marked all the same).
    """
    from tasks import backends

    settings = settings or get_settings()
    registry = Registry(settings.registry)
    provider = backends.provider(settings, registry)
    try:
        provider.stop_each((inst.name for inst in registry.instances()), say)
    finally:
        _mark_stopped(registry)


def _mark_stopped(registry: Registry) -> None:
    """The versions' states once their instances are stopped (see stop_serving_instances)."""
    for v in registry.versions():
        if v.state == "serving":
            registry.set_state(v.model_id, v.version, "stopped",
                               f"stack stopped (modelops down) at weight {v.weight}; modelops up serves it again")
        elif v.state == "draining":
            registry.set_weights(v.model_id, {v.version: 0})
            registry.set_state(v.model_id, v.version, "retired", "stack stopped (modelops down) while it drained")
        elif v.state == "provisioning":
            registry.set_state(v.model_id, v.version, "failed", "stack stopped (modelops down) during its rollout; "
                               "announce it again")


def restore_stopped(settings: Settings | None = None, say: Callable[[str], None] = log.info) -> list[Restored]:
    """Serve every ``stopped`` version again (see the module docstring), then apply the routes.

    Returns:
        one :class:`Restored` per stopped version, in registry order.
    """
    from tasks.health import check_instance
    from tasks.image import build_runtime_image
    from tasks.materialize import COMPLETION_RECORD
    from tasks import backends
    from tasks.traffic.interface import commit_routes

    settings = settings or get_settings()
    registry = Registry(settings.registry)
    stopped = [v for v in registry.versions() if v.state == "stopped"]
    if not stopped:
        return []
    image = build_runtime_image(settings)
    provider = backends.provider(settings, registry)
    out: list[Restored] = []
    for v in stopped:
        name = f"{v.model_id} {v.version}"
        package = sealed_package(settings, v.model_id, v.version)
        weights = settings.fsx_dir / v.model_id / v.version / COMPLETION_RECORD
        try:
            if package is None:
                raise ModelopsError(f"its sealed package ({settings.packages_dir / v.model_id / v.version}) is gone")
            if not weights.is_file():
                raise ModelopsError(f"its weights on FSx ({weights.parent}) are gone")
            check_package_runtime(package, image.lock_hash)
            if v.manifest.scaling.min == 0:
                instance = "no instance (scaling.min 0: the first request starts one)"
            else:
                say(f"{name}: starting an instance from its package (weight {v.weight}) ...")
                instance, endpoints = provider.ensure_instance(package, image)
                check_instance(package, endpoints)
        except ModelopsError as e:
            reason = f"not served again after the restart: {' '.join(str(e).split())}; announce it again"
            registry.set_weights(v.model_id, {v.version: 0})  # not routed: no weight may claim otherwise
            registry.set_state(v.model_id, v.version, "failed", reason)
            provider.stop_each(inst.name for inst in registry.instances(v.model_id, v.version))
            say(f"{name}: {reason}")
            out.append(Restored(v.model_id, v.version, v.weight, False, reason))
            continue
        registry.set_state(v.model_id, v.version, "serving", f"served again after the restart (weight {v.weight})")
        say(f"{name}: serving again on {instance} (weight {v.weight})")
        out.append(Restored(v.model_id, v.version, v.weight, True))
    commit_routes(registry, backends.router(settings))
    return out
