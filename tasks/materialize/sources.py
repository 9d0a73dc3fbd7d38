"""Where weights come from: S3 (boto3) or a local directory, listed, streamed, and the part
layout of multipart S3 objects.

S3 waits are bounded (settings ``s3_connect_timeout_s``, ``s3_read_timeout_s``,
``s3_max_attempts``): botocore's read timeout applies to each socket read, so an endpoint that
never answers fails after about attempts × read timeout, while one that trickles bytes slowly
keeps its transfer alive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from modelops.errors import ManifestError, MaterializeError
from modelops.manifest import Manifest
from modelops.settings import Settings, get_settings
from modelops.tabular import model_files
from tasks.materialize.digests import CRCS
from tasks.s3 import s3_client

__all__ = ["SUMS_FILE", "ObjectChanged", "RangeReader", "SourceFile", "StoredChecksum", "list_source", "open_source"]

log = logging.getLogger(__name__)

SUMS_FILE = "SHA256SUMS"
COMPLETION_RECORD = ".modelops-complete.json"
JOURNAL = ".modelops-journal.json"
PART = ".modelops-part"  # suffix of files being written; never a source key
CHUNK = 4 << 20  # bytes per read and per pool buffer (tasks/materialize/writer.py): few calls per GiB
# A source must hold a model config and weights in one of these formats.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_EMPTY_REFUSED = (".safetensors", ".bin", ".gguf")  # a 0-byte file of these kinds is a broken upload
_LAYOUT_THREADS = 16  # parallel HeadObject(PartNumber=N) calls for an unequal part layout


class ObjectChanged(MaterializeError):
    """An S3 object no longer has the ETag it was listed with (HTTP 412 to ``If-Match``): it was
    replaced during the pull. Not retried within the transfer: the listing itself is stale."""


@dataclass(frozen=True)
class StoredChecksum:
    """The checksum S3 stores with an object (HeadObject with ``ChecksumMode=ENABLED``):
    ``algo`` a key of :data:`~tasks.materialize.digests.CRCS`, ``value`` base64 without a
    ``-<parts>`` suffix, ``type`` ``FULL_OBJECT``, ``COMPOSITE`` or None where the endpoint does
    not say (older objects, moto) and a ``-<parts>`` suffix does not tell either."""

    algo: str
    value: str
    type: str | None

    @classmethod
    def from_head(cls, head: dict) -> StoredChecksum | None:
        """The CRC checksum of a HeadObject response, or None (no checksum, or a SHA one)."""
        for algo in CRCS:
            if value := head.get(f"Checksum{algo.upper()}"):
                b64, suffix, _ = value.partition("-")
                return cls(algo, b64, head.get("ChecksumType") or ("COMPOSITE" if suffix else None))
        return None


@dataclass(frozen=True)
class SourceFile:
    """One file of a source: ``key`` relative to the source prefix, ``size`` in bytes, ``etag``
    the S3 ETag without quotes (local files: their mtime in ns, so a changed file is re-copied),
    ``checksum`` the algorithm of the checksum S3 stores with it (``crc64nvme``, ...; ListObjectsV2
    ``ChecksumAlgorithm``), empty when it has none."""

    key: str
    size: int
    etag: str
    checksum: str = ""

    @property
    def parts(self) -> int:
        """Parts of a multipart S3 upload (its ETag ends in ``-N``); 0 for anything else."""
        head, sep, tail = self.etag.rpartition("-")
        return int(tail) if sep and head and tail.isdigit() else 0


class Source:
    """A source of files; subclasses list and stream them."""

    def __init__(self, manifest: Manifest, settings: Settings) -> None:
        self.manifest, self.settings = manifest, settings

    def list(self) -> dict[str, SourceFile]:
        raise NotImplementedError

    def open(self, key: str, start: int, end: int, checksum_to: Callable[[StoredChecksum | None], None] | None = None,
             etag: str | None = None) -> RangeReader:
        """A reader of bytes ``[start, end)`` of ``key``: ``readinto(buffer)`` fills the
        buffer as far as the next read goes and returns the count (0 at the end).

        ``checksum_to`` (S3, ``[start, end)`` the whole object): fetch without a Range and pass
        the checksum the GET's headers carry (or None) to it before returning. ``etag`` (S3):
        the listed ETag, sent as ``If-Match``; :class:`ObjectChanged` when it differs."""
        raise NotImplementedError

    def stream(self, key: str, start: int, end: int, etag: str | None = None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``key`` in chunks of at most :data:`CHUNK` bytes (for
        small files read whole, e.g. ``SHA256SUMS``; transfers use :meth:`open`)."""
        reader = self.open(key, start, end, etag=etag)
        try:
            while n := reader.readinto(buf := bytearray(min(CHUNK, max(1, end - start)))):
                yield bytes(buf[:n])
        finally:
            reader.close()

    def range_size(self, file_size: int) -> int:
        """Byte-range size for a file of ``file_size`` bytes from this source (0: whole file)."""
        return self.settings.materialize_range_size or 0

    def where(self) -> str:
        raise NotImplementedError

    def changed(self, f: SourceFile) -> bool:
        """True if ``f`` changed since it was listed, as far as one can tell after reading it
        (S3: never; every GET carries ``If-Match`` instead)."""
        return False


