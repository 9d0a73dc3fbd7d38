"""The native constraint engine against its plain-Python twin (modelops_native.reference).

Property tests: random constraints, vocabularies, EOS ids and dense-mask thresholds must give the
same compile outcome (or the same failing field) and bit-identical masks along random token
walks; random batch histories (adds with history, removes, moves, swaps, appends, in-place
truncation and rewrites, re-adds with shorter or new lists) must leave every row's mask equal to
a fresh replay of its history. Plus: applying masks, errors naming fields, state size, cache.
"""

from __future__ import annotations

import modelops_native as mn
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from modelops_native import (
    ConstraintBatch,
    ConstraintSpecError,
    compile_constraint,
    new_bitmask,
)

from tests.unit.native_strategies import spec as spec_strategy

PROPS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_extension_is_built():
    assert mn.NATIVE, "modelops_native._engine did not import; the reference fallback is in use"
    assert mn.backend() is mn.backend("native")


def _compile_both(spec, vocab, dense):
    out, errors = {}, {}
    for eng in ("native", "reference"):
        try:
            out[eng] = compile_constraint(spec, vocab, engine=eng, dense_min_children=dense)
        except ConstraintSpecError as e:
            errors[eng] = e
    return out, errors


def _mask_rows(batch: ConstraintBatch, rows: int) -> np.ndarray:
    m = new_bitmask(rows, batch.vocab_size)
    m[:] = 0x5A5A5A5A  # garbage: fill must overwrite every word
    return batch.fill(m, rows)


