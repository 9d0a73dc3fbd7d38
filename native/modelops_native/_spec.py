"""The constraint spec: a JSON-able dict, parsed into a normalized, hashable form.

Spec (what a request carries, e.g. ``SamplingParams.extra_args["constraint"]``)::

    {"type": "catalog", "items": [[12, 7], [12, 9, 4], ...]}   # output = one of the token sequences
    {"type": "catalog", "texts": ["red shoe", ...]}            # same, tokenized with the model's tokenizer
    {"type": "literal", "tokens": [5, 6]}                      # exactly this sequence
    {"type": "dfa", "num_states": 3, "start": 0, "accepting": [2],
     "sets": [[1, 2, 3], {"ranges": [[100, 200]]}, {"tokens": [7], "negate": true}],
     "transitions": [[0, 0, 1], [1, 1, 2]]}                    # [state, set index, next state]
    {"type": "repeat", "item": <catalog|literal|dfa>, "min": 3, "max": 3,
     "separator": [11], "unique": true}                        # k items, separated, none twice
    {"type": "sequence", "parts": [<leaf or repeat>, ...]}     # one after the other

Token sets in a DFA are a list of ids or ``{"tokens": [...], "ranges": [[lo, hi), ...], "negate": bool}``
(negate = every other token of the vocabulary). Unknown keys and wrong types are errors that name
the field (:class:`ConstraintSpecError`). Checks that need the vocabulary size (ids in range,
ambiguity, reachability) happen when the spec is compiled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAX_SPEC_TOKENS",
    "CatalogSpec",
    "ConstraintSpecError",
    "DfaSpec",
    "ProgramSpec",
    "SegmentSpec",
    "TokenSetSpec",
    "parse_spec",
]

# A spec bigger than this (token ids across all catalogs and sets) is refused before any work.
MAX_SPEC_TOKENS = 50_000_000

Tokenize = Callable[[list[str]], list[list[int]]]


class ConstraintSpecError(ValueError):
    """A malformed constraint spec; ``field`` is the dotted path of the offending field.

    Raised by :func:`parse_spec` and by compilation; a ``ValueError`` so vLLM's
    ``validate_params`` turns it into HTTP 400.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, eq=False)
class CatalogSpec:
    """N token sequences: ``tokens`` int32 [total], ``offsets`` int64 [N+1] (item i = tokens[o[i]:o[i+1]]).

    Both are None when the spec gave ``texts`` and no tokenizer was at hand (validation only).
    """

    tokens: np.ndarray | None
    offsets: np.ndarray | None
    path: str
    kind: str = "catalog"  # or "literal" (one item): errors name the literal's own fields

    def items(self) -> list[tuple[int, ...]]:
        assert self.tokens is not None and self.offsets is not None
        t, o = self.tokens.tolist(), self.offsets.tolist()
        return [tuple(t[o[i]:o[i + 1]]) for i in range(len(o) - 1)]


@dataclass(frozen=True)
class TokenSetSpec:
    tokens: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    negate: bool

    def resolve(self, vocab_size: int) -> np.ndarray:
        """Sorted unique int32 ids; ``negate`` complements within [0, vocab_size)."""
        parts = [np.asarray(self.tokens, dtype=np.int64)]
        parts += [np.arange(lo, hi, dtype=np.int64) for lo, hi in self.ranges]
        ids = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if self.negate:
            inside = ids[(ids >= 0) & (ids < vocab_size)]
            keep = np.ones(vocab_size, dtype=bool)
            keep[inside] = False
            ids = np.flatnonzero(keep)
        return ids.astype(np.int32)


@dataclass(frozen=True)
class DfaSpec:
    num_states: int
    start: int
    accepting: tuple[int, ...]
    sets: tuple[TokenSetSpec, ...]
    transitions: tuple[tuple[int, int, int], ...]
    path: str


Leaf = CatalogSpec | DfaSpec


@dataclass(frozen=True)
class SegmentSpec:
    """``leaf`` repeated min..max times, ``separator`` between items, ``unique``: no item twice."""

    leaf: Leaf
    min: int
    max: int
    separator: tuple[int, ...]
    unique: bool
    path: str


@dataclass(frozen=True)
class ProgramSpec:
    segments: tuple[SegmentSpec, ...]

    @property
    def complete(self) -> bool:
        """False when a catalog still needs a tokenizer (``texts`` parsed for validation only)."""
        return all(not isinstance(s.leaf, CatalogSpec) or s.leaf.tokens is not None for s in self.segments)

    def max_token(self) -> int:
        """Largest token id mentioned (-1 if none): a lower bound on the vocabulary size."""
        m = -1
        for s in self.segments:
            m = max([m, *s.separator])
            leaf = s.leaf
            if isinstance(leaf, CatalogSpec) and leaf.tokens is not None and leaf.tokens.size:
                m = max(m, int(leaf.tokens.max()))
            elif isinstance(leaf, DfaSpec):
                for ts in leaf.sets:
                    m = max([m, *ts.tokens, *(hi - 1 for _, hi in ts.ranges)])
        return m


