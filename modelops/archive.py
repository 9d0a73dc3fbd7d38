"""A package on disk: one archive plus a manifest of sha256 digests.

    <package dir>/package.tar.gz   the model repository, deployment.json, plugin wheels
    <package dir>/package.json     metadata + sha256 of the archive and of every file in it

:func:`seal` writes both (deterministically: sorted members, fixed mtimes and owners, so the
same content gives the same digest). :func:`unpack` is what the serving image runs first: it
checks the archive's digest, refuses absolute and ``..`` member names, extracts with tarfile's
``data`` filter (PEP 706: refuses links that leave the tree, device files and special files,
and members that would land outside ``dest``) and then checks every
file against its recorded digest and refuses any file that is not recorded.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

from modelops.errors import PackageError
from modelops.fs import atomic_dir

__all__ = ["ARCHIVE", "META", "read_meta", "seal", "unpack"]

ARCHIVE = "package.tar.gz"
META = "package.json"
# package.json's metadata, sealed inside the archive too: an edit to package.json alone is refused.
SEALED_META = ".modelops-meta.json"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def seal(files: dict[str, bytes | Path], dest: Path, meta: dict) -> dict:
    """Write ``package.tar.gz`` and ``package.json`` into ``dest`` (created or replaced).

    Args:
        files: ``{relative path: content or a file to copy}``; paths use ``/``, no ``..``.
        dest: the package folder; meta: extra fields for ``package.json``.

    Returns:
        The ``package.json`` content (``meta`` plus ``archive_sha256`` and ``files``). ``meta``
        is also sealed inside the archive, so :func:`unpack` refuses a package.json whose
        metadata was edited.

    Raises:
        PackageError: a path is absolute or escapes the package, or ``dest`` cannot be written.
    """
    digests = {}
    for rel in files:
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or "" in parts or rel == SEALED_META:
            raise PackageError(f"package path {rel!r} must be relative and stay inside the package")
    files = {**files, SEALED_META: json.dumps(meta, sort_keys=True).encode()}
    try:
        with atomic_dir(dest) as staging:
            raw = io.BytesIO()
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for rel in sorted(files):
                    content = files[rel]
                    data = content.read_bytes() if isinstance(content, Path) else content
                    digests[rel] = hashlib.sha256(data).hexdigest()
                    info = tarfile.TarInfo(rel)
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
            with (staging / ARCHIVE).open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
                gz.write(raw.getvalue())
            record = {**meta, "archive_sha256": _sha256_file(staging / ARCHIVE),
                      "files": {k: v for k, v in digests.items() if k != SEALED_META}}
            (staging / META).write_text(json.dumps(record, indent=1, sort_keys=True))
    except OSError as e:
        raise PackageError(f"cannot write package {dest}: {e}") from e
    return record


def read_meta(package: Path) -> dict:
    """``package.json`` of the package folder ``package``.

    Raises:
        PackageError: the folder has no readable package.json (not a package).
    """
    try:
        return json.loads((package / META).read_text())
    except (OSError, ValueError) as e:
        raise PackageError(f"{package} is not a package (no readable {META}: {e})") from None


def unpack(package: Path, dest: Path) -> dict:
    """Verify and extract the package folder ``package`` into ``dest``.

    It is extracted and checked in a staging folder beside ``dest`` that replaces ``dest`` only
    when every check passed (:func:`modelops.fs.atomic_dir`): a refused package leaves no tree.

    Returns:
        The ``package.json`` content.

    Raises:
        PackageError: the archive's sha256 differs from the record; a member is refused by the
            ``data`` filter (absolute path, ``..``, a link leaving the tree, a device or other
            special file); a file is missing, unrecorded or has another sha256.
    """
    meta = read_meta(package)
    archive = package / ARCHIVE
    if not archive.is_file():
        raise PackageError(f"package {package}: {ARCHIVE} is missing")
    actual = _sha256_file(archive)
    if actual != meta.get("archive_sha256"):
        raise PackageError(f"package {package}: {ARCHIVE} has sha256 {actual}, {META} records "
                           f"{meta.get('archive_sha256')}; the package was altered or is incomplete")
    with atomic_dir(dest) as staging:  # a refused package leaves no half-extracted tree
        _extract(package, archive, staging)
        problems = _check_tree(staging, meta)
        if problems:
            raise PackageError(f"package {package} does not match {META}:\n  " + "\n  ".join(problems))
    return meta


def _extract(package: Path, archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar.getmembers():
                # The data filter would strip a leading "/" and extract the file anyway; a
                # package with an absolute path was not written by seal(), so refuse it.
                if member.name.startswith("/") or ".." in member.name.split("/"):
                    raise tarfile.FilterError(f"{member.name!r} is absolute or leaves the package")
            tar.extractall(dest, filter="data")
    except tarfile.FilterError as e:
        raise PackageError(f"package {package}: refused archive member: {e}") from None
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PackageError(f"package {package}: cannot extract {ARCHIVE}: {e}") from None


def _check_tree(dest: Path, meta: dict) -> list[str]:
    """What differs between the extracted tree and the record (the sealed copy is removed)."""
    recorded = meta.get("files", {})
    problems = []
    sealed = dest / SEALED_META
    try:
        inner = json.loads(sealed.read_text())
        sealed.unlink()
    except (OSError, ValueError):
        inner = None
    outer = {k: v for k, v in meta.items() if k not in ("archive_sha256", "files")}
    if inner != outer:
        changed = sorted(k for k in set(outer) | set(inner or {}) if (inner or {}).get(k) != outer.get(k))
        problems.append(f"{META}: fields {changed} differ from the metadata sealed in the archive")
    for path in sorted(dest.rglob("*")):
        rel = path.relative_to(dest).as_posix()
        if path.is_symlink() or (not path.is_dir() and rel not in recorded):
            problems.append(f"{rel}: not recorded in {META}")
    for rel, digest in recorded.items():
        path = dest / rel
        if not path.is_file() or path.is_symlink():
            problems.append(f"{rel}: missing")
        elif (got := _sha256_file(path)) != digest:
            problems.append(f"{rel}: sha256 {got}, recorded {digest}")
    return problems
