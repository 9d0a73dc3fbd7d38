"""model-lifecycle: announce → materialize ∥ image → package → [provision → health → traffic →
verify → promote] → retire → cleanup.

Started by the ``model-lifecycle`` deployment's trigger on the event ``modelops.model.announced``
(prefect.yaml), or in-process by ``modelops announce --local``.

The bracketed stages run in one Prefect transaction while the model's rollout lock is held: if
any of them fails, the transaction rolls back, and the ``on_rollback`` hooks of the stages that
finished undo them in reverse (the traffic stage restores the weights it found, the provision
stage stops the instance it started). Only after the commit are replaced versions retired.

Every stage emits ``modelops.stage.<stage>.completed|failed`` and the run publishes artifacts with
stable keys (tasks/observe.py); a crashed run is resumed by announcing again (the registry knows
what was started).
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.logging import get_logger
from prefect.states import Completed
from prefect.transactions import transaction

from flows.shell import failure_cause, locked_rollout, report_failure

from modelops.manifest import Manifest
from tasks.cleanup import cleanup_task
from tasks.health import health_task, verify_route_task
from tasks.image import build_runtime_image_task
from tasks.materialize import materialize_task
from tasks.observe import (
    Stages,
    endpoints_text,
    publish_rollout_report,
    publish_versions_table,
    rollout_report,
    weights_text,
)
from tasks.package import package_task
from tasks.provision import provision_task
from tasks.provision.task import stop_unserved_instances
from tasks.traffic.promote import promote_task
from tasks.traffic.retire import retire_replaced_task
from tasks.traffic.rollout import rollout_task
from tasks.traffic.undo import rollback_incomplete
from tasks.validate import nothing_to_do, record_failure_task, validate_task

__all__ = ["model_lifecycle"]


# Stages whose failure marks the version failed: after validation recorded it, before the
# rollout committed. A lock timeout leaves it alone (another run of it may hold the lock).
_RECORDED = ("materialize", "image", "package", "rollout_lock", "provision", "health", "traffic", "promote", "verify")
_TRANSACTION = ("provision", "health", "traffic", "promote", "verify")


def _ended_early(flow, flow_run, state) -> None:
    """on_cancellation hook (Prefect's runner runs it after it stops the run's process): a run
    cancelled between provision and commit ran no transaction rollback, so the instance it
    started would keep running for nobody, its version ``provisioning`` for ever: stop it and
    mark the version failed (:func:`~tasks.provision.task.stop_unserved_instances`; a version
    with router weight is left to ``modelops rollback``). A crashed run is not cleaned up: announcing
    it again resumes it on the instance it started (docs/operations.md)."""
    manifest = (flow_run.parameters or {}).get("manifest")
    if isinstance(manifest, Manifest):
        manifest = manifest.model_dump()
    if not isinstance(manifest, dict) or not manifest.get("model_id") or manifest.get("version") is None:
        return
    # The hook runs in state Cancelling (or Cancelled): either way the run was cancelled.
    why = f"flow run {flow_run.name or flow_run.id} was cancelled before the version served"
    try:
        stop_unserved_instances(manifest["model_id"], str(manifest["version"]), why)
    except Exception:  # noqa: BLE001 - a hook must not hide the run's own end
        get_logger(__name__).exception("could not stop the instances of %s %s after %s", manifest["model_id"],
                                       manifest["version"], why)


@flow(name="model-lifecycle", log_prints=True, flow_run_name="{manifest.model_id}-{manifest.version}",
      on_cancellation=[_ended_early])
def model_lifecycle(manifest: Manifest, announcement_id: str = ""):
    """Take an announced model version to serving traffic behind the router.

    Args:
        manifest: the announcement (validated by Prefect against :class:`Manifest`).
        announcement_id: the announcing event's id, so ``modelops announce --wait`` can find this run.

    Returns:
        a Completed state whose message says what happened, or Failed naming the stage and cause
        (the same line heads the ``rollout-<model_id>`` report).
    """
    model_id, version = manifest.model_id, manifest.version
    stages = Stages(model_id, version)
    traffic: dict = {}
    try:
        with stages.run("validate"):
            announced = validate_task(manifest)
        if announced.nothing_to_do:
            publish_rollout_report(model_id, version, rollout_report(model_id, version, stages,
                                                                     outcome=announced.nothing_to_do))
            return Completed(message=announced.nothing_to_do)
        # Pre-materialization: the weights move while the runtime image is built or probed.
        started = time.monotonic()
        weights_future = materialize_task.submit(manifest)
        image_future = build_runtime_image_task.submit()
        with stages.run("materialize", started=started) as row:
            weights = weights_future.result()
            row["detail"] = f"{weights.path} ({weights.transferred / 1e6:.1f} MB transferred)"
        with stages.run("image", started=started) as row:
            image = image_future.result()
            row["detail"] = f"runtime {image.lock_hash} (vLLM {image.pin.vllm}, tritonserver {image.pin.tritonserver})"
        with stages.run("package"):
            package = package_task(manifest, weights.path, image)
        with locked_rollout(stages, model_id):
            done = nothing_to_do(manifest)  # a run of the same version may have finished while we waited
            if done:
                get_run_logger().info(done)
                publish_rollout_report(model_id, version, rollout_report(model_id, version, stages, outcome=done))
                return Completed(message=done)
            with transaction():
                with stages.run("provision") as row:
                    instance, endpoints = provision_task(package, image)
                    row["detail"] = f"{instance}: {endpoints.openai}"
                publish_versions_table(model_id, f"provisioning {version}")
                with stages.run("health"):
                    health_task(package, endpoints)
                with stages.run("traffic") as row:
                    traffic = rollout_task(manifest, package, image)
                    row["detail"] = f"{traffic['strategy']}: weights {weights_text(traffic['weights'])}" + \
                        "".join(f"; {judged}" for judged in _shadow_steps(traffic))
                publish_versions_table(model_id, f"traffic to {version}")
                default = traffic["strategy"] != "versioned"
                if traffic["strategy"] == "versioned" and manifest.promote:
                    with stages.run("promote"):
                        traffic["promoted"] = promote_task(model_id, version)
                    default = True
                with stages.run("verify") as row:
                    row["detail"] = verify_route_task(model_id, version, manifest.task, default,
                                                      manifest.execution_mode == "separate")
            warnings = _after_commit(stages, model_id, version, traffic)  # still under the lock
    except Exception as e:
        failed, cause = failure_cause(stages, e, "lifecycle")
        if failed in _TRANSACTION and (problem := rollback_incomplete(model_id, version)):
            cause += f"; ROLLBACK INCOMPLETE: {problem}; fix it with `modelops rollback {model_id}`"
        # A red-black that rolled itself back has recorded why; one whose rollback failed has not.
        if failed in _RECORDED and getattr(getattr(e, "report", None), "outcome", "") != "rolled-back":
            record_failure_task(manifest, failed, str(e))
        return report_failure(model_id, version, stages, cause, table_note=f"failed {failed} of {version}",
                              outcome="failed", strategy=traffic.get("strategy", ""), why=traffic.get("reason", ""),
                              rollout=getattr(getattr(e, "report", None), "__dict__", None) or traffic.get("rollout"))
    weights = weights_text(traffic["weights"])
    msg = (f"{model_id} version {version} is serving ({traffic['strategy']}; weights {weights}) "
           f"via instance {instance}") + "".join(f"; {s}" for s in (*_shadow_steps(traffic), *warnings))
    publish_versions_table(model_id, f"rollout of {version}")
    publish_rollout_report(model_id, version, rollout_report(
        model_id, version, stages, outcome="completed", cause=msg, strategy=traffic["strategy"],
        why=traffic.get("reason", ""), rollout=traffic.get("rollout"),
        notes=[f"endpoints: {endpoints_text(endpoints.as_dict())}", f"announcement: {announcement_id or '-'}"]))
    return Completed(message=msg)


def _shadow_steps(traffic: dict) -> list[str]:
    """What a red-black's shadow step judged (``shadow: N copies in N s, ...``), for the stage's
    line and the run's message; empty without one."""
    return [st["gate"]["judged"] for st in (traffic.get("rollout") or {}).get("steps", [])
            if st.get("phase") == "shadow"]


def _after_commit(stages: Stages, model_id: str, version: str, traffic: dict) -> list[str]:
    """Retire what a red-black replaced, then sweep idle versions. The new version serves
    already: a failure here is reported as a warning (the cleanup cron retries), never as a
    failed rollout."""
    warnings = []
    steps = [("retire", lambda: retire_replaced_task(model_id, version, traffic["replaced"]))] \
        if traffic.get("replaced") else []
    steps.append(("cleanup", lambda: cleanup_task(model_id, lock=False)))  # we hold the lock
    for name, step in steps:
        try:
            with stages.run(name) as row:
                done = step()
                row["detail"] = f"retired {done}" if done else "nothing to retire"
        except Exception as e:
            warnings.append(f"{name} failed (the cleanup-idle-versions schedule retries it): {e}")
            get_run_logger().warning(warnings[-1])
    return warnings
