"""The one wrapper around the compiled extension: compiling specs (with a content-hash cache),
the batch of row states, and applying bitmasks to logits.

Nothing else imports ``modelops_native._engine``. When the extension is missing (a broken build)
the plain-Python twin in :mod:`modelops_native.reference` takes its place and :data:`NATIVE` is
False; tests assert it is True.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from modelops_native import reference
from modelops_native._spec import (
    CatalogSpec,
    ConstraintSpecError,
    DfaSpec,
    ProgramSpec,
    Tokenize,
    leaf_digest,
    parse_spec,
    program_digest,
)

if TYPE_CHECKING:
    import torch

try:
    from modelops_native import _engine
except ImportError as e:  # pragma: no cover - exercised only on a broken build
    _engine = None
    IMPORT_ERROR: ImportError | None = e
else:
    IMPORT_ERROR = None

NATIVE = _engine is not None

__all__ = ["NATIVE", "Constraint", "ConstraintBatch", "ConstraintCache", "apply_bitmask_torch_", "backend",
           "compile_constraint", "default_threads", "new_bitmask"]

_DTYPE_CODES = {"torch.float32": 0, "torch.bfloat16": 1, "torch.float16": 2}


def backend(name: str | None = None) -> ModuleType:
    """The engine module: ``"native"`` (the extension), ``"reference"`` (plain Python), or the default.

    Raises:
        ImportError: ``"native"`` was asked for and the extension did not import.
        ValueError: an unknown name.
    """
    if name is None:
        return _engine if _engine is not None else reference
    if name == "native":
        if _engine is None:
            raise ImportError(f"modelops_native._engine is not built: {IMPORT_ERROR}")
        return _engine
    if name == "reference":
        return reference
    raise ValueError(f"backend must be 'native' or 'reference', got {name!r}")


def default_threads() -> int:
    """Threads for mask work: ``MODELOPS_CONSTRAINT_THREADS``, else the CPUs this process may use.

    Raises:
        ValueError: the variable is set but not a positive integer (names the variable).
    """
    raw = os.environ.get("MODELOPS_CONSTRAINT_THREADS")
    if raw is None or raw == "":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"MODELOPS_CONSTRAINT_THREADS must be a positive integer, got {raw!r}")
    return n


@dataclass(frozen=True)
class Constraint:
    """A compiled constraint, immutable and shared by every row that uses it.

    Attributes:
        program: the engine's program object; digest: blake2b-128 of (spec, vocab_size);
        vocab_size: the vocabulary it was compiled for; memory_bytes: program + leaves, bytes;
        num_edges: catalog trie edges / DFA transitions over all distinct leaves.
    """

    program: Any
    digest: bytes
    vocab_size: int
    memory_bytes: int
    num_edges: int


class ConstraintCache:
    """LRU of compiled leaves and programs keyed by content hash, bounded in bytes.

    Leaves are cached separately so one 100k-item catalog is compiled once even when it appears
    in differently composed constraints. Thread-safe. Entries still in use by rows stay alive
    after eviction (rows hold their own reference).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, key: tuple) -> Any:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return hit[0]

    def put(self, key: tuple, value: Any, size: int) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, (_, old) = self._items.popitem(last=False)
                self._bytes -= old

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


def _cache_bytes() -> int:
    raw = os.environ.get("MODELOPS_CONSTRAINT_CACHE_MB", "512")
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"MODELOPS_CONSTRAINT_CACHE_MB must be an integer >= 0, got {raw!r}")
    return mb << 20


CACHE = ConstraintCache(_cache_bytes())


def _reraise(e: ValueError, path: str, kind: str = "catalog") -> ConstraintSpecError:
    """Engine messages start with a field relative to ``path`` ("items[3][0]: ..."); a literal
    is built as a one-item catalog, so its ``items[0][k]`` is its ``tokens[k]``."""
    msg = str(e)
    head, sep, rest = msg.partition(": ")
    if sep and " " not in head:
        if kind == "literal":
            head = re.sub(r"^items\[0\](\[\d+\])?", lambda m: "tokens" + (m.group(1) or ""), head)
        return ConstraintSpecError(f"{path}.{head}", f"{rest} (in a {kind})")
    return ConstraintSpecError(path, f"{msg} (in a {kind})")


