"""Writing a stream's bytes into its part file: reused page-aligned buffers, ``O_DIRECT`` writes
where the file system takes them, and an in-order commit step (hash, journal) behind the writes.

Why ``O_DIRECT``: a buffered write puts every byte of the model into the page cache first. A
pull of a large model on a serving node then evicts what its instances read, and the pull's rate
becomes the page cache's: on this VM (virtio-balloon free page reporting) every fresh page-cache
page costs a host fault. ``O_DIRECT`` from reused buffers runs at the disk's rate instead: in the
9-round runs of bench/materialize.py, 0.97 of one thread writing the same GET with ``O_DIRECT``,
and 0.65-0.80 of the GET read to nothing where the page cache path made 0.49-0.71 (the host's
disk and memory swing from run to run; reading the file back right after costs the other way:
about 1 GB/s from disk, 8 GB/s from the page cache). Blocks wholly inside
a chunk go down directly; the unaligned head and tail of a range (file starts, part edges, the
file's last block) go through the page cache on a second descriptor. The two never write the
same block, so the file reads back coherent either way. A file system that refuses
``O_DIRECT`` (``EINVAL`` on open or on a write) gets buffered writes, with one warning per folder.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

__all__ = ["ALIGN", "STREAM_BUFFERS", "BufferPool", "PartFile", "RangePipeline"]

log = logging.getLogger(__name__)

# Offset and length alignment of O_DIRECT writes: the largest logical block size of common
# devices (4Kn disks; 512-byte ones accept it too); mmap'd buffers are page-aligned.
ALIGN = 4096
# Writes in flight per stream. Measured (2 cores, one GET from moto into O_DIRECT, 4 MiB chunks):
# one writer 0.69-0.77 of the read-to-nothing rate, two 0.83-0.94, four 0.64-0.73.
WRITERS = 2
# Buffers one stream may hold (being read, written or committed): enough for the reader to run
# ahead of two writes, few enough that one large file does not take the whole pool.
STREAM_BUFFERS = 8


_warned: set[Path] = set()


def _fallback(path: Path, why: str) -> None:
    """Say once per folder (per process) that its files go through the page cache."""
    if path.parent not in _warned:
        _warned.add(path.parent)
        log.warning("%s: %s; writing through the page cache (set MODELOPS_MATERIALIZE_DIRECT_IO=false to skip "
                    "the attempt)", path.parent, why)


class BufferPool:
    """Page-aligned buffers of ``size`` bytes, reused across streams (their pages stay resident
    and warm); at most ``limit`` exist, so memory stays at ``size × limit`` however the streams
    run. :meth:`get` blocks until one is free."""

    def __init__(self, size: int, limit: int) -> None:
        self.size, self.limit = size, limit
        self._free: list[memoryview] = []
        self._made = 0
        self._cond = threading.Condition()

    def get(self, stop: threading.Event | None = None) -> memoryview | None:
        """A free buffer; None when ``stop`` was set while waiting."""
        with self._cond:
            while not self._free and self._made >= self.limit:
                if stop is not None and stop.is_set():
                    return None
                self._cond.wait(0.2)
            if self._free:
                return self._free.pop()
            self._made += 1
        return self._new()

    def warm(self, n: int) -> None:
        """Make up to ``n`` buffers on a thread of its own, their pages faulted in: a transfer
        calls this before its first request, so the first bytes land in resident pages (on this
        VM a fresh page costs a host fault: 24 buffers took 33-70 ms to fault in)."""
        def make() -> None:
            for _ in range(n):
                with self._cond:
                    if self._made >= self.limit:
                        return
                    self._made += 1
                self.put(self._new())

        threading.Thread(target=make, name="buffers", daemon=True).start()

    def _new(self) -> memoryview:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return memoryview(mmap.mmap(-1, self.size, flags=flags))

    def put(self, buf: memoryview) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class PartFile:
    """A preallocated part file open for writing: whole aligned blocks with ``O_DIRECT`` (when
    ``direct`` and the file system allows it), the rest through the page cache.

    :meth:`write` takes a view whose start lies at offset ``at % ALIGN`` of a page-aligned
    buffer (what :class:`RangePipeline` hands it), so the aligned blocks of the file are aligned
    in memory too. Safe to call from several threads for disjoint byte ranges."""

    def __init__(self, path: Path, direct: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY)
        self.direct_fd = -1
        self.direct = False  # O_DIRECT in use (turned off for good by a refused write)
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    os.close(self.fd)
                    raise
                _fallback(path, f"the file system refuses O_DIRECT ({e})")

    def write(self, view: memoryview, at: int) -> None:
        """Write all of ``view`` at file offset ``at``.

        Raises:
            OSError: from the write (ENOSPC and the like); a short write is continued."""
        n = len(view)
        lo, hi = -(-at // ALIGN) * ALIGN, (at + n) // ALIGN * ALIGN
        if not self.direct or hi <= lo:
            self._all(self.fd, view, at)
            return
        self._all(self.fd, view[:lo - at], at)
        self._all(self.fd, view[hi - at:], hi)
        try:
            self._all(self.direct_fd, view[lo - at:hi - at], lo, direct=True)
        except OSError as e:
            if e.errno != errno.EINVAL:  # a stricter alignment than ALIGN: the page cache takes it
                raise
            if self.direct:  # the descriptor stays open until close(): another writer may be in it
                _fallback(self.path, f"an O_DIRECT write was refused ({e})")
                self.direct = False
            self._all(self.fd, view[lo - at:hi - at], lo)

    def _all(self, fd: int, view: memoryview, at: int, direct: bool = False) -> None:
        while len(view):
            done = os.pwrite(fd, view, at)
            if not done and not direct:
                raise OSError(errno.ENOSPC, f"nothing written at byte {at}", str(self.path))
            view, at = view[done:], at + done
            if direct and len(view):  # a short direct write (full disk, signal): the rest buffered
                fd, direct = self.fd, False

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1


class _Stage:
    """Threads that run ``fn`` on items fed through a queue of at most ``depth`` items (one
    thread: in order). After ``fn`` raised once, later items go to ``drop`` instead (their
    buffers must still be returned). Writes and CRC/MD5 updates release the GIL, so stages
    overlap the reading thread."""

    def __init__(self, fn: Callable, depth: int, threads: int = 1, drop: Callable | None = None) -> None:
        self.fn, self.drop, self.error = fn, drop, None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is not None:
                if self.drop:
                    self.drop(*item)
                continue
            try:
                self.fn(*item)
            except BaseException as e:  # noqa: BLE001 - raised to the feeder by put() or close()
                self.error = e

    def put(self, *item) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put(item)

    def close(self) -> None:
        """Wait until every item fed is done; raise the stage's error. Safe to call twice."""
        if any(t.is_alive() for t in self._threads):
            for _ in self._threads:
                self._queue.put(None)
            for t in self._threads:
                t.join()
        if self.error is not None:
            raise self.error


