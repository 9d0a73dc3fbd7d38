"""runtime.engine.logits: vLLM V1 BatchUpdate bookkeeping (ConstraintRows) and the request config.

A model of vLLM's persistent batch (gpu_input_batch.py: added requests fill the lowest removed
index, then condense() moves rows from the end into holes, then reordering swaps) drives
ConstraintRows with real-shaped BatchUpdates; after every update and every decode step each
row's native mask must equal a fresh replay of that request's history with the reference engine.
Requests come and go, get preempted and resume with the same list, a copy, or a shorter one.
"""

from __future__ import annotations

import enum
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelops_native import (
    ConstraintBatch,
    ConstraintSpecError,
    compile_constraint,
    new_bitmask,
)

from runtime.engine.logits import END_NOW, ConstraintRows, constraint_spec, validate_constraint
from tests.unit.native_strategies import spec as spec_strategy

EOS = 0


class Move(enum.Enum):  # stands in for vllm's MoveDirectionality (compared by name)
    UNIDIRECTIONAL = 1
    SWAP = 2


class Req:
    def __init__(self, spec: dict | None, vocab: int) -> None:
        raw = None if spec is None else json.dumps(spec) if len(str(spec)) % 2 else spec  # both forms
        self.params = SimpleNamespace(extra_args=None if raw is None else {"constraint": raw},
                                      all_stop_token_ids={EOS}, eos_token_id=EOS)
        self.history: list[int] = []
        if spec is None:
            self.ref = None
        else:
            try:
                self.ref = compile_constraint(spec, vocab, engine="reference").program
            except ConstraintSpecError:
                self.ref = compile_constraint(END_NOW, vocab, engine="reference").program  # what the engine falls back to

    def allowed(self, vocab: int) -> set[int]:
        if self.ref is None:
            return set(range(vocab))
        s = self.ref.initial()
        for t in self.history:
            s = self.ref.step(s, t)
        return self.ref.allowed(s, (EOS,))


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]).tolist())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_follow_vllm_batch_updates(data):
    vocab = data.draw(st.integers(3, 50), label="vocab")
    batch = ConstraintBatch(vocab, data.draw(st.integers(1, 2)))
    rows = ConstraintRows(batch, lambda raw: compile_constraint(constraint_spec({"constraint": raw}), vocab),
                          lambda p: sorted(p.all_stop_token_ids), compile_constraint(END_NOW, vocab))
    slots: list[Req] = []
    waiting: list[Req] = []

    def new_request() -> Req:
        kind = data.draw(st.integers(0, 5))
        if kind == 0:
            return Req(None, vocab)  # unconstrained request in the same batch
        if kind == 1:
            return Req({"type": "literal", "tokens": [vocab + 3]}, vocab)  # passes no engine check: id > vocab
        return Req(data.draw(spec_strategy(vocab)), vocab)

    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        # -- one scheduler step: removed → added → moved -----------------------------------------
        removed = sorted(data.draw(st.sets(st.sampled_from(range(len(slots))), max_size=3)) if slots else [],
                         reverse=True)
        holes = sorted(removed)
        for i in removed:
            req = slots[i]
            if data.draw(st.booleans()):  # preempted: comes back later with some history
                how = data.draw(st.sampled_from(["same", "copy", "shorter"]))
                if how == "copy":
                    req.history = list(req.history)
                elif how == "shorter":
                    req.history = req.history[:data.draw(st.integers(0, len(req.history)))]
                waiting.append(req)
        occupied = {i: r for i, r in enumerate(slots) if i not in removed}
        added = []
        for _ in range(data.draw(st.integers(0, 3))):
            req = waiting.pop(0) if waiting and data.draw(st.booleans()) else new_request()
            idx = holes.pop(0) if holes else max([*occupied, *(a[0] for a in added), -1]) + 1
            occupied[idx] = req
            added.append((idx, req.params, None, req.history))
        size = len(occupied)
        moved = []
        for hole in sorted(i for i in range(size) if i not in occupied):  # condense from the end
            last = max(occupied)
            occupied[hole] = occupied.pop(last)
            moved.append((last, hole, Move.UNIDIRECTIONAL))
        slots = [occupied[i] for i in range(size)]
        if size >= 2 and data.draw(st.booleans()):
            a, b = data.draw(st.sampled_from(range(size))), data.draw(st.sampled_from(range(size)))
            if a != b:
                slots[a], slots[b] = slots[b], slots[a]
                moved.append((a, b, Move.SWAP))
        update = SimpleNamespace(batch_size=size, removed=removed, added=added, moved=moved)
        rows.update(update if (removed or added or moved) else None)
        _check(batch, slots, vocab)
        # -- the forward pass samples one token per row (masked) -----------------------------------
        for req in slots:
            choices = sorted(req.allowed(vocab) - {EOS})
            if choices and data.draw(st.integers(0, 4)):
                req.history.append(data.draw(st.sampled_from(choices)))
        rows.update(None)
        _check(batch, slots, vocab)
    assert rows.active == {i for i, r in enumerate(slots) if r.ref is not None}


