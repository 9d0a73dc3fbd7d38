"""Manual rollback: make an earlier version of a model the default again.

The target is ``to_version``, or else the newest earlier version that did not fail and still
has its sealed package. If it still has running instances (a replaced version not yet retired,
or a versioned deployment), only the router's weights move. If it was retired, it is provisioned
again from its package on the current runtime (the package must have been built for it), health
checked, and then the weights move. The versions that were the default are drained and retired
once the rollback commits.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NO_CACHE

from modelops.artifacts import Package, sealed_package
from modelops.errors import TrafficError
from modelops.registry import LIVE_INSTANCE_STATES, Registry
from modelops.settings import get_settings
from tasks import backends
from tasks.materialize.cache import read_record
from tasks.traffic.undo import restore_snapshot, snapshot_traffic

__all__ = ["RollbackPlan", "plan_rollback", "plan_rollback_task", "reactivate_task"]


@dataclass(frozen=True)
class RollbackPlan:
    """``to``: the version to make the default; ``current``: the versions with weight above 0
    now; ``package``: the target's sealed package when it must be provisioned again (None when it
    has running instances); ``task``: ``embed``, ``generate`` or ``tabular``; ``kserve``: the target
    has no OpenAI face (execution_mode separate), so its route is checked over KServe."""

    model_id: str
    to: str
    current: tuple[str, ...]
    package: Package | None
    task: str
    kserve: bool = False


def plan_rollback(model_id: str, to_version: str | None = None, registry: Registry | None = None) -> RollbackPlan:
    """Choose the rollback target and what it needs.

    Raises:
        TrafficError: the model is unknown, has no default now, the target is the default
            already, failed, or has neither running instances nor a sealed package.
    """

    settings = get_settings()
    registry = registry or Registry(settings.registry)
    versions = registry.versions(model_id)
    if not versions:
        raise TrafficError(f"model {model_id!r} is not in the registry (`modelops status` lists the models)")
    current = tuple(v.version for v in versions if v.state == "serving" and v.weight > 0)
    if not current:
        raise TrafficError(f"{model_id} has no default version now (no serving version with weight above 0); "
                           "nothing to roll back from: `modelops promote` a serving version, or announce one again "
                           "(after `modelops down`, `modelops up` serves the stopped versions again first)")

    provider = backends.provider(settings, registry)

    def live(version: str) -> bool:
        return any(i.state in LIVE_INSTANCE_STATES and provider.is_alive(i) for i in registry.instances(model_id, version))

    def weights_kept(version: str) -> bool:  # an evicted copy cannot be provisioned again from its package
        return read_record(settings.fsx_dir / model_id / version) is not None

    if to_version is None:
        newest_current = max(i for i, v in enumerate(versions) if v.version in current)
        # Only versions that served (a provisioning one never took traffic).
        earlier = [v for v in versions[:newest_current]
                   if v.version not in current and v.state in ("serving", "draining", "retired")]
        candidates = [v for v in reversed(earlier) if live(v.version) or (
            sealed_package(settings, model_id, v.version) and weights_kept(v.version))]
        if not candidates:
            raise TrafficError(f"{model_id}: no earlier version to roll back to (none before {current[-1]} that "
                               "did not fail and still has running instances, or its package and its weights on "
                               "FSx); pass --to VERSION")
        target = candidates[0]
    else:
        target = next((v for v in versions if v.version == to_version), None)
        if target is None:
            raise TrafficError(f"{model_id} has no version {to_version!r}; known: "
                               f"{', '.join(v.version for v in versions)}")
    if target.version in current:
        raise TrafficError(f"{model_id} {target.version} is already the default (weight {target.weight})")
    if target.state == "failed":
        raise TrafficError(f"{model_id} {target.version} failed ({target.reason}); roll back to a version that served")
    if target.state == "provisioning":
        raise TrafficError(f"{model_id} {target.version} never served (it is provisioning); roll back to a version "
                           "that served")
    package = None
    if not live(target.version):
        package = sealed_package(settings, model_id, target.version)
        if package is None:
            raise TrafficError(f"{model_id} {target.version} has no running instance and its package is gone from "
                               f"{settings.packages_dir / model_id / target.version}; announce it again instead")
        if not weights_kept(target.version):
            raise TrafficError(f"{model_id} {target.version} has no running instance and its weights were evicted from "
                               f"the FSx cache ({settings.fsx_dir / model_id / target.version}): `modelops cache pull` "
                               "its manifest first, or announce it again")
    return RollbackPlan(model_id, target.version, current, package, target.manifest.task,
                        target.manifest.execution_mode == "separate")


@task(name="plan_rollback", retries=0, timeout_seconds=60, tags=["modelops"], cache_policy=NO_CACHE)
def plan_rollback_task(model_id: str, to_version: str | None = None) -> RollbackPlan:
    """Prefect task around :func:`plan_rollback`."""
    from prefect import get_run_logger

    plan = plan_rollback(model_id, to_version)
    get_run_logger().info("rollback of %s: %s → %s%s", model_id, ", ".join(plan.current), plan.to,
                          " (provisioned again from its package)" if plan.package else "")
    return plan


@task(name="reactivate", retries=0, timeout_seconds=60, tags=["modelops"], cache_policy=NO_CACHE)
def reactivate_task(model_id: str, version: str) -> None:
    """Mark a version that has a ready instance again as serving (weight 0 until promoted).
    Inside a transaction, its ``on_rollback`` hook puts every version of the model back as it was."""
    from prefect.transactions import get_transaction


    registry = Registry(get_settings().registry)
    if (txn := get_transaction()) is not None:
        txn.set("reactivate_before", (model_id, snapshot_traffic(registry, model_id)))
    registry.set_weights(model_id, {version: 0})
    registry.set_state(model_id, version, "serving", "the default again after a manual rollback")


@reactivate_task.on_rollback
def _undo_reactivate(txn) -> None:
    """Transaction rollback: states and weights as before the rollback began."""

    restore_snapshot(*txn.get("reactivate_before"))
