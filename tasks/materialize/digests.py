"""Integrity of transferred files: sha256 against ``SHA256SUMS``, S3 ETags, part layouts.

An S3 ETag is the MD5 of the object for a single-part upload, and for a multipart upload the
MD5 of the concatenated binary MD5s of its parts followed by ``-<parts>`` (observed S3
behaviour, relied on by awscli and s5cmd; objects encrypted with SSE-KMS/SSE-C have other
ETags and are checked by size and SHA256SUMS only). Digests are computed while the bytes
stream in (:class:`StreamHasher`), so a verified file is read once; only a file split into
several ranges under a whole-file digest (sha256, single-part MD5) is read again at the end.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from modelops.errors import MaterializeError

__all__ = ["StreamHasher", "compress_layout", "etag_of_parts", "expand_layout", "file_digests", "parse_sums"]

_READ = 8 << 20


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
    ETag's parts); ``algo`` is ``md5`` for ETags or ``sha256``. :meth:`update` returns the parts
    it completed as ``(start, end, digest)``; :meth:`final` the part still open;
    :meth:`digests` every part's binary digest in order (one in all when there are no cuts).
    """

    def __init__(self, algo: str, start: int, cuts: list[int]) -> None:
        self.algo, self.pos, self.cuts = algo, start, sorted(c for c in cuts if c > start)
        self.part_start = start
        self.done: list[bytes] = []
        self.h = hashlib.new(algo)

    def update(self, data) -> list[tuple[int, int, bytes]]:
        view, finished = memoryview(data), []
        while self.cuts and self.pos + len(view) >= self.cuts[0]:
            cut = self.cuts.pop(0)
            n = cut - self.pos
            self.h.update(view[:n])
            self.done.append(self.h.digest())
            finished.append((self.part_start, cut, self.done[-1]))
            self.h, self.part_start = hashlib.new(self.algo), cut
            view, self.pos = view[n:], cut
        self.h.update(view)  # hashlib releases the GIL for large buffers
        self.pos += len(view)
        return finished

    def final(self) -> tuple[int, int, bytes]:
        return self.part_start, self.pos, self.h.digest()

    def digests(self) -> list[bytes]:
        return [*self.done, self.h.digest()]


def file_digests(path: Path, algo: str, part_sizes: list[int] | None = None) -> list[bytes]:
    """Read ``path`` once and return the digest of each part (``part_sizes``; None: the whole
    file as one part).

    Raises:
        MaterializeError: the file is shorter than its parts.
    """
    sizes = part_sizes if part_sizes is not None else [path.stat().st_size]
    out = []
    with path.open("rb", buffering=0) as f:
        for size in sizes:
            h, left = hashlib.new(algo), size
            while left > 0 and (chunk := f.read(min(_READ, left))):
                h.update(chunk)
                left -= len(chunk)
            if left:
                raise MaterializeError(f"{path.name}: shorter than its parts ({left} bytes missing)")
            out.append(h.digest())
    return out
