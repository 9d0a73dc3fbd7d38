"""Batch inference's state, in the registry's database: files, batches and the result cache.

The file contents live in S3 (tasks/batch/files.py); here are their records. A batch's row is
written before each side effect (a flow run started, a chunk written), so a resumed runner
knows what was done. Times are Unix seconds (int), as OpenAI's objects give them.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from sqlalchemy import String, Text, delete, func, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from modelops.batch import TERMINAL
from modelops.registry import Registry

__all__ = ["ACTIVE", "Batch", "BatchFile", "BatchStore", "CachedResult"]

# Statuses a runner still has work in (resumed when its runner went silent).
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class _Base(DeclarativeBase):
    pass


class BatchFile(_Base):
    """An uploaded or produced file: ``owner`` is the API key's name ("" while the router takes
    requests without keys); its bytes are in S3 under ``files/<id>``."""

    __tablename__ = "batch_files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(63), index=True, default="")
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[int] = mapped_column()

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")


class Batch(_Base):
    """One batch: OpenAI's fields, plus its runner's lease (``runner``, ``heartbeat``), the flow
    run that runs it, how often it was resumed and how many answers came from the cache."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(63), index=True, default="")
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8), default="24h")
    status: Mapped[str] = mapped_column(String(16), default="validating", index=True)
    total: Mapped[int] = mapped_column(default=0)
    completed: Mapped[int] = mapped_column(default=0)
    failed: Mapped[int] = mapped_column(default=0)
    cache_hits: Mapped[int] = mapped_column(default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    error_file_id: Mapped[str | None] = mapped_column(String(40), default=None)
    metadata_json: Mapped[str] = mapped_column(Text, default="null")
    errors_json: Mapped[str] = mapped_column(Text, default="null")
    flow_run_id: Mapped[str] = mapped_column(String(64), default="")
    runner: Mapped[str] = mapped_column(String(64), default="")
    heartbeat: Mapped[float] = mapped_column(default=0.0)
    resumes: Mapped[int] = mapped_column(default=0)
    concurrency: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[int] = mapped_column()
    in_progress_at: Mapped[int | None] = mapped_column(default=None)
    expires_at: Mapped[int | None] = mapped_column(default=None)
    finalizing_at: Mapped[int | None] = mapped_column(default=None)
    completed_at: Mapped[int | None] = mapped_column(default=None)
    failed_at: Mapped[int | None] = mapped_column(default=None)
    expired_at: Mapped[int | None] = mapped_column(default=None)
    cancelling_at: Mapped[int | None] = mapped_column(default=None)
    cancelled_at: Mapped[int | None] = mapped_column(default=None)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's batch object; ``modelops`` adds what OpenAI's lacks (cache hits, resumes,
        the current concurrency, the Prefect flow run)."""
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": json.loads(self.errors_json),
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                **{t: getattr(self, t) for t in _TIMES},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": json.loads(self.metadata_json),
                "modelops": {"cache_hits": self.cache_hits, "resumes": self.resumes, "concurrency": self.concurrency,
                             "flow_run_id": self.flow_run_id or None}}


class CachedResult(_Base):
    """One cached answer (``body``, the JSON text) to a deterministic request, keyed by
    :func:`modelops.batch.cache_key`."""

    __tablename__ = "result_cache"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(63), index=True)
    version: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column()
    hits: Mapped[int] = mapped_column(default=0)
    last_used: Mapped[float] = mapped_column(index=True)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class BatchStore:
    """Files, batches and cached results in the registry's database (tables made on first use).

    Args:
        registry: whose database holds the tables.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        _Base.metadata.create_all(registry.engine)

    # -- files -----------------------------------------------------------------------------
    def new_file_id(self) -> str:
        """An id for a file about to be stored (its bytes first, then :meth:`record_file`)."""
        return _new_id("file-")

    def record_file(self, file_id: str, owner: str, filename: str, purpose: str, size: int) -> BatchFile:
        """Record a file stored under ``file_id``; a second call for the same id (a retried
        finalize) returns the first record."""
        with self.registry.session() as s:
            if f := s.get(BatchFile, file_id):
                return f
            f = BatchFile(id=file_id, owner=owner, filename=filename, purpose=purpose, bytes=size,
                          created_at=int(time.time()))
            s.add(f)
        return f

    def file(self, file_id: str, owner: str | None = None) -> BatchFile | None:
        """The file, or None when there is none of that id (for ``owner``, when given)."""
        with self.registry.session() as s:
            f = s.get(BatchFile, file_id)
        return f if f is not None and (owner is None or f.owner == owner) else None

    def files(self, owner: str, purpose: str | None = None) -> list[BatchFile]:
        """``owner``'s files, newest first."""
        with self.registry.session() as s:
            q = select(BatchFile).where(BatchFile.owner == owner)
            if purpose:
                q = q.where(BatchFile.purpose == purpose)
            return list(s.scalars(q.order_by(BatchFile.created_at.desc(), BatchFile.id)))

    def delete_file(self, file_id: str) -> None:
        with self.registry.session() as s:
            s.execute(delete(BatchFile).where(BatchFile.id == file_id))

    # -- batches ---------------------------------------------------------------------------
    def add_batch(self, owner: str, endpoint: str, input_file_id: str, completion_window: str,
                  metadata: dict[str, str] | None, window_s: int = 24 * 3600) -> Batch:
        """Record a new batch, ``validating``, expiring ``window_s`` after now."""
        now = int(time.time())
        with self.registry.session() as s:
            b = Batch(id=_new_id("batch_"), owner=owner, endpoint=endpoint, input_file_id=input_file_id,
                      completion_window=completion_window, metadata_json=json.dumps(metadata), created_at=now,
                      expires_at=now + window_s)
            s.add(b)
        return b

    def batch(self, batch_id: str, owner: str | None = None) -> Batch | None:
        """The batch, or None when there is none of that id (for ``owner``, when given)."""
        with self.registry.session() as s:
            b = s.get(Batch, batch_id)
        return b if b is not None and (owner is None or b.owner == owner) else None

    def batches(self, owner: str | None = None, statuses: tuple[str, ...] | None = None) -> list[Batch]:
        """Batches (of ``owner``, in ``statuses``, when given), newest first."""
        with self.registry.session() as s:
            q = select(Batch)
            if owner is not None:
                q = q.where(Batch.owner == owner)
            if statuses:
                q = q.where(Batch.status.in_(statuses))
            return list(s.scalars(q.order_by(Batch.created_at.desc(), Batch.id.desc())))

    def update(self, batch_id: str, only_from: tuple[str, ...] | None = None, **fields: Any) -> Batch:
        """Set ``fields`` of the batch; ``status`` also stamps its ``<status>_at`` time once.
        With ``only_from``, nothing changes unless the batch's status is one of those (read and
        written in one transaction: a cancel and a runner's end do not overwrite each other).

        Raises:
            KeyError: no such batch.
        """
        with self.registry.session() as s:
            b = s.get(Batch, batch_id, with_for_update=True)
            if b is None:
                raise KeyError(batch_id)
            if only_from is not None and b.status not in only_from:
                return b
            for k, v in fields.items():
                setattr(b, k, v)
            stamp = f"{fields.get('status')}_at"
            if stamp in _TIMES and getattr(b, stamp) is None:
                setattr(b, stamp, int(time.time()))
        return b

    def claim(self, batch_id: str, runner: str, stale_after_s: float) -> Batch | None:
        """Take the batch for ``runner``: when it has no runner, this one, or one silent for
        ``stale_after_s``. Returns the batch, or None when another live runner holds it or it
        is over (one of :data:`modelops.batch.TERMINAL`)."""
        now = time.time()
        with self.registry.session() as s:
            b = s.get(Batch, batch_id, with_for_update=True)
            if b is None or b.status in TERMINAL:
                return None
            if b.runner and b.runner != runner and now - b.heartbeat < stale_after_s:
                return None
            if b.runner and b.runner != runner:
                b.resumes += 1
            b.runner, b.heartbeat = runner, now
        return b

    def beat(self, batch_id: str, runner: str, **fields: Any) -> Batch | None:
        """The runner's heartbeat, with progress ``fields``; None when it lost the batch (another
        runner took it over), and must stop."""
        with self.registry.session() as s:
            n = s.execute(update(Batch).where(Batch.id == batch_id, Batch.runner == runner)
                          .values(heartbeat=time.time(), **fields)).rowcount
        return self.batch(batch_id) if n else None

    def stale(self, stale_after_s: float) -> list[Batch]:
        """Active batches whose runner has been silent for ``stale_after_s`` (or never began)."""
        cutoff = time.time() - stale_after_s
        with self.registry.session() as s:
            return list(s.scalars(select(Batch).where(Batch.status.in_(ACTIVE), Batch.heartbeat < cutoff,
                                                      Batch.created_at < cutoff)))

    # -- result cache ----------------------------------------------------------------------
    def cached(self, key: str, touch: bool = True) -> str | None:
        """The cached answer (JSON text) for ``key``; None on a miss. ``touch``: mark it used
        now (a hit, a write); a caller that marks many passes False and marks them with
        :meth:`keep`'s ``used``."""
        with self.registry.session() as s:
            row = s.get(CachedResult, key)
            if row is None:
                return None
            if touch:
                row.hits += 1
                row.last_used = time.time()
            return row.body

    def cache(self, key: str, model_id: str, version: str, body: str) -> None:
        """Keep ``body`` (JSON text) as the answer for ``key`` (a second put keeps the first)."""
        self.keep([(key, model_id, version, body)])

    def keep(self, answers: Iterable[tuple[str, str, str, str]] = (), used: Iterable[str] = ()) -> None:
        """In one transaction: keep each answer ``(key, model_id, version, body)`` whose key
        has none yet (the first kept stays), and mark each key of ``used`` used now, a hit
        each time it is listed (a key no longer cached is skipped)."""
        now, first = time.time(), {}
        for key, model_id, version, body in answers:
            first.setdefault(key, (model_id, version, body))
        with self.registry.session() as s:
            for key, (model_id, version, body) in first.items():
                if s.get(CachedResult, key) is None:
                    s.add(CachedResult(key=key, model_id=model_id, version=version, body=body,
                                       size=len(body.encode()), last_used=now))
            for key, n in Counter(used).items():
                s.execute(update(CachedResult).where(CachedResult.key == key)
                          .values(hits=CachedResult.hits + n, last_used=now))

    def invalidate(self, model_id: str, keep_version: str) -> int:
        """Drop ``model_id``'s entries of every version but ``keep_version`` (the one serving);
        returns how many went."""
        with self.registry.session() as s:
            return s.execute(delete(CachedResult).where(CachedResult.model_id == model_id,
                                                        CachedResult.version != keep_version)).rowcount

    def evict(self, budget_bytes: int) -> int:
        """Drop the least recently used entries until the cache holds at most ``budget_bytes``
        of answers; returns how many went."""
        gone = 0
        with self.registry.session() as s:
            total = s.scalar(select(func.coalesce(func.sum(CachedResult.size), 0)))
            if total <= budget_bytes:
                return 0
            for key, size in s.execute(select(CachedResult.key, CachedResult.size).order_by(CachedResult.last_used)):
                if total <= budget_bytes:
                    break
                s.execute(delete(CachedResult).where(CachedResult.key == key))
                total, gone = total - size, gone + 1
        return gone

    def cache_stats(self) -> dict[str, int]:
        """``{"entries", "bytes", "hits"}`` of the whole cache."""
        with self.registry.session() as s:
            n, size, hits = s.execute(select(func.count(), func.coalesce(func.sum(CachedResult.size), 0),
                                             func.coalesce(func.sum(CachedResult.hits), 0))).one()
        return {"entries": n, "bytes": size, "hits": hits}
