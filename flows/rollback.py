"""rollback: make an earlier version of a model the default again (the manual ``rollback``
deployment in prefect.yaml; ``modelops rollback MODEL [--to VERSION]``).

Under the model's rollout lock: plan → image (only if the target was retired) → [provision →
health (the same condition) → traffic (default moved) → verify] in one transaction → retire the
versions that were the default. See tasks/traffic/rollback.py for how the target is chosen.
"""

from __future__ import annotations

from prefect import flow
from prefect.states import Completed
from prefect.transactions import transaction

from flows.shell import failure_cause, locked_rollout, report_failure
from modelops.artifacts import check_package_runtime
from tasks.health import health_task, verify_route_task
from tasks.image import build_runtime_image_task
from tasks.observe import Stages, publish_rollout_report, publish_versions_table, rollout_report
from tasks.provision import provision_task
from tasks.traffic.promote import promote_task
from tasks.traffic.rollback import plan_rollback_task, reactivate_task
from tasks.traffic.retire import retire_replaced_task

__all__ = ["rollback_flow"]


@flow(name="rollback", log_prints=True, flow_run_name="rollback-{model_id}")
def rollback_flow(model_id: str, to_version: str | None = None):
    """Roll ``model_id`` back to ``to_version`` (default: the newest earlier version that served).

    Returns:
        Completed naming the new default, or Failed naming the stage and cause; the
        ``rollout-<model_id>`` report and ``versions-<model_id>`` table say the same.
    """
    stages = Stages(model_id, to_version or "?")
    try:
        with locked_rollout(stages, model_id):
            with stages.run("plan") as row:  # under the lock: no rollout moves things meanwhile
                plan = plan_rollback_task(model_id, to_version)
                stages.version = plan.to
                row["detail"] = f"{', '.join(plan.current)} → {plan.to}"
            if plan.package is not None:  # retired: serve it again from its sealed package
                with stages.run("image"):
                    image = build_runtime_image_task()
                    check_package_runtime(plan.package, image.lock_hash)
            with transaction():
                if plan.package is not None:
                    with stages.run("provision") as row:
                        instance, endpoints = provision_task(plan.package, image)
                        row["detail"] = f"{instance}: {endpoints.openai}"
                    with stages.run("health"):
                        health_task(plan.package, endpoints)
                with stages.run("traffic") as row:
                    reactivate_task(model_id, plan.to)
                    promoted = promote_task(model_id, plan.to, reason=f"rolled back to {plan.to}")
                    row["detail"] = f"default {', '.join(promoted['previous'])} → {plan.to}"
                with stages.run("verify") as row:
                    row["detail"] = verify_route_task(model_id, plan.to, plan.task, True, plan.kserve)
            with stages.run("retire"):
                retire_replaced_task(model_id, plan.to, list(plan.current), how="manual rollback")
    except Exception as e:
        failed, cause = failure_cause(stages, e, "rollback")
        return report_failure(model_id, stages.version, stages, cause, table_note=f"failed rollback ({failed})",
                              outcome="rollback failed")
    msg = f"{model_id}: rolled back to {plan.to}; retired {', '.join(plan.current)}"
    publish_versions_table(model_id, f"rollback to {plan.to}")
    publish_rollout_report(model_id, plan.to, rollout_report(model_id, plan.to, stages, outcome="rolled back",
                                                             cause=msg, strategy="rollback",
                                                             why="manual rollback (modelops rollback)"))
    return Completed(message=msg)
