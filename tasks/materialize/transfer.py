"""The transfer: a source's files into ``<fsx_root>/<model_id>/<version>/``, verified, atomically.

- **Plan**: per file, the check it gets (sha256 from ``SHA256SUMS``; else the CRC S3 stores with
  the object; else its ETag with the part layout; for local sources a CRC32C of the bytes read,
  recorded so that ``cache verify`` can re-hash the copy) and its byte ranges. Where the check is
  per part (a multipart ETag, a COMPOSITE checksum) ranges are whole groups of parts, so every
  part's digest is computed while its bytes stream in; a FULL_OBJECT CRC is computed per range
  and the ranges' CRCs combined.
- **Space**: the bytes still to write are checked against the file system's free space before
  anything is written; each new file is preallocated (``posix_fallocate``).
- **Parallel transfer**: ``materialize_concurrency`` threads fetch ranges, each reading into
  pool buffers of 4 MiB that :mod:`~tasks.materialize.writer` writes at their offsets of a
  ``.modelops-part`` file (``O_DIRECT``); the thread that fetched a file's last range verifies it.
- **Resume**: a journal records, against the listing entry, each range written (with its part
  digests) and each file verified; a rerun keeps both and fetches only the rest. Once all are
  verified, a completion record is written and the staging folder renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
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
from tasks.materialize.cache import clean_strays, is_complete, listing_of, read_record, shared_files, version_lock
from tasks.materialize.digests import (
    StreamHasher,
    combine_crcs,
    composite_crc,
    compress_layout,
    crc_b64,
    etag_of_parts,
    expand_layout,
    file_digests,
    new_hash,
    parse_sums,
)
from tasks.materialize.sources import (
    CHUNK,
    COMPLETION_RECORD,
    JOURNAL,
    PART,
    SUMS_FILE,
    S3Source,
    Source,
    ObjectChanged,
    SourceFile,
    list_source,
    open_source,
)
from tasks.materialize.writer import ALIGN, STREAM_BUFFERS, BufferPool, PartFile, RangePipeline

__all__ = ["MaterializeResult", "materialize"]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with bytes just written
# A single-part object with a listed checksum up to this size is fetched in one GET that also
# carries its checksum: no HeadObject per small file (about 5 ms of moto's CPU each, a billed
# request on S3). botocore then validates that GET too; past this size, one HEAD costs less.
_LEARN_MAX = 64 << 20
_DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)  # the disk, not the network: not retried
# Local sources store no checksum: the copy's CRC is computed as it is read and recorded, so that
# `cache verify` can find a byte changed later. CRC32C: the fastest of CRCS here (about 29 GB/s,
# bench/results/materialize.json), and one S3 also stores.
LOCAL_CRC = "crc32c"
_AGAIN = "pull again (a rerun fetches this file again); if it fails again, upload the object again"


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
    """How one file is verified: ``kind`` sha256 | crc (S3's stored checksum) | md5
    (single-part ETag) | etag (multipart) | local (a local source: nothing stored to compare
    with; the CRC of the bytes read is recorded for ``cache verify``); ``parts`` the multipart
    layout (bytes per part) where the check is per part, ``exact`` whether it was read part by
    part or assumed from part 1. For ``crc``: ``crc`` the algorithm, ``expected`` S3's base64 value,
    ``composite`` True (COMPOSITE), False (FULL_OBJECT) or None (the endpoint does not say:
    either matches); ``expected`` empty: learnt from the file's GET (see :data:`_LEARN_MAX`)."""

    kind: str
    parts: list[int] = field(default_factory=list)
    exact: bool = True
    crc: str = ""
    expected: str = ""
    composite: bool | None = False

    @property
    def algo(self) -> str | None:
        return self.crc or {"sha256": "sha256", "md5": "md5", "etag": "md5"}.get(self.kind)

    @property
    def per_part(self) -> bool:
        """Digests are kept per part (ranges are whole parts), not per range."""
        return self.kind == "etag" or (self.kind == "crc" and bool(self.parts))


def _ranges(f: SourceFile, check: _Check, range_size: int,
            written: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The GET ranges still to fetch of ``f`` (``range_size`` 0: one range).

    A per-part check's ranges are runs of whole parts not yet ``written`` (the journal records
    each part as it completes), up to ``range_size`` each; any other file's are equal slices,
    skipping those written."""
    if f.size == 0:
        return [] if (0, 0) in written else [(0, 0)]
    if not check.per_part:
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
    source = open_source(manifest, settings)
    files = list_source(manifest, settings, source)
    total = sum(f.size for f in files.values())
    dest = settings.fsx_dir / manifest.model_id / manifest.version
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(version_lock(dest.parent, manifest.version))
        except OSError as e:  # a file, a read-only mount, /proc...: before anything is fetched
            raise MaterializeError(f"cannot use the FSx cache at {settings.fsx_dir} (MODELOPS_FSX_ROOT): {e}; point "
                                   "it at a writable folder") from e
        clean_strays(dest.parent, manifest.version)
        if is_complete(dest, files):
            os.utime(dest / COMPLETION_RECORD)  # last use, for LRU eviction
            log.info("cache hit: %s (%d files, %.1f MB) already on FSx, nothing transferred", dest, len(files), total / 1e6)
            if total_callback:
                total_callback(0)
            return MaterializeResult(dest, len(files), total, 0, time.monotonic() - t0)
        transferred = _Transfer(manifest, settings, files, dest, source).run(progress, total_callback, t0)
    seconds = time.monotonic() - t0
    result = MaterializeResult(dest, len(files), total, transferred, seconds)
    log.info("materialized %s → %s: %d files, %.1f MB, %.1f MB transferred in %.1f s (%.0f MB/s)", manifest.source,
             dest, len(files), total / 1e6, transferred / 1e6, seconds, result.mb_per_s)
    return result


class _Transfer:
    """One materialization's plan, state and workers (see the module docstring)."""

    def __init__(self, manifest: Manifest, settings: Settings, files: dict[str, SourceFile], dest: Path,
                 source: Source) -> None:
        self.manifest, self.settings, self.files, self.dest, self.source = manifest, settings, files, dest, source
        self.staging = dest.parent / f".staging-{manifest.version}"
        self.journal_path = self.staging / JOURNAL
        self.listing = listing_of(files)
        self.lock = threading.Lock()
        self.stop = threading.Event()  # set on the first failure or Ctrl-C: workers quit between chunks
        self.moved = 0
        self.last_save = 0.0
        self.sums: dict[str, str] = {}
        self.checks: dict[str, _Check] = {}
        # Read buffers, shared by the streams (at most STREAM_BUFFERS each): 3 a stream on
        # average keeps the RSS target; one large stream's worth is faulted in while the first
        # requests wait (see tasks/materialize/writer.py).
        self.buffers = BufferPool(CHUNK, 3 * max(1, settings.materialize_concurrency))

    # -- planning ------------------------------------------------------------------------------
    def _load_journal(self) -> dict:
        try:
            return json.loads(self.journal_path.read_text())
        except (OSError, ValueError):
            return {}

    def _plan_checks(self, keys: list[str], journal: dict) -> None:
        s3 = isinstance(self.source, S3Source)
        remote = []
        for key in keys:
            f = self.files[key]
            if key in self.sums:
                self.checks[key] = _Check("sha256")
            elif not s3:
                self.checks[key] = _Check("local", crc=LOCAL_CRC)
            elif f.checksum and not f.parts and f.size <= _LEARN_MAX and \
                    not 0 < self.source.range_size(f.size) < f.size:  # one GET, its headers say
                self.checks[key] = _Check("crc", crc=f.checksum)
            elif f.checksum or f.parts:
                remote.append(f)
            else:
                self.checks[key] = _Check("md5")
        if remote:  # a HeadObject or two per object (more for an unequal layout), in parallel
            with ThreadPoolExecutor(max(1, self.settings.materialize_concurrency), thread_name_prefix="plan") as pool:
                for f, check in zip(remote, pool.map(lambda f: self._remote_check(f, journal.get(f.key, {})), remote)):
                    self.checks[f.key] = check

    def _remote_check(self, f: SourceFile, entry: dict) -> _Check:
        """The check of an S3 object that has a stored checksum or several parts."""
        stored = self.source.stored_checksum(f) if f.checksum else None
        if stored and (stored.type == "FULL_OBJECT" or (stored.type is None and not f.parts)):
            return _Check("crc", crc=stored.algo, expected=stored.value, composite=False)
        if not f.parts:  # listed with a checksum S3 did not return (SHA, or none after all)
            return _Check("md5")
        if entry.get("listing") == self.listing[f.key] and "layout" in entry:  # read before: cached
            parts, exact = expand_layout(entry["layout"]), entry.get("exact", False)
        else:
            parts, exact = self.source.part_layout(f)
        if stored:
            return _Check("crc", parts, exact, crc=stored.algo, expected=stored.value,
                          composite=True if stored.type == "COMPOSITE" else None)
        return _Check("etag", parts, exact)

    def run(self, progress: Progress | None, total_callback: Callable[[int], None] | None, t_start: float) -> int:
        self.buffers.warm(min(STREAM_BUFFERS, -(-sum(f.size for f in self.files.values()) // CHUNK)))
        if SUMS_FILE in self.files:
            sums = self.files[SUMS_FILE]
            self.sums = parse_sums(b"".join(self.source.stream(SUMS_FILE, 0, sums.size, etag=sums.etag)).decode())
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
            and (self.dest / k).is_file() and (self.dest / k).stat().st_size == e["size"]
            and not (self.staging / k).exists()}  # a truncated or grown copy is fetched again
        shared = self._link_shared(journal, reuse)
        # Per file: verified earlier against the same listing entry → keep; a .part with ranges
        # recorded as written → fetch the other ranges; anything else → fetch again from scratch.
        keep, resume, fresh = set(reuse) | shared, {}, []
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
            written = self._recheck(f, entry)
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

    def _link_shared(self, journal: dict, reuse: dict) -> set[str]:
        """Hard-link into staging the files another version's complete copy already holds
        with the same content (:func:`tasks.materialize.cache.shared_files`: S3 size and ETag),
        so versions of one source keep one copy of their bytes on FSx and pull nothing twice.
        Returns the keys linked (with their verified digests in ``journal``); a file whose
        copy vanished meanwhile (evicted) is fetched as usual."""
        if not isinstance(self.source, S3Source):
            return set()  # a local source's listing has no content checksum to match on
        wanted = {k: e for k, e in self.listing.items() if k not in reuse and k not in journal
                  and not (self.staging / k).exists()}
        linked, size = set(), 0
        for key, (path, entry) in shared_files(self.settings, wanted, self.dest).items():
            new = self.staging / key
            try:
                new.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, new)
            except FileNotFoundError:
                continue
            except OSError as e:  # another file system (no hard links across them): fetch it
                log.info("cannot link %s from %s (%s); fetching it", key, path, e)
                continue
            journal[key] = {"listing": self.listing[key], "digest": entry["digest"],
                            **({"layout": entry["parts"]} if "parts" in entry else {})}
            linked.add(key)
            size += self.files[key].size
        if linked:
            log.info("%d file(s), %.1f MB, already on FSx in other versions' copies: linked, not pulled", len(linked),
                     size / 1e6)
        return linked

    def _recheck(self, f: SourceFile, entry: dict) -> list[tuple[int, int]]:
        """The ranges an earlier attempt journaled for ``f`` whose bytes on disk still have the
        digest it journaled; the others are dropped from ``entry`` and fetched again. Nothing
        was fsynced, so a crash of the node (not only of the process) can leave journaled
        ranges zeroed, and a part file may have been touched since. Ranges journaled without a
        digest (a whole-file sha256/MD5 split in ranges) are re-read at verification anyway."""
        algo, hashes = self.checks[f.key].algo, entry.get("hashes", {})
        kept, damaged = [], 0
        with (self.staging / (f.key + PART)).open("rb", buffering=0) as part:
            for start, end in (tuple(r) for r in entry["ranges"]):
                digests = hashes.get(str(start))
                if digests is not None and len(digests) == 1 and algo:
                    h = new_hash(algo)
                    part.seek(start)
                    left = end - start
                    while left > 0 and (chunk := part.read(min(CHUNK, left))):
                        h.update(chunk)
                        left -= len(chunk)
                    if left or h.digest().hex() != digests[0]:
                        damaged += 1
                        hashes.pop(str(start), None)
                        continue
                kept.append((start, end))
        if damaged:
            log.warning("%s: %d range(s) journaled by an earlier attempt no longer match their digest on disk; "
                        "fetching them again", f.key, damaged)
        entry["ranges"] = [list(r) for r in kept]
        return kept

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
        """GET ``[start, end)`` of ``f`` into its part file: this thread reads into pool
        buffers, :class:`~tasks.materialize.writer.RangePipeline` writes them (``O_DIRECT``
        where it can) and, in order behind the writes, hashes and journals each part it
        completes (so a journaled part is written and a kill loses at most the parts in flight)."""
        check = self.checks[f.key]
        # A digest worth computing here: every part of a per-part check, any range of a CRC
        # (CRCs combine), or a whole file.
        whole = (start, end) == (0, f.size)
        hasher = StreamHasher(check.algo, start, _cuts(check, start, end)) \
            if check.per_part or check.kind in ("crc", "local") or (check.algo and whole) else None

        def learnt(stored) -> None:  # the checksum the whole-object GET carried
            if stored and stored.algo == check.crc and stored.type != "COMPOSITE":
                check.expected = stored.value

        def hashed(view, _at) -> None:
            parts = hasher.update(view)
            if check.per_part and parts:
                with self.lock:
                    for a, b, digest in parts:
                        self._record_piece(f, a, b, [digest])

        part = PartFile(self.staging / (f.key + PART), direct=self.settings.materialize_direct_io)
        pipeline = RangePipeline(part, self.buffers, hashed if hasher else None)
        try:
            at = [start]  # the next byte to read, advanced by _read as it submits
            # A stream that drops or stalls resumes from the last byte read, within the same
            # budget of tries as each request (s3_max_attempts). A GET that was not answered is
            # not tried again here: botocore has already made its s3_max_attempts tries, and
            # trying those again would multiply the bound on a silent endpoint.
            attempts = max(1, self.settings.s3_max_attempts)
            for attempt in range(1, attempts + 1):
                if self.stop.is_set():
                    return
                pos = at[0]
                reader = None
                try:
                    learn = learnt if check.kind == "crc" and not check.expected and (pos, end) == (0, f.size) \
                        else None
                    reader = self.source.open(f.key, pos, end, checksum_to=learn, etag=f.etag)
                    if not self._read(f, at, end, reader, pipeline, progress):
                        return
                    pos = at[0]
                    if pos == end:
                        break
                    problem = f"ended early at byte {pos}"
                except ObjectChanged:
                    raise
                except Exception as e:  # a dropped connection mid-stream; botocore retried the request itself
                    if reader is None and isinstance(e, MaterializeError):
                        raise  # the GET itself failed, named by the source, after botocore's tries
                    pos = at[0]
                    if pipeline.error is not None or (isinstance(e, OSError) and e.errno in _DISK_ERRORS):
                        raise MaterializeError(f"{f.key}: cannot write to {self.staging}: {e}") from e
                    problem = str(e)
                if attempt == attempts:
                    raise MaterializeError(f"{f.key}: bytes {start}-{end} failed after {attempt} attempts: {problem}")
                log.warning("%s: bytes %d-%d: %s; resuming at byte %d", f.key, start, end, problem, pos)
            try:
                pipeline.close()  # every byte written and hashed before the range counts as done
            except OSError as e:
                raise MaterializeError(f"{f.key}: cannot write to {self.staging}: {e}") from e
        finally:
            try:
                pipeline.close()
            except BaseException:  # noqa: BLE001 - already raised above, or the range is abandoned
                pass
            part.close()
        with self.lock:
            if check.per_part:
                a, b, digest = hasher.final()
                self._record_piece(f, a, b, [digest])
            else:
                self._record_piece(f, start, end, hasher.digests() if hasher else None)
            self.remaining[f.key] -= 1
            last = self.remaining[f.key] == 0
        if last:  # the thread that wrote a file's last range verifies it
            self._finish(f)

    def _read(self, f: SourceFile, at: list[int], end: int, reader, pipeline: RangePipeline,
              progress: Progress | None) -> bool:
        """Read ``reader`` (the bytes from ``at[0]`` on) into pool buffers and submit them until
        ``end`` or the stream ends, advancing ``at[0]`` past each buffer submitted (also when a
        read fails: the retry resumes there); False: the transfer stopped. Each buffer holds
        the bytes of one aligned window of the file at their offset in it, so the pipeline can
        write whole blocks with ``O_DIRECT``.

        Raises:
            ObjectChanged: the stream holds more bytes than the listing said.
        """
        pos = at[0]
        try:
            while pos < end:
                buf = pipeline.buffer(self.stop)
                if buf is None or self.stop.is_set():
                    if buf is not None:
                        pipeline.unused(buf)
                    return False
                lo = pos % ALIGN
                view = buf[lo:lo + min(len(buf) - lo, end - pos)]
                got, failed = 0, None
                try:
                    while got < len(view) and (n := reader.readinto(view[got:])):
                        got += n
                except Exception as e:  # noqa: BLE001 - raised below, after what arrived is kept
                    failed = e
                except BaseException:
                    pipeline.unused(buf)
                    raise
                if not got:
                    pipeline.unused(buf)
                    if failed is not None:
                        raise failed
                    break
                # Submitted also when the stream broke mid-buffer: the retry resumes after the
                # last byte that arrived, so a stream that always breaks early still advances.
                pipeline.submit(buf, view[:got], pos)
                pos = at[0] = pos + got
                with self.lock:
                    self.moved += got
                if progress:
                    progress(got)
                if failed is not None:
                    raise failed
            if pos == end and reader.readinto(bytearray(1)):  # an endpoint that ignored If-Match
                raise ObjectChanged(f"{f.key}: more bytes than the {f.size} listed: the object changed since it "
                                    "was listed; pull again once the upload has finished")
            return True
        finally:
            reader.close()

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

    def _streamed(self, f: SourceFile) -> list[tuple[int, list[bytes]]] | None:
        """The digests computed while the ranges streamed in, as ``(range length, [digest per
        part])`` in file order (None: some range's are unknown, e.g. written by an older modelops)."""
        with self.lock:
            hashes = dict(self.journal[f.key].get("hashes", {}))
            ranges = sorted(tuple(r) for r in self.journal[f.key]["ranges"])
        out = []
        for start, end in ranges:
            if str(start) not in hashes:
                return None
            out.append((end - start, [bytes.fromhex(h) for h in hashes[str(start)]]))
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
        if check.kind == "local":
            if self.source.changed(f):  # written to while we read it: the copy may mix old and new
                raise ObjectChanged(f"{f.key}: {self.source.where()} changed while it was copied (its size or "
                                    "modification time is no longer the listed one); pull again once nothing "
                                    "writes to it")
            return f"{check.crc}:{self._full_crc(path, f, self._streamed(f))}"
        if check.kind == "crc" and not check.expected:  # its GET carried none after all: ask
            replanned = self._remote_check(f, {})
            if replanned.algo != check.algo:  # the digests streamed are of another algorithm
                with self.lock:
                    self.journal[f.key]["hashes"] = {}
            self.checks[f.key] = check = replanned
        streamed = self._streamed(f)
        if check.kind == "crc":
            return self._verify_crc(path, f, streamed)
        flat = None if streamed is None else [d for _, ds in streamed for d in ds]
        if check.kind in ("sha256", "md5"):  # one digest of the whole file
            digests = flat if flat is not None and len(flat) == 1 else file_digests(path, check.algo)
            actual = digests[0].hex()
            expected = self.sums[f.key] if check.kind == "sha256" else f.etag
            if actual != expected:
                origin = SUMS_FILE if check.kind == "sha256" else "ETag, the MD5 of a single-part upload"
                raise MaterializeError(f"{f.key}: {check.kind} mismatch: expected {expected} ({origin}), got {actual}; "
                                       f"{_AGAIN}")
            return f"sha256:{actual}" if check.kind == "sha256" else f"etag:{f.etag}"
        md5s = flat if flat is not None and len(flat) == len(check.parts) else file_digests(path, "md5", check.parts)
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
                                   f"MD5s of its {len(check.parts)} parts, sizes read from HeadObject); {_AGAIN}")
        return f"etag:{f.etag}"

    def _full_crc(self, path: Path, f: SourceFile, streamed: list[tuple[int, list[bytes]]] | None) -> str:
        """The whole file's CRC (base64, the check's algorithm): the ranges' CRCs combined in
        order, or the file read again where some range's is unknown."""
        crc = self.checks[f.key].crc
        pieces = [(n, ds[0]) for n, ds in streamed] if streamed is not None and all(
            len(ds) == 1 for _, ds in streamed) else [(f.size, file_digests(path, crc)[0])]
        return crc_b64(combine_crcs(crc, pieces))

    def _verify_crc(self, path: Path, f: SourceFile, streamed: list[tuple[int, list[bytes]]] | None) -> str:
        """Check a file against S3's stored CRC; return ``algo:base64`` (``-<parts>`` for a
        COMPOSITE one).

        Raises:
            MaterializeError: naming the key, the algorithm, expected and actual values.
        """
        check = self.checks[f.key]
        if not check.parts:  # FULL_OBJECT
            actual = self._full_crc(path, f, streamed)
            if actual != check.expected:
                raise MaterializeError(f"{f.key}: {check.crc.upper()} mismatch: expected {check.expected} (the "
                                       f"full-object checksum S3 stores), got {actual}; {_AGAIN}")
            return f"{check.crc}:{actual}"
        flat = None if streamed is None else [d for _, ds in streamed for d in ds]
        crcs = flat if flat is not None and len(flat) == len(check.parts) else file_digests(path, check.crc, check.parts)

        def matches(crcs: list[bytes]) -> str | None:  # the record's digest when one form matches
            if check.composite is not False and (c := composite_crc(check.crc, crcs)).split("-")[0] == check.expected:
                return c
            if check.composite is not True and crc_b64(
                    combine_crcs(check.crc, list(zip(check.parts, crcs)))) == check.expected:
                return check.expected
            return None

        found = matches(crcs)
        if found is None and not check.exact:
            # Part 1's size fitted equal parts, but S3 allows unequal ones: read every part's size.
            exact = self.source.exact_layout(f)
            if exact != check.parts:
                log.info("%s: parts of unequal sizes (%d parts); verifying with the exact layout", f.key, len(exact))
                check.parts, check.exact = exact, True
                crcs = file_digests(path, check.crc, exact)
                found = matches(crcs)
        if found is None:
            form = {True: "COMPOSITE", False: "FULL_OBJECT", None: "composite or full-object"}[check.composite]
            raise MaterializeError(f"{f.key}: {check.crc.upper()} mismatch: expected {check.expected} (the {form} "
                                   f"checksum S3 stores), got {composite_crc(check.crc, crcs).split('-')[0]} over its "
                                   f"{len(check.parts)} parts (sizes read from HeadObject); {_AGAIN}")
        return f"{check.crc}:{found}"

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
