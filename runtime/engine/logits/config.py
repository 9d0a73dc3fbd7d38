"""The per-request constraint config: ``SamplingParams.extra_args["constraint"]``.

Offline: ``SamplingParams(extra_args={"constraint": {...}})`` with the spec dict of
:mod:`modelops_native._spec`. Over HTTP, vLLM's ``vllm_xargs`` only carries flat values, so the
same spec travels as a JSON string: ``"vllm_xargs": {"constraint": "{\\"type\\": \\"catalog\\", ...}"}``.
Both forms are accepted; prefer the string for large specs offline too: vLLM deep-copies
``extra_args`` for every request (about 16 ms for a 500-item catalog of 8-24 tokens on 2 cores),
a string costs nothing to copy and the processor caches compiled specs by its hash. Errors are
``ValueError`` (vLLM answers HTTP 400) whose message starts with the field, e.g.
``extra_args.constraint.parts[1].min: must be [1, ...], got 0``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from modelops_native import ConstraintSpecError, compile_constraint, parse_spec

__all__ = ["END_NOW", "EXTRA_ARGS_KEY", "ROOT", "constraint_spec", "validate_constraint"]

EXTRA_ARGS_KEY = "constraint"
ROOT = f"extra_args.{EXTRA_ARGS_KEY}"
# Accepts the empty output and nothing else: the request ends at once (EOS is its only token).
# What a request gets when its spec passed the API server's check but fails against the model.
END_NOW = {"type": "dfa", "num_states": 1, "accepting": [0], "sets": [], "transitions": []}


def constraint_spec(extra_args: Mapping[str, Any] | None) -> dict | None:
    """The constraint spec dict of a request, or None when it has none.

    Raises:
        ConstraintSpecError: the value is neither an object nor a JSON string holding one.
    """
    if not extra_args or extra_args.get(EXTRA_ARGS_KEY) is None:
        return None
    raw = extra_args[EXTRA_ARGS_KEY]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConstraintSpecError(ROOT, f"is a string but not valid JSON ({e.msg} at position {e.pos})") from e
    if not isinstance(raw, dict):
        raise ConstraintSpecError(ROOT, f"must be an object (or a JSON string of one), got {type(raw).__name__}")
    return raw


def validate_constraint(extra_args: Mapping[str, Any] | None) -> None:
    """Check a request's constraint without the model at hand (``validate_params`` runs in the
    API server): structure and types, then a trial compile against a vocabulary just large enough
    for the ids it names (ambiguity, empty items, DFA determinism and reachability). Ids beyond the
    model's vocabulary are only caught by the engine, which then ends that request at once.

    Raises:
        ConstraintSpecError: naming the field.
    """
    spec = constraint_spec(extra_args)
    if spec is None:
        return
    parsed = parse_spec(spec, root=ROOT)
    if parsed.complete:
        compile_constraint(parsed, max(parsed.max_token() + 1, 1))
