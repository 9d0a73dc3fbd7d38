"""model-lifecycle: announce → materialize → image → package → provision → health → traffic → cleanup.

Started by the ``model-lifecycle`` deployment's trigger on the event ``modelops.model.announced``
(prefect.yaml), or in-process by ``modelops announce --local``.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed

from modelops.manifest import Manifest
from tasks.cleanup import cleanup_task
from tasks.health import health_task
from tasks.image import build_runtime_image_task
from tasks.materialize import materialize_task
from tasks.package import package_task
from tasks.provision import deprovision_task, provision_task
from tasks.lock import rollout_lock
from tasks.traffic.promote import promote
from tasks.traffic.rollout import RolloutFailed, rollout_task
from tasks.validate import record_failure_task, validate_task

__all__ = ["model_lifecycle"]


def _summary(manifest: Manifest, lines: list[str]) -> None:
    create_markdown_artifact(
        key=f"rollout-{manifest.model_id}",
        markdown=f"# {manifest.model_id} version {manifest.version}\n\n" + "\n".join(f"- {x}" for x in lines),
        description=f"rollout of {manifest.model_id} {manifest.version}",
    )


def _steps_table(rollout: dict) -> str:
    rows = ["| step | gate | requests (new) | errors | p99 new / old (s) |", "|---|---|---|---|---|"]
    for st in rollout.get("steps", []):
        g = st.get("gate") or {}
        rows.append(f"| {st['weight']}% | {'pass' if g.get('passed') else (g.get('reason') or 'not reached')} | "
                    f"{g.get('requests_new', '-')} | {g.get('errors_new', '-')} | {g.get('p99_new_s')} / {g.get('p99_old_s')} |")
    extra = f"\n\nrollback took {rollout['rollback_s']} s" if rollout.get("rollback_s") is not None else ""
    return "red-black steps:\n\n" + "\n".join(rows) + extra


@flow(name="model-lifecycle", log_prints=True, flow_run_name="{manifest.model_id}-{manifest.version}")
def model_lifecycle(manifest: Manifest, announcement_id: str = ""):
    """Take an announced model version to serving traffic behind the router.

    Args:
        manifest: the announcement (validated by Prefect against :class:`Manifest`).
        announcement_id: the announcing event's id, so ``modelops announce --wait`` can find this run.

    Returns:
        a Completed state whose message says what happened, or Failed naming the stage.
    """
    announced = validate_task(manifest)
    if announced.nothing_to_do:
        _summary(manifest, [announced.nothing_to_do])
        return Completed(message=announced.nothing_to_do)
    stage, instance = "materialize", None
    try:
        # Pre-materialization: the weights move while the runtime image is built or probed.
        weights_future = materialize_task.submit(manifest)
        image_future = build_runtime_image_task.submit()
        weights = weights_future.result()
        stage = "build_runtime_image"
        image = image_future.result()
        stage = "package"
        package = package_task(manifest, weights.path, image)
        stage = "rollout_lock"
        # One rollout per model at a time (tasks/lock.py): provisioning through traffic.
        with rollout_lock(manifest.model_id, holder=f"flow run {flow_run.get_id() or 'local'}",
                          on_wait=get_run_logger().info):
            stage = "provision"
            instance, endpoints = provision_task(package, image)
            stage = "health"
            health_task(package, endpoints)
            stage = "shift_traffic"
            traffic = rollout_task(manifest, package, image)
            if traffic["strategy"] == "versioned" and manifest.promote:
                stage = "promote"
                traffic["promoted"] = promote(manifest.model_id, manifest.version)
    except RolloutFailed as e:
        # Already rolled back: the old version has all traffic, the new one was drained.
        _summary(manifest, [f"**rolled back**: {e}", _steps_table(e.report.as_dict())])
        return Failed(message=str(e))
    except Exception as e:
        if instance is not None:
            deprovision_task(instance)
        record_failure_task(manifest, stage, str(e))
        _summary(manifest, [f"**failed at {stage}**: {e}"])
        return Failed(message=f"{stage} failed: {e}")
    retired = cleanup_task(manifest.model_id)
    msg = (f"{manifest.model_id} version {manifest.version} is serving ({traffic['strategy']}, "
           f"weights {traffic['weights']}) via instance {instance}")
    _summary(manifest, [msg, f"strategy {traffic['strategy']}: {traffic.get('reason', '')}",
                        *([_steps_table(traffic["rollout"])] if "rollout" in traffic else []), f"weights on FSx: {weights.path} ({weights.transferred / 1e6:.1f} MB transferred)",
                        f"runtime {image.lock_hash} (vLLM {image.pin.vllm}, tritonserver {image.pin.tritonserver})",
                        f"endpoints: {endpoints.as_dict()}", f"retired: {retired or 'none'}"])
    return Completed(message=msg)