def _allowed(mask_row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


@PROPS
@given(data=st.data())
def test_masks_match_reference_along_random_walks(data):
    vocab = data.draw(st.integers(2, 90), label="vocab")
    spec = data.draw(spec_strategy(vocab), label="spec")
    dense = data.draw(st.sampled_from([1, 2, 3, None]), label="dense_min_children")
    compiled, errors = _compile_both(spec, vocab, dense)
    assert set(errors) in (set(), {"native", "reference"}), errors
    event(f"{spec['type']}: {'refused' if errors else 'compiled'}")
    if errors:
        assert errors["native"].field == errors["reference"].field, errors
        return
    eos = data.draw(st.lists(st.integers(0, vocab - 1), max_size=12, unique=True), label="eos")  # > 8 too
    threads = data.draw(st.integers(1, 3), label="threads")
    native = ConstraintBatch(vocab, threads, engine="native")
    ref = ConstraintBatch(vocab, 1, engine="reference")
    history: list[int] = []
    native.add(0, compiled["native"], eos, history)
    ref.add(0, compiled["reference"], eos, history)
    for _ in range(data.draw(st.integers(0, 30), label="steps")):
        nm, rm = _mask_rows(native, 2), _mask_rows(ref, 2)
        np.testing.assert_array_equal(nm, rm)
        assert native.accepts(0) == ref.accepts(0) and native.dead(0) == ref.dead(0)
        allowed = sorted(_allowed(rm[0], vocab) - set(eos))
        if allowed and data.draw(st.integers(0, 9), label="stray") > 0:
            tok = data.draw(st.sampled_from(allowed), label="token")
        else:
            tok = data.draw(st.integers(0, vocab - 1), label="any token")  # may break the rule: dead
        history.append(tok)
        native.sync()
        ref.sync()
    np.testing.assert_array_equal(_mask_rows(native, 2), _mask_rows(ref, 2))
    event(f"walk ended {'accepting' if ref.accepts(0) else 'dead' if ref.dead(0) else 'inside'}")


def _walk(rng_draw, ref_prog, eos, n: int) -> list[int]:
    """A valid history of up to n tokens, chosen with the reference program."""
    st_, out = ref_prog.initial(), []
    for _ in range(n):
        allowed = sorted(ref_prog.allowed(st_, tuple(eos)) - set(eos))
        if not allowed:
            break
        t = rng_draw(allowed)
        out.append(t)
        st_ = ref_prog.step(st_, t)
    return out


@PROPS
@given(data=st.data())
def test_batch_histories_match_fresh_replay(data):
    """Rows keyed to live history lists stay equal to a from-scratch replay of those lists."""
    vocab = data.draw(st.integers(4, 60), label="vocab")
    specs = []
    while len(specs) < 3:
        s = data.draw(spec_strategy(vocab), label="spec")
        compiled, errors = _compile_both(s, vocab, None)
        if not errors:
            specs.append(compiled)
    eos = [data.draw(st.integers(0, vocab - 1), label="eos")]
    native = ConstraintBatch(vocab, data.draw(st.integers(1, 3), label="threads"), engine="native")
    pick = lambda xs: data.draw(st.sampled_from(xs))
    cap = 6
    slots: list[tuple[int, list[int]] | None] = [None] * cap  # (spec index, live history)
    parked: list[tuple[int, list[int]]] = []

    def ref_prog(k):
        return specs[k]["reference"].program

    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        op = data.draw(st.sampled_from(["add", "remove", "readd", "move", "swap", "decode", "decode",
                                        "truncate", "rewrite"]), label="op")
        empty = [i for i in range(cap) if slots[i] is None]
        full = [i for i in range(cap) if slots[i] is not None]
        if op == "add" and empty:
            k = data.draw(st.integers(0, 2))
            hist = _walk(pick, ref_prog(k), eos, data.draw(st.integers(0, 6)))
            i = pick(empty)
            slots[i] = (k, hist)
            native.add(i, specs[k]["native"], eos, hist)
        elif op == "remove" and full:
            i = pick(full)
            parked.append(slots[i])  # type: ignore[arg-type]
            slots[i] = None
            native.remove(i)
        elif op == "readd" and parked and empty:
            k, hist = parked.pop(data.draw(st.integers(0, len(parked) - 1)))
            how = data.draw(st.sampled_from(["same", "copy", "shorter"]))
            if how == "copy":
                hist = list(hist)
            elif how == "shorter":
                hist = hist[:data.draw(st.integers(0, len(hist)))]
            i = pick(empty)
            slots[i] = (k, hist)
            native.add(i, specs[k]["native"], eos, hist)
        elif op == "move" and full and empty:
            a, b = pick(full), pick(empty)
            slots[b], slots[a] = slots[a], None
            native.move(a, b)
        elif op == "swap" and len(full) + len(empty) >= 2:
            a, b = pick(list(range(cap))), pick(list(range(cap)))
            slots[a], slots[b] = slots[b], slots[a]
            native.swap(a, b)
        elif op == "decode":
            for i in full:
                k, hist = slots[i]  # type: ignore[misc]
                hist.extend(_walk(pick, ref_prog(k), eos, len(hist) + 1)[len(hist):])
        elif op == "truncate" and full:
            k, hist = slots[pick(full)]  # type: ignore[misc]
            del hist[data.draw(st.integers(0, len(hist))):]
        elif op == "rewrite" and full:
            k, hist = slots[pick(full)]  # type: ignore[misc]
            if hist:  # same length, a different last token: only the last-token check can notice
                hist[-1] = (hist[-1] + 1 + data.draw(st.integers(0, vocab - 2))) % vocab
        native.sync()
        masks = _mask_rows(native, cap)
        for i in range(cap):
            if slots[i] is None:
                assert _allowed(masks[i], vocab) == set(range(vocab))
                continue
            k, hist = slots[i]
            prog = ref_prog(k)
            st_ = prog.initial()
            for t in hist:
                st_ = prog.step(st_, t)
            assert _allowed(masks[i], vocab) == prog.allowed(st_, tuple(eos)), (i, hist)
            assert native.consumed(i) == len(hist)


def test_truncated_history_restarts_and_replays():
    c = compile_constraint({"type": "catalog", "items": [[2, 3], [2, 4], [5]]}, 8)
    b = ConstraintBatch(8, 1)
    h = [2]
    b.add(0, c, [1], h)
    assert _allowed(b.fill(new_bitmask(1, 8), 1)[0], 8) == {3, 4}
    h[:] = []  # preempted and recomputed: history shorter than what the state consumed
    b.sync()
    assert b.replays == 1 and b.consumed(0) == 0
    assert _allowed(b.fill(new_bitmask(1, 8), 1)[0], 8) == {2, 5}
    h.append(5)
    b.sync()
    assert _allowed(b.fill(new_bitmask(1, 8), 1)[0], 8) == {1}  # accepts: EOS only
    h.append(-1)  # async-scheduling placeholder: not consumed
    b.sync()
    assert b.consumed(0) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_apply_matches_torch_path_and_numpy(dtype, threads):
    g = torch.Generator().manual_seed(threads)
    rows, vocab = 37, 1000 + threads  # not a multiple of 32
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32).numpy()
    mask[3] = -1  # all allowed
    mask[4] = 0  # none allowed
    wide = torch.randn(rows, vocab + 7, generator=g).to(dtype)
    logits = wide[:, :vocab]  # rows not contiguous with each other: stride(0) = vocab + 7
    expected = logits.clone()
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    expected[torch.from_numpy(~bits)] = float("-inf")
    via_torch = mn.apply_bitmask_torch_(logits.clone(), torch.from_numpy(mask))
    ConstraintBatch(vocab, threads).apply_(logits, mask)
    assert torch.equal(logits, expected) and torch.equal(via_torch, expected)
    assert torch.equal(wide[:, vocab:], wide[:, vocab:].clone())  # padding columns untouched


