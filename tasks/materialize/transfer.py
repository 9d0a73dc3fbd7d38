"""The transfer: a source's files into ``<fsx_root>/<model_id>/<version>/``, verified, atomically.

- **Plan**: per file, the check it gets (sha256 from ``SHA256SUMS``, the S3 ETag with its part
  layout, or the size for local sources) and its byte ranges. A multipart object's ranges are
  whole groups of its parts, so every part's MD5 is computed while its bytes stream in.
- **Space**: the bytes still to write are checked against the file system's free space before
  anything is written; each new file is preallocated (``posix_fallocate``).
- **Parallel transfer**: ``materialize_concurrency`` threads fetch ranges in 8 MiB reads into
  their offsets of a ``.modelops-part`` file; the thread that writes a file's last range
  verifies it.
- **Resume**: a journal records, against the listing entry, each range written (with its part
  digests) and each file verified; a rerun keeps both and fetches only the rest. Once all are
  verified, a completion record is written and the staging folder renamed into place.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from modelops.errors import MaterializeError
from modelops.fs import replace_dir
from modelops.manifest import Manifest
from modelops.settings import Settings, get_settings
from tasks.materialize.cache import clean_strays, is_complete, listing_of, read_record, version_lock
from tasks.materialize.digests import (
    StreamHasher,
    compress_layout,
    etag_of_parts,
    expand_layout,
    file_digests,
    parse_sums,
)
from tasks.materialize.sources import (
    COMPLETION_RECORD,
    JOURNAL,
    PART,
    SUMS_FILE,
    S3Source,
    Source,
    SourceFile,
    list_source,
    open_source,
)

__all__ = ["MaterializeResult", "materialize"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with bytes just written


@dataclass(frozen=True)
class MaterializeResult:
    """Where the weights are and what it took: ``path`` on FSx, ``bytes`` total size,
    ``files`` count, ``transferred`` bytes actually copied (0 on a cache hit), ``seconds``."""

    path: Path
    files: int
    bytes: int
    transferred: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.transferred / 1e6 / max(self.seconds, 1e-9)


@dataclass
class _Check:
    """How one file is verified: ``kind`` sha256 | md5 (single-part ETag) | etag (multipart) |
    size; ``parts`` the multipart layout (bytes per part), ``exact`` whether it was read part
    by part or assumed from part 1."""

    kind: str
    parts: list[int] = field(default_factory=list)
    exact: bool = True

    @property
    def algo(self) -> str | None:
        return {"sha256": "sha256", "md5": "md5", "etag": "md5"}.get(self.kind)


def _ranges(f: SourceFile, check: _Check, range_size: int,
            written: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The GET ranges still to fetch of ``f`` (``range_size`` 0: one range).

    A multipart ETag's ranges are runs of whole parts not yet ``written`` (the journal records
    each part as it completes), up to ``range_size`` each; any other file's are equal slices,
    skipping those written."""
    if f.size == 0:
        return [] if (0, 0) in written else [(0, 0)]
    if check.kind != "etag":
        step = f.size if range_size <= 0 or f.size <= range_size else range_size
        return [r for r in ((s, min(s + step, f.size)) for s in range(0, f.size, step)) if r not in written]
    out: list[tuple[int, int]] = []
    start = pos = 0
    for size in check.parts:
        end = pos + size
        if any(s <= pos and end <= e for s, e in written):  # done: the run so far is one range
            if pos > start:
                out.append((start, pos))
            start = end
        elif range_size and end - start >= range_size:
            out.append((start, end))
            start = end
        pos = end
    if pos > start:
        out.append((start, pos))
    return out


def _cuts(check: _Check, start: int, end: int) -> list[int]:
    """Offsets strictly inside ``(start, end)`` where a part begins."""
    out, pos = [], 0
    for size in check.parts[:-1]:
        pos += size
        if start < pos < end:
            out.append(pos)
        elif pos >= end:
            break
    return out


