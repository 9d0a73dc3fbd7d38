"""Hypothesis strategies for constraint specs (shared by the test_native_* modules).

Specs are drawn from token pools: parts of a sequence usually get disjoint pools so a fair share
of compositions is unambiguous; sometimes they share one, which exercises the ambiguity errors.
"""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def token_set(draw, pool: list[int]) -> list[int] | dict:
    ids = sorted(draw(st.sets(st.sampled_from(pool), max_size=6)))
    form = draw(st.integers(0, 3))
    if form == 0:
        return ids
    lo = draw(st.sampled_from(pool))
    hi = lo + draw(st.integers(0, 4))
    out: dict = {"tokens": ids}
    if form >= 2:
        out["ranges"] = [[lo, hi]]
    if form == 3:
        out["negate"] = draw(st.booleans())
    return out


@st.composite
def catalog(draw, pool: list[int]) -> dict:
    items = draw(st.lists(st.lists(st.sampled_from(pool), min_size=0 if draw(st.integers(0, 9)) == 0 else 1,
                                   max_size=5), min_size=1, max_size=14))
    return {"type": "catalog", "items": items}


@st.composite
def literal(draw, pool: list[int]) -> dict:
    return {"type": "literal", "tokens": draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))}


@st.composite
def dfa(draw, pool: list[int]) -> dict:
    """Mostly deterministic (each state's tokens split into disjoint sets); sometimes free-form."""
    n = draw(st.integers(1, 6))
    sets: list = []
    trans: list[list[int]] = []
    free_form = draw(st.integers(0, 5)) == 0
    for s in range(n):
        if free_form:
            for _ in range(draw(st.integers(0, 3))):
                sets.append(draw(token_set(pool)))
                trans.append([s, len(sets) - 1, draw(st.integers(0, n - 1))])
            continue
        toks = draw(st.lists(st.sampled_from(pool), unique=True, max_size=min(8, len(pool))))
        k = draw(st.integers(1, 3))
        for j in range(k):
            part = sorted(toks[j::k])
            if part:
                sets.append(part)
                trans.append([s, len(sets) - 1, draw(st.integers(0, n - 1))])
    accepting = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    return {"type": "dfa", "num_states": n, "start": draw(st.integers(0, n - 1)), "accepting": accepting,
            "sets": sets, "transitions": trans}


def leaf(pool: list[int]):
    return st.one_of(catalog(pool), literal(pool), dfa(pool))


@st.composite
def repeat(draw, pool: list[int], sep_pool: list[int]) -> dict:
    lo = draw(st.integers(1, 3))
    item = draw(catalog(pool)) if draw(st.booleans()) else draw(leaf(pool))
    out = {"type": "repeat", "item": item, "min": lo, "max": lo + draw(st.integers(0, 3))}
    if draw(st.booleans()):
        out["separator"] = draw(st.lists(st.sampled_from(sep_pool), min_size=1, max_size=2))
    if item["type"] == "catalog" and draw(st.booleans()):
        out["unique"] = True
    return out


@st.composite
def spec(draw, vocab: int) -> dict:
    """A constraint over token ids [0, vocab)."""
    ids = list(range(vocab))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(leaf(ids))
    if kind == 1:
        return draw(repeat(ids, ids))
    n = draw(st.integers(2, 3)) if kind == 2 else 1
    shared = draw(st.integers(0, 4)) == 0
    parts = []
    for i in range(n):
        # disjoint pools per part (and for separators) unless `shared`
        pool = ids if shared else ids[i::n + 1] or ids
        sep_pool = ids if shared else ids[n::n + 1] or ids
        parts.append(draw(repeat(pool, sep_pool)) if draw(st.booleans()) else draw(leaf(pool)))
    return {"type": "sequence", "parts": parts}
