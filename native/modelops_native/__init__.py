"""modelops_native: per-request token constraints as batched, multithreaded bitmask masks.

A constraint (catalog of token sequences, token DFA, or a sequence/repeat of those; spec format
in :mod:`modelops_native._spec`) is compiled once per content hash (:func:`compile_constraint`)
and shared. A :class:`ConstraintBatch` keeps one automaton state per batch row, derived only from
the row's token history:

    batch = ConstraintBatch(vocab_size)
    batch.add(row, compile_constraint(spec, vocab_size), eos=[eos_id], history=output_ids)
    batch.sync()                              # catch up with tokens appended to the histories
    batch.fill(bitmask, num_rows)             # int32 [rows, ceil(V/32)], parallel, GIL released
    batch.apply_(logits, bitmask, num_rows)   # -inf where the bit is 0, in place

EOS ids are allowed exactly when the state accepts. A row whose history already broke the rule
(it cannot happen through these masks) is "dead" and allows only EOS. If a history stops
extending what the state consumed (shorter, or a different token at the last consumed
position), the row restarts and replays it.

Errors: :class:`ConstraintSpecError` (a ``ValueError``) names the bad field.
"""

from modelops_native._native import (
                                     NATIVE,
                                     Constraint,
                                     ConstraintBatch,
                                     ConstraintCache,
                                     apply_bitmask_torch_,
                                     backend,
                                     compile_constraint,
                                     default_threads,
                                     new_bitmask,
)
from modelops_native._spec import ConstraintSpecError, ProgramSpec, parse_spec

__all__ = ["NATIVE", "Constraint", "ConstraintBatch", "ConstraintCache", "ConstraintSpecError", "ProgramSpec",
           "apply_bitmask_torch_", "backend", "compile_constraint", "default_threads", "new_bitmask", "parse_spec"]
