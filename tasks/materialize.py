"""materialize: copy a model version's weights from its source onto the FSx cache.

Destination: ``<fsx_root>/<model_id>/<version>/``. Files are downloaded into a staging
directory beside it (same file system), their sizes checked against the listing, and the
directory renamed into place; a completion record ``.modelops-complete.json`` is written last.
A reader never sees a partial model, and a rerun after a complete copy transfers nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import fsspec
from prefect import task

from modelops.errors import ManifestError, MaterializeError
from modelops.manifest import Manifest
from modelops.settings import Settings, get_settings
from tasks._retry import retry_unless_bad_input

__all__ = ["COMPLETION_RECORD", "MaterializeResult", "list_source", "materialize", "materialize_task"]

log = logging.getLogger(__name__)

COMPLETION_RECORD = ".modelops-complete.json"
# A source must hold a model config and weights in one of these formats.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class MaterializeResult:
    """Where the weights are and what it took: ``path`` on FSx, ``bytes`` total size,
    ``files`` count, ``transferred`` bytes actually copied (0 on a cache hit), ``seconds``."""

    path: Path
    files: int
    bytes: int
    transferred: int
    seconds: float


def _filesystem(manifest: Manifest, settings: Settings) -> tuple[fsspec.AbstractFileSystem, str]:
    if manifest.is_s3:
        fs = fsspec.filesystem("s3", **settings.storage_options())
        return fs, manifest.source.removeprefix("s3://").rstrip("/")
    path = manifest.source.removeprefix("file://")
    return fsspec.filesystem("file"), str(Path(path).expanduser().resolve())


def list_source(manifest: Manifest, settings: Settings | None = None) -> dict[str, int]:
    """List the files of a manifest's source.

    Returns:
        ``{relative key: size in bytes}`` for every file under the source prefix.

    Raises:
        ManifestError: the source does not exist, is empty, holds a key that would land outside
            the destination, or has no ``config.json`` or weights file.
        MaterializeError: the object store could not be reached.
    """
    settings = settings or get_settings()
    fs, root = _filesystem(manifest, settings)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    except Exception as e:  # botocore and aiohttp raise many types; name the endpoint
        where = settings.s3_endpoint if manifest.is_s3 else "local file system"
        raise MaterializeError(f"cannot list source {manifest.source} ({where}): {e}") from e
    files: dict[str, int] = {}
    for full, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = full[len(root):].lstrip("/") if full.startswith(root) else full
        p = PurePosixPath(rel)
        if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
            raise ManifestError(f"source: key {full!r} would land outside the model directory; refusing to copy")
        files[rel] = int(info.get("size") or 0)
    if not files:
        if manifest.is_s3:
            raise ManifestError(f"source: {manifest.source} does not exist or is empty on {settings.s3_endpoint}; "
                                "upload the weights there or fix the URI")
        raise ManifestError(f"source: local directory {root} does not exist or is empty; fix the path")
    top = {k for k in files if "/" not in k}
    if "config.json" not in top or not any(k.endswith(_WEIGHT_SUFFIXES) for k in files):
        raise ManifestError(
            f"source: {manifest.source} holds no model weights (need config.json and *.safetensors "
            f"or pytorch_model.bin at the top level; found {sorted(files)[:8]})"
        )
    return files


def _complete(dest: Path, files: dict[str, int]) -> bool:
    record = dest / COMPLETION_RECORD
    if not record.is_file():
        return False
    try:
        recorded = json.loads(record.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return recorded == files and all((dest / k).is_file() and (dest / k).stat().st_size == n for k, n in files.items())


def materialize(manifest: Manifest, settings: Settings | None = None) -> MaterializeResult:
    """Copy the source's files to ``<fsx_root>/<model_id>/<version>/`` and publish atomically.

    Idempotent: when the destination's completion record matches the source listing
    (keys and sizes), nothing is transferred.

    Raises:
        ManifestError: see :func:`list_source`.
        MaterializeError: a transfer failed or a file's size differs from the listing; the
            staging directory is removed and nothing is published.
    """
    settings = settings or get_settings()
    t0 = time.monotonic()
    files = list_source(manifest, settings)
    total = sum(files.values())
    dest = settings.fsx_dir / manifest.model_id / manifest.version
    if _complete(dest, files):
        log.info("cache hit: %s (%d files, %.1f MB) already on FSx, nothing transferred", dest, len(files), total / 1e6)
        return MaterializeResult(dest, len(files), total, 0, time.monotonic() - t0)

    fs, root = _filesystem(manifest, settings)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".staging-{manifest.version}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        for rel, size in sorted(files.items()):
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            # fs.get_file streams in blocks; the object is never held in memory whole.
            fs.get_file(f"{root}/{rel}", str(target))
            got = target.stat().st_size
            if got != size:
                raise MaterializeError(f"{manifest.source}{rel}: expected {size} bytes, got {got}")
        (staging / COMPLETION_RECORD).write_text(
            json.dumps({"source": manifest.source, "files": files, "bytes": total, "time": time.time()}, indent=1)
        )
        if dest.exists():
            # An incomplete earlier copy (no or stale record) is replaced, never merged.
            old = dest.parent / f".old-{manifest.version}-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(staging, dest)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, MaterializeError | KeyboardInterrupt):
            raise
        raise MaterializeError(f"transfer of {manifest.source} to {dest} failed: {e}") from e
    seconds = time.monotonic() - t0
    log.info("materialized %s → %s: %d files, %.1f MB in %.1f s (%.0f MB/s)", manifest.source, dest,
             len(files), total / 1e6, seconds, total / 1e6 / max(seconds, 1e-6))
    return MaterializeResult(dest, len(files), total, total, seconds)


# Transfers fail transiently (throttling, a dropped connection); a retry resumes idempotently.
@task(name="materialize", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_unless_bad_input,
      timeout_seconds=3600, tags=["modelops"])
def materialize_task(manifest: Manifest) -> MaterializeResult:
    """Prefect task around :func:`materialize`."""
    from prefect import get_run_logger

    result = materialize(manifest)
    get_run_logger().info(
        "weights of %s/%s on FSx at %s: %d files, %.1f MB, %.1f MB transferred in %.1f s",
        manifest.model_id, manifest.version, result.path, result.files, result.bytes / 1e6,
        result.transferred / 1e6, result.seconds,
    )
    return result
