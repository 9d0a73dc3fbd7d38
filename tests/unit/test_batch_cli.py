"""``modelops batch``: every key's batches with what OpenAI's object lacks, and cancel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from modelops import get_settings
from modelops.batch_store import BatchStore
from modelops.registry import Registry

CLI = str(Path(sys.executable).parent / "modelops")


def _batch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "batch", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "250"})


def test_status_lists_every_keys_batches_and_cancel_ends_only_a_running_one(home):
    store = BatchStore(Registry(get_settings().registry))
    assert "no batches" in _batch("status").stdout
    f = store.record_file(store.new_file_id(), "team-a", "in.jsonl", "batch", 10)
    running = store.add_batch("team-a", "/v1/embeddings", f.id, "24h", None)
    store.update(running.id, status="in_progress", total=10, completed=4, failed=1, cache_hits=2, concurrency=3)
    ended = store.add_batch("", "/v1/chat/completions", f.id, "24h", None)
    store.update(ended.id, status="completed")

    table = _batch("status").stdout
    assert running.id in table and ended.id in table and "5/10" in table and "team-a" in table
    shown = json.loads(_batch("status", running.id, "--json").stdout)
    assert (shown["status"], shown["owner"], shown["modelops"]["cache_hits"]) == ("in_progress", "team-a", 2)

    cancelled = _batch("cancel", running.id)
    assert cancelled.returncode == 0 and store.batch(running.id).status == "cancelling"
    refused = _batch("cancel", ended.id)
    assert refused.returncode == 1 and "already completed" in refused.stderr
    unknown = _batch("status", "batch_nope")
    assert unknown.returncode == 2 and "no batch 'batch_nope'" in unknown.stderr