def _leaf(be: ModuleType, leaf: CatalogSpec | DfaSpec, vocab_size: int, dense_min_children: int | None) -> Any:
    key = (be.__name__, "leaf", leaf_digest(leaf), vocab_size, dense_min_children)
    hit = CACHE.get(key)
    if hit is not None:
        return hit
    try:
        if isinstance(leaf, CatalogSpec):
            words = (vocab_size + 31) // 32
            dense = max(8, words) if dense_min_children is None else dense_min_children
            built = be.build_catalog(leaf.tokens, leaf.offsets, vocab_size, dense)
        else:
            sets = [s.resolve(vocab_size).tolist() for s in leaf.sets]
            trans = np.asarray(leaf.transitions, dtype=np.int32).reshape(-1, 3)
            built = be.build_dfa(leaf.num_states, leaf.start, list(leaf.accepting), sets, trans, vocab_size)
    except ValueError as e:
        raise _reraise(e, leaf.path, getattr(leaf, "kind", "dfa")) from e
    CACHE.put(key, built, built.memory_bytes)
    return built


def compile_constraint(spec: dict | ProgramSpec, vocab_size: int, *, tokenize: Tokenize | None = None,
                       root: str = "constraint", engine: str | None = None,
                       dense_min_children: int | None = None) -> Constraint:
    """Compile a constraint spec (see :mod:`modelops_native._spec`) for a vocabulary.

    Cached by content hash: the same spec and vocab_size return the same compiled program.

    Args:
        spec: the JSON-able dict (or an already parsed :class:`ProgramSpec`).
        vocab_size: tokens the logits have (row width); ids must be below it.
        tokenize: turns catalog ``texts`` into ids (required if the spec has texts).
        root: the name errors use for the spec's top level (e.g. ``extra_args.constraint``).
        engine: ``"native"``, ``"reference"`` or None (native when built).
        dense_min_children: catalog nodes with at least this many children keep a ready child
            mask (default: ceil(vocab/32), where ORing words beats setting bits); for tests.

    Raises:
        ConstraintSpecError: malformed spec, ids outside the vocabulary, an ambiguous or empty
            composition, a DFA that cannot accept; the message names the field.
    """
    be = backend(engine)
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    parsed = spec if isinstance(spec, ProgramSpec) else parse_spec(spec, root=root, tokenize=tokenize)
    if not parsed.complete:
        raise ConstraintSpecError(root, "catalog texts need the model's tokenizer (pass tokenize=)")
    digest = program_digest(parsed, vocab_size)
    key = (be.__name__, "program", digest, dense_min_children)
    hit = CACHE.get(key)
    if hit is not None:
        return hit
    leaves = [_leaf(be, s.leaf, vocab_size, dense_min_children) for s in parsed.segments]
    segments = [(leaf, s.min, s.max, list(s.separator), s.unique, s.path) for leaf, s in zip(leaves, parsed.segments)]
    try:
        program = be.Program(segments, vocab_size)
    except ValueError as e:
        msg = str(e)
        head, sep, rest = msg.partition(": ")
        raise ConstraintSpecError(head if sep else root, rest if sep else msg) from e
    distinct = {id(x): x for x in leaves}.values()
    # program.memory_bytes counts its distinct leaves (the reference reports 0: no native memory)
    c = Constraint(program, digest, vocab_size, int(program.memory_bytes), sum(int(x.num_edges) for x in distinct))
    CACHE.put(key, c, max(1, int(program.memory_bytes)))
    return c


