"""The part-file writer: O_DIRECT for whole blocks, the page cache for the edges, in-order
commits behind parallel writes, and the fallbacks where a file system refuses O_DIRECT."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelops import parse_manifest
from tasks.materialize import materialize
from tasks.materialize import writer as writer_mod
from tasks.materialize.writer import ALIGN, BufferPool, PartFile, RangePipeline

CHUNK = 64 * 1024


def _direct_supported(path) -> bool:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def _blank(path, size: int):
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _pull(part: PartFile, data: bytes, start: int, end: int, pool: BufferPool, commit=None) -> None:
    """What a stream does: fill pool buffers at ``at % ALIGN``, submit, close."""
    pipe = RangePipeline(part, pool, commit)
    try:
        pos = start
        while pos < end:
            buf = pipe.buffer()
            lo = pos % ALIGN
            view = buf[lo:lo + min(len(buf) - lo, end - pos)]
            view[:] = data[pos:pos + len(view)]
            pipe.submit(buf, view, pos)
            pos += len(view)
    finally:
        pipe.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300_000), cuts=st.lists(st.integers(1, 299_999), max_size=6), direct=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_split_into_ranges_writes_the_same_bytes(tmp_path, size, cuts, direct, seed):
    data = random.Random(seed).randbytes(size)
    path = _blank(tmp_path / f"f-{seed}-{size}", size)
    bounds = sorted({0, size, *(c for c in cuts if c < size)})
    ranges = list(zip(bounds, bounds[1:]))
    random.Random(seed).shuffle(ranges)
    part, pool = PartFile(path, direct=direct), BufferPool(CHUNK, 6)
    assert part.direct == (direct and _direct_supported(path))
    try:
        threads = [threading.Thread(target=_pull, args=(part, data, s, e, pool)) for s, e in ranges]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        part.close()
    assert path.read_bytes() == data
    assert len(pool._free) == pool._made <= pool.limit  # every buffer came back


def test_commits_run_in_stream_order_after_their_writes_whatever_order_the_writes_finish(tmp_path):
    size = 40 * CHUNK + 123
    data = random.Random(7).randbytes(size)
    path = _blank(tmp_path / "f", size)
    written: set[int] = set()

    class Slow(PartFile):
        def write(self, view, at):
            time.sleep(random.random() / 200)  # two writers finish out of order
            super().write(view, at)
            written.add(at)

    seen: list[tuple[int, bytes]] = []

    def commit(view, at):
        assert at in written  # committed only once its bytes are written
        seen.append((at, hashlib.md5(view).digest()))

    part = Slow(path)
    try:
        _pull(part, data, 17, size, BufferPool(CHUNK, 8), commit)
    finally:
        part.close()
    assert [at for at, _ in seen] == sorted(at for at, _ in seen)
    assert seen[0][0] == 17 and len(seen) == -(-size // CHUNK)
    assert path.read_bytes()[17:] == data[17:]


def test_a_failed_write_stops_every_later_commit_and_returns_every_buffer(tmp_path):
    size = 30 * CHUNK
    path = _blank(tmp_path / "f", size)

    class Full(PartFile):
        def write(self, view, at):
            if at >= 10 * CHUNK:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(view, at)

    committed: list[int] = []
    pool = BufferPool(CHUNK, 4)
    part = Full(path)
    try:
        with pytest.raises(OSError, match="No space left"):
            _pull(part, bytes(size), 0, size, pool, lambda view, at: committed.append(at))
    finally:
        part.close()
    assert committed == [i * CHUNK for i in range(10)]
    assert len(pool._free) == pool._made


def test_a_file_system_refusing_o_direct_is_written_through_the_page_cache(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=writer_mod.__name__)
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(writer_mod.os, "open", no_direct)
    monkeypatch.setattr(writer_mod, "_warned", set())
    data = random.Random(3).randbytes(5 * ALIGN + 99)
    path = _blank(tmp_path / "f", len(data))
    part = PartFile(path)
    assert not part.direct
    try:
        _pull(part, data, 0, len(data), BufferPool(CHUNK, 2))
    finally:
        part.close()
    assert path.read_bytes() == data
    assert caplog.text.count("refuses O_DIRECT") == 1
    again = PartFile(path)  # the same folder: no second warning
    again.close()
    assert caplog.text.count("refuses O_DIRECT") == 1


def test_a_refused_direct_write_falls_back_for_the_rest_of_the_file(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=writer_mod.__name__)
    data = random.Random(4).randbytes(20 * ALIGN + 5)
    path = _blank(tmp_path / "f", len(data))
    part = PartFile(path)
    if not part.direct:
        part.close()
        pytest.skip("this file system refuses O_DIRECT on open")
    real_pwrite, direct_fd = os.pwrite, part.direct_fd

    def stricter(fd, view, at):
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, view, at)

    monkeypatch.setattr(writer_mod.os, "pwrite", stricter)
    monkeypatch.setattr(writer_mod, "_warned", set())
    try:
        _pull(part, data, 0, len(data), BufferPool(CHUNK, 2))
        assert not part.direct
    finally:
        part.close()
    assert path.read_bytes() == data
    assert "an O_DIRECT write was refused" in caplog.text


def test_a_pull_with_unaligned_ranges_from_a_local_directory(home, tmp_path, monkeypatch):
    """Ranges of 1 MiB + 3 bytes over a file of an odd size: every range starts and ends inside
    a block, the last block is partial; the published file equals the source."""
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str((1 << 20) + 3))
    monkeypatch.setenv("MODELOPS_MATERIALIZE_CONCURRENCY", "3")
    src = tmp_path / "src"
    src.mkdir()
    weights = random.Random(5).randbytes(7_654_321)
    (src / "config.json").write_text('{"architectures": ["BertModel"]}')
    (src / "model.safetensors").write_bytes(weights)
    result = materialize(parse_manifest({"model_id": "m", "version": "1", "source": str(src), "task": "embed"}))
    assert (result.path / "model.safetensors").read_bytes() == weights
    assert result.transferred == len(weights) + len('{"architectures": ["BertModel"]}')


def _resident_pages(path) -> list[bool]:
    """Which pages of ``path`` are in the page cache (mincore(2) over a shared mapping, which
    faults nothing in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
        anchor = ctypes.c_char.from_buffer(mm)
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(ctypes.addressof(anchor), size, vec) == 0, ctypes.get_errno()
        finally:
            del anchor
    return [bool(v & 1) for v in vec]


@pytest.mark.parametrize("direct", [True, False])
def test_direct_writes_leave_whole_blocks_out_of_the_page_cache(tmp_path, direct):
    size = 64 * ALIGN + 100
    data = random.Random(6).randbytes(size)
    path = _blank(tmp_path / "f", size)
    part = PartFile(path, direct=direct)
    if direct and not part.direct:
        part.close()
        pytest.skip("this file system refuses O_DIRECT")
    try:
        _pull(part, data, 100, size, BufferPool(16 * ALIGN, 4))  # a head inside page 0, a tail in page 64
    finally:
        part.close()
    resident = _resident_pages(path)
    if direct:
        assert resident[0] and resident[64] and not any(resident[1:64])
    else:
        assert all(resident)
    assert path.read_bytes()[100:] == data[100:]


def test_one_stream_holds_at_most_stream_buffers_and_warm_buffers_are_reused(tmp_path):
    from tasks.materialize.writer import STREAM_BUFFERS

    size = 50 * CHUNK
    data = random.Random(8).randbytes(size)
    path = _blank(tmp_path / "f", size)

    class Slow(PartFile):
        def write(self, view, at):
            time.sleep(0.002)  # the reader runs ahead of the writes
            super().write(view, at)

    pool = BufferPool(CHUNK, 4 * STREAM_BUFFERS)
    pool.warm(3)
    deadline = time.monotonic() + 5
    while len(pool._free) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._made == len(pool._free) == 3
    part = Slow(path)
    try:
        _pull(part, data, 0, size, pool)
    finally:
        part.close()
    assert path.read_bytes() == data
    assert pool._made == STREAM_BUFFERS == len(pool._free)  # the 3 warm ones among them


def test_an_fsx_root_that_cannot_hold_the_cache_is_one_clear_error(home, tmp_path, monkeypatch):
    from modelops import MaterializeError

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"w" * 10)
    not_a_folder = tmp_path / "fsx-file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("MODELOPS_FSX_ROOT", str(not_a_folder))
    with pytest.raises(MaterializeError, match=r"cannot use the FSx cache at .*fsx-file \(MODELOPS_FSX_ROOT\).*"
                                               r"point it at a writable folder"):
        materialize(parse_manifest({"model_id": "m", "version": "1", "source": str(src), "task": "embed"}))
    assert not_a_folder.read_text() == "x"


def test_a_range_size_under_one_mib_is_refused_naming_the_setting(monkeypatch):
    from modelops.settings import Settings, settings_problem

    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", "64")
    with pytest.raises(Exception) as e:
        Settings()
    assert "MODELOPS_MATERIALIZE_RANGE_SIZE" in settings_problem(e.value) and "at least 1048576" in str(e.value)
    for ok in ("0", str(1 << 20)):
        monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", ok)
        assert Settings().materialize_range_size == int(ok)
