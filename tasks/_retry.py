"""Retry policy shared by the lifecycle tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelops.errors import ManifestError

__all__ = ["retry_unless", "retry_unless_bad_input"]


def retry_unless(*permanent: type[BaseException]) -> Callable[[Any, Any, Any], bool]:
    """A Prefect ``retry_condition_fn`` that retries any failure except the ``permanent`` types,
    which fail the same way on every attempt."""

    def condition(task: Any, task_run: Any, state: Any) -> bool:
        try:
            state.result()
        except permanent:
            return False
        except Exception:
            return True
        return True

    return condition


# A ManifestError fails the same way on every attempt; retrying only delays the message the
# model developer needs.
retry_unless_bad_input = retry_unless(ManifestError)