def new_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """A zeroed int32 bitmask ``[num_rows, ceil(vocab_size / 32)]`` (bit t%32 of word t//32 = token t)."""
    return np.zeros((num_rows, (vocab_size + 31) // 32), dtype=np.int32)


class ConstraintBatch:
    """Per-row constraint states for one persistent batch, rows indexed like the model runner's.

    Not thread-safe: one caller at a time (the engine's step loop). The mask work runs on the
    batch's own thread pool with the GIL released.

    Args:
        vocab_size: logits row width; num_threads: pool size including the caller (default
            :func:`default_threads`); engine: ``"native"`` / ``"reference"`` / None.
    """

    def __init__(self, vocab_size: int, num_threads: int | None = None, engine: str | None = None) -> None:
        self.engine = backend(engine)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._b = self.engine.Batch(vocab_size, default_threads() if num_threads is None else num_threads)

    @property
    def num_threads(self) -> int:
        return self._b.num_threads

    @property
    def replays(self) -> int:
        """Rows whose history stopped extending what their state had consumed (preemption,
        truncation): they restarted from the initial state and replayed the history."""
        return self._b.replays

    def add(self, row: int, constraint: Constraint, eos: list[int] | tuple[int, ...], history: list[int] | None) -> None:
        """Put a request at ``row``: fresh state, then replay ``history`` (the live output-id list,
        kept by reference and re-read by :meth:`sync`). Replaces whatever the row held.

        Raises:
            ValueError: vocab mismatch, more than 8 EOS ids, an EOS id outside the vocabulary.
        """
        self._b.add(row, constraint.program, list(eos), history)

    def remove(self, row: int) -> None:
        self._b.remove(row)

    def move(self, src: int, dst: int) -> None:
        """One-way move: ``dst`` takes ``src``'s row (replacing it), ``src`` becomes empty."""
        self._b.move(src, dst)

    def swap(self, a: int, b: int) -> None:
        self._b.swap(a, b)

    def sync(self) -> int:
        """Advance every row over the tokens its history gained; returns rows that restarted."""
        return self._b.sync()

    def advance(self, row: int, tokens: list[int]) -> bool:
        """Consume explicit tokens (rows added without a history). False once the row is dead."""
        return self._b.advance(row, list(tokens))

    def has(self, row: int) -> bool:
        return self._b.has(row)

    def accepts(self, row: int) -> bool:
        return self._b.accepts(row)

    def dead(self, row: int) -> bool:
        return self._b.dead(row)

    def consumed(self, row: int) -> int:
        return self._b.consumed(row)

    def state_bytes(self, row: int) -> int:
        """Bytes of native state for the row (fixed part + the used-item list)."""
        return self._b.state_bytes(row)

    def fill(self, out: np.ndarray, num_rows: int) -> np.ndarray:
        """Write rows [0, num_rows) of the int32 bitmask ``out`` [>= num_rows, words]; rows without
        a constraint allow every token. Returns ``out``.

        Raises:
            ValueError: ``out`` has the wrong dtype, shape or layout.
        """
        self._b.fill(out, num_rows)
        return out

    def apply_(self, logits: torch.Tensor, bitmask: np.ndarray, num_rows: int | None = None) -> torch.Tensor:
        """Set ``logits[r, t] = -inf`` where bit t of ``bitmask[r]`` is 0, in place, for the first
        ``num_rows`` rows (default: all). Returns ``logits``.

        CPU float32/bfloat16/float16 tensors with contiguous rows go through the native kernel on
        the pool (one memory-bound pass, about the cost of ``logits.fill_``); anything else (CUDA)
        through :func:`apply_bitmask_torch_`.
        """
        n = logits.shape[0] if num_rows is None else num_rows
        code = _DTYPE_CODES.get(str(logits.dtype))
        if (logits.device.type == "cpu" and code is not None and logits.dim() == 2 and logits.stride(-1) == 1
                and self.engine is _engine and n > 0):
            self._b.apply(logits.data_ptr(), code, n, logits.shape[1], logits.stride(0), bitmask)
            return logits
        import torch

        apply_bitmask_torch_(logits[:n], torch.from_numpy(bitmask[:n]))
        return logits


def apply_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Torch path of :meth:`ConstraintBatch.apply_`, for any device: unpack bits, one ``masked_fill_``.

    ``bitmask`` int32 [rows, >= ceil(V/32)] (CPU or on ``logits.device``; copied non-blocking if
    needed); ``logits`` [rows, V]. Returns ``logits``.
    """
    import torch

    rows, vocab = logits.shape
    bits = bitmask[:rows].to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).to(torch.bool).reshape(rows, -1)[:, :vocab]
    return logits.masked_fill_(~allowed, float("-inf"))