def test_parallel_fill_equals_serial_fill():
    vocab = 5000
    items = [[(7 * i + 3 * k) % vocab for k in range(1 + i % 4)] for i in range(3000)]
    c = compile_constraint({"type": "catalog", "items": items}, vocab)
    one, three = ConstraintBatch(vocab, 1), ConstraintBatch(vocab, 3)
    hists = [[items[i][0]] if i % 3 else [] for i in range(300)]
    for b in (one, three):
        for i, h in enumerate(hists):
            if i % 5:
                b.add(i, c, [1], h)
    np.testing.assert_array_equal(_mask_rows(one, 300), _mask_rows(three, 300))


def test_state_stays_under_1kib_with_the_most_unique_items():
    vocab = 600
    cap = mn.backend("native").MAX_UNIQUE_ITEMS
    spec = {"type": "repeat", "item": {"type": "catalog", "items": [[i] for i in range(2, 2 + cap + 10)]},
            "min": cap, "max": cap, "separator": [1 + cap + 20]}
    spec["unique"] = True
    b = ConstraintBatch(vocab, 1)
    h: list[int] = []
    b.add(0, compile_constraint(spec, vocab), [0], h)
    for i in range(cap):
        h += [2 + i] + ([spec["separator"][0]] if i + 1 < cap else [])
    b.sync()
    assert b.accepts(0) and not b.dead(0)
    assert b.state_bytes(0) <= 1024