def leaf_digest(leaf: Leaf) -> bytes:
    """Content hash of a leaf (blake2b-128 over a canonical encoding)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(leaf, CatalogSpec):
        assert leaf.tokens is not None and leaf.offsets is not None
        h.update(b"catalog")
        h.update(leaf.offsets.astype("<i8").tobytes())
        h.update(leaf.tokens.astype("<i4").tobytes())
    else:
        h.update(b"dfa")
        h.update(repr((leaf.num_states, leaf.start, leaf.accepting, leaf.transitions,
                       [(s.tokens, s.ranges, s.negate) for s in leaf.sets])).encode())
    return h.digest()


def program_digest(spec: ProgramSpec, vocab_size: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(str(vocab_size).encode())
    for s in spec.segments:
        h.update(leaf_digest(s.leaf))
        h.update(repr((s.min, s.max, s.separator, s.unique)).encode())
    return h.digest()


# ---- parsing ----------------------------------------------------------------------------------

def _keys(d: Any, path: str, required: set[str], optional: set[str]) -> dict:
    if not isinstance(d, dict):
        raise ConstraintSpecError(path, f"must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - required - optional - {"type"})
    if unknown:
        raise ConstraintSpecError(f"{path}.{unknown[0]}", f"unknown field (allowed: {sorted(required | optional)})")
    for k in sorted(required):
        if k not in d:
            raise ConstraintSpecError(f"{path}.{k}", "is required")
    return d


def _int(v: Any, path: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int:  # bool is an int subclass: refuse it too
        raise ConstraintSpecError(path, f"must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConstraintSpecError(path, f"must be {bound}, got {v}")
    return v


def _int_list(v: Any, path: str, *, nonempty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list | tuple):
        raise ConstraintSpecError(path, f"must be a list of token ids, got {type(v).__name__}")
    if nonempty and not v:
        raise ConstraintSpecError(path, "must not be empty")
    for i, x in enumerate(v):
        if type(x) is not int or x < 0:
            raise ConstraintSpecError(f"{path}[{i}]", f"must be a token id (an integer >= 0), got {x!r}")
    return tuple(v)


def _catalog_items(items: Any, path: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(items, list | tuple) or not items:
        raise ConstraintSpecError(path, "must be a non-empty list of token-id lists")
    lengths = np.empty(len(items), dtype=np.int64)
    for i, it in enumerate(items):
        if not isinstance(it, list | tuple):
            raise ConstraintSpecError(f"{path}[{i}]", f"must be a list of token ids, got {type(it).__name__}")
        lengths[i] = len(it)
    total = int(lengths.sum())
    if total > MAX_SPEC_TOKENS:
        raise ConstraintSpecError(path, f"has {total} token ids, more than the limit {MAX_SPEC_TOKENS}")
    flat = [x for it in items for x in it]
    # One pass over Python objects: ints only (not bool), non-negative, within int32.
    ok = all(type(x) is int for x in flat) and (not flat or (min(flat) >= 0 and max(flat) < 2**31))
    if not ok:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for k, x in enumerate(flat):
            if type(x) is not int or not 0 <= x < 2**31:
                i = int(np.searchsorted(offsets, k, side="right") - 1)
                raise ConstraintSpecError(f"{path}[{i}][{k - int(offsets[i])}]",
                                          f"must be a token id (an integer >= 0), got {x!r}")
    tokens = np.array(flat, dtype=np.int32)
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return tokens, offsets


def _leaf(d: Any, path: str, tokenize: Tokenize | None) -> Leaf:
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == "catalog":
        _keys(d, path, set(), {"items", "texts"})
        if ("items" in d) == ("texts" in d):
            raise ConstraintSpecError(f"{path}.items", "give exactly one of items (token ids) or texts (strings)")
        if "items" in d:
            tokens, offsets = _catalog_items(d["items"], f"{path}.items")
            return CatalogSpec(tokens, offsets, path)
        texts = d["texts"]
        if not isinstance(texts, list | tuple) or not texts:
            raise ConstraintSpecError(f"{path}.texts", "must be a non-empty list of strings")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ConstraintSpecError(f"{path}.texts[{i}]", f"must be a string, got {type(t).__name__}")
        if tokenize is None:
            return CatalogSpec(None, None, path)
        tokens, offsets = _catalog_items([list(x) for x in tokenize(list(texts))], f"{path}.texts")
        return CatalogSpec(tokens, offsets, path)
    if kind == "literal":
        _keys(d, path, {"tokens"}, set())
        toks = _int_list(d["tokens"], f"{path}.tokens", nonempty=True)
        return CatalogSpec(np.array(toks, dtype=np.int32), np.array([0, len(toks)], dtype=np.int64), path, "literal")
    if kind == "dfa":
        _keys(d, path, {"num_states", "accepting", "sets", "transitions"}, {"start"})
        n = _int(d["num_states"], f"{path}.num_states", 1, 2**31 - 1)
        start = _int(d.get("start", 0), f"{path}.start", 0, n - 1)
        accepting = _int_list(d["accepting"], f"{path}.accepting")
        for i, a in enumerate(accepting):
            _int(a, f"{path}.accepting[{i}]", 0, n - 1)
        if not isinstance(d["sets"], list | tuple):
            raise ConstraintSpecError(f"{path}.sets", "must be a list of token sets")
        sets = tuple(_token_set(s, f"{path}.sets[{i}]") for i, s in enumerate(d["sets"]))
        trans = d["transitions"]
        if not isinstance(trans, list | tuple):
            raise ConstraintSpecError(f"{path}.transitions", "must be a list of [state, set, next_state]")
        out = []
        for i, t in enumerate(trans):
            p = f"{path}.transitions[{i}]"
            if not isinstance(t, list | tuple) or len(t) != 3:
                raise ConstraintSpecError(p, "must be [state, set index, next state]")
            out.append((_int(t[0], f"{p}[0]", 0, n - 1), _int(t[1], f"{p}[1]", 0, max(len(sets) - 1, 0)),
                        _int(t[2], f"{p}[2]", 0, n - 1)))
        if out and not sets:
            raise ConstraintSpecError(f"{path}.sets", "transitions refer to sets, but there are none")
        return DfaSpec(n, start, accepting, sets, tuple(out), path)
    if kind in ("repeat", "sequence"):
        raise ConstraintSpecError(f"{path}.type", f"a {kind} cannot appear here (only catalog, literal or dfa)")
    raise ConstraintSpecError(f"{path}.type", f"must be one of catalog, literal, dfa, repeat, sequence; got {kind!r}")


def _token_set(s: Any, path: str) -> TokenSetSpec:
    if isinstance(s, list | tuple):
        return TokenSetSpec(_int_list(s, path), (), False)
    _keys(s, path, set(), {"tokens", "ranges", "negate"})
    tokens = _int_list(s.get("tokens", []), f"{path}.tokens")
    ranges = s.get("ranges", [])
    if not isinstance(ranges, list | tuple):
        raise ConstraintSpecError(f"{path}.ranges", "must be a list of [lo, hi) pairs")
    rs = []
    for i, r in enumerate(ranges):
        if not isinstance(r, list | tuple) or len(r) != 2:
            raise ConstraintSpecError(f"{path}.ranges[{i}]", "must be [lo, hi) (hi exclusive)")
        lo, hi = _int(r[0], f"{path}.ranges[{i}][0]"), _int(r[1], f"{path}.ranges[{i}][1]")
        if hi < lo:
            raise ConstraintSpecError(f"{path}.ranges[{i}]", f"hi ({hi}) is below lo ({lo})")
        if hi - lo > MAX_SPEC_TOKENS:
            raise ConstraintSpecError(f"{path}.ranges[{i}]", f"spans more than {MAX_SPEC_TOKENS} ids")
        rs.append((lo, hi))
    negate = s.get("negate", False)
    if type(negate) is not bool:
        raise ConstraintSpecError(f"{path}.negate", f"must be true or false, got {negate!r}")
    return TokenSetSpec(tokens, tuple(rs), negate)


def _segment(d: dict, path: str, tokenize: Tokenize | None) -> SegmentSpec:
    if isinstance(d, dict) and d.get("type") == "repeat":
        _keys(d, path, {"item", "min"}, {"max", "separator", "unique"})
        lo = _int(d["min"], f"{path}.min", 1, 2**31 - 1)
        hi = _int(d.get("max", lo), f"{path}.max", lo, 2**31 - 1)
        sep = _int_list(d.get("separator", []), f"{path}.separator")
        unique = d.get("unique", False)
        if type(unique) is not bool:
            raise ConstraintSpecError(f"{path}.unique", f"must be true or false, got {unique!r}")
        return SegmentSpec(_leaf(d["item"], f"{path}.item", tokenize), lo, hi, sep, unique, path)
    return SegmentSpec(_leaf(d, path, tokenize), 1, 1, (), False, path)


def parse_spec(spec: Any, *, root: str = "constraint", tokenize: Tokenize | None = None) -> ProgramSpec:
    """Parse a JSON-able constraint spec (module docstring) into a :class:`ProgramSpec`.

    ``tokenize`` turns catalog ``texts`` into token ids (the model's tokenizer, no special
    tokens); without it such catalogs are only checked (``ProgramSpec.complete`` is False).

    Raises:
        ConstraintSpecError: naming the field, e.g. ``constraint.parts[1].item.items[4][0]``.
    """
    if isinstance(spec, dict) and spec.get("type") == "sequence":
        _keys(spec, root, {"parts"}, set())
        parts = spec["parts"]
        if not isinstance(parts, list | tuple) or not parts:
            raise ConstraintSpecError(f"{root}.parts", "must be a non-empty list of constraints")
        for i, p in enumerate(parts):
            if isinstance(p, dict) and p.get("type") == "sequence":
                raise ConstraintSpecError(f"{root}.parts[{i}].type", "sequences do not nest; flatten the parts")
        return ProgramSpec(tuple(_segment(p, f"{root}.parts[{i}]", tokenize) for i, p in enumerate(parts)))
    if not isinstance(spec, dict):
        raise ConstraintSpecError(root, f"must be an object, got {type(spec).__name__}")
    return ProgramSpec((_segment(spec, root, tokenize),))
