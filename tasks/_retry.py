"""Retry policy shared by the lifecycle tasks."""

from __future__ import annotations

from typing import Any

from modelops.errors import ManifestError

__all__ = ["retry_unless_bad_input"]


def retry_unless_bad_input(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry transient failures, never a bad announcement.

    A :class:`ManifestError` will fail the same way on every attempt, so retrying it only
    delays the message the model developer needs.
    """
    try:
        state.result()
    except ManifestError:
        return False
    except Exception:
        return True
    return True
