"""What the flows that move a model's traffic share (lifecycle, rollback): the rollout lock as a
stage, and one way to report a failed run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from prefect import get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed, State

from tasks.lock import rollout_lock
from tasks.observe import Stages, publish_rollout_report, publish_versions_table, rollout_report

__all__ = ["failure_cause", "locked_rollout", "report_failure"]


@contextmanager
def locked_rollout(stages: Stages, model_id: str) -> Iterator[None]:
    """Hold ``model_id``'s rollout lock for the block, taken in the ``rollout_lock`` stage (which
    records the wait; the holder is this flow run). Raises what :func:`tasks.lock.rollout_lock`
    raises when the lock is not had in time."""
    with ExitStack() as lock:
        with stages.run("rollout_lock"):
            lock.enter_context(rollout_lock(model_id, holder=f"flow run {flow_run.get_id() or 'local'}",
                                            on_wait=get_run_logger().info))
        yield


def failure_cause(stages: Stages, error: BaseException, default_stage: str) -> tuple[str, str]:
    """``(the stage that failed, "<stage> failed: <error on one line>")``; ``default_stage`` when
    the error came from outside any stage."""
    failed = (stages.failed or {"stage": default_stage})["stage"]
    return failed, f"{failed} failed: {' '.join(str(error).split())}"


def report_failure(model_id: str, version: str, stages: Stages, cause: str, *, table_note: str, outcome: str,
                   **report) -> State:
    """Log ``cause``, publish the model's versions table (``table_note``) and the rollout report
    (``outcome``, ``cause`` and the ``report`` fields of :func:`tasks.observe.rollout_report`);
    returns the Failed state the flow ends in."""
    get_run_logger().error(cause)
    publish_versions_table(model_id, table_note)
    publish_rollout_report(model_id, version, rollout_report(model_id, version, stages, outcome=outcome, cause=cause,
                                                             **report))
    return Failed(message=cause)
