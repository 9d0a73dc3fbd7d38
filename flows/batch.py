"""batch-inference: one flow run per batch (the ``batch-inference`` deployment in prefect.yaml;
the batch API starts it when a batch is created, and again to resume one whose runner went
silent: tasks/batch/api.py)."""

from __future__ import annotations

import json

from prefect import flow
from prefect.states import Cancelled, Failed

from modelops.batch import TERMINAL
from modelops.batch_store import BatchStore
from modelops.registry import Registry
from modelops.settings import Settings
from tasks.batch.run import BatchOutcome, run_batch_task

__all__ = ["batch_inference"]


@flow(name="batch-inference", log_prints=True, flow_run_name="{batch_id}")
def batch_inference(batch_id: str):
    """Answer batch ``batch_id``'s lines and write its output and error files. The run ends
    Completed with the :class:`BatchOutcome`, Failed or Cancelled as the batch did.

    A failure past the task's retries marks the batch ``failed`` with the cause (a batch already
    ended keeps its status).
    """
    try:
        outcome = run_batch_task(batch_id)
    except Exception as e:
        store = BatchStore(Registry(Settings().registry))
        batch = store.batch(batch_id)
        if batch is not None and batch.status not in TERMINAL:
            store.update(batch_id, status="failed", runner="", errors_json=json.dumps(
                {"object": "list", "data": [{"code": "batch_failed", "message": f"{type(e).__name__}: {e}"[:2000],
                                             "param": None, "line": None}]}))
        raise
    # The run's state says how the batch ended, as the UI lists runs: failed and cancelled too.
    batch = BatchStore(Registry(Settings().registry)).batch(batch_id)
    if outcome.status == "failed":
        return Failed(message=f"batch {batch_id} failed: {batch.errors_json if batch else ''}"[:2000])
    if outcome.status == "cancelled":
        return Cancelled(message=f"batch {batch_id} cancelled after {batch.completed if batch else '?'} lines")
    return outcome