@pytest.mark.parametrize("engine", ["native", "reference"])
@pytest.mark.parametrize("spec,field", [
    ({"type": "catalog"}, "constraint.items"),
    ({"type": "catalog", "items": [[1, True]]}, "constraint.items[0][1]"),
    ({"type": "catalog", "items": [[1, 99]]}, "constraint.items[0][1]"),  # outside vocab 50
    ({"type": "catalg", "items": [[1]]}, "constraint.type"),
    ({"type": "literal", "tokens": [1], "extra": 1}, "constraint.extra"),
    ({"type": "repeat", "item": {"type": "literal", "tokens": [5]}, "min": 0}, "constraint.min"),
    ({"type": "repeat", "item": {"type": "literal", "tokens": [5]}, "min": 2, "max": 1}, "constraint.max"),
    ({"type": "repeat", "item": {"type": "catalog", "items": [[5], [5, 6]]}, "min": 1, "max": 2,
      "separator": [6]}, "constraint"),  # 6 continues [5] and starts the separator
    ({"type": "sequence", "parts": [{"type": "literal", "tokens": [5]},
                                    {"type": "repeat", "min": 1, "separator": [7], "unique": True,
                                     "item": {"type": "dfa", "num_states": 2, "accepting": [1], "sets": [[6]],
                                              "transitions": [[0, 0, 1]]}}]}, "constraint.parts[1].unique"),
    ({"type": "sequence", "parts": [{"type": "catalog", "items": [[]]}, {"type": "literal", "tokens": [3]}]},
     "constraint.parts[0]"),
    ({"type": "sequence", "parts": [{"type": "sequence", "parts": []}]}, "constraint.parts[0].type"),
    ({"type": "dfa", "num_states": 2, "accepting": [1], "sets": [[3], [3, 4]],
      "transitions": [[0, 0, 1], [0, 1, 1]]}, "constraint.transitions"),
    ({"type": "dfa", "num_states": 2, "accepting": [1], "sets": [[3]], "transitions": [[1, 0, 1]]},
     "constraint.accepting"),
    ({"type": "dfa", "num_states": 2, "accepting": [1], "sets": [[3]], "transitions": [[0, 1, 1]]},
     "constraint.transitions[0][1]"),
])
def test_bad_specs_name_the_field(engine, spec, field):
    with pytest.raises(ConstraintSpecError) as e:
        compile_constraint(spec, 50, engine=engine)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(field + ": ")


def test_compiled_constraints_are_shared_by_content_hash():
    catalog = {"type": "catalog", "items": [[3, 4], [5]]}
    a = compile_constraint(catalog, 64)
    assert compile_constraint({"items": [[3, 4], [5]], "type": "catalog"}, 64) is a
    assert compile_constraint(catalog, 65) is not a
    hits = mn._native.CACHE.hits
    compile_constraint({"type": "repeat", "item": catalog, "min": 2, "separator": [9]}, 64)
    assert mn._native.CACHE.hits > hits  # the catalog leaf was reused


def test_bad_thread_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("MODELOPS_CONSTRAINT_THREADS", "two")
    with pytest.raises(ValueError, match="MODELOPS_CONSTRAINT_THREADS"):
        mn.default_threads()
    monkeypatch.setenv("MODELOPS_CONSTRAINT_THREADS", "3")
    assert mn.default_threads() == 3
    with pytest.raises(ValueError, match="num_threads"):
        ConstraintBatch(10, 0)


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_a_failed_add_leaves_no_row_and_later_syncs_work(engine):
    vocab = 16
    batch = ConstraintBatch(vocab, 1, engine=engine)
    literal = compile_constraint({"type": "literal", "tokens": [3, 4]}, vocab, engine=engine)
    good: list = [3]
    batch.add(0, literal, [0], good)
    with pytest.raises((TypeError, ValueError)):
        batch.add(1, literal, [0], [3, "x"])  # not a token id
    assert not batch.has(1) and batch.has(0)
    good.append(4)
    batch.sync()  # would raise for a half-added row 1
    assert batch.accepts(0) and batch.consumed(0) == 2
    batch.add(1, literal, [0], [3])  # the index is usable again
    assert batch.consumed(1) == 1


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_twenty_stop_ids_are_all_gated(engine):
    vocab = 64
    batch = ConstraintBatch(vocab, 1, engine=engine)
    stops = list(range(40, 60))
    batch.add(0, compile_constraint({"type": "literal", "tokens": [5]}, vocab, engine=engine), stops, [])
    mask = batch.fill(new_bitmask(1, vocab), 1)
    allowed = set(np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]).tolist())
    assert allowed == {5}  # no stop id before the literal is complete
    batch.advance(0, [5])
    mask = batch.fill(new_bitmask(1, vocab), 1)
    allowed = set(np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]).tolist())
    assert allowed == set(stops)  # then every one of the 20 ends it
