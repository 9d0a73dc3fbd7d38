"""The FSx cache: completion records, per-version locks, LRU eviction, abandoned staging folders
and re-verification of a cached copy.

Layout under ``<fsx_root>/<model_id>/``: ``<version>/`` (complete, with its completion record
``.modelops-complete.json``), ``.staging-<version>/`` (a transfer in progress or abandoned),
``.old-<version>-<pid>/`` (a replaced copy being removed) and ``.<version>.lock`` (an
``flock`` held by whoever writes or evicts that version).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from modelops.errors import MaterializeError
from modelops.manifest import MODEL_ID_PATTERN, VERSION_PATTERN
from modelops.process import file_lock
from modelops.settings import Settings, get_settings
from tasks.materialize.digests import CRCS, composite_crc, crc_b64, etag_of_parts, expand_layout, file_digests
from tasks.materialize.sources import COMPLETION_RECORD, SourceFile

if TYPE_CHECKING:
    from modelops.registry import Registry

__all__ = ["cached_versions", "evict", "evict_version", "leftovers", "shared_files", "stored_bytes", "verify_cached"]

log = logging.getLogger(__name__)

# Versions in these states are in use and never evicted.
_IN_USE = ("provisioning", "serving", "draining")


def read_record(dest: Path) -> dict | None:
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


def listing_of(files: dict[str, SourceFile]) -> dict[str, dict]:
    """``{key: {size, etag}}``: what a completion record and the journal are checked against."""
    return {k: {"size": f.size, "etag": f.etag} for k, f in sorted(files.items())}


def is_complete(dest: Path, files: dict[str, SourceFile]) -> bool:
    """True when ``dest`` holds a completion record for exactly this listing and every file
    has its size (a cache hit)."""
    record = read_record(dest)
    if record is None or {k: {"size": v["size"], "etag": v["etag"]} for k, v in record["files"].items()} != \
            listing_of(files):
        return False
    return all((dest / k).is_file() and (dest / k).stat().st_size == f.size for k, f in files.items())


def version_lock(parent: Path, version: str):
    """The lock that serializes writers and evictors of one version (blocking)."""
    return file_lock(parent / f".{version}.lock")


@contextlib.contextmanager
def _reading(parent: Path, version: str) -> Iterator[None]:
    """A shared hold on the version's lock for a reader (``cache verify``): readers do not wait
    for each other, a pull or an eviction waits for them. Opened read-only, so that a read-only
    mount (a serving pod's) can verify too; no lock file: no pull ever ran here, nothing to wait for."""
    try:
        f = (parent / f".{version}.lock").open("rb")
    except FileNotFoundError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_SH)
        yield


