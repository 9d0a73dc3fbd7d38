"""materialize: copy a model version's weights from its source onto the FSx cache, verified.

Destination: ``<fsx_root>/<model_id>/<version>/``. One module per concern:

- :mod:`~tasks.materialize.sources`: listing and streaming S3 (boto3, bounded waits) and local
  sources; the part layout of multipart objects; what a usable source must hold.
- :mod:`~tasks.materialize.digests`: sha256 against ``SHA256SUMS``, S3 ETags (single-part MD5,
  multipart MD5-of-MD5s for any part layout), hashed while the bytes stream in.
- :mod:`~tasks.materialize.writer`: a stream's bytes into its part file: reused page-aligned
  buffers, ``O_DIRECT`` writes (two in flight), hashing and journaling in order behind them.
- :mod:`~tasks.materialize.transfer`: the plan (checks, ranges), free-space check and
  preallocation, parallel ranged transfer, journal and resume, atomic publish.
- :mod:`~tasks.materialize.cache`: completion records, locks, LRU eviction (never a version in
  use), abandoned staging folders, re-verification of a cached copy.

- :mod:`~tasks.materialize.task`: the Prefect task, with a progress artifact and eviction
  (imported on first use: ``cache`` commands and benchmarks do not pay Prefect's import).
"""

from __future__ import annotations

from tasks.materialize.cache import cached_versions, evict, evict_version, leftovers, stored_bytes, verify_cached
from tasks.materialize.sources import COMPLETION_RECORD, SUMS_FILE, SourceFile, list_source
from tasks.materialize.transfer import MaterializeResult, materialize

__all__ = [
    "COMPLETION_RECORD",
    "SUMS_FILE",
    "MaterializeResult",
    "SourceFile",
    "cached_versions",
    "evict",
    "evict_version",
    "leftovers",
    "list_source",
    "materialize",
    "materialize_task",
    "stored_bytes",
    "verify_cached",
]


def __getattr__(name: str):
    if name == "materialize_task":
        from tasks.materialize.task import materialize_task

        return materialize_task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
