"""vLLM V1 logits processor: per-request catalog / DFA / sequence constraints on the native engine.

Enable it in one of three ways: install modelops-native (entry point ``vllm.logits_processors``,
loaded into every generative engine of the environment), ``--logits-processors
runtime.engine.logits.v1:ConstraintLogitsProcessor``, or ``LLM(logits_processors=[ConstraintLogitsProcessor])``.
When the entry point and an explicit registration both load it, the second instance stays idle.
Under async scheduling (GPU) also pass it explicitly: vLLM fills in the ``-1`` placeholders of
the output-id lists before sampling only for processors given that way.

A request opts in with ``SamplingParams(extra_args={"constraint": spec})`` (``vllm_xargs`` over
HTTP, spec as a JSON string; see :mod:`runtime.engine.logits.config`). Per step:

* ``update_state`` — :class:`runtime.engine.logits.state.ConstraintRows` applies removed → added →
  moved and catches each row's state up with its live output-id list;
* ``apply`` — catches up once more (under async scheduling placeholders are replaced between
  ``update_state`` and sampling; it never advances a state on its own account), fills the
  packed bitmask for the batch on the native pool with the GIL released, and writes -inf into
  the logits in place (native kernel on CPU; unpack + ``masked_fill_`` on CUDA).

Model Runner V2 (GPU builds of vLLM >= 0.31; ``vllm.v1.worker.gpu.sample.logits_processor``)
has a different interface: ``add_request(req_idx, sampling_params)`` and ``apply(logits, ctx)``.
Its adapter would be another thin class over the same pieces: ``add_request`` compiles the spec
(same cache) and calls ``ConstraintBatch.add(req_idx, constraint, eos, history)`` with the
request's token-history list from the context (or ``advance`` with the ids the context reports
since the last step); ``apply`` calls ``sync``/``fill``/``apply_`` exactly as below. Nothing in
modelops_native or state.py depends on which runner calls it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from modelops_native import Constraint, ConstraintBatch, compile_constraint
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from runtime.engine.logits.config import (
    END_NOW,
    EXTRA_ARGS_KEY,
    ROOT,
    constraint_spec,
    validate_constraint,
)
from runtime.engine.logits.state import ConstraintRows

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

__all__ = ["ConstraintLogitsProcessor"]

log = logging.getLogger(__name__)

# Specs seen by this engine, by the hash of their JSON: a 100k-item catalog is parsed (and its
# texts tokenized) once, not once per request.
_SPEC_CACHE_ENTRIES = 64

_live: dict[int, weakref.ref] = {}
_live_lock = threading.Lock()


class ConstraintLogitsProcessor(LogitsProcessor):
    """Masks each constrained row to the tokens its constraint allows next (V1 interface)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a malformed ``extra_args["constraint"]`` (called in the API server per request).

        Raises:
            ValueError: the message names the field (HTTP 400).
        """
        validate_constraint(sampling_params.extra_args)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        key = id(vllm_config)
        with _live_lock:
            other = _live.get(key)
            self._idle = other is not None and other() is not None
            if not self._idle:
                _live[key] = weakref.ref(self)
        if self._idle:
            log.info("ConstraintLogitsProcessor registered twice (entry point and explicitly); this one stays idle")
            return
        model = vllm_config.model_config
        self.vocab_size = int(model.get_vocab_size())
        self.device = device
        self._model = model
        self._tokenizer: Any = None
        self._specs: OrderedDict[bytes, Constraint] = OrderedDict()
        self.batch = ConstraintBatch(self.vocab_size)
        fallback = compile_constraint(END_NOW, self.vocab_size)
        self.rows = ConstraintRows(self.batch, self._compile, lambda p: _stop_ids(p, self.vocab_size), fallback)
        max_rows = int(vllm_config.scheduler_config.max_num_seqs)
        words = (self.vocab_size + 31) // 32
        # Pinned on GPU hosts so the host → device copy of the mask is asynchronous.
        pinned = is_pin_memory and torch.device(device).type == "cuda"
        self._mask_t = torch.zeros((max_rows, words), dtype=torch.int32, pin_memory=pinned)
        self.bitmask: np.ndarray = self._mask_t.numpy()
        # CUDA: the host → device copy of the mask is asynchronous; the next fill waits for it.
        self._copied: Any = None

    def is_argmax_invariant(self) -> bool:
        """Masking changes which token is most likely, so greedy requests need it too."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each forward pass with the batch's changes (None: none)."""
        if not self._idle:
            self.rows.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set disallowed tokens of constrained rows to -inf, in place; returns ``logits``."""
        if self._idle or not self.rows.active:
            return logits
        n = logits.shape[0]
        if n > self.bitmask.shape[0]:  # more rows than max_num_seqs: never expected, but stay correct
            self._mask_t = torch.zeros((n, self.bitmask.shape[1]), dtype=torch.int32)
            self.bitmask = self._mask_t.numpy()
        self.batch.sync()
        if self._copied is not None:
            self._copied.synchronize()
        self.batch.fill(self.bitmask, n)
        if logits.device.type == "cpu":
            self.batch.apply_(logits, self.bitmask, n)
        else:
            from modelops_native import apply_bitmask_torch_

            mask = self._mask_t[:n].to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            apply_bitmask_torch_(logits, mask)
        return logits

    # ---- helpers ------------------------------------------------------------------------------

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self._model.tokenizer, trust_remote_code=self._model.trust_remote_code,
                revision=self._model.tokenizer_revision)
        return self._tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _compile(self, raw: dict | str) -> Constraint:
        # Keyed by the raw value: a JSON string (the vllm_xargs form) is hashed as it is, so a
        # repeated large spec costs one hash, not a parse.
        text = raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True, separators=(",", ":"))
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        hit = self._specs.get(key)
        if hit is not None:
            self._specs.move_to_end(key)
            return hit
        spec = constraint_spec({EXTRA_ARGS_KEY: raw})
        c = compile_constraint(spec, self.vocab_size, tokenize=self._tokenize, root=ROOT)
        self._specs[key] = c
        if len(self._specs) > _SPEC_CACHE_ENTRIES:
            self._specs.popitem(last=False)
        return c


def _stop_ids(params: SamplingParams, vocab_size: int) -> list[int]:
    """Ids that end the request: EOS plus stop ids, every one of them (allowed exactly when the
    constraint accepts). Ids outside the model's vocabulary can never be sampled: left out."""
    ids = set(params.all_stop_token_ids or ())
    if params.eos_token_id is not None:
        ids.add(params.eos_token_id)
    return sorted(i for i in ids if 0 <= i < vocab_size)
