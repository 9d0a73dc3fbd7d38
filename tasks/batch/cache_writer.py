"""The result cache's writes of one batch run, made by one thread: the answers to keep and the
hits to mark, in one transaction per round of what queued meanwhile.

A commit from each sending thread (an fsync each, 3 ms measured here) put them all in line for
SQLite's one write lock: in a py-spy profile of a batch of 1,000 embeddings the sending threads
spent as many samples in those commits as in their requests. A run that dies loses what was
queued and not yet written, which costs those lines a second request on resume, never a wrong
answer.
"""

from __future__ import annotations

import logging
import queue
import threading

from modelops.batch_store import BatchStore

__all__ = ["CacheWriter"]

log = logging.getLogger(__name__)

_END = ("end", None)


class CacheWriter:
    """``with CacheWriter(store) as writer:`` a thread that writes what :meth:`keep` and
    :meth:`used` queue; leaving the block writes what is left, then ends the thread.

    Args:
        store: the batch store whose result cache is written (:meth:`BatchStore.keep`).
    """

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="batch-cache", daemon=True)

    def __enter__(self) -> CacheWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._queue.put(_END)
        self._thread.join()

    def keep(self, key: str, model_id: str, version: str, body: str) -> None:
        """Queue ``body`` (JSON text) as the answer for ``key``."""
        self._queue.put(("keep", (key, model_id, version, body)))

    def used(self, key: str) -> None:
        """Queue a hit on ``key``."""
        self._queue.put(("used", key))

    def _run(self) -> None:
        ending = False
        while not ending:
            items = [self._queue.get()]
            while True:  # everything queued meanwhile goes in the same transaction
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            ending = _END in items
            answers = [item for kind, item in items if kind == "keep"]
            used = [item for kind, item in items if kind == "used"]
            if not answers and not used:
                continue
            try:
                self.store.keep(answers, used)
            except Exception as e:  # noqa: BLE001 - a cache miss later, never a lost answer
                log.warning("result cache: %d answer(s) and %d hit(s) not written: %s", len(answers), len(used), e)
