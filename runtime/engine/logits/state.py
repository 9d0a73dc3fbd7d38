"""Batch bookkeeping between vLLM's persistent batch and the native constraint states.

No vLLM import: ``batch_update`` is duck-typed (``batch_size``, ``removed``, ``added``,
``moved``), the move direction is compared by name, so the same code serves the V1 adapter and
tests with a stand-in.

Assumptions (vLLM V1 ``BatchUpdate``, ``vllm/v1/sample/logits_processor/interface.py``):
* ``update_state`` runs before every forward pass; ``batch_update`` is None when no request
  joined, left or moved, yet histories may still have grown.
* Changes apply in the order removed → added → moved; an added or moved request may replace
  whatever occupied its index.
* ``added`` carries the request's live output-id list: appended in place as tokens are
  sampled, possibly truncated in place, replaced by a new list when a request is re-added
  (after preemption, or when it simply was not scheduled for a step), and under async
  scheduling ending in ``-1`` placeholders until the real ids are known.
* Rows whose prefill is still running in chunks are part of the batch and get masked; the
  token sampled for them is discarded and never reaches the history.

Guarantees:
* A row's state is a function of its history alone: it advances only over ids present in the
  history list (never on ``apply`` having been called), stops at a placeholder, and restarts
  with a replay when the history no longer extends what was consumed (shorter, or a different
  id at the last consumed position). An added request always starts fresh and replays.
* ``active`` is the set of row indices holding a constraint, so ``apply`` can skip batches
  without any.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from modelops_native import Constraint, ConstraintBatch

from runtime.engine.logits.config import EXTRA_ARGS_KEY

__all__ = ["ConstraintRows"]

log = logging.getLogger(__name__)


class ConstraintRows:
    """Applies ``BatchUpdate`` messages to a :class:`ConstraintBatch`.

    Args:
        batch: the native row states.
        compile: the raw ``extra_args["constraint"]`` (spec dict or JSON string) → :class:`Constraint`,
            cached by the caller; raises ValueError for a bad spec.
        eos_of: sampling params → the ids that end the request (EOS and stop ids).
        fallback: the constraint for a request whose spec failed to compile here (validation in
            the API server cannot see the vocabulary): it accepts the empty output at once, so
            the request ends instead of running unconstrained.
    """

    def __init__(self, batch: ConstraintBatch, compile: Callable[[dict], Constraint],
                 eos_of: Callable[[Any], list[int]], fallback: Constraint) -> None:
        self.batch = batch
        self.compile = compile
        self.eos_of = eos_of
        self.fallback = fallback
        self.active: set[int] = set()
        self.batch_size = 0
        self.resumed = 0  # requests (re-)added with output ids already present: preempted, or unscheduled a while

    def update(self, batch_update: Any | None) -> None:
        """Apply one step's batch changes (removed → added → moved), then catch every row up with
        its history."""
        if batch_update is not None:
            for i in batch_update.removed:
                self.batch.remove(i)
                self.active.discard(i)
            for i, params, _prompt_ids, output_ids in batch_update.added:
                self._add(i, params, output_ids)
            for a, b, direction in batch_update.moved:
                self._move(a, b, getattr(direction, "name", str(direction)) == "SWAP")
            self.batch_size = batch_update.batch_size
        if self.active:
            self.batch.sync()

    def _add(self, i: int, params: Any, output_ids: list[int]) -> None:
        raw = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
        if raw is None:
            self.batch.remove(i)
            self.active.discard(i)
            return
        try:
            constraint = self.compile(raw)
        except ValueError as e:
            log.error("constraint of the request at row %d refused, ending it: %s", i, e)
            constraint = self.fallback
        eos = self.eos_of(params)
        try:
            self.batch.add(i, constraint, eos, output_ids)
        except (ValueError, TypeError, IndexError) as e:
            # The batch keeps no half-added row (ConstraintBatch.add), so the others go on; this
            # request ends at once rather than running unconstrained.
            log.error("constraint of the request at row %d could not start, ending it: %s", i, e)
            self.batch.add(i, self.fallback, eos, None)
        self.active.add(i)
        if output_ids:
            self.resumed += 1

    def _move(self, a: int, b: int, swap: bool) -> None:
        if swap:
            self.batch.swap(a, b)
            in_a, in_b = a in self.active, b in self.active
            self.active.discard(a)
            self.active.discard(b)
            if in_a:
                self.active.add(b)
            if in_b:
                self.active.add(a)
        else:
            self.batch.move(a, b)
            if a in self.active:
                self.active.discard(a)
                self.active.add(b)
            else:
                self.active.discard(b)