class S3Source(Source):
    """An ``s3://bucket/prefix/`` source through boto3, with bounded waits."""

    def __init__(self, manifest: Manifest, settings: Settings) -> None:
        super().__init__(manifest, settings)
        self.bucket, _, prefix = manifest.source.removeprefix("s3://").partition("/")
        self.prefix = prefix.rstrip("/") + "/" if prefix else ""
        try:
            self.client, self.endpoint = s3_client(settings, s3_config(settings))  # endpoint None: AWS itself
        except ValueError as e:
            raise ManifestError(str(e)) from e

    def where(self) -> str:
        return f"on {self.endpoint or 'AWS S3'}"

    def _call(self, operation: str, key: str | None, fn):
        """Run one S3 call; a timeout or unreachable endpoint becomes one line that names the
        endpoint, the operation and what to check."""
        from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

        try:
            return fn()
        except ClientError as e:  # the endpoint answered with an error: name it with the object
            err = e.response.get("Error", {})
            if err.get("Code") in ("PreconditionFailed", "412"):
                raise ObjectChanged(f"s3://{self.bucket}/{self.prefix}{key or ''} changed since it was listed (its "
                                    "ETag is no longer the listed one): it is being replaced; pull again once the "
                                    "upload has finished (a rerun keeps what was verified)") from e
            raise MaterializeError(f"S3 {operation} s3://{self.bucket}/{self.prefix}{key or ''} on "
                                   f"{self.endpoint or 'AWS S3'} failed: {err.get('Code', '?')} "
                                   f"{err.get('Message', '')}".rstrip()) from e
        except (ConnectTimeoutError, ReadTimeoutError, EndpointConnectionError) as e:
            s = self.settings
            what = f"s3://{self.bucket}/{self.prefix}{key or ''}"
            verb = "could not be reached for" if isinstance(e, EndpointConnectionError) else "did not answer"
            raise MaterializeError(
                f"S3 endpoint {self.endpoint or 'AWS S3'} {verb} {operation} {what} "
                f"({type(e).__name__} after {s.s3_max_attempts} attempt(s), read timeout {s.s3_read_timeout_s:g} s, "
                f"connect timeout {s.s3_connect_timeout_s:g} s); check that the endpoint URL is right and "
                "reachable from here and that the bucket's region answers (MODELOPS_S3_ENDPOINT_URL, "
                "MODELOPS_S3_READ_TIMEOUT_S, MODELOPS_S3_MAX_ATTEMPTS)") from e

    def list(self) -> dict[str, SourceFile]:
        def pages():
            out = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
                for obj in page.get("Contents", []):
                    if obj["Key"].endswith("/"):
                        continue  # folder placeholder objects
                    rel = obj["Key"][len(self.prefix):]
                    algos = obj.get("ChecksumAlgorithm") or [""]
                    out[rel] = SourceFile(rel, int(obj["Size"]), obj["ETag"].strip('"'), algos[0].lower())
            return out

        return self._call("ListObjectsV2", None, pages)

    def open(self, key: str, start: int, end: int, checksum_to: Callable[[StoredChecksum | None], None] | None = None,
             etag: str | None = None) -> RangeReader:
        match = {"IfMatch": f'"{etag}"'} if etag else {}
        if checksum_to:  # S3 sends stored checksums on whole-object GETs only (HeadObject would cost a request)
            response = self._call("GetObject", key, lambda: self.client.get_object(
                Bucket=self.bucket, Key=self.prefix + key, ChecksumMode="ENABLED", **match))
            checksum_to(StoredChecksum.from_head(response))
            return _S3Body(self, key, response["Body"])
        if end <= start:
            return _Empty()
        body = self._call("GetObject", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=self.prefix + key, Range=f"bytes={start}-{end - 1}", **match)["Body"])
        return _S3Body(self, key, body)

    def stored_checksum(self, f: SourceFile) -> StoredChecksum | None:
        """The CRC S3 stores with ``f`` (HeadObject, ``ChecksumMode=ENABLED``, ``If-Match`` its
        listed ETag), or None."""
        head = self._call("HeadObject", f.key, lambda: self.client.head_object(
            Bucket=self.bucket, Key=self.prefix + f.key, ChecksumMode="ENABLED", IfMatch=f'"{f.etag}"'))
        return StoredChecksum.from_head(head)

    def part_size(self, key: str, number: int) -> tuple[int, int]:
        """``(size of part number, parts count)`` of a multipart object (HeadObject with
        PartNumber; S3 API reference, HeadObject: ``x-amz-mp-parts-count``). No ``If-Match``:
        moto answers it with the part's ETag; a changed object fails the sum of the parts or
        the If-Match of its GETs."""
        head = self._call("HeadObject", key, lambda: self.client.head_object(
            Bucket=self.bucket, Key=self.prefix + key, PartNumber=number))
        return int(head["ContentLength"]), int(head.get("PartsCount") or 1)

    def part_layout(self, f: SourceFile) -> tuple[list[int], bool]:
        """The part sizes of multipart object ``f`` and whether they are exact.

        S3 allows parts of unequal sizes (every part but the last ≥ 5 MiB). One HeadObject of
        part 1 gives its size P and the count N; when N parts of P bytes and a last one of the
        remainder add up to the object, that layout is assumed (``exact`` False: a mismatching
        ETag then asks :meth:`exact_layout`); otherwise every part's size is read.

        Raises:
            MaterializeError: the parts do not add up to the listed size (the object changed).
        """
        first, count = self.part_size(f.key, 1)
        assumed = assumed_layout(f.size, first, max(count, f.parts))
        return (assumed, False) if assumed is not None else (self.exact_layout(f), True)

    def exact_layout(self, f: SourceFile) -> list[int]:
        """Every part's size, from HeadObject(PartNumber=n) for n in 1..N (parallel)."""
        with ThreadPoolExecutor(_LAYOUT_THREADS, thread_name_prefix="layout") as pool:
            sizes = [size for size, _ in pool.map(lambda n: self.part_size(f.key, n), range(1, f.parts + 1))]
        if sum(sizes) != f.size:
            raise MaterializeError(f"{f.key}: its {f.parts} parts add up to {sum(sizes)} bytes, the listing says "
                                   f"{f.size}; the object changed while it was read: announce again once it is stable")
        return sizes

    def range_size(self, file_size: int) -> int:
        """The setting if given; else whole files from the local moto endpoint (it reads the
        whole object for every GET, ranged or not: bench/results/materialize.json), and from
        any other endpoint a file's size over ``materialize_concurrency``, at least 64 MiB (real
        S3 serves about 100 MB/s per connection) and at most 1 GiB: one large file still
        keeps every stream busy, with as few GETs as that takes (S3 bills per request). A kill
        loses little either way: the journal records each part as it completes."""
        if self.settings.materialize_range_size is not None:
            return self.settings.materialize_range_size
        if not self.settings.aws_credentials_block and self.settings.s3_endpoint_url is None:
            return 0
        return min(max(64 << 20, -(-file_size // max(1, self.settings.materialize_concurrency))), 1 << 30)


def assumed_layout(size: int, first: int, count: int) -> list[int] | None:
    """The layout of ``count`` parts of ``first`` bytes but a last one of the remainder (what
    awscli, boto3 and s5cmd upload), when that adds up to ``size``; else None (unequal parts)."""
    last = size - first * (count - 1)
    return [first] * (count - 1) + [last] if first > 0 and 0 < last <= first else None


class RangeReader(Protocol):
    """What :meth:`Source.open` returns."""

    def readinto(self, buffer: memoryview | bytearray) -> int: ...

    def close(self) -> None: ...


class _Empty:
    def readinto(self, buffer) -> int:
        return 0

    def close(self) -> None:
        pass


_PIECE = 256 << 10  # bytes per read call of an S3 body (see _S3Body.readinto)


class _S3Body:
    """A GET's body, read into the caller's buffers; a read that timed out mid-stream is named
    like the request's own.

    botocore's ``StreamingBody`` reads through urllib3, whose ``readinto`` reads into a bytes
    object of its own and copies that (urllib3 2.x, ``BaseHTTPResponse.readinto``): with
    ``O_DIRECT`` writes in flight the copy cut one stream after its headers from 2.8 to 2.0 GB/s
    here. So, while urllib3 has read nothing of it, the body is read from the ``http.client``
    response underneath: the same bytes (botocore asks urllib3 for no content decoding), read
    straight into the buffer, and ``http.client`` raises ``IncompleteRead`` itself when the body
    ends short of its Content-Length. At the end the connection goes back to urllib3's pool.
    Anything else reads through ``StreamingBody.readinto`` (which checks the length too)."""

    def __init__(self, source: S3Source, key: str, body) -> None:
        import http.client

        self.source, self.key, self.body = source, key, body
        raw = getattr(body, "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        self._plain = fp if isinstance(fp, http.client.HTTPResponse) and getattr(raw, "decode_content", None) is False \
            and raw.tell() == 0 else None
        self._ended = False

    def readinto(self, buffer) -> int:
        from botocore.exceptions import ReadTimeoutError
        from urllib3.exceptions import ReadTimeoutError as Urllib3ReadTimeout

        # At most _PIECE per call: a read that times out loses what it had read (the buffered
        # reader below raises without saying how much), so a retry resumes at most that far back.
        piece = memoryview(buffer)[:_PIECE]
        try:
            if self._plain is None:
                return self.body.readinto(piece)
            if self._ended:
                return 0
            n = self._plain.readinto(piece)
            if not n and len(buffer) and self._plain.isclosed():  # read to its end: the connection is free
                self._ended = True
                self.body._raw_stream.release_conn()
            return n
        except (ReadTimeoutError, Urllib3ReadTimeout, TimeoutError) as e:
            s = self.source
            raise MaterializeError(f"S3 endpoint {s.endpoint or 'AWS S3'} stopped sending s3://{s.bucket}/{s.prefix}"
                                   f"{self.key} for {s.settings.s3_read_timeout_s:g} s (MODELOPS_S3_READ_TIMEOUT_S)") from e

    def close(self) -> None:
        self.body.close()


class _FileRange:
    """Bytes ``[start, end)`` of a local file."""

    def __init__(self, path: Path, start: int, end: int) -> None:
        self.file = path.open("rb", buffering=0)
        self.file.seek(start)
        self.left = end - start

    def readinto(self, buffer) -> int:
        n = self.file.readinto(memoryview(buffer)[:self.left]) if self.left > 0 else 0
        self.left -= n
        return n

    def close(self) -> None:
        self.file.close()


def s3_config(settings: Settings):
    """The botocore ``Config`` of every S3 client: a pool for the transfer threads and the
    bounded waits of the settings (retries: botocore's standard mode; ``total_max_attempts``
    counts the first try, where botocore's ``max_attempts`` would count retries only).

    botocore's own response checksum validation is off (``when_required``): it only covers
    whole-object GETs, and the transfer verifies every range itself against the same stored
    checksum; left on, each byte would be hashed twice."""
    from botocore.config import Config

    return Config(max_pool_connections=max(10, settings.materialize_concurrency * 2),
                  response_checksum_validation="when_required",
                  connect_timeout=settings.s3_connect_timeout_s, read_timeout=settings.s3_read_timeout_s,
                  retries={"total_max_attempts": settings.s3_max_attempts, "mode": "standard"})


class LocalSource(Source):
    """A local directory (``/path`` or ``file:///path``)."""

    def __init__(self, manifest: Manifest, settings: Settings) -> None:
        super().__init__(manifest, settings)
        self.root = Path(manifest.source.removeprefix("file://")).expanduser().resolve()

    def where(self) -> str:
        return f"(local directory {self.root})"

    def list(self) -> dict[str, SourceFile]:
        out = {}
        if self.root.is_dir():
            for p in self.root.rglob("*"):
                if p.is_file():
                    st = p.stat()
                    rel = p.relative_to(self.root).as_posix()
                    out[rel] = SourceFile(rel, st.st_size, str(st.st_mtime_ns))
        return out

    def open(self, key: str, start: int, end: int, checksum_to=None, etag=None) -> RangeReader:
        return _FileRange(self.root / key, start, end)

    def changed(self, f: SourceFile) -> bool:
        """True if ``f`` no longer has its listed size and modification time (or is gone)."""
        try:
            st = (self.root / f.key).stat()
        except OSError:
            return True
        return (st.st_size, str(st.st_mtime_ns)) != (f.size, f.etag)


def open_source(manifest: Manifest, settings: Settings) -> Source:
    """The source of a manifest: S3 for ``s3://``, else a local directory."""
    return S3Source(manifest, settings) if manifest.is_s3 else LocalSource(manifest, settings)


def list_source(manifest: Manifest, settings: Settings | None = None, source: Source | None = None
                ) -> dict[str, SourceFile]:
    """List the files of a manifest's source (through ``source`` where given, e.g. the one the
    transfer then reads with: one S3 client per pull).

    Returns:
        ``{relative key: SourceFile}`` for every file under the source prefix.

    Raises:
        ManifestError: the source does not exist, is empty, holds a key that would land outside
            the destination, has no ``config.json`` or weights file, or an empty weights file.
        MaterializeError: the object store could not be reached (or did not answer in time).
    """
    settings = settings or get_settings()
    source = source or open_source(manifest, settings)
    try:
        files = source.list()
    except MaterializeError:
        raise
    except Exception as e:  # botocore raises many types; name the endpoint
        raise MaterializeError(f"cannot list source {manifest.source} {source.where()}: {e}") from e
    # A cache folder copied back to S3 carries our own records; they describe another copy.
    ours = [k for k in files if PurePosixPath(k).name in (COMPLETION_RECORD, JOURNAL)]
    for k in ours:
        log.info("ignoring %s in the source: modelops writes its own", k)
        del files[k]
    for rel in files:
        p = PurePosixPath(rel)
        if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
            raise ManifestError(f"source: key {rel!r} would land outside the model directory; refusing to copy")
        if "" in rel.split("/") or rel.endswith(PART):
            raise ManifestError(f"source: key {rel!r} is not a usable file name (empty path segment or the "
                                f"reserved suffix {PART}); rename it in the source")
    folders = {str(parent) for rel in files for parent in PurePosixPath(rel).parents if str(parent) != "."}
    if clash := sorted(folders & set(files)):
        raise ManifestError(f"source: {clash[0]!r} is both a file and a folder prefix of other keys; "
                            "rename one of them in the source")
    if not files:
        if manifest.is_s3:
            raise ManifestError(f"source: {manifest.source} does not exist or is empty {source.where()}; "
                                "upload the weights there or fix the URI")
        raise ManifestError(f"source: local directory {source.root} does not exist or is empty; fix the path")
    if manifest.framework == "xgboost":
        return _check_xgboost_source(manifest, files)
    top = {k for k in files if "/" not in k}
    if not any(k.endswith(WEIGHT_SUFFIXES) for k in files):
        raise ManifestError(f"source: {manifest.source} holds no model weights (need *.safetensors, *.bin, *.pt or "
                            f"*.gguf; found {sorted(files)[:8]})")
    if "config.json" not in top:
        raise ManifestError(f"source: {manifest.source} has no config.json at its top level (found "
                            f"{sorted(top)[:8]}); upload the model's config.json beside its weights")
    if files["config.json"].size == 0:
        raise ManifestError(f"source: config.json is empty (0 bytes) in {manifest.source}: an interrupted upload? "
                            "upload the model's config.json again")
    if empty := sorted(k for k, f in files.items() if f.size == 0 and k.endswith(_EMPTY_REFUSED)):
        raise ManifestError(f"source: weights file {empty[0]!r} is empty (0 bytes) in {manifest.source}"
                            f"{f' and {len(empty) - 1} more' if len(empty) > 1 else ''}: an interrupted upload? "
                            "upload it again")
    return files


def _check_xgboost_source(manifest: Manifest, files: dict[str, SourceFile]) -> dict[str, SourceFile]:
    """A framework xgboost source holds exactly one non-empty model file at its top level."""
    found = model_files(set(files))
    if len(found) != 1:
        raise ManifestError(f"source: {manifest.source} must hold exactly one XGBoost model file at its top level "
                            f"(*.ubj or *.json, as Booster.save_model writes it); found "
                            f"{found or sorted(files)[:8]}" + ("" if found else " (no model file)"))
    if files[found[0]].size == 0:
        raise ManifestError(f"source: model file {found[0]!r} is empty (0 bytes) in {manifest.source}: an interrupted "
                            "upload? upload it again")
    return files
