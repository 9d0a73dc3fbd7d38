"""Folders that appear whole or not at all: staging beside the target, then one rename.

Every stage that writes a folder others read (a sealed package, the runtime venv, the native
extension, materialized weights) writes it under a hidden staging name in the same parent (so
the rename stays on one file system, where POSIX ``rename(2)`` is atomic) and renames it into
place only when it is complete. A reader therefore sees the old folder or the new one, never
half of either.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "replace_dir"]


def replace_dir(staging: Path, dest: Path, aside: str | None = None) -> None:
    """Put the complete folder ``staging`` at ``dest``.

    An existing ``dest`` (a stale or incomplete earlier copy) is replaced, never merged: it is
    renamed aside to ``<parent>/<aside>`` (default ``.old-<name>-<pid>``), ``staging`` takes its
    name, and the old folder is removed last, so ``dest`` is missing only between two renames.

    Raises:
        OSError: a rename failed (``staging`` and ``dest`` must be on one file system).
    """
    if dest.exists():
        old = dest.parent / (aside or f".old-{dest.name}-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
        os.rename(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, dest)


@contextmanager
def atomic_dir(dest: Path, prefix: str = ".staging-") -> Iterator[Path]:
    """Yield a new empty folder ``<dest.parent>/<prefix><dest.name>-<8 hex>``; fill it in the block.

    On a clean exit it replaces ``dest`` (:func:`replace_dir`); on any exception it is removed
    and ``dest`` is left as it was. For a transfer that must survive a crash and resume, keep
    a fixed staging folder and call :func:`replace_dir` instead.

    Raises:
        OSError: the staging folder cannot be created, or the final rename failed.
    """
    staging = dest.parent / f"{prefix}{dest.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        yield staging
        replace_dir(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
