"""modelops/batch_store.py: batch records, the runner's lease and the result cache."""

import time

import pytest

from modelops.batch_store import BatchStore
from modelops.registry import Registry


@pytest.fixture
def store(tmp_path) -> BatchStore:
    return BatchStore(Registry(f"sqlite:///{tmp_path / 'registry.db'}"))


def _batch(store: BatchStore, owner: str = "team-a"):
    f = store.record_file(store.new_file_id(), owner, "in.jsonl", "batch", 10)
    return store.add_batch(owner, "/v1/embeddings", f.id, "24h", {"job": "nightly"})


def test_a_new_batch_is_validating_and_has_openais_fields(store):
    b = _batch(store).to_openai()
    assert b["object"] == "batch" and b["status"] == "validating" and b["id"].startswith("batch_")
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert b["metadata"] == {"job": "nightly"} and b["expires_at"] - b["created_at"] == 24 * 3600
    assert b["in_progress_at"] is None and b["errors"] is None


def test_status_changes_stamp_their_time_once(store):
    b = _batch(store)
    first = store.update(b.id, status="in_progress").in_progress_at
    assert first is not None
    time.sleep(1.1)
    assert store.update(b.id, status="in_progress").in_progress_at == first
    with pytest.raises(KeyError):
        store.update("batch_nope", status="failed")


def test_files_and_batches_belong_to_their_owner(store):
    b = _batch(store, "team-a")
    assert store.batch(b.id, "team-a") is not None and store.batch(b.id, "team-b") is None
    assert store.file(b.input_file_id, "team-b") is None
    assert [x.id for x in store.batches("team-a")] == [b.id] and store.batches("team-b") == []
    assert store.record_file(b.input_file_id, "team-a", "other", "batch", 99).bytes == 10  # a retry records once


def test_one_runner_holds_a_batch_until_it_goes_silent(store):
    b = _batch(store)
    assert store.claim(b.id, "r1", stale_after_s=60) is not None
    assert store.claim(b.id, "r2", stale_after_s=60) is None  # r1 is alive
    assert store.beat(b.id, "r1", completed=3).completed == 3
    assert store.claim(b.id, "r2", stale_after_s=0.0) is not None  # r1 silent past the limit: taken over
    assert store.batch(b.id).resumes == 1
    assert store.beat(b.id, "r1") is None  # r1 lost it and must stop
    store.update(b.id, status="completed")
    assert store.claim(b.id, "r3", stale_after_s=0.0) is None  # over


def test_stale_lists_active_batches_whose_runner_is_silent(store):
    b = _batch(store)
    assert store.stale(60) == []  # just created
    assert [x.id for x in store.stale(0.0)] == [b.id]
    store.claim(b.id, "r1", 60)
    assert store.stale(60) == []
    store.update(b.id, status="cancelled")
    assert store.stale(0.0) == []


def test_the_cache_answers_repeats_and_evicts_the_least_recently_used(store):
    for i in range(4):
        store.cache(f"k{i}", "m", "1", "x" * 100)
        time.sleep(0.01)
    assert store.cached("k0") == "x" * 100  # k0 used again: k1 is now the oldest
    assert store.cached("nope") is None
    assert store.evict(250) == 2
    assert store.cached("k1") is None and store.cached("k2") is None
    assert store.cached("k0") is not None and store.cached("k3") is not None
    stats = store.cache_stats()
    assert stats["entries"] == 2 and stats["bytes"] == 200 and stats["hits"] >= 3


def test_a_new_version_invalidates_its_models_entries_only(store):
    store.cache("a1", "m", "1", "{}")
    store.cache("b1", "other", "1", "{}")
    store.cache("a2", "m", "2", "{}")
    assert store.invalidate("m", keep_version="2") == 1
    assert store.cached("a1") is None and store.cached("a2") == "{}" and store.cached("b1") == "{}"


def test_keep_writes_many_answers_and_hits_at_once_and_the_first_answer_stays(store):
    store.cache("k0", "m", "1", '{"n": 0}')
    store.keep([("k1", "m", "1", '{"n": 1}'), ("k1", "m", "1", '{"n": "again"}'), ("k0", "m", "1", '{"n": "x"}')],
               used=["k0", "k0", "k1", "gone"])
    assert store.cached("k0", touch=False) == '{"n": 0}' and store.cached("k1", touch=False) == '{"n": 1}'
    assert store.cache_stats() == {"entries": 2, "bytes": 16, "hits": 3}


def test_the_cache_writer_writes_what_every_thread_queued_by_the_end_of_its_block(store):
    import threading

    from tasks.batch.cache_writer import CacheWriter

    store.cache("hit", "m", "1", "{}")
    with CacheWriter(store) as writer:
        def answer(t: int) -> None:
            for i in range(50):
                writer.keep(f"t{t}-{i}", "m", "1", '{"v": %d}' % i)
                writer.used("hit")

        threads = [threading.Thread(target=answer, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    stats = store.cache_stats()
    assert (stats["entries"], stats["hits"]) == (401, 400)
    assert store.cached("t7-49", touch=False) == '{"v": 49}'


def test_a_cache_write_that_fails_is_logged_and_the_block_still_ends(store, monkeypatch, caplog):
    from tasks.batch.cache_writer import CacheWriter

    def locked(*a, **k):
        raise RuntimeError("database is locked")

    monkeypatch.setattr(store, "keep", locked)
    with CacheWriter(store) as writer:
        writer.keep("k", "m", "1", "{}")
    assert "1 answer(s) and 0 hit(s) not written: database is locked" in caplog.text
