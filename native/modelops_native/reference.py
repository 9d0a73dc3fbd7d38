"""Plain-Python twin of the native engine: same API as ``modelops_native._engine``, same masks.

Written independently of the C++ (a dict trie keyed by token, items identified by their token
tuple, DFA sets as Python sets) so the property tests compare two implementations, not one
algorithm twice. Also the fallback when the extension is missing, and the "pure-Python
per-request processor" of the benchmark: :meth:`Batch.fill` loops over rows and computes each
row's allowed set in Python, then packs it with numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_UNIQUE_ITEMS", "Batch", "Leaf", "Program", "SpecError", "build_catalog", "build_dfa"]

MAX_UNIQUE_ITEMS = 192


class SpecError(ValueError):
    """Same role as ``_engine.SpecError``: a spec that cannot be compiled."""


ITEM, SEP, DEAD = 0, 1, 2


class Leaf:
    """A catalog trie or a DFA; states are ints (trie node ids / DFA state ids)."""

    kind: str

    def start(self) -> int:
        raise NotImplementedError

    def accepts(self, s: int) -> bool:
        raise NotImplementedError

    def next(self, s: int, t: int, used: tuple, extra: tuple | None, unique: bool) -> int:
        raise NotImplementedError

    def allowed(self, s: int, used: tuple, extra: tuple | None, unique: bool) -> set[int]:
        raise NotImplementedError

    def accept_out(self) -> set[int]:
        raise NotImplementedError

    @property
    def memory_bytes(self) -> int:
        return 0


class _Catalog(Leaf):
    kind = "catalog"

    def __init__(self, items: list[tuple[int, ...]], vocab: int) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.prefix: list[tuple[int, ...]] = [()]
        self.terminal: list[bool] = [False]
        for item in items:
            node = 0
            for t in item:
                nxt = self.children[node].get(t)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][t] = nxt
                    self.children.append({})
                    self.prefix.append(self.prefix[node] + (t,))
                    self.terminal.append(False)
                node = nxt
            self.terminal[node] = True
        self.n_items = [0] * len(self.children)
        for n in sorted(range(len(self.children)), key=lambda n: -len(self.prefix[n])):
            self.n_items[n] = int(self.terminal[n]) + sum(self.n_items[c] for c in self.children[n].values())
        self.vocab = vocab

    def start(self) -> int:
        return 0

    def accepts(self, s: int) -> bool:
        return self.terminal[s]

    def item(self, s: int) -> tuple[int, ...]:
        return self.prefix[s]

    def _open(self, c: int, used: tuple, extra: tuple | None) -> bool:
        p = self.prefix[c]
        taken = sum(1 for u in (*used, *([extra] if extra is not None else [])) if u[:len(p)] == p)
        return self.n_items[c] > taken

    def next(self, s, t, used, extra, unique):
        c = self.children[s].get(t, -1)
        if c < 0 or not unique or self._open(c, used, extra):
            return c
        return -1

    def allowed(self, s, used, extra, unique):
        if not unique:
            return set(self.children[s])
        return {t for t, c in self.children[s].items() if self._open(c, used, extra)}

    def accept_out(self):
        out: set[int] = set()
        for n, term in enumerate(self.terminal):
            if term:
                out |= set(self.children[n])
        return out

    @property
    def num_items(self) -> int:
        return sum(self.terminal)

    @property
    def num_edges(self) -> int:
        return len(self.children) - 1

    @property
    def num_nodes(self) -> int:
        return len(self.children)


class _Dfa(Leaf):
    kind = "dfa"

    def __init__(self, start: int, accepting: list[bool], sets: list[set[int]],
                 trans: list[list[tuple[int, int]]]) -> None:
        self._start, self.accepting, self.sets, self.trans = start, accepting, sets, trans

    def start(self):
        return self._start

    def accepts(self, s):
        return self.accepting[s]

    def next(self, s, t, used, extra, unique):
        for k, nx in self.trans[s]:
            if t in self.sets[k]:
                return nx
        return -1

    def allowed(self, s, used, extra, unique):
        out: set[int] = set()
        for k, _ in self.trans[s]:
            out |= self.sets[k]
        return out

    def accept_out(self):
        out: set[int] = set()
        for s, a in enumerate(self.accepting):
            if a:
                out |= self.allowed(s, (), None, False)
        return out

    num_items = 0

    @property
    def num_edges(self) -> int:
        return sum(len(t) for t in self.trans)

    @property
    def num_nodes(self) -> int:
        return len(self.trans)


def _check_token(t: int, vocab: int, where: str) -> None:
    if not 0 <= t < vocab:
        raise SpecError(f"{where}: token id {t} is outside the vocabulary [0, {vocab})")


def build_catalog(tokens, offsets, vocab_size: int, dense_min_children: int = 0) -> Leaf:
    """Same contract as ``_engine.build_catalog`` (``dense_min_children`` has no effect here)."""
    if vocab_size <= 0:
        raise SpecError("vocab_size must be positive")
    t, o = np.asarray(tokens).tolist(), np.asarray(offsets).tolist()
    if len(o) < 2:
        raise SpecError("items: a catalog needs at least one item")
    items = []
    for i in range(len(o) - 1):
        item = tuple(t[o[i]:o[i + 1]])
        for k, x in enumerate(item):
            _check_token(x, vocab_size, f"items[{i}][{k}]")
        items.append(item)
    return _Catalog(items, vocab_size)


def build_dfa(num_states: int, start: int, accepting, sets, transitions, vocab_size: int) -> Leaf:
    """Same contract as ``_engine.build_dfa``: validates, checks determinism, trims dead states."""
    if vocab_size <= 0:
        raise SpecError("vocab_size must be positive")
    if num_states <= 0:
        raise SpecError("num_states: a DFA needs at least one state")
    if not 0 <= start < num_states:
        raise SpecError(f"start: state {start} is not in [0, num_states)")
    py_sets = []
    for i, s in enumerate(sets):
        s = [int(x) for x in s]
        for x in s:
            _check_token(x, vocab_size, f"sets[{i}]")
        if s != sorted(set(s)):
            raise SpecError(f"sets[{i}]: token ids must be sorted and unique")
        py_sets.append(set(s))
    acc = [False] * num_states
    for a in accepting:
        if not 0 <= a < num_states:
            raise SpecError(f"accepting: state {a} is not in [0, num_states)")
        acc[a] = True
    trans: list[list[tuple[int, int]]] = [[] for _ in range(num_states)]
    for i, (s, k, nx) in enumerate(np.asarray(transitions, dtype=np.int64).reshape(-1, 3).tolist()):
        if not 0 <= s < num_states:
            raise SpecError(f"transitions[{i}]: state {s} is not in [0, num_states)")
        if not 0 <= k < len(py_sets):
            raise SpecError(f"transitions[{i}]: set {k} is not in [0, len(sets))")
        if not 0 <= nx < num_states:
            raise SpecError(f"transitions[{i}]: next state {nx} is not in [0, num_states)")
        trans[s].append((k, nx))
    for s in range(num_states):
        seen: set[int] = set()
        for k, _ in trans[s]:
            if seen & py_sets[k]:
                raise SpecError(f"transitions: state {s} has token {min(seen & py_sets[k])} in two sets; "
                                "a DFA must be deterministic")
            seen |= py_sets[k]
    live = list(acc)
    changed = True
    while changed:
        changed = False
        for s in range(num_states):
            if not live[s] and any(live[nx] and py_sets[k] for k, nx in trans[s]):
                live[s] = changed = True
    if not live[start]:
        raise SpecError("accepting: no accepting state is reachable from the start state")
    trans = [[(k, nx) for k, nx in ts if live[nx] and py_sets[k]] for ts in trans]
    return _Dfa(start, acc, py_sets, trans)


class Program:
    """Segments ``(leaf, min, max, separator, unique, path)``; same validation as the native one."""

    def __init__(self, segments, vocab_size: int) -> None:
        if vocab_size <= 0:
            raise SpecError("vocab_size must be positive")
        if not segments:
            raise SpecError("parts: a sequence needs at least one part")
        self.vocab_size = vocab_size
        self.segs = [(leaf, int(lo), int(hi), tuple(sep), bool(u), path) for leaf, lo, hi, sep, u, path in segments]
        n = len(self.segs)
        for leaf, lo, hi, sep, unique, path in self.segs:
            if isinstance(leaf, _Catalog) and leaf.vocab != vocab_size:
                raise SpecError(f"{path}: the constraint was compiled for another vocabulary size")
            if lo < 1 or hi < lo:
                raise SpecError(f"{path}: need 1 <= min <= max, got min={lo} max={hi}")
            for k, t in enumerate(sep):
                _check_token(t, vocab_size, f"{path}.separator[{k}]")
            if unique:
                if leaf.kind != "catalog":
                    raise SpecError(f"{path}.unique: only catalog items can be required to differ")
                if hi > MAX_UNIQUE_ITEMS:
                    raise SpecError(f"{path}.max: at most {MAX_UNIQUE_ITEMS} items when unique is set, got {hi}")
                if lo > leaf.num_items:
                    raise SpecError(f"{path}.min: {lo} distinct items requested, the catalog has {leaf.num_items}")
            if leaf.accepts(leaf.start()) and (n > 1 or hi > 1):
                raise SpecError(f"{path}: the empty sequence is an item; only a single constraint "
                                "(no sequence, no repeat) may accept it")
        for i, (leaf, lo, hi, sep, unique, path) in enumerate(self.segs):
            cont = leaf.accept_out()
            again: set[int] = set()
            if hi > 1:
                again = {sep[0]} if sep else leaf.allowed(leaf.start(), (), None, False)
            nxt = set()
            if i + 1 < n:
                nl = self.segs[i + 1][0]
                nxt = nl.allowed(nl.start(), (), None, False)
            if cont & again:
                raise SpecError(f"{path}: token {min(cont & again)} can both continue an item and start "
                                f"{'the next item' if not sep else 'the separator'}; the constraint would be ambiguous")
            if cont & nxt:
                raise SpecError(f"{path}: token {min(cont & nxt)} can both continue an item and start "
                                f"{self.segs[i + 1][5]}; the constraint would be ambiguous")
            if lo < hi and again & nxt:
                raise SpecError(f"{path}: token {min(again & nxt)} can both start another item and start "
                                f"{self.segs[i + 1][5]}; the constraint would be ambiguous")

    @property
    def memory_bytes(self) -> int:
        return 0

    # ---- the state machine: state = (phase, seg, count, leaf state, sep_pos, used items) ----

    def initial(self) -> tuple:
        return (ITEM, 0, 0, self.segs[0][0].start(), 0, ())

    def _complete(self, seg, node, used) -> bool:
        leaf, _, _, _, unique, _ = self.segs[seg]
        return leaf.accepts(node) and not (unique and leaf.item(node) in used)

    def step(self, st: tuple, t: int) -> tuple:
        phase, seg, count, node, pos, used = st
        if phase == DEAD:
            return st
        leaf, lo, hi, sep, unique, _ = self.segs[seg]
        dead = (DEAD, seg, count, node, pos, used)
        if phase == SEP:
            if t != sep[pos]:
                return dead
            if pos + 1 == len(sep):
                return (ITEM, seg, count, leaf.start(), 0, used)
            return (SEP, seg, count, node, pos + 1, used)
        nx = leaf.next(node, t, used, None, unique)
        if nx >= 0:
            return (ITEM, seg, count, nx, 0, used)
        if not self._complete(seg, node, used):
            return dead
        done = tuple(sorted(used + (leaf.item(node),))) if unique else used
        if count + 1 < hi:
            if sep:
                if t == sep[0]:
                    return (ITEM, seg, count + 1, leaf.start(), 0, done) if len(sep) == 1 else \
                        (SEP, seg, count + 1, node, 1, done)
            else:
                nx = leaf.next(leaf.start(), t, used, leaf.item(node) if unique else None, unique)
                if nx >= 0:
                    return (ITEM, seg, count + 1, nx, 0, done)
        if count + 1 >= lo and seg + 1 < len(self.segs):
            nl, _, _, _, nu, _ = self.segs[seg + 1]
            nx = nl.next(nl.start(), t, (), None, nu)
            if nx >= 0:
                return (ITEM, seg + 1, 0, nx, 0, ())
        return dead

    def accepts(self, st: tuple) -> bool:
        phase, seg, count, node, _, used = st
        return (phase == ITEM and seg + 1 == len(self.segs) and count + 1 >= self.segs[seg][1]
                and self._complete(seg, node, used))

    def allowed(self, st: tuple, eos: tuple[int, ...]) -> set[int]:
        """Allowed token ids in state ``st``; EOS ids exactly when it accepts (dead: EOS only)."""
        phase, seg, count, node, pos, used = st
        out: set[int] = set()
        acc = False
        if phase == SEP:
            out.add(self.segs[seg][3][pos])
        elif phase == ITEM:
            leaf, lo, hi, sep, unique, _ = self.segs[seg]
            out |= leaf.allowed(node, used, None, unique)
            if self._complete(seg, node, used):
                if count + 1 < hi:
                    if sep:
                        out.add(sep[0])
                    else:
                        out |= leaf.allowed(leaf.start(), used, leaf.item(node) if unique else None, unique)
                if count + 1 >= lo:
                    if seg + 1 < len(self.segs):
                        nl, _, _, _, nu, _ = self.segs[seg + 1]
                        out |= nl.allowed(nl.start(), (), None, nu)
                    else:
                        acc = True
        if acc or phase == DEAD:
            out |= set(eos)
        else:
            out -= set(eos)
        return out


class _Row:
    __slots__ = ("consumed", "eos", "hist", "last", "prog", "st")

    def __init__(self, prog: Program, eos: tuple[int, ...], hist) -> None:
        self.prog, self.eos, self.hist = prog, eos, hist
        self.st, self.consumed, self.last = prog.initial(), 0, -1


class Batch:
    """Same contract as ``_engine.Batch``; rows keyed by batch index."""

    def __init__(self, vocab_size: int, num_threads: int) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.vocab_size, self.num_threads = vocab_size, num_threads
        self.words = (vocab_size + 31) // 32
        self.rows: list[_Row | None] = []
        self.replays = 0

    @property
    def capacity(self) -> int:
        return len(self.rows)

    def _slot(self, i: int) -> None:
        if i < 0:
            raise IndexError("row index must be >= 0")
        while len(self.rows) <= i:
            self.rows.append(None)

    def _row(self, i: int) -> _Row:
        if not self.has(i):
            raise IndexError(f"row {i} has no constraint")
        return self.rows[i]  # type: ignore[return-value]

    def add(self, row: int, program: Program, eos, history) -> None:
        if program.vocab_size != self.vocab_size:
            raise ValueError(f"constraint compiled for vocab_size {program.vocab_size}, batch has {self.vocab_size}")
        eos = tuple(int(e) for e in eos)
        for e in eos:
            if not 0 <= e < self.vocab_size:
                raise ValueError(f"EOS id {e} is outside the vocabulary")
        self._slot(row)
        r = self.rows[row] = _Row(program, eos, history)
        try:
            self._sync(r)
        except Exception:
            self.rows[row] = None  # an unreadable history leaves no row behind
            raise

    def remove(self, row: int) -> None:
        if row < 0:
            raise IndexError("row index must be >= 0")
        if row < len(self.rows):
            self.rows[row] = None

    def move(self, src: int, dst: int) -> None:
        self._slot(max(src, dst))
        self.rows[dst], self.rows[src] = self.rows[src], None

    def swap(self, a: int, b: int) -> None:
        self._slot(max(a, b))
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    def _sync(self, r: _Row) -> int:
        h = r.hist
        if h is None:
            return 0
        restarted = 0
        if len(h) < r.consumed or (r.consumed > 0 and h[r.consumed - 1] != r.last):
            r.st, r.consumed, r.last = r.prog.initial(), 0, -1
            restarted = 1
            self.replays += 1
        for t in h[r.consumed:]:
            if t < 0:
                break
            r.st = r.prog.step(r.st, t)
            r.last, r.consumed = t, r.consumed + 1
        return restarted

    def sync(self) -> int:
        return sum(self._sync(r) for r in self.rows if r is not None)

    def advance(self, row: int, tokens) -> bool:
        r = self._row(row)
        for t in tokens:
            r.st = r.prog.step(r.st, int(t))
            r.last, r.consumed = int(t), r.consumed + 1
        return r.st[0] != DEAD

    def reset(self, row: int) -> None:
        r = self._row(row)
        r.st, r.consumed, r.last = r.prog.initial(), 0, -1

    def has(self, row: int) -> bool:
        return 0 <= row < len(self.rows) and self.rows[row] is not None

    def accepts(self, row: int) -> bool:
        r = self._row(row)
        return r.prog.accepts(r.st)

    def dead(self, row: int) -> bool:
        return self._row(row).st[0] == DEAD

    def consumed(self, row: int) -> int:
        return self._row(row).consumed

    def state_bytes(self, row: int) -> int:
        return 0

    def allowed(self, row: int) -> set[int]:
        """The allowed token ids of one row (every token for a row without a constraint)."""
        if not self.has(row):
            return set(range(self.vocab_size))
        r = self.rows[row]
        return r.prog.allowed(r.st, r.eos)  # type: ignore[union-attr]

    def fill(self, out: np.ndarray, num_rows: int) -> None:
        """Per row: the allowed set in Python, packed into ``out[row]`` with numpy."""
        words = self.words
        for i in range(num_rows):
            bits = np.zeros(words * 32, dtype=np.uint8)
            if self.has(i):
                ids = np.fromiter(self.allowed(i), dtype=np.int64)
                bits[ids] = 1
            else:
                bits[:self.vocab_size] = 1
            out[i, :words] = np.packbits(bits, bitorder="little").view(np.int32)

    def apply(self, logits_ptr, dtype, num_rows, cols, row_stride, bitmask) -> None:
        raise NotImplementedError("the reference applies masks with torch (modelops_native.apply_bitmask_torch_)")