class _Stage:
    """One step of a stream's pipeline (write, hash) on a thread of its own, fed in order
    through a queue of at most ``depth`` chunks. Reads, ``pwrite`` and hashing all release the
    GIL, so the three overlap: measured on 2 cores against moto, one stream that did them in
    turn reached about 170 MB/s, pipelined about 300 (bench/results/materialize.json)."""

    def __init__(self, fn: Callable, depth: int = 2) -> None:
        self.fn, self.error = fn, None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is None:
                try:
                    self.fn(*item)
                except BaseException as e:  # noqa: BLE001 - raised to the feeder by put() or close()
                    self.error = e

    def put(self, *item) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put(item)

    def close(self) -> None:
        """Wait until every chunk fed is done; raise the stage's error. Safe to call twice."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self.error is not None:
            raise self.error


def _allocate(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)  # blocks reserved now: no ENOSPC halfway
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, size)  # a file system without fallocate: sparse, as before
    finally:
        os.close(fd)


def materialize(manifest: Manifest, settings: Settings | None = None, progress: Progress | None = None,
                total_callback: Callable[[int], None] | None = None) -> MaterializeResult:
    """Copy the source's files to ``<fsx_root>/<model_id>/<version>/``, verified, atomically.

    Idempotent and resumable (see the module docstring). ``progress`` is called with each
    chunk's byte count as it is written; ``total_callback`` once with the bytes still to fetch.

    Raises:
        ManifestError: see :func:`~tasks.materialize.sources.list_source`.
        MaterializeError: the endpoint did not answer in time, there is not enough free space
            (nothing written), a transfer failed or a file failed verification (verified files
            stay staged for the next attempt, the failed one is removed, nothing is published).
    """
    settings = settings or get_settings()
    t0 = time.monotonic()
    files = list_source(manifest, settings)
    total = sum(f.size for f in files.values())
    dest = settings.fsx_dir / manifest.model_id / manifest.version
    with version_lock(dest.parent, manifest.version):
        clean_strays(dest.parent, manifest.version)
        if is_complete(dest, files):
            os.utime(dest / COMPLETION_RECORD)  # last use, for LRU eviction
            log.info("cache hit: %s (%d files, %.1f MB) already on FSx, nothing transferred", dest, len(files), total / 1e6)
            if total_callback:
                total_callback(0)
            return MaterializeResult(dest, len(files), total, 0, time.monotonic() - t0)
        transferred = _Transfer(manifest, settings, files, dest).run(progress, total_callback, t0)
    seconds = time.monotonic() - t0
    result = MaterializeResult(dest, len(files), total, transferred, seconds)
    log.info("materialized %s → %s: %d files, %.1f MB, %.1f MB transferred in %.1f s (%.0f MB/s)", manifest.source,
             dest, len(files), total / 1e6, transferred / 1e6, seconds, result.mb_per_s)
    return result


class _Transfer:
    """One materialization's plan, state and workers (see the module docstring)."""

    def __init__(self, manifest: Manifest, settings: Settings, files: dict[str, SourceFile], dest: Path) -> None:
        self.manifest, self.settings, self.files, self.dest = manifest, settings, files, dest
        self.source: Source = open_source(manifest, settings)
        self.staging = dest.parent / f".staging-{manifest.version}"
        self.journal_path = self.staging / JOURNAL
        self.listing = listing_of(files)
        self.lock = threading.Lock()
        self.stop = threading.Event()  # set on the first failure or Ctrl-C: workers quit between chunks
        self.moved = 0
        self.last_save = 0.0
        self.sums: dict[str, str] = {}
        self.checks: dict[str, _Check] = {}

    # -- planning ------------------------------------------------------------------------------
    def _load_journal(self) -> dict:
        try:
            return json.loads(self.journal_path.read_text())
        except (OSError, ValueError):
            return {}

    def _plan_checks(self, keys: list[str], journal: dict) -> None:
        s3 = isinstance(self.source, S3Source)
        multipart = []
        for key in keys:
            f = self.files[key]
            if key in self.sums:
                self.checks[key] = _Check("sha256")
            elif not s3:
                self.checks[key] = _Check("size")
            elif f.parts:
                entry = journal.get(key, {})
                if entry.get("listing") == self.listing[key] and "layout" in entry:  # read before: cached
                    self.checks[key] = _Check("etag", expand_layout(entry["layout"]), entry.get("exact", False))
                else:
                    multipart.append(f)
            else:
                self.checks[key] = _Check("md5")
        if multipart:  # one HeadObject per object (more for an unequal layout), in parallel
            with ThreadPoolExecutor(max(1, self.settings.materialize_concurrency), thread_name_prefix="layout") as pool:
                for f, (parts, exact) in zip(multipart, pool.map(self.source.part_layout, multipart)):
                    self.checks[f.key] = _Check("etag", parts, exact)

    def run(self, progress: Progress | None, total_callback: Callable[[int], None] | None, t_start: float) -> int:
        if SUMS_FILE in self.files:
            self.sums = parse_sums(b"".join(self.source.stream(SUMS_FILE, 0, self.files[SUMS_FILE].size)).decode())
            if missing := sorted(set(self.sums) - set(self.files)):
                raise MaterializeError(f"{SUMS_FILE} lists {len(missing)} file(s) the source does not have, e.g. "
                                       f"{missing[0]!r}; upload them or fix {SUMS_FILE}")
        journal = self._load_journal() if self.staging.is_dir() else {}
        # Files of an earlier complete copy whose listing entry is unchanged are hard-linked into
        # staging (same file system): a changed file re-fetches that file, not the model.
        previous = read_record(self.dest)
        reuse = {} if previous is None else {
            k: e for k, e in previous["files"].items()
            if k in self.listing and {"size": e["size"], "etag": e["etag"]} == self.listing[k] and k not in journal
            and (self.dest / k).is_file() and not (self.staging / k).exists()}
        # Per file: verified earlier against the same listing entry → keep; a .part with ranges
        # recorded as written → fetch the other ranges; anything else → fetch again from scratch.
        keep, resume, fresh = set(reuse), {}, []
        for key, f in sorted(self.files.items()):
            if key in keep:
                continue
            entry = journal.get(key, {})
            same = entry.get("listing") == self.listing[key]
            final, part = self.staging / key, self.staging / (key + PART)
            if same and "digest" in entry and final.is_file() and final.stat().st_size == f.size:
                keep.add(key)
            elif same and "ranges" in entry and part.is_file() and part.stat().st_size == f.size:
                resume[key] = entry
            else:
                fresh.append(f)
        self._check_space(fresh)
        self._plan_checks([k for k in self.files if k not in keep], journal)

        self.staging.mkdir(parents=True, exist_ok=True)
        for key, entry in reuse.items():
            new = self.staging / key
            new.parent.mkdir(parents=True, exist_ok=True)
            os.link(self.dest / key, new)
            journal[key] = {"listing": self.listing[key], "digest": entry["digest"], **(
                {"layout": entry["parts"]} if "parts" in entry else {})}
        work: list[tuple[SourceFile, list[tuple[int, int]]]] = []
        for key, entry in resume.items():
            f = self.files[key]
            written = [tuple(r) for r in entry["ranges"]]
            work.append((f, _ranges(f, self.checks[key], self.source.range_size(f.size), written)))
        for f in fresh:
            (self.staging / f.key).unlink(missing_ok=True)
            check = self.checks[f.key]
            journal[f.key] = {"listing": self.listing[f.key], "ranges": [], "hashes": {},
                              **({"layout": compress_layout(check.parts), "exact": check.exact} if check.parts else {})}
            work.append((f, _ranges(f, check, self.source.range_size(f.size))))
        self.journal = journal
        # The reset entries must be on disk before their .part files are emptied: a stale entry
        # that still lists written ranges would otherwise vouch for zeroed bytes after a kill.
        self._save(force=True)
        for f in fresh:
            try:
                _allocate(self.staging / (f.key + PART), f.size)
            except OSError as e:
                raise MaterializeError(f"cannot allocate {f.size} bytes for {f.key} in {self.staging}: {e}") from e
        todo_bytes = sum(e - s for _, rs in work for s, e in rs)
        if total_callback:
            total_callback(todo_bytes)
        self.remaining = {f.key: len(rs) for f, rs in work}
        self._run_workers(work, progress, t_start)
        self._publish()
        return self.moved

    def _check_space(self, fresh: list[SourceFile]) -> None:
        need = sum(f.size for f in fresh)
        probe = next(p for p in (self.staging, self.dest.parent, *self.dest.parents) if p.exists())
        free = shutil.disk_usage(probe).free
        if need > free:
            raise MaterializeError(
                f"not enough space on {self.settings.fsx_dir} for {self.manifest.model_id} {self.manifest.version}: "
                f"{need / 1e9:.2f} GB to write, {free / 1e9:.2f} GB free; free some with `modelops cache evict "
                "--budget-gb N` (abandoned staging folders count) or give the cache a larger file system")

    # -- workers -------------------------------------------------------------------------------
    def _save(self, force: bool = False) -> None:
        """Write the journal (call with the lock held, or before the workers start). At most
        every 0.5 s unless forced: a kill loses at most that much bookkeeping, and what it
        loses is fetched again, never trusted."""
        if not force and time.monotonic() - self.last_save < 0.5:
            return
        tmp = self.journal_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.journal))
        os.replace(tmp, self.journal_path)
        self.last_save = time.monotonic()

    def _record_piece(self, f: SourceFile, start: int, end: int, digests: list[bytes] | None) -> None:
        """Journal bytes ``[start, end)`` of ``f`` as written (and their digests); call with the
        lock held."""
        entry = self.journal[f.key]
        entry["ranges"].append([start, end])
        if digests is not None:
            entry.setdefault("hashes", {})[str(start)] = [d.hex() for d in digests]
        self._save()

    def _fetch_range(self, f: SourceFile, start: int, end: int, progress: Progress | None) -> None:
        """GET ``[start, end)`` of ``f`` into its part file through a pipeline: this thread
        reads, a stage writes, a stage after it hashes and journals each part it completes (so
        a journaled part is written and a kill loses at most the parts in flight)."""
        check = self.checks[f.key]
        # A digest worth computing here: every part of a multipart ETag, or the whole file.
        whole = (start, end) == (0, f.size)
        hasher = StreamHasher(check.algo, start, _cuts(check, start, end)) \
            if check.kind == "etag" or (check.algo and whole) else None

        def hashed(chunk, _at) -> None:
            parts = hasher.update(chunk)
            if check.kind == "etag" and parts:
                with self.lock:
                    for a, b, digest in parts:
                        self._record_piece(f, a, b, [digest])

        fd = os.open(self.staging / (f.key + PART), os.O_WRONLY)
        hash_stage = _Stage(hashed) if hasher else None

        def write(chunk, at) -> None:
            os.pwrite(fd, chunk, at)
            if hash_stage:
                hash_stage.put(chunk, at)

        stages = [_Stage(write)] + ([hash_stage] if hash_stage else [])  # closed in this order
        try:
            pos = start
            # A stream that drops or stalls resumes from the last byte written, within the same
            # budget of tries as each request (s3_max_attempts).
            attempts = max(1, self.settings.s3_max_attempts)
            for attempt in range(1, attempts + 1):
                if self.stop.is_set():
                    return
                try:
                    for chunk in self.source.stream(f.key, pos, end):
                        if self.stop.is_set():
                            return
                        stages[0].put(chunk, pos)
                        pos += len(chunk)
                        with self.lock:
                            self.moved += len(chunk)
                        if progress:
                            progress(len(chunk))
                    if pos == end:
                        break
                    problem = f"ended early at byte {pos}"
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):  # the disk, not the network
                        raise MaterializeError(f"{f.key}: cannot write to {self.staging}: {e}") from e
                    problem = str(e)
                except Exception as e:  # a dropped connection mid-stream; botocore retried the request itself
                    problem = str(e)
                if attempt == attempts:
                    raise MaterializeError(f"{f.key}: bytes {start}-{end} failed after {attempt} attempts: {problem}")
                log.warning("%s: bytes %d-%d: %s; resuming at byte %d", f.key, start, end, problem, pos)
            for stage in stages:  # every byte written and hashed before the range counts as done
                stage.close()
        finally:
            for stage in stages:
                try:
                    stage.close()
                except BaseException:  # noqa: BLE001 - already raised above, or the range is abandoned
                    pass
            os.close(fd)
        with self.lock:
            if check.kind == "etag":
                a, b, digest = hasher.final()
                self._record_piece(f, a, b, [digest])
            else:
                self._record_piece(f, start, end, hasher.digests() if hasher else None)
            self.remaining[f.key] -= 1
            last = self.remaining[f.key] == 0
        if last:  # the thread that wrote a file's last range verifies it
            self._finish(f)

    def _finish(self, f: SourceFile) -> None:
        part = self.staging / (f.key + PART)
        try:
            digest = self._verify(part, f)
        except MaterializeError:
            part.unlink(missing_ok=True)
            with self.lock:
                self.journal.pop(f.key, None)
                self._save()
            raise
        os.rename(part, self.staging / f.key)
        parts = self.checks[f.key].parts  # the exact layout when verification had to read it
        with self.lock:
            self.journal[f.key] = {"listing": self.listing[f.key], "digest": digest,
                                   **({"layout": compress_layout(parts)} if parts else {})}
            self._save()

    def _streamed(self, f: SourceFile) -> list[bytes] | None:
        """The part digests computed while the ranges streamed in, in order (None: some range's
        are unknown, e.g. written by an older modelops)."""
        with self.lock:
            hashes = dict(self.journal[f.key].get("hashes", {}))
            ranges = sorted(tuple(r) for r in self.journal[f.key]["ranges"])
        out = []
        for start, _ in ranges:
            if str(start) not in hashes:
                return None
            out += [bytes.fromhex(h) for h in hashes[str(start)]]
        return out

    def _verify(self, path: Path, f: SourceFile) -> str:
        """Check a transferred file; return its verified digest as ``algo:hex``.

        Raises:
            MaterializeError: naming the key, expected and actual values.
        """
        size = path.stat().st_size
        if size != f.size:
            raise MaterializeError(f"{f.key}: expected {f.size} bytes, got {size}")
        check = self.checks[f.key]
        if check.kind == "size":
            return f"size:{size}"
        streamed = self._streamed(f)
        if check.kind in ("sha256", "md5"):  # one digest of the whole file
            digests = streamed if streamed is not None and len(streamed) == 1 else file_digests(path, check.algo)
            actual = digests[0].hex()
            expected = self.sums[f.key] if check.kind == "sha256" else f.etag
            if actual != expected:
                origin = SUMS_FILE if check.kind == "sha256" else "ETag, the MD5 of a single-part upload"
                raise MaterializeError(f"{f.key}: {check.kind} mismatch: expected {expected} ({origin}), got {actual}")
            return f"sha256:{actual}" if check.kind == "sha256" else f"etag:{f.etag}"
        md5s = streamed if streamed is not None and len(streamed) == len(check.parts) else \
            file_digests(path, "md5", check.parts)
        actual = etag_of_parts(md5s)
        if actual != f.etag and not check.exact:
            # Part 1's size fitted equal parts, but S3 allows unequal ones: read every part's size.
            exact = self.source.exact_layout(f)
            if exact != check.parts:
                log.info("%s: parts of unequal sizes (%d parts); verifying with the exact layout", f.key, len(exact))
                check.parts, check.exact = exact, True
                actual = etag_of_parts(file_digests(path, "md5", exact))
        if actual != f.etag:
            raise MaterializeError(f"{f.key}: ETag mismatch: expected {f.etag}, got {actual} (multipart: MD5 of the "
                                   f"MD5s of its {len(check.parts)} parts, sizes read from HeadObject)")
        return f"etag:{f.etag}"

    def _run_workers(self, work, progress: Progress | None, t_start: float) -> None:
        pool = ThreadPoolExecutor(max_workers=max(1, self.settings.materialize_concurrency),
                                  thread_name_prefix="materialize")
        timed_out = False
        try:
            # Largest ranges first: the long ones do not start last and trail alone.
            jobs = sorted(((f, s, e) for f, rs in work for s, e in rs), key=lambda j: j[1] - j[2])
            futures = [pool.submit(self._fetch_range, f, s, e, progress) for f, s, e in jobs]
            futures += [pool.submit(self._finish, f) for f, rs in work if not rs]  # every range was already written
            # Our own deadline (Prefect's task timeout cannot interrupt a task in a worker thread):
            # past it the workers stop at their next chunk, a read blocked on a silent endpoint ends
            # with botocore's read timeout, and this call returns at once.
            deadline = t_start + self.settings.materialize_timeout_s
            try:
                for fut in as_completed(futures, timeout=max(0.0, deadline - time.monotonic())):
                    fut.result()
            except TimeoutError:
                timed_out = True
                self._stop_workers(futures)
                raise MaterializeError(f"transfer of {self.manifest.source} to {self.dest} did not finish within "
                                       f"{self.settings.materialize_timeout_s:g} s (setting materialize_timeout_s); "
                                       "what was verified stays staged for the next attempt") from None
            except BaseException as e:  # including Ctrl-C: stop the workers, keep what they finished
                self._stop_workers(futures)
                if isinstance(e, MaterializeError | KeyboardInterrupt | SystemExit):
                    raise
                raise MaterializeError(f"transfer of {self.manifest.source} to {self.dest} failed: {e}") from e
        finally:
            # Past the deadline a worker may sit in a read for a while more: not waited for.
            pool.shutdown(wait=not timed_out, cancel_futures=True)
        if self.stop.is_set():
            raise MaterializeError("transfer stopped")

    def _stop_workers(self, futures) -> None:
        self.stop.set()
        for fut in futures:
            fut.cancel()
        with self.lock:
            self._save(force=True)

    def _publish(self) -> None:
        files = {}
        for k in sorted(self.files):
            entry = self.journal[k]
            files[k] = {**self.listing[k], "digest": entry["digest"], **({"parts": entry["layout"]}
                                                                       if "layout" in entry else {})}
        record = {"source": self.manifest.source, "time": time.time(),
                  "bytes": sum(f.size for f in self.files.values()), "files": files}
        (self.staging / COMPLETION_RECORD).write_text(json.dumps(record, indent=1))
        self.journal_path.unlink(missing_ok=True)
        self.journal_path.with_suffix(".tmp").unlink(missing_ok=True)
        replace_dir(self.staging, self.dest)  # an incomplete or stale earlier copy is replaced, never merged
