"""Integrity of transferred files: sha256 against ``SHA256SUMS``, S3's stored checksums, S3
ETags, part layouts.

- **Stored checksums** (``x-amz-checksum-crc32`` / ``-crc32c`` / ``-crc64nvme``; AWS S3 user
  guide, "Checking object integrity"): a FULL_OBJECT checksum is the CRC of the whole object,
  so ranges hashed on their own are joined with CRC combination (``awscrt.checksums.combine_*``)
  and nothing is read twice; a COMPOSITE one (multipart uploads) is the CRC of the concatenated
  big-endian part CRCs, shown with a ``-<parts>`` suffix. Real S3 stores a CRC64NVME on every
  object uploaded without a checksum since December 2024.
- **ETags** (objects without a stored checksum): the MD5 of a single-part upload, or for a
  multipart upload the MD5 of the concatenated binary MD5s of its parts followed by
  ``-<parts>`` (observed S3 behaviour, relied on by awscli and s5cmd; SSE-KMS/SSE-C objects have
  other ETags and are checked by size and SHA256SUMS only).

Digests are computed while the bytes stream in (:class:`StreamHasher`), so a verified file is
read once; only a file split into several ranges under a whole-file digest that cannot be
combined (sha256, single-part MD5) is read again at the end. The CRCs run at about 9–10 GB/s
on one core here, MD5 at about 0.5 (``digest_MB_per_s_single_thread`` in
bench/results/materialize.json).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from awscrt import checksums
from isal import isal_zlib

from modelops.errors import MaterializeError

__all__ = ["CRCS", "StreamHasher", "combine_crcs", "composite_crc", "compress_layout", "crc_b64", "etag_of_parts",
           "expand_layout", "file_digests", "new_hash", "parse_sums"]

_READ = 8 << 20

# The CRCs S3 stores: name → (checksum, combine, width in bytes). Source: S3 API reference,
# "Checksum" (ChecksumCRC32, ChecksumCRC32C: 4 bytes; ChecksumCRC64NVME: 8 bytes, base64).
# CRC32 from ISA-L (about 10 GB/s here, zlib and awscrt about 2); the rest from awscrt.
CRCS = {"crc32": (isal_zlib.crc32, checksums.combine_crc32, 4),
        "crc32c": (checksums.crc32c, checksums.combine_crc32c, 4),
        "crc64nvme": (checksums.crc64nvme, checksums.combine_crc64nvme, 8)}


class _Crc:
    """A CRC with hashlib's ``update``/``digest`` (digest: the big-endian bytes S3 encodes)."""

    def __init__(self, algo: str) -> None:
        self.fn, _, self.width = CRCS[algo]
        self.value = 0

    def update(self, data) -> None:
        self.value = self.fn(data, self.value)  # both libraries release the GIL while they run

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")


def new_hash(algo: str):
    """A fresh hash object for ``algo``: ``sha256``, ``md5`` (hashlib) or a key of :data:`CRCS`."""
    return _Crc(algo) if algo in CRCS else hashlib.new(algo)


def crc_b64(digest: bytes) -> str:
    """A CRC's bytes as S3 shows them (base64)."""
    return base64.b64encode(digest).decode()


def combine_crcs(algo: str, pieces: list[tuple[int, bytes]]) -> bytes:
    """The CRC of consecutive pieces given as ``(length in bytes, CRC bytes)`` in order."""
    _, combine, width = CRCS[algo]
    value = 0
    for i, (length, digest) in enumerate(pieces):
        crc = int.from_bytes(digest, "big")
        value = crc if i == 0 else combine(value, crc, length)
    return value.to_bytes(width, "big")


def composite_crc(algo: str, part_crcs: list[bytes]) -> str:
    """A multipart object's COMPOSITE checksum: the CRC of its concatenated part CRCs,
    ``<base64>-<parts>``."""
    h = new_hash(algo)
    h.update(b"".join(part_crcs))
    return f"{crc_b64(h.digest())}-{len(part_crcs)}"


def parse_sums(text: str) -> dict[str, str]:
    """``{relative path: sha256 hex}`` from ``sha256sum`` output (``<hex>  <path>``; ``*`` and
    ``./`` prefixes allowed)."""
    sums = {}
    for line in text.splitlines():
        if line.strip():
            digest, _, name = line.strip().partition(" ")
            sums[name.strip().lstrip("*").removeprefix("./")] = digest.lower()
    return sums


def etag_of_parts(md5s: list[bytes]) -> str:
    """The multipart ETag of parts with these binary MD5s: ``md5(concat)-N``."""
    return f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"


def compress_layout(sizes: list[int]) -> list[list[int]]:
    """Part sizes as runs ``[[size, count], ...]`` (10,000 equal parts are one run)."""
    runs: list[list[int]] = []
    for s in sizes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return runs


def expand_layout(runs: list[list[int]]) -> list[int]:
    """Inverse of :func:`compress_layout`."""
    return [size for size, count in runs for _ in range(count)]


class StreamHasher:
    """Digests of one byte range ``[start, end)`` fed in order, split at part boundaries.

    ``cuts`` are the absolute offsets inside the range where a new part starts (a multipart
    ETag's or composite checksum's parts); ``algo`` as for :func:`new_hash`. :meth:`update`
    returns the parts it completed as ``(start, end, digest)``; :meth:`final` the part still
    open; :meth:`digests` every part's binary digest in order (one in all when there are no cuts).
    """

    def __init__(self, algo: str, start: int, cuts: list[int]) -> None:
        self.algo, self.pos, self.cuts = algo, start, sorted(c for c in cuts if c > start)
        self.part_start = start
        self.done: list[bytes] = []
        self.h = new_hash(algo)

    def update(self, data) -> list[tuple[int, int, bytes]]:
        view, finished = memoryview(data), []
        while self.cuts and self.pos + len(view) >= self.cuts[0]:
            cut = self.cuts.pop(0)
            n = cut - self.pos
            self.h.update(view[:n])
            self.done.append(self.h.digest())
            finished.append((self.part_start, cut, self.done[-1]))
            self.h, self.part_start = new_hash(self.algo), cut
            view, self.pos = view[n:], cut
        self.h.update(view)  # hashlib and awscrt release the GIL for large buffers
        self.pos += len(view)
        return finished

    def final(self) -> tuple[int, int, bytes]:
        return self.part_start, self.pos, self.h.digest()

    def digests(self) -> list[bytes]:
        return [*self.done, self.h.digest()]


def file_digests(path: Path, algo: str, part_sizes: list[int] | None = None) -> list[bytes]:
    """Read ``path`` once and return the digest of each part (``part_sizes``; None: the whole
    file as one part); ``algo`` as for :func:`new_hash`.

    Raises:
        MaterializeError: the file is shorter than its parts.
    """
    sizes = part_sizes if part_sizes is not None else [path.stat().st_size]
    out = []
    with path.open("rb", buffering=0) as f:
        for size in sizes:
            h, left = new_hash(algo), size
            while left > 0 and (chunk := f.read(min(_READ, left))):
                h.update(chunk)
                left -= len(chunk)
            if left:
                raise MaterializeError(f"{path.name}: shorter than its parts ({left} bytes missing)")
            out.append(h.digest())
    return out