class RangePipeline:
    """One stream's writes and commits: the reading thread fills pool buffers and
    :meth:`submit`\\ s them; :data:`WRITERS` threads write them (any order); one thread then
    takes them in stream order, waits for each one's write, calls ``commit(view, at)`` (hash,
    journal) and returns the buffer. So whatever ``commit`` records is on its way to disk, and
    a failed write stops every later commit."""

    def __init__(self, part: PartFile, pool: BufferPool, commit: Callable[[memoryview, int], None] | None) -> None:
        self.part, self.pool, self.commit = part, pool, commit
        self._slots = threading.Semaphore(STREAM_BUFFERS)
        self._writes = _Stage(self._write, STREAM_BUFFERS, threads=WRITERS)
        self._commits = _Stage(self._commit, STREAM_BUFFERS, drop=self._release)

    def buffer(self, stop: threading.Event | None = None) -> memoryview | None:
        """A pool buffer for this stream (at most :data:`STREAM_BUFFERS` held at once); None
        when ``stop`` was set while waiting. Hand it back with :meth:`submit` or :meth:`unused`."""
        while not self._slots.acquire(timeout=0.2):
            if stop is not None and stop.is_set():
                return None
        buf = self.pool.get(stop)
        if buf is None:
            self._slots.release()
        return buf

    def unused(self, buf: memoryview) -> None:
        """Return a buffer from :meth:`buffer` that was not submitted."""
        self.pool.put(buf)
        self._slots.release()

    def _write(self, view: memoryview, at: int, done: Future) -> None:
        try:
            self.part.write(view, at)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to the commit thread
            done.set_exception(e)

    def _commit(self, buf: memoryview, view: memoryview, at: int, done: Future) -> None:
        try:
            done.result()
            if self.commit:
                self.commit(view, at)
        finally:
            self.unused(buf)

    def _release(self, buf: memoryview, view: memoryview, at: int, done: Future) -> None:
        done.exception()  # wait: the write may still read the buffer
        self.unused(buf)

    @property
    def error(self) -> BaseException | None:
        """The first write's or commit's error, once the commit thread has met it."""
        return self._commits.error

    def submit(self, buf: memoryview, view: memoryview, at: int) -> None:
        """Queue ``view`` (a slice of ``buf`` from :meth:`buffer`, starting at offset
        ``at % ALIGN`` of it) for file offset ``at``; ``buf`` returns to the pool once committed.

        Raises:
            BaseException: an earlier write's or commit's error (``buf`` is returned)."""
        done: Future = Future()
        self._writes.put(view, at, done)
        try:
            self._commits.put(buf, view, at, done)
        except BaseException:
            self._release(buf, view, at, done)
            raise

    def close(self) -> None:
        """Wait for every write and commit submitted; raise the first error. Safe to call twice."""
        try:
            self._writes.close()
        finally:
            self._commits.close()
