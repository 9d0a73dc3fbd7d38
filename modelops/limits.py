"""What one request may ask of a generative model's engine: the manifest's ``limits:``.

Without bounds, one client's request can hold an engine for minutes: ``n: 16, max_tokens:
2000`` took every sequence slot of a 16-slot engine, and a completions request of 64 long
prompts ran 150 s while other clients' requests timed out behind it. Two bounds, checked on
the instance before the engine sees the request:

- ``max_request_tokens``: the request's total work, ``prompt tokens + n × max_tokens`` summed
  over its prompts (a completions request may send a list; ``max_tokens`` is what the engine
  would generate, vLLM's default of the rest of the context when the request leaves it out). A
  request over it is a 400 naming both numbers. Default: four full contexts
  (``4 × max_model_len``), so a request of one whole context always passes.
- ``max_request_share``: the largest share of the engine's sequence slots (``max_num_seqs``) one
  request may hold at once. ``n`` above it is a 400; the prompts of a list wait for the
  request's own slots (the engine never holds more of them at once), so other clients always
  find free slots. Default 0.5.

The defaults come from the settings (``MODELOPS_MAX_REQUEST_TOKENS``,
``MODELOPS_MAX_REQUEST_SHARE``); a manifest's ``limits`` overrides them for its model. KServe
``generate`` requests get the same bounds (one prompt each).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CONTEXTS_PER_REQUEST", "RequestLimits"]

CONTEXTS_PER_REQUEST = 4
"""The default ``max_request_tokens``, in full contexts of the model (``max_model_len``)."""


class RequestLimits(BaseModel):
    """A model's per-request bounds (see the module docstring); a field left out takes the
    settings' default.

    Fields:
        max_request_tokens: prompt tokens + n × max_tokens over the request's prompts (≥ 1).
        max_request_share: share of ``max_num_seqs`` one request may hold at once (0 < s ≤ 1).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    max_request_tokens: int | None = Field(default=None, ge=1)
    max_request_share: float | None = Field(default=None, gt=0, le=1)
