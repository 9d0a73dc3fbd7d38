"""materialize: copy a model version's weights from its source onto the FSx cache, verified.

Destination: ``<fsx_root>/<model_id>/<version>/``. How:

- **Listing** (boto3 for S3, credentials from settings or a prefect-aws ``AwsCredentials``
  block named by ``MODELOPS_AWS_CREDENTIALS_BLOCK``; the file system for local sources): key,
  size and ETag of every file. Keys that would land outside the destination are refused before anything is written.
- **Parallel transfer**: files, and byte ranges of files larger than the range size,
  are fetched by ``materialize_concurrency`` threads (range size: ``_S3Source.range_size``). Each range streams in 1 MiB chunks into
  its offset of a preallocated ``.modelops-part`` file (memory ≈ concurrency × 1 MiB); the thread that
  writes a file's last range verifies it.
- **Integrity**: each file is checked after transfer: size, then sha256 against ``SHA256SUMS``
  when the source publishes one (``sha256sum`` format), else the S3 ETag (MD5 of the object for
  single-part uploads; MD5 of the parts' MD5s plus ``-N`` for multipart uploads, the part size
  read from ``HeadObject(PartNumber=1)``). A mismatch names the key, expected and actual values.
- **Atomic publish and resume**: files land in ``.staging-<version>/`` beside the destination
  (same file system); a file is renamed from ``.modelops-part`` to its name only once verified. A journal
  records, against the listing entry, each range written and each file verified; a rerun after
  a crash or kill keeps both and fetches only the rest. When all are there, a completion record
  ``.modelops-complete.json`` is written and the folder renamed into place: readers never see a
  partial model. A lock file serializes concurrent materializations of one version, so a
  second caller (provisioning after pre-materialization) waits and then finds a cache hit.
- **Eviction**: :func:`evict` removes least recently used versions beyond a byte budget,
  never one the registry has provisioning, serving or draining.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from prefect import task

from modelops.errors import ManifestError, MaterializeError
from modelops.manifest import Manifest
from modelops.process import file_lock
from modelops.registry import Registry
from modelops.settings import Settings, get_settings
from tasks._retry import retry_unless_bad_input

__all__ = [
    "COMPLETION_RECORD",
    "SUMS_FILE",
    "MaterializeResult",
    "SourceFile",
    "cached_versions",
    "evict",
    "list_source",
    "materialize",
    "materialize_task",
]

log = logging.getLogger(__name__)

COMPLETION_RECORD = ".modelops-complete.json"
SUMS_FILE = "SHA256SUMS"
_JOURNAL = ".modelops-journal.json"
_PART = ".modelops-part"  # suffix of files being written; never a source key
_CHUNK = 1 << 20
_RANGE_ATTEMPTS = 3  # a dropped connection resumes the range from the last byte written
# A source must hold a model config and weights in one of these formats.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# Versions in these states are in use and never evicted.
_IN_USE = ("provisioning", "serving", "draining")

Progress = Callable[[int], None]  # called with bytes just written


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: ``key`` relative to the source prefix, ``size`` in bytes, ``etag``
    the S3 ETag without quotes (local files: their mtime in ns, so a changed file is re-copied)."""

    key: str
    size: int
    etag: str


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