def _locked(parent: Path, version: str) -> bool:
    """True if someone holds the version's lock now (a pull in progress)."""
    path = parent / f".{version}.lock"
    if not path.exists():
        return False
    try:
        f = path.open("a")  # for writing: where flock is emulated with POSIX locks (NFS), LOCK_EX needs it
    except OSError:
        f = path.open("rb")  # a read-only mount: flock itself does not care
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def clean_strays(parent: Path, version: str) -> None:
    """Remove copies of ``version`` left half-deleted by an earlier replace or eviction."""
    for stray in parent.glob(f".old-{version}-*"):
        shutil.rmtree(stray, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_blocks * 512  # allocated, as preallocated parts take space
        except FileNotFoundError:
            pass
    return total


def _unique_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` that no other version links (one link: its own), the
    completion record left out."""
    total = 0
    for p in path.rglob("*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.is_file() and st.st_nlink == 1 and p.name != COMPLETION_RECORD:
            total += st.st_size
    return total


def cached_versions(settings: Settings | None = None) -> list[dict]:
    """Complete versions on FSx: ``[{model_id, version, path, bytes, unique_bytes, last_used
    (epoch s)}]``, least recently used first. ``bytes`` is the copy's size; ``unique_bytes`` what
    removing it would free (files no other version shares, see :func:`shared_files`)."""
    settings = settings or get_settings()
    out = []
    for record in settings.fsx_dir.glob(f"*/*/{COMPLETION_RECORD}"):
        if record.parent.name.startswith("."):
            continue  # staging or a copy being replaced or evicted
        data = read_record(record.parent)
        try:
            last_used = record.stat().st_mtime
        except FileNotFoundError:
            continue  # evicted meanwhile
        size = data["bytes"] if data is not None and "bytes" in data else \
            sum(p.stat().st_size for p in record.parent.rglob("*") if p.is_file())  # a stale record: still evictable
        out.append({"model_id": record.parent.parent.name, "version": record.parent.name,
                    "path": record.parent, "bytes": size, "unique_bytes": _unique_bytes(record.parent),
                    "last_used": last_used})
    return sorted(out, key=lambda v: v["last_used"])


def stored_bytes(settings: Settings | None = None) -> int:
    """Bytes of the complete copies' files on FSx, a file shared by several versions counted once
    (their completion records, a few hundred bytes each, left out)."""
    settings = settings or get_settings()
    seen, total = set(), 0
    for v in cached_versions(settings):
        for p in v["path"].rglob("*"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if p.is_file() and p.name != COMPLETION_RECORD and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def shared_files(settings: Settings, listing: dict[str, dict], exclude: Path) -> dict[str, tuple[Path, dict]]:
    """Files of other complete copies with the same content as entries of ``listing``
    (``{key: {size, etag}}`` of an S3 source): ``{key: (path of the copy's file, its record
    entry)}``. Content is the object's size and ETag (S3's MD5, or the MD5 of its parts' MD5s),
    read from copies of S3 sources only, whose files were verified against it when they were
    pulled: an object uploaded again with other bytes under the same name has another ETag and
    is fetched. The first copy found per content is used."""
    wanted = {(e["size"], e["etag"]): key for key, e in listing.items() if e.get("etag")}
    found: dict[str, tuple[Path, dict]] = {}
    if not wanted:
        return found
    for record_path in settings.fsx_dir.glob(f"*/*/{COMPLETION_RECORD}"):
        copy = record_path.parent
        if copy.name.startswith(".") or copy == exclude:
            continue
        record = read_record(copy)
        if record is None or not str(record.get("source", "")).startswith("s3://"):
            continue
        for name, entry in record["files"].items():
            key = wanted.get((entry["size"], entry["etag"]))
            if key is not None and key not in found and (copy / name).is_file() \
                    and (copy / name).stat().st_size == entry["size"]:
                found[key] = (copy / name, entry)
    return found


def leftovers(settings: Settings | None = None) -> list[dict]:
    """Staging folders and half-removed copies: ``[{model_id, version, path, bytes (allocated),
    last_used (mtime, epoch s), in_use}]``; ``in_use`` is True while a pull holds the version's lock (still transferring)."""
    settings = settings or get_settings()
    out = []
    for path in sorted([*settings.fsx_dir.glob("*/.staging-*"), *settings.fsx_dir.glob("*/.old-*")]):
        if not path.is_dir():
            continue
        name = path.name
        version = name.removeprefix(".staging-") if name.startswith(".staging-") else \
            name.removeprefix(".old-").rsplit("-", 1)[0]
        try:
            last_used = path.stat().st_mtime
        except FileNotFoundError:
            continue  # published or removed meanwhile
        out.append({"model_id": path.parent.name, "version": version, "path": path, "bytes": _tree_bytes(path),
                    "last_used": last_used, "in_use": _locked(path.parent, version)})
    return out


def evict(budget_bytes: int | None, settings: Settings | None = None, registry: Registry | None = None,
          keep: tuple[str, str] | None = None) -> list[dict]:
    """Reclaim abandoned staging folders (no pull holds their lock), then remove least recently
    used versions until the cache holds at most ``budget_bytes`` (None: reclaim only).

    A version the registry has provisioning, serving or draining is never removed, nor ``keep``
    (``(model_id, version)``: the one just pulled, which nothing uses yet), even if the budget
    stays exceeded. Returns what was removed: the entries of :func:`cached_versions`
    and :func:`leftovers` (``leftover`` True for the latter).
    """
    from modelops.registry import Registry  # SQLAlchemy: only eviction needs the registry

    settings = settings or get_settings()
    registry = registry or Registry(settings.registry)
    removed = []
    for left in leftovers(settings):
        if left["in_use"]:
            continue
        with version_lock(left["path"].parent, left["version"]):
            if not left["path"].exists():
                continue  # a pull finished (renamed it) or removed it meanwhile
            trash = left["path"]
            if trash.name.startswith(".staging-"):  # out of a resuming pull's way before the slow part
                trash = trash.parent / f".old-{left['version']}-{os.getpid()}"
                os.rename(left["path"], trash)
            shutil.rmtree(trash, ignore_errors=True)
        removed.append({**left, "leftover": True})
        log.info("reclaimed %s (%.1f MB, abandoned)", left["path"], left["bytes"] / 1e6)
    if budget_bytes is None:
        return removed
    in_use = {(v.model_id, v.version) for v in registry.versions() if v.state in _IN_USE} | {keep}
    cached = cached_versions(settings)
    used = stored_bytes(settings)  # shared files once: what the budget is about
    for v in cached:  # oldest use first
        if used <= budget_bytes:
            break
        if (v["model_id"], v["version"]) in in_use:
            continue
        with version_lock(v["path"].parent, v["version"]):
            trash = v["path"].parent / f".old-{v['version']}-{os.getpid()}"
            os.rename(v["path"], trash)
            shutil.rmtree(trash, ignore_errors=True)
        used = stored_bytes(settings)  # its shared files still hold their bytes in other versions
        removed.append({**v, "leftover": False})
        log.info("evicted %s/%s (%.1f MB) from the FSx cache", v["model_id"], v["version"], v["bytes"] / 1e6)
    return removed


def _check_names(model_id: str, version: str) -> None:
    """Refuse a model id or version a manifest could not have (``..``, slashes, ...) before any path is built."""
    if not re.fullmatch(MODEL_ID_PATTERN, model_id):
        raise MaterializeError(f"model id {model_id!r} is not one a manifest allows (lowercase letters, digits and "
                               "'-', as in `modelops cache ls`)")
    if not re.fullmatch(VERSION_PATTERN, version):
        raise MaterializeError(f"version {version!r} is not one a manifest allows (letters, digits, '.', '_' and "
                               "'-', as in `modelops cache ls`)")


def evict_version(model_id: str, version: str, settings: Settings | None = None,
                  registry: Registry | None = None) -> dict:
    """Remove one cached version (its entry of :func:`cached_versions` is returned).

    Raises:
        MaterializeError: it is not cached, or the registry has it provisioning, serving or
            draining (an instance reads its weights from there).
    """
    from modelops.registry import Registry

    settings = settings or get_settings()
    _check_names(model_id, version)
    registry = registry or Registry(settings.registry)
    (entry,) = [v for v in cached_versions(settings) if (v["model_id"], v["version"]) == (model_id, version)] or [None]
    if entry is None:
        raise MaterializeError(f"{model_id} {version} is not in the cache at {settings.fsx_dir}; `modelops cache ls` "
                               "lists what is")
    state = next((v.state for v in registry.versions(model_id) if v.version == version), None)
    if state in _IN_USE:
        raise MaterializeError(f"{model_id} {version} is {state}: its instances read these weights; retire it first "
                               "(`modelops cleanup` or a newer version)")
    try:
        with version_lock(entry["path"].parent, version):
            trash = entry["path"].parent / f".old-{version}-{os.getpid()}"
            os.rename(entry["path"], trash)
            shutil.rmtree(trash, ignore_errors=True)
    except OSError as e:  # a read-only mount (a serving pod's), permissions
        raise MaterializeError(f"cannot remove {entry['path']}: {e.strerror or e}; evict where the FSx cache "
                               f"({settings.fsx_dir}) is writable") from e
    log.info("evicted %s/%s (%.1f MB) from the FSx cache", model_id, version, entry["bytes"] / 1e6)
    return entry


def verify_cached(model_id: str, version: str, settings: Settings | None = None) -> dict:
    """Re-hash a cached copy against its completion record.

    Returns:
        ``{"path", "files", "bytes", "checked": {kind: count}, "problems": [one line per bad file]}``;
        kinds are ``sha256``, ``crc32`` / ``crc32c`` / ``crc64nvme`` (S3's stored checksum, full-object
        or composite; ``crc32c`` also for local sources, computed as the copy was read), ``etag``
        (MD5 or multipart ETag) and ``size`` (records of older modelops: local sources before
        their CRC was kept, multipart objects before part layouts were).

    Raises:
        MaterializeError: the version is not in the cache (or its record is unreadable).
    """
    settings = settings or get_settings()
    _check_names(model_id, version)
    dest = settings.fsx_dir / model_id / version
    record = read_record(dest)
    if record is None:
        raise MaterializeError(f"{model_id} {version} is not in the cache at {dest} (or its completion record is "
                               "unreadable); `modelops cache ls` lists what is, `modelops cache pull` fetches it")
    checked: dict[str, int] = {}
    problems = []
    with _reading(dest.parent, version):
        for key, entry in sorted(record["files"].items()):
            path = dest / key
            if not path.is_file():
                problems.append(f"{key}: missing")
                continue
            if (size := path.stat().st_size) != entry["size"]:
                problems.append(f"{key}: {size} bytes, the record says {entry['size']}")
                continue
            algo, _, expected = entry["digest"].partition(":")
            if algo == "sha256":
                actual = file_digests(path, "sha256")[0].hex()
            elif algo == "etag" and "-" not in expected:
                actual = file_digests(path, "md5")[0].hex()
            elif algo == "etag" and "parts" in entry:
                actual = etag_of_parts(file_digests(path, "md5", expand_layout(entry["parts"])))
            elif algo in CRCS and "-" not in expected:  # FULL_OBJECT
                actual = crc_b64(file_digests(path, algo)[0])
            elif algo in CRCS and "parts" in entry:  # COMPOSITE
                actual = composite_crc(algo, file_digests(path, algo, expand_layout(entry["parts"])))
            else:
                algo, actual = "size", expected
            checked[algo] = checked.get(algo, 0) + 1
            if actual != expected:
                problems.append(f"{key}: {algo} is {actual}, the record says {expected}")
    return {"path": dest, "files": len(record["files"]), "bytes": record.get("bytes"), "checked": checked,
            "problems": problems}