def _check(batch: ConstraintBatch, slots: list[Req], vocab: int) -> None:
    if not slots:
        return
    mask = batch.fill(new_bitmask(len(slots), vocab), len(slots))
    for i, req in enumerate(slots):
        assert _allowed(mask[i], vocab) == req.allowed(vocab), (i, req.history)


def test_constraint_config_forms_and_errors():
    spec = {"type": "literal", "tokens": [4]}
    assert constraint_spec({"constraint": spec}) == spec
    assert constraint_spec({"constraint": json.dumps(spec)}) == spec  # the vllm_xargs form
    assert constraint_spec({"other": 1}) is None and constraint_spec(None) is None
    with pytest.raises(ConstraintSpecError, match=r"^extra_args.constraint: is a string but not valid JSON"):
        constraint_spec({"constraint": "{nope"})
    with pytest.raises(ConstraintSpecError, match=r"^extra_args.constraint: must be an object"):
        constraint_spec({"constraint": [1, 2]})
    with pytest.raises(ConstraintSpecError) as e:
        validate_constraint({"constraint": {"type": "sequence", "parts": [spec, {"type": "repeat", "item": spec,
                                                                                  "min": 1, "max": "3"}]}})
    assert e.value.field == "extra_args.constraint.parts[1].max"
    with pytest.raises(ConstraintSpecError) as e:  # ambiguous, found without knowing the vocabulary
        validate_constraint({"constraint": {"type": "repeat", "min": 1, "max": 2,
                                            "item": {"type": "catalog", "items": [[4], [4, 4]]}}})
    assert e.value.field == "extra_args.constraint"
    validate_constraint({"constraint": {"type": "catalog", "texts": ["red shoe"]}})  # needs the tokenizer later
    with pytest.raises(ConstraintSpecError, match=r"texts\[1\]: must be a string"):
        validate_constraint({"constraint": {"type": "catalog", "texts": ["a", 3]}})


def test_a_row_that_cannot_start_ends_and_the_batch_goes_on():
    vocab = 16
    batch = ConstraintBatch(vocab, 1)
    rows = ConstraintRows(batch, lambda raw: compile_constraint(constraint_spec({"constraint": raw}), vocab),
                          lambda p: sorted(p.all_stop_token_ids), compile_constraint(END_NOW, vocab))
    good, bad = Req({"type": "literal", "tokens": [3, 4]}, vocab), Req({"type": "literal", "tokens": [5]}, vocab)
    bad.history = [5, "x"]  # unreadable: the native add refuses it
    good.history = [3]
    rows.update(SimpleNamespace(batch_size=2, removed=[], added=[(0, good.params, None, good.history),
                                                                 (1, bad.params, None, bad.history)], moved=[]))
    mask = batch.fill(new_bitmask(2, vocab), 2)
    assert _allowed(mask[0], vocab) == {4} and _allowed(mask[1], vocab) == {EOS}  # row 1 ends at once
    good.history.append(4)
    rows.update(None)  # later syncs do not raise
    assert _allowed(batch.fill(new_bitmask(2, vocab), 2)[0], vocab) == {EOS}