# -- sources ---------------------------------------------------------------------------------
class _Source:
    def __init__(self, manifest: Manifest, settings: Settings) -> None:
        self.manifest, self.settings = manifest, settings

    def list(self) -> dict[str, SourceFile]:
        raise NotImplementedError

    def stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``key`` in chunks of at most 1 MiB."""
        raise NotImplementedError

    def part_size(self, key: str) -> int:
        raise NotImplementedError

    def range_size(self) -> int:
        """Byte-range size for this source (0: whole files)."""
        return self.settings.materialize_range_size or 0


class _S3Source(_Source):
    def __init__(self, manifest: Manifest, settings: Settings) -> None:
        super().__init__(manifest, settings)
        import boto3
        from botocore.config import Config

        self.bucket, _, prefix = manifest.source.removeprefix("s3://").partition("/")
        self.prefix = prefix.rstrip("/") + "/" if prefix else ""
        config = Config(max_pool_connections=max(10, settings.materialize_concurrency * 2),
                        retries={"max_attempts": 3, "mode": "standard"})
        if settings.aws_credentials_block:
            from prefect_aws import AwsCredentials

            try:
                creds = AwsCredentials.load(settings.aws_credentials_block)
            except ValueError as e:
                raise ManifestError(f"MODELOPS_AWS_CREDENTIALS_BLOCK: no AwsCredentials block named "
                                    f"{settings.aws_credentials_block!r}; create it in Prefect or unset it") from e
            self.endpoint = creds.aws_client_parameters.endpoint_url  # None: AWS itself
            self.client = creds.get_boto3_session().client("s3", endpoint_url=self.endpoint, config=config)
        else:
            self.endpoint = settings.s3_endpoint
            self.client = boto3.client(
                "s3", endpoint_url=settings.s3_endpoint, aws_access_key_id=settings.aws_access_key_id,
                aws_secret_access_key=settings.aws_secret_access_key, region_name=settings.aws_region, config=config)

    def list(self) -> dict[str, SourceFile]:
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith("/"):
                    continue  # folder placeholder objects
                rel = obj["Key"][len(self.prefix):]
                out[rel] = SourceFile(rel, int(obj["Size"]), obj["ETag"].strip('"'))
        return out

    def stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        if end <= start:
            return iter(())
        body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key, Range=f"bytes={start}-{end - 1}")["Body"]
        return body.iter_chunks(_CHUNK)

    def part_size(self, key: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=self.prefix + key, PartNumber=1)["ContentLength"])

    def range_size(self) -> int:
        """The setting if given; else whole files from the local moto endpoint (it serves ranged
        GETs slowly: bench/results/materialize.json) and 64 MiB ranges from any other endpoint
        (real S3 serves about 100 MB/s per connection)."""
        if self.settings.materialize_range_size is not None:
            return self.settings.materialize_range_size
        local = not self.settings.aws_credentials_block and self.settings.s3_endpoint_url is None
        return 0 if local else 64 << 20


class _LocalSource(_Source):
    def __init__(self, manifest: Manifest, settings: Settings) -> None:
        super().__init__(manifest, settings)
        self.root = Path(manifest.source.removeprefix("file://")).expanduser().resolve()

    def list(self) -> dict[str, SourceFile]:
        out = {}
        if self.root.is_dir():
            for p in self.root.rglob("*"):
                if p.is_file():
                    st = p.stat()
                    rel = p.relative_to(self.root).as_posix()
                    out[rel] = SourceFile(rel, st.st_size, str(st.st_mtime_ns))
        return out

    def stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        with (self.root / key).open("rb") as f:
            f.seek(start)
            left = end - start
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                left -= len(chunk)
                yield chunk


def _source(manifest: Manifest, settings: Settings) -> _Source:
    return _S3Source(manifest, settings) if manifest.is_s3 else _LocalSource(manifest, settings)


def _where(manifest: Manifest, source: _Source) -> str:
    if isinstance(source, _S3Source):
        return f"on {source.endpoint or 'AWS S3'}"
    return f"(local directory {source.root})"


def list_source(manifest: Manifest, settings: Settings | None = None) -> dict[str, SourceFile]:
    """List the files of a manifest's source.

    Returns:
        ``{relative key: SourceFile}`` for every file under the source prefix.

    Raises:
        ManifestError: the source does not exist, is empty, holds a key that would land outside
            the destination, or has no ``config.json`` or weights file.
        MaterializeError: the object store could not be reached.
    """
    settings = settings or get_settings()
    source = _source(manifest, settings)
    try:
        files = source.list()
    except Exception as e:  # botocore raises many types; name the endpoint
        raise MaterializeError(f"cannot list source {manifest.source} {_where(manifest, source)}: {e}") from e
    # A cache folder copied back to S3 carries our own records; they describe another copy.
    ours = [k for k in files if PurePosixPath(k).name in (COMPLETION_RECORD, _JOURNAL)]
    for k in ours:
        log.info("ignoring %s in the source: modelops writes its own", k)
        del files[k]
    for rel in files:
        p = PurePosixPath(rel)
        if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
            raise ManifestError(f"source: key {rel!r} would land outside the model directory; refusing to copy")
        if "" in rel.split("/") or rel.endswith(_PART):
            raise ManifestError(f"source: key {rel!r} is not a usable file name (empty path segment or the "
                                f"reserved suffix {_PART}); rename it in the source")
    folders = {str(parent) for rel in files for parent in PurePosixPath(rel).parents if str(parent) != "."}
    if clash := sorted(folders & set(files)):
        raise ManifestError(f"source: {clash[0]!r} is both a file and a folder prefix of other keys; "
                            "rename one of them in the source")
    if not files:
        if manifest.is_s3:
            raise ManifestError(f"source: {manifest.source} does not exist or is empty {_where(manifest, source)}; "
                                "upload the weights there or fix the URI")
        raise ManifestError(f"source: local directory {source.root} does not exist or is empty; fix the path")
    top = {k for k in files if "/" not in k}
    if "config.json" not in top or not any(k.endswith(_WEIGHT_SUFFIXES) for k in files):
        raise ManifestError(
            f"source: {manifest.source} holds no model weights (need config.json and *.safetensors "
            f"or pytorch_model.bin at the top level; found {sorted(files)[:8]})"
        )
    return files


# -- verification ----------------------------------------------------------------------------
def _parse_sums(text: str) -> dict[str, str]:
    sums = {}
    for line in text.splitlines():
        if line.strip():
            digest, _, name = line.strip().partition(" ")
            sums[name.strip().lstrip("*").removeprefix("./")] = digest.lower()
    return sums


def _file_md5s(path: Path, part_size: int) -> list[bytes]:
    digests = []
    with path.open("rb") as f:
        while True:
            h, left = hashlib.md5(), part_size
            while left > 0 and (chunk := f.read(min(_CHUNK * 8, left))):
                h.update(chunk)
                left -= len(chunk)
            if left == part_size:
                break
            digests.append(h.digest())
    return digests


def _verify(path: Path, sf: SourceFile, sums: dict[str, str], source: _Source) -> str:
    """Check a transferred file; return its verified digest as ``algo:hex``.

    Raises:
        MaterializeError: naming the key, expected and actual values.
    """
    size = path.stat().st_size
    if size != sf.size:
        raise MaterializeError(f"{sf.key}: expected {sf.size} bytes, got {size}")
    if sf.key in sums:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK * 8):
                h.update(chunk)
        if h.hexdigest() != sums[sf.key]:
            raise MaterializeError(f"{sf.key}: sha256 mismatch: expected {sums[sf.key]} ({SUMS_FILE}), "
                                   f"got {h.hexdigest()}")
        return f"sha256:{h.hexdigest()}"
    if not isinstance(source, _S3Source):
        return f"size:{size}"
    if "-" in sf.etag:  # multipart: md5 of the concatenated part md5s, then "-<parts>"
        parts = int(sf.etag.rsplit("-", 1)[1])
        md5s = _file_md5s(path, source.part_size(sf.key))
        actual = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"
        if len(md5s) != parts or actual != sf.etag:
            raise MaterializeError(f"{sf.key}: ETag mismatch: expected {sf.etag}, got {actual}")
    else:
        (md5,) = _file_md5s(path, max(size, 1)) or [hashlib.md5().digest()]
        actual = md5.hex()
        if actual != sf.etag:
            raise MaterializeError(f"{sf.key}: ETag mismatch: expected {sf.etag} (MD5), got {actual}")
    return f"etag:{sf.etag}"


# -- the cache -------------------------------------------------------------------------------
def _record(dest: Path) -> dict | None:
    """The completion record, or None when it is missing, unreadable or of another layout (a
    record written by an older modelops counts as stale: the version is verified again)."""
    try:
        record = json.loads((dest / COMPLETION_RECORD).read_text())
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and {"size", "etag", "digest"} <= set(v)
                                              for v in files.values()):
        return None
    return record


def _listing(files: dict[str, SourceFile]) -> dict[str, dict]:
    return {k: {"size": f.size, "etag": f.etag} for k, f in sorted(files.items())}


def _is_complete(dest: Path, files: dict[str, SourceFile]) -> bool:
    record = _record(dest)
    if record is None or {k: {"size": v["size"], "etag": v["etag"]} for k, v in record["files"].items()} != _listing(files):
        return False
    return all((dest / k).is_file() and (dest / k).stat().st_size == f.size for k, f in files.items())


def _version_lock(parent: Path, version: str):
    return file_lock(parent / f".{version}.lock")


def _clean_strays(parent: Path, version: str) -> None:
    for stray in parent.glob(f".old-{version}-*"):
        shutil.rmtree(stray, ignore_errors=True)


def _ranges(size: int, range_size: int) -> list[tuple[int, int]]:
    if size == 0:
        return [(0, 0)]
    step = size if range_size <= 0 else range_size
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def materialize(manifest: Manifest, settings: Settings | None = None, progress: Progress | None = None,
                total_callback: Callable[[int], None] | None = None) -> MaterializeResult:
    """Copy the source's files to ``<fsx_root>/<model_id>/<version>/``, verified, atomically.

    Idempotent and resumable (see the module docstring). ``progress`` is called with each
    chunk's byte count as it is written; ``total_callback`` once with the bytes still to fetch.

    Raises:
        ManifestError: see :func:`list_source`.
        MaterializeError: a transfer failed or a file failed verification; verified files stay
            staged for the next attempt, the failed one is removed, nothing is published.
    """
    settings = settings or get_settings()
    t0 = time.monotonic()
    files = list_source(manifest, settings)
    total = sum(f.size for f in files.values())
    dest = settings.fsx_dir / manifest.model_id / manifest.version
    with _version_lock(dest.parent, manifest.version):
        _clean_strays(dest.parent, manifest.version)
        if _is_complete(dest, files):
            os.utime(dest / COMPLETION_RECORD)  # last use, for LRU eviction
            log.info("cache hit: %s (%d files, %.1f MB) already on FSx, nothing transferred", dest, len(files), total / 1e6)
            if total_callback:
                total_callback(0)
            return MaterializeResult(dest, len(files), total, 0, time.monotonic() - t0)
        transferred = _transfer(manifest, settings, files, dest, progress, total_callback)
    seconds = time.monotonic() - t0
    result = MaterializeResult(dest, len(files), total, transferred, seconds)
    log.info("materialized %s → %s: %d files, %.1f MB, %.1f MB transferred in %.1f s (%.0f MB/s)", manifest.source,
             dest, len(files), total / 1e6, transferred / 1e6, seconds, result.mb_per_s)
    return result


def _transfer(manifest: Manifest, settings: Settings, files: dict[str, SourceFile], dest: Path,
              progress: Progress | None, total_callback: Callable[[int], None] | None) -> int:
    t_start = time.monotonic()
    source = _source(manifest, settings)
    staging = dest.parent / f".staging-{manifest.version}"
    staging.mkdir(exist_ok=True)
    journal_path = staging / _JOURNAL
    try:
        journal = json.loads(journal_path.read_text())
    except (OSError, ValueError):
        journal = {}
    listing = _listing(files)
    range_size = source.range_size()
    # Files of an earlier complete copy whose listing entry is unchanged are hard-linked into
    # staging (same file system): a changed file re-fetches that file, not the model.
    previous = _record(dest)
    if previous is not None:
        for key, entry in previous["files"].items():
            old, new = dest / key, staging / key
            if key in listing and {"size": entry["size"], "etag": entry["etag"]} == listing[key] \
                    and key not in journal and old.is_file() and not new.exists():
                new.parent.mkdir(parents=True, exist_ok=True)
                os.link(old, new)
                journal[key] = {"listing": listing[key], "digest": entry["digest"]}

    def plan(f: SourceFile) -> list[tuple[int, int]]:
        return _ranges(f.size, range_size if f.size > range_size else 0)

    # Per file: verified earlier against the same listing entry → keep; a .part with ranges
    # recorded as written → fetch the other ranges; anything else → fetch again from scratch.
    work: list[tuple[SourceFile, list[tuple[int, int]]]] = []
    fresh: list[SourceFile] = []
    for key, f in sorted(files.items()):
        entry = journal.get(key, {})
        same = entry.get("listing") == listing[key]
        final, part = staging / key, staging / (key + _PART)
        if same and "digest" in entry and final.is_file() and final.stat().st_size == f.size:
            continue
        final.unlink(missing_ok=True)
        if same and "ranges" in entry and part.is_file() and part.stat().st_size == f.size:
            written = {tuple(r) for r in entry["ranges"]}
            work.append((f, [r for r in plan(f) if r not in written]))
            continue
        journal[key] = {"listing": listing[key], "ranges": []}
        fresh.append(f)
        work.append((f, plan(f)))
    # The reset entries must be on disk before their .part files are emptied: a stale entry
    # that still lists written ranges would otherwise vouch for zeroed bytes after a kill.
    journal_path.with_suffix(".tmp").write_text(json.dumps(journal))
    os.replace(journal_path.with_suffix(".tmp"), journal_path)
    for f in fresh:
        part = staging / (f.key + _PART)
        part.parent.mkdir(parents=True, exist_ok=True)
        with part.open("wb") as out:
            out.truncate(f.size)
    todo_bytes = sum(e - s for _, rs in work for s, e in rs)
    if total_callback:
        total_callback(todo_bytes)
    sums: dict[str, str] = {}
    if SUMS_FILE in files:
        sums = _parse_sums(b"".join(source.stream(SUMS_FILE, 0, files[SUMS_FILE].size)).decode())
        if missing := sorted(set(sums) - set(files)):
            raise MaterializeError(f"{SUMS_FILE} lists {len(missing)} file(s) the source does not have, e.g. "
                                   f"{missing[0]!r}; upload them or fix {SUMS_FILE}")
    lock = threading.Lock()
    stop = threading.Event()  # set on the first failure or Ctrl-C: workers quit between chunks
    moved = [0]
    remaining = {f.key: len(rs) for f, rs in work}
    last_save = [0.0]

    def save_journal(force: bool = False) -> None:  # called with lock held
        # At most every 0.5 s: a kill loses at most that much bookkeeping, and what it loses
        # is fetched again, never trusted.
        if not force and time.monotonic() - last_save[0] < 0.5:
            return
        tmp = journal_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(journal))
        os.replace(tmp, journal_path)
        last_save[0] = time.monotonic()

    def finish(f: SourceFile) -> None:
        part = staging / (f.key + _PART)
        try:
            digest = _verify(part, f, sums, source)
        except MaterializeError:
            part.unlink(missing_ok=True)
            with lock:
                journal.pop(f.key, None)
                save_journal()
            raise
        os.rename(part, staging / f.key)
        with lock:
            journal[f.key] = {"listing": listing[f.key], "digest": digest}
            save_journal()

    def fetch_range(f: SourceFile, start: int, end: int) -> None:
        fd = os.open(staging / (f.key + _PART), os.O_WRONLY)
        try:
            pos = start
            for attempt in range(1, _RANGE_ATTEMPTS + 1):
                if stop.is_set():
                    return
                try:
                    for chunk in source.stream(f.key, pos, end):
                        if stop.is_set():
                            return
                        os.pwrite(fd, chunk, pos)
                        pos += len(chunk)
                        with lock:
                            moved[0] += len(chunk)
                        if progress:
                            progress(len(chunk))
                    if pos == end:
                        break
                    problem = f"ended early at byte {pos}"
                except Exception as e:  # a dropped connection mid-stream; botocore retried the request itself
                    problem = str(e)
                if attempt == _RANGE_ATTEMPTS:
                    raise MaterializeError(f"{f.key}: bytes {start}-{end} failed after {attempt} attempts: {problem}")
                log.warning("%s: bytes %d-%d: %s; resuming at byte %d", f.key, start, end, problem, pos)
        finally:
            os.close(fd)
        with lock:
            journal[f.key]["ranges"].append([start, end])
            save_journal()
            remaining[f.key] -= 1
            last = remaining[f.key] == 0
        if last:  # the thread that wrote a file's last range verifies it
            finish(f)

    pool = ThreadPoolExecutor(max_workers=max(1, settings.materialize_concurrency), thread_name_prefix="materialize")
    timed_out = False
    try:
        futures = [pool.submit(fetch_range, f, s, e) for f, rs in work for s, e in rs]
        futures += [pool.submit(finish, f) for f, rs in work if not rs]  # every range was already written
        # Our own deadline (Prefect's task timeout cannot interrupt a task in a worker thread):
        # past it the workers stop at their next chunk, a read blocked on a silent endpoint ends
        # with botocore's read timeout, and this call returns at once.
        deadline = t_start + settings.materialize_timeout_s
        try:
            for fut in as_completed(futures, timeout=max(0.0, deadline - time.monotonic())):
                fut.result()
        except TimeoutError:
            timed_out = True
            stop.set()
            for fut in futures:
                fut.cancel()
            with lock:
                save_journal(force=True)
            raise MaterializeError(f"transfer of {manifest.source} to {dest} did not finish within "
                                   f"{settings.materialize_timeout_s:g} s (setting materialize_timeout_s); what "
                                   "was verified stays staged for the next attempt") from None
        except BaseException as e:  # including Ctrl-C: stop the workers, keep what they finished
            stop.set()
            for fut in futures:
                fut.cancel()
            with lock:
                save_journal(force=True)
            if isinstance(e, MaterializeError | KeyboardInterrupt | SystemExit):
                raise
            raise MaterializeError(f"transfer of {manifest.source} to {dest} failed: {e}") from e
    finally:
        # Past the deadline a worker may sit in a read for a while more: not waited for.
        pool.shutdown(wait=not timed_out, cancel_futures=True)

    if stop.is_set():
        raise MaterializeError("transfer stopped")
    record = {"source": manifest.source, "time": time.time(), "bytes": sum(f.size for f in files.values()),
              "files": {k: {**listing[k], "digest": journal[k]["digest"]} for k in sorted(files)}}
    (staging / COMPLETION_RECORD).write_text(json.dumps(record, indent=1))
    journal_path.unlink(missing_ok=True)
    journal_path.with_suffix(".tmp").unlink(missing_ok=True)
    if dest.exists():
        # An incomplete or stale earlier copy is replaced, never merged.
        old = dest.parent / f".old-{manifest.version}-{os.getpid()}"
        os.rename(dest, old)
        os.rename(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, dest)
    return moved[0]


def cached_versions(settings: Settings | None = None) -> list[dict]:
    """Complete versions on FSx: ``[{model_id, version, path, bytes, last_used (epoch s)}]``."""
    settings = settings or get_settings()
    out = []
    for record in settings.fsx_dir.glob(f"*/*/{COMPLETION_RECORD}"):
        if record.parent.name.startswith("."):
            continue  # staging or a copy being replaced or evicted
        data = _record(record.parent)
        try:
            last_used = record.stat().st_mtime
        except FileNotFoundError:
            continue  # evicted meanwhile
        size = data["bytes"] if data is not None and "bytes" in data else \
            sum(p.stat().st_size for p in record.parent.rglob("*") if p.is_file())  # a stale record: still evictable
        out.append({"model_id": record.parent.parent.name, "version": record.parent.name,
                    "path": record.parent, "bytes": size, "last_used": last_used})
    return sorted(out, key=lambda v: v["last_used"])


def evict(budget_bytes: int, settings: Settings | None = None, registry: Registry | None = None) -> list[dict]:
    """Remove least recently used versions until the cache holds at most ``budget_bytes``.

    A version the registry has provisioning, serving or draining is never removed, even if
    the budget stays exceeded. Returns the evicted entries (see :func:`cached_versions`).
    """
    settings = settings or get_settings()
    registry = registry or Registry(settings.registry)
    in_use = {(v.model_id, v.version) for v in registry.versions() if v.state in _IN_USE}
    cached = cached_versions(settings)
    used = sum(v["bytes"] for v in cached)
    evicted = []
    for v in cached:  # oldest use first
        if used <= budget_bytes:
            break
        if (v["model_id"], v["version"]) in in_use:
            continue
        with _version_lock(v["path"].parent, v["version"]):
            trash = v["path"].parent / f".old-{v['version']}-{os.getpid()}"
            os.rename(v["path"], trash)
            shutil.rmtree(trash, ignore_errors=True)
        used -= v["bytes"]
        evicted.append(v)
        log.info("evicted %s/%s (%.1f MB) from the FSx cache", v["model_id"], v["version"], v["bytes"] / 1e6)
    return evicted


# Transfers fail transiently (throttling, a dropped connection); a retry resumes from what
# was already verified. No Prefect timeout: the flow runs this in a worker thread, where Prefect's
# timeout cannot interrupt it (and warns so in the run's log); materialize_timeout_s bounds it.
@task(name="materialize", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_unless_bad_input,
      tags=["modelops"])
def materialize_task(manifest: Manifest) -> MaterializeResult:
    """Prefect task around :func:`materialize`, with a progress artifact and eviction."""
    from prefect import get_run_logger
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    settings = get_settings()
    state = {"todo": 0, "done": 0, "shown": -1, "artifact": None}

    def on_total(todo: int) -> None:
        state["todo"] = todo
        if todo:
            state["artifact"] = create_progress_artifact(
                0.0, key=f"materialize-{manifest.model_id}", description=f"weights of {manifest.model_id} {manifest.version}")

    def on_progress(n: int) -> None:
        state["done"] += n
        pct = int(100 * state["done"] / max(state["todo"], 1))
        if state["artifact"] and pct >= state["shown"] + 5:  # a few dozen updates, not one per chunk
            state["shown"] = pct
            update_progress_artifact(state["artifact"], float(pct))

    result = materialize(manifest, settings, progress=on_progress, total_callback=on_total)
    if state["artifact"]:
        update_progress_artifact(state["artifact"], 100.0)
    else:  # nothing to transfer: the UI still shows the stage as done
        create_progress_artifact(100.0, key=f"materialize-{manifest.model_id}",
                                 description=f"weights of {manifest.model_id} {manifest.version} (cache hit)")
    logger = get_run_logger()
    logger.info("weights of %s/%s on FSx at %s: %d files, %.1f MB; %.1f MB transferred in %.1f s (%.0f MB/s)%s",
                manifest.model_id, manifest.version, result.path, result.files, result.bytes / 1e6,
                result.transferred / 1e6, result.seconds, result.mb_per_s, " (cache hit)" if not result.transferred else "")
    if settings.cache_budget_gb is not None:
        for v in evict(int(settings.cache_budget_gb * 1e9), settings):
            logger.info("evicted %s/%s (%.1f MB, least recently used)", v["model_id"], v["version"], v["bytes"] / 1e6)
    return result
