"""The small flows a global rollout runs on each region's work pool, besides the regional
lifecycle and rollback (tasks/regions.py deploys one of each per region):

- ``materialize-weights``: the weights onto the region's FSx, at announce time, in every region
  at once (the lifecycle's own materialize stage then finds them there);
- ``bake-version``: after a wave, the version watched in its region for the plan's bake time.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed

from modelops.errors import ModelopsError
from modelops.manifest import Manifest
from tasks.materialize import materialize_task
from tasks.traffic.rollout import bake

__all__ = ["bake_version", "materialize_weights"]


@flow(name="materialize-weights", log_prints=True, flow_run_name="{manifest.model_id}-{manifest.version}")
def materialize_weights(manifest: Manifest):
    """Materialize ``manifest``'s weights onto this region's FSx root (verified, resumable).

    Returns:
        Completed naming the folder and the bytes moved, or Failed with the cause."""
    try:
        weights = materialize_task(manifest)
    except Exception as e:  # noqa: BLE001 - reported as the run's end, for the global flow to read
        return Failed(message=f"materialize failed: {e}")
    return Completed(message=f"{weights.path} ({weights.transferred / 1e6:.1f} MB transferred)")


@flow(name="bake-version", log_prints=True, flow_run_name="{model_id}-{version}-bake")
def bake_version(model_id: str, version: str, seconds: float):
    """Watch ``version`` of ``model_id`` serving in this region for ``seconds``
    (:func:`tasks.traffic.rollout.bake`).

    Returns:
        Completed with the window's requests and error ratio, or Failed naming why."""
    try:
        result = bake(model_id, version, seconds)
    except ModelopsError as e:
        return Failed(message=f"bake failed: {e}")
    seen = f"{result.requests_new} requests, error ratio {result.error_ratio:.3f}"
    get_run_logger().info("bake of %s %s: %s", model_id, version, seen)
    if not result.passed:
        return Failed(message=f"bake failed: {result.reason}")
    return Completed(message=f"baked {seconds:g} s: {seen}")
