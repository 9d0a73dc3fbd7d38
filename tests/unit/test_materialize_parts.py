"""Multipart ETags for any valid part layout, bounded S3 waits, free space, leftovers and
``cache verify``: against moto's S3 server over HTTP."""

import hashlib
import json
import os
import random
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelops import MaterializeError
from modelops.errors import ManifestError
from modelops.settings import get_settings
from tasks.materialize import COMPLETION_RECORD, evict, leftovers, materialize, verify_cached
from tasks.materialize.digests import StreamHasher, compress_layout, etag_of_parts, expand_layout, file_digests
from tasks.materialize.sources import ObjectChanged, S3Source, SourceFile
from tasks.materialize.transfer import _Check, _cuts, _ranges

from tests.conftest import FlippingProxy, PacedProxy, parsed_manifest as _manifest

MiB = 1 << 20


@pytest.fixture
def s3(s3_no_checksum):
    """These tests are about ETags: objects uploaded without a stored checksum."""
    return s3_no_checksum



def _multipart(s3, bucket: str, key: str, parts: list[bytes]) -> str:
    """Upload ``parts`` as one multipart object (sizes as given); returns its ETag."""
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    done = [{"PartNumber": n, "ETag": s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n,
                                                     Body=data)["ETag"]} for n, data in enumerate(parts, 1)]
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    return s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


def _model(s3, prefix: str, part_sizes: list[int], seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    parts = [rnd.randbytes(n) for n in part_sizes]
    etag = _multipart(s3, "models", prefix + "model.safetensors", parts)
    assert etag == etag_of_parts([hashlib.md5(p).digest() for p in parts])  # S3's rule, as moto computes it
    s3.put_object(Bucket="models", Key=prefix + "config.json", Body=b'{"architectures": ["BertModel"]}')
    return b"".join(parts)


@pytest.mark.parametrize("mode", ["whole-file", "ranges"])
@pytest.mark.parametrize("sizes", [[6 * MiB, 5 * MiB, 1 * MiB],  # unequal: part 1 does not fit the count
                                   [6 * MiB, 5 * MiB, 6 * MiB, 2 * MiB],  # unequal, yet part 1 fits: found late
                                   [7 * MiB + 3],  # one part
                                   [5 * MiB, 5 * MiB, 123]])  # the usual layout: equal parts, a short last one
def test_any_valid_part_layout_pulls_and_verifies(home, s3, monkeypatch, sizes, mode):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", "0" if mode == "whole-file" else str(4 * MiB))
    prefix = f"layout/{len(sizes)}-{sizes[0]}-{mode}/"
    data = _model(s3, prefix, sizes)
    result = materialize(_manifest(f"s3://models/{prefix}"))
    assert (result.path / "model.safetensors").read_bytes() == data
    record = json.loads((result.path / COMPLETION_RECORD).read_text())["files"]["model.safetensors"]
    assert expand_layout(record["parts"]) == sizes
    assert record["digest"] == f"etag:{etag_of_parts([hashlib.md5(data[sum(sizes[:i]):sum(sizes[:i + 1])]).digest() for i in range(len(sizes))])}"
    report = verify_cached("m", "1")
    assert report["problems"] == [] and report["checked"] == {"etag": 2}  # config.json: single-part MD5


def test_a_bit_flipped_in_transit_is_an_etag_mismatch_naming_both(home, s3, s3_server, monkeypatch):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(5 * MiB))  # one part per range
    sizes = [5 * MiB, 5 * MiB, 5 * MiB]
    _model(s3, "flipped/", sizes, seed=1)
    listed = s3.head_object(Bucket="models", Key="flipped/model.safetensors")["ETag"].strip('"')
    proxy = FlippingProxy(s3_server["port"])
    monkeypatch.setenv("MODELOPS_S3_PORT", str(proxy.port))
    with pytest.raises(MaterializeError) as e:
        materialize(_manifest("s3://models/flipped/"))
    proxy.srv.close()
    assert proxy.flipped.is_set()
    msg = str(e.value)
    assert msg.startswith("model.safetensors: ETag mismatch: expected " + listed + ", got ")
    assert msg.split("got ")[1].split(" ")[0].endswith("-3") and "3 parts" in msg
    assert not (get_settings().fsx_dir / "m" / "1").exists()  # nothing published


def test_an_object_replaced_mid_transfer_fails_at_its_next_get(home, s3, monkeypatch):
    """Every GET carries If-Match with the listed ETag: a replaced object is named as such, and
    no mix of old and new bytes is published."""
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(5 * MiB))  # one part per range
    monkeypatch.setenv("MODELOPS_MATERIALIZE_CONCURRENCY", "1")
    sizes = [5 * MiB, 5 * MiB, 5 * MiB]
    _model(s3, "swap/", sizes, seed=1)
    swapped = threading.Event()

    def replace_once(_n: int) -> None:  # after the first bytes: later ranges would read the new object
        if not swapped.is_set():
            swapped.set()
            _multipart(s3, "models", "swap/model.safetensors", [random.Random(2).randbytes(n) for n in sizes])

    with pytest.raises(ObjectChanged, match=r"^s3://models/swap/model.safetensors changed since it was listed .*"
                                            "pull again once the upload has finished"):
        materialize(_manifest("s3://models/swap/"), progress=replace_once)
    assert not (get_settings().fsx_dir / "m" / "1").exists()  # nothing published
    again = materialize(_manifest("s3://models/swap/"))  # the rerun lists the new object and fetches it
    assert (again.path / "model.safetensors").read_bytes() == b"".join(random.Random(2).randbytes(n) for n in sizes)


def test_ten_thousand_part_shapes():
    """The ETag rule, the range grouping and the layout runs at S3's maximum part count, on a
    small file (10,000 parts of 1 KiB; real parts are ≥ 5 MiB but the arithmetic is the same)."""
    rnd = random.Random(3)
    sizes = [1024] * 9_999 + [77]
    data = rnd.randbytes(sum(sizes))
    expected = etag_of_parts([hashlib.md5(data[i * 1024:(i + 1) * 1024]).digest() for i in range(10_000)])
    assert expected.endswith("-10000")
    assert compress_layout(sizes) == [[1024, 9_999], [77, 1]] and expand_layout(compress_layout(sizes)) == sizes
    check = _Check("etag", sizes, exact=False)
    f = SourceFile("w.safetensors", len(data), expected)
    assert f.parts == 10_000
    for range_size in (0, 1, 64 * 1024, 3_000_000):
        ranges = _ranges(f, check, range_size)
        per_range = -(-range_size // 1024)  # whole parts, until the range reaches range_size
        assert len(ranges) == (1 if range_size == 0 else -(-10_000 // per_range)), range_size
        assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous
        md5s = []
        for start, end in ranges:  # every range starts on a part boundary and is hashed as it streams
            assert start % 1024 == 0
            h = StreamHasher("md5", start, _cuts(check, start, end))
            for i in range(start, end, 7_001):  # chunks that straddle part boundaries
                h.update(data[i:min(i + 7_001, end)])
            md5s += h.digests()
        assert etag_of_parts(md5s) == expected, range_size
    # Resumed with parts 3..9,998 written: what is left are runs of the parts not written.
    assert _ranges(f, check, 64 * 1024, written=[(i * 1024, (i + 1) * 1024) for i in range(3, 9_999)]) == \
        [(0, 3 * 1024), (9_999 * 1024, len(data))]


def test_exact_layout_reads_every_part_and_a_sum_that_differs_is_refused(home, s3):
    _model(s3, "exact/", [6 * MiB, 5 * MiB, 1 * MiB])
    source = S3Source(_manifest("s3://models/exact/"), get_settings())
    (f,) = [f for f in source.list().values() if f.key == "model.safetensors"]
    assert source.part_layout(f) == ([6 * MiB, 5 * MiB, 1 * MiB], True)
    with pytest.raises(MaterializeError, match="parts add up to 12582912 bytes, the listing says 12582913"):
        source.exact_layout(SourceFile(f.key, f.size + 1, f.etag))


def test_file_digests_per_part(tmp_path):
    path = tmp_path / "x"
    data = os.urandom(3 * MiB + 5)
    path.write_bytes(data)
    assert file_digests(path, "md5", [2 * MiB, MiB + 5]) == [hashlib.md5(data[:2 * MiB]).digest(),
                                                             hashlib.md5(data[2 * MiB:]).digest()]
    with pytest.raises(MaterializeError, match="shorter than its parts"):
        file_digests(path, "md5", [4 * MiB])


def _silent_endpoint() -> tuple[socket.socket, list]:
    """A TCP server that accepts connections (listed in the second item) and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns: list = []

    def accept() -> None:
        while True:
            try:
                conns.append(srv.accept())
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, conns


def _failed_pull(monkeypatch, port: int, source: str):
    """Pull ``source`` through the endpoint on ``port`` with a 1 s read timeout and 2 tries;
    returns the MaterializeError's ExceptionInfo and the seconds it took."""
    monkeypatch.setenv("MODELOPS_S3_PORT", str(port))
    monkeypatch.setenv("MODELOPS_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("MODELOPS_S3_MAX_ATTEMPTS", "2")
    t0 = time.monotonic()
    with pytest.raises(MaterializeError) as e:
        materialize(_manifest(source))
    return e, time.monotonic() - t0


def test_a_silent_endpoint_fails_within_the_bound_naming_endpoint_operation_and_what_to_check(home, monkeypatch):
    srv, conns = _silent_endpoint()
    port = srv.getsockname()[1]
    e, took = _failed_pull(monkeypatch, port, "s3://models/silent/")
    srv.close()
    assert len(conns) == 2  # the first try and one retry, each on a fresh connection
    msg = str(e.value)
    assert f"S3 endpoint http://127.0.0.1:{port} did not answer ListObjectsV2 s3://models/silent/" in msg
    assert "ReadTimeoutError after 2 attempt(s), read timeout 1 s" in msg and "check that the endpoint URL" in msg
    assert "\n" not in msg
    assert 2 <= took < 2 * 1 + 3, took  # attempts × read timeout + botocore's back-off (≤ 1 s here)


def test_default_waits_bound_a_silent_endpoint_under_60_s():
    s = get_settings()
    # botocore standard mode: max_attempts tries, each waiting at most read_timeout for a byte,
    # with a back-off of at most 2^(n-1) s (capped at 20 s) between tries.
    worst = s.s3_max_attempts * (s.s3_connect_timeout_s + s.s3_read_timeout_s) + \
        sum(min(2 ** (n - 1), 20) for n in range(1, s.s3_max_attempts))
    assert worst < 60, worst


def test_a_slow_but_live_endpoint_is_not_killed_by_the_read_timeout(home, s3, s3_server, monkeypatch):
    data = _model(s3, "trickle/", [1 * MiB + 17])
    proxy = PacedProxy(s3_server["port"], 0.3)  # 64 KiB every 0.3 s
    monkeypatch.setenv("MODELOPS_S3_PORT", str(proxy.port))
    monkeypatch.setenv("MODELOPS_S3_READ_TIMEOUT_S", "1")
    t0 = time.monotonic()
    result = materialize(_manifest("s3://models/trickle/"))
    took = time.monotonic() - t0
    proxy.srv.close()
    assert (result.path / "model.safetensors").read_bytes() == data
    assert took > 3, took  # 17 pieces of 64 KiB, 0.3 s apart: far longer than one read timeout


def test_not_enough_space_fails_before_writing_anything(home, s3, monkeypatch):
    import shutil

    data = _model(s3, "space/", [5 * MiB, 1 * MiB])
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=len(data) - 1))
    with pytest.raises(MaterializeError) as e:
        materialize(_manifest("s3://models/space/"))
    assert f"{(len(data) + 32) / 1e9:.2f} GB to write, {(len(data) - 1) / 1e9:.2f} GB free" in str(e.value)
    assert "modelops cache evict" in str(e.value)
    parent = get_settings().fsx_dir / "m"
    assert not [p for p in parent.iterdir() if not p.name.endswith(".lock")]  # no staging, no part file


def test_empty_weights_file_is_refused(home, s3):
    s3.create_bucket(Bucket="models") if "models" not in {b["Name"] for b in s3.list_buckets()["Buckets"]} else None
    s3.put_object(Bucket="models", Key="empty/config.json", Body=b"{}")
    s3.put_object(Bucket="models", Key="empty/model.safetensors", Body=b"")
    with pytest.raises(ManifestError, match=r"weights file 'model.safetensors' is empty \(0 bytes\)"):
        materialize(_manifest("s3://models/empty/"))
    s3.put_object(Bucket="models", Key="empty/model.safetensors", Body=b"weights")
    s3.put_object(Bucket="models", Key="empty/config.json", Body=b"")  # vLLM would fail on it only at serving
    with pytest.raises(ManifestError, match=r"config.json is empty \(0 bytes\) in s3://models/empty/"):
        materialize(_manifest("s3://models/empty/"))
    assert not (get_settings().fsx_dir / "m").exists()  # refused before anything was written


def test_abandoned_staging_is_listed_and_reclaimed_unless_a_pull_holds_it(home, s3, monkeypatch):
    from modelops.process import file_lock

    fsx = get_settings().fsx_dir
    for v in ("7", "8"):
        (fsx / "m" / f".staging-{v}").mkdir(parents=True)
        (fsx / "m" / f".staging-{v}" / "model.safetensors.modelops-part").write_bytes(os.urandom(100_000))
    with file_lock(fsx / "m" / ".8.lock"):  # a pull of version 8 in progress
        found = {(x["version"], x["in_use"]) for x in leftovers()}
        assert found == {("7", False), ("8", True)}
        assert all(x["bytes"] >= 100_000 for x in leftovers())
        removed = evict(None)  # no budget: reclaim only
    assert [(r["version"], r["leftover"]) for r in removed] == [("7", True)]
    assert not (fsx / "m" / ".staging-7").exists() and (fsx / "m" / ".staging-8").exists()


def test_verify_finds_a_flipped_byte_and_a_missing_file(home, s3):
    data = _model(s3, "verify/", [5 * MiB, 2 * MiB])
    result = materialize(_manifest("s3://models/verify/"))
    with (result.path / "model.safetensors").open("r+b") as f:
        f.seek(6 * MiB)
        f.write(bytes([data[6 * MiB] ^ 1]))
    (result.path / "config.json").unlink()
    problems = verify_cached("m", "1")["problems"]
    assert problems[0] == "config.json: missing"
    assert problems[1].startswith("model.safetensors: etag is ") and problems[1].endswith("-2")
    assert len(problems) == 2
    with pytest.raises(MaterializeError, match="is not in the cache"):
        verify_cached("m", "9")


def test_an_interrupted_single_get_resumes_from_the_parts_it_journaled(home, s3, monkeypatch):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", "0")  # the whole object in one GET
    sizes = [5 * MiB] * 4
    data = _model(s3, "resume/", sizes, seed=4)
    seen = [0]

    def ctrl_c(n: int) -> None:
        seen[0] += n
        if seen[0] >= 16 * MiB:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        materialize(_manifest("s3://models/resume/"), progress=ctrl_c)
    journal = json.loads((get_settings().fsx_dir / "m" / ".staging-1" / ".modelops-journal.json").read_text())
    parts = journal["model.safetensors"]["ranges"]
    assert parts and all(b - a == 5 * MiB and a % (5 * MiB) == 0 for a, b in parts), parts  # whole parts only
    again = materialize(_manifest("s3://models/resume/"))
    assert (again.path / "model.safetensors").read_bytes() == data
    config = len(b'{"architectures": ["BertModel"]}')  # fetched before the interrupt, or now
    assert again.transferred in (len(data) - len(parts) * 5 * MiB, len(data) - len(parts) * 5 * MiB + config)
    assert verify_cached("m", "1")["problems"] == []


def test_the_cache_commands_do_not_pay_for_prefect_or_sqlalchemy():
    import subprocess
    import sys

    code = ("import sys, tasks.materialize as m; m.materialize, m.verify_cached, m.leftovers; "
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'prefect', 'sqlalchemy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys; from tasks.materialize import materialize_task; print(materialize_task.name)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "materialize"


def test_a_source_without_config_json_says_so(home, s3):
    s3.create_bucket(Bucket="models") if "models" not in {b["Name"] for b in s3.list_buckets()["Buckets"]} else None
    s3.put_object(Bucket="models", Key="noconfig/model.safetensors", Body=b"x" * 10)
    with pytest.raises(ManifestError, match="has no config.json at its top level"):
        materialize(_manifest("s3://models/noconfig/"))


def _cli(*args: str, **env: str):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([str(Path(sys.executable).parent / "modelops"), "cache", *args], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)


def test_cli_verify_names_the_damage_and_its_advice_repairs_it(home, s3, tmp_path):
    data = _model(s3, "cli/", [5 * MiB, 3 * MiB])
    manifest = tmp_path / "m.yaml"
    manifest.write_text("model_id: m\nversion: '1'\nsource: s3://models/cli/\ntask: embed\n")
    bad = _cli("pull", str(manifest), MODELOPS_S3_READ_TIMEOUT_S="0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "MODELOPS_S3_READ_TIMEOUT_S: Input should be greater than 0" in bad.stderr
    assert _cli("pull", str(manifest)).returncode == 0
    path = get_settings().fsx_dir / "m" / "1" / "model.safetensors"
    with path.open("r+b") as f:
        f.write(bytes([data[0] ^ 1]))
    verify = _cli("verify", "m", "1")
    assert verify.returncode == 1 and "[red]" not in verify.stderr
    assert "model.safetensors: etag is " in verify.stderr and "`modelops cache evict m 1` then" in verify.stderr
    evict = _cli("evict", "m", "1")  # the advice, followed
    assert evict.returncode == 0 and "evicted m 1 (8.4 MB)" in evict.stdout, evict.stdout + evict.stderr
    again = _cli("pull", str(manifest))
    assert again.returncode == 0 and "8.4 MB transferred" in again.stdout, again.stdout
    assert _cli("verify", "m", "1").returncode == 0
    assert path.read_bytes() == data
    missing = _cli("evict", "m", "7")
    assert missing.returncode == 2 and "m 7 is not in the cache" in missing.stderr


def test_cli_pull_keeps_the_budget_and_never_evicts_what_it_just_pulled(home, s3, tmp_path):
    _model(s3, "budget/", [5 * MiB, 1 * MiB])
    manifests = []
    for version in ("1", "2"):
        manifests.append(tmp_path / f"{version}.yaml")
        manifests[-1].write_text(f"model_id: m\nversion: '{version}'\nsource: s3://models/budget/\ntask: embed\n")
    assert _cli("pull", str(manifests[0])).returncode == 0
    tight = _cli("pull", str(manifests[1]), MODELOPS_CACHE_BUDGET_GB="0.001")  # 1 MB: less than one copy
    assert tight.returncode == 0 and "evicted m 1 (6.3 MB, least recently used; budget 0.001 GB)" in tight.stdout, \
        tight.stdout + tight.stderr
    fsx = get_settings().fsx_dir / "m"
    assert not (fsx / "1").exists() and verify_cached("m", "2")["problems"] == []


@pytest.mark.parametrize("model_id, version", [("m", "../m/1"), ("../fsx/m", "1"), ("m", "1/.."), ("M", "1")])
def test_cache_verify_and_evict_refuse_names_no_manifest_allows(home, s3, model_id, version):
    _model(s3, "names/", [5 * MiB])
    materialize(_manifest("s3://models/names/"))
    for command in ("verify", "evict"):
        out = _cli(command, model_id, version)
        assert out.returncode == 2 and "is not one a manifest allows" in out.stderr, out.stderr
    assert verify_cached("m", "1")["problems"] == []
    assert not list(get_settings().fsx_dir.rglob("*.lock.*")) and \
        sorted(p.name for p in get_settings().fsx_dir.rglob(".*.lock")) == [".1.lock"]


def test_a_stream_that_stalls_is_retried_within_s3_max_attempts(home, s3, s3_server, monkeypatch):
    _model(s3, "stall/", [6 * MiB])
    proxy = _StallingProxy(s3_server["port"], after=1 * MiB)
    e, took = _failed_pull(monkeypatch, proxy.port, "s3://models/stall/")
    proxy.srv.close()
    assert "model.safetensors: bytes 0-6291456 failed after 2 attempts" in str(e.value), str(e.value)
    assert took < 10, took


def test_an_endpoint_silent_after_the_listing_fails_after_botocores_tries_alone(home, s3, s3_server, monkeypatch):
    _model(s3, "gone/", [6 * MiB])
    proxy = _SilentOnGetProxy(s3_server["port"], b"GET /models/gone/model.safetensors ")
    e, took = _failed_pull(monkeypatch, proxy.port, "s3://models/gone/")
    proxy.srv.close()
    msg = str(e.value)
    assert f"S3 endpoint http://127.0.0.1:{proxy.port} did not answer GetObject s3://models/gone/model.safetensors" \
        in msg and "after 2 attempt(s), read timeout 1 s" in msg and "\n" not in msg, msg
    assert proxy.asked == 2, proxy.asked  # botocore's two tries, not tried again by the stream's retries
    assert 2 <= took < 2 * 1 + 3, took


class _SilentOnGetProxy(PacedProxy):
    """Forwards every request; the answers to requests that start with ``request`` are never
    sent (an endpoint gone silent after the listing), connection left open; ``asked`` counts them."""

    def __init__(self, upstream: int, request: bytes) -> None:
        self.request, self.asked, self.silent = request, 0, set()
        super().__init__(upstream, 0)

    def _pipe(self, src, dst, delay):  # noqa: ARG002 - same signature as the parent's
        asking = dst.getpeername()[1] == self.upstream
        try:
            while data := src.recv(64 * 1024):
                if asking and data.startswith(self.request):
                    self.asked += 1
                    self.silent.add(dst)
                if src not in self.silent:
                    dst.sendall(data)
        except OSError:
            pass


def test_a_stream_that_always_stalls_early_advances_with_each_try_and_completes(home, s3, s3_server, monkeypatch):
    data = _model(s3, "early/", [3 * MiB + 5])
    proxy = _StallingProxy(s3_server["port"], after=MiB)  # each answer stops short of one pool buffer (4 MiB)
    monkeypatch.setenv("MODELOPS_S3_PORT", str(proxy.port))
    monkeypatch.setenv("MODELOPS_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("MODELOPS_S3_MAX_ATTEMPTS", "6")
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", "0")
    result = materialize(_manifest("s3://models/early/"))
    proxy.srv.close()
    assert (result.path / "model.safetensors").read_bytes() == data
    assert verify_cached("m", "1")["problems"] == []


class _StallingProxy(PacedProxy):
    """Forwards GET answers' first ``after`` bytes, then stays silent (a stalled stream);
    listings and heads pass."""

    def __init__(self, upstream: int, after: int) -> None:
        self.after = after
        super().__init__(upstream, 0.3)

    def _pipe(self, src, dst, delay):  # noqa: ARG002 - same signature as the parent's
        sent = 0
        try:
            while data := src.recv(64 * 1024):
                if delay and sent + len(data) > self.after and len(data) > 1000:
                    time.sleep(30)  # silent, connection open
                    return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass


@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=30), range_size=st.integers(0, 9000),
       chunk=st.integers(1, 5000), written_mask=st.integers(0, 2 ** 30 - 1), seed=st.integers(0, 2 ** 16))
@settings(max_examples=300, deadline=None)
def test_any_layout_any_ranges_any_resume_gives_the_s3_etag(sizes, range_size, chunk, written_mask, seed):
    """Generated layouts (any part sizes), range sizes, chunkings and resumes: the ranges cover
    exactly the parts not written, on part boundaries, and hashing them as they stream gives
    S3's ETag; the assumed layout is used only when it is the true one or provably differs."""
    from tasks.materialize.sources import assumed_layout

    data = random.Random(seed).randbytes(sum(sizes))
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    parts = [(bounds[i], bounds[i + 1]) for i in range(len(sizes))]
    expected = etag_of_parts([hashlib.md5(data[a:b]).digest() for a, b in parts])
    written = [p for i, p in enumerate(parts) if written_mask >> i & 1]
    f, check = SourceFile("w.bin", len(data), expected), _Check("etag", sizes)
    ranges = _ranges(f, check, range_size, written)
    covered = sorted([*written, *(p for s, e in ranges for p in parts if s <= p[0] and p[1] <= e)])
    assert covered == parts  # every part once: written before, or in exactly one range
    assert all(s in bounds and e in bounds and s < e for s, e in ranges)
    if range_size:  # a range closes at the first part boundary at or past range_size
        assert all(e - s < range_size + max(sizes) for s, e in ranges)
    digests = {a: hashlib.md5(data[a:b]).digest() for a, b in written}
    for s, e in ranges:
        h = StreamHasher("md5", s, _cuts(check, s, e))
        done = []
        for i in range(s, e, chunk):
            done += h.update(data[i:min(i + chunk, e)])
        done.append(h.final())
        assert [(a, b) for a, b, _ in done] == [p for p in parts if s <= p[0] and p[1] <= e]
        digests.update({a: d for a, _, d in done})
    assert etag_of_parts([digests[a] for a, _ in parts]) == expected
    guess = assumed_layout(len(data), sizes[0], len(sizes))
    if guess is not None and guess != sizes:  # the wrong guess is caught by the ETag, then read exactly
        assert file_digests_of(data, guess) != expected
    if sizes[:-1] == [sizes[0]] * (len(sizes) - 1) and sizes[-1] <= sizes[0]:
        assert guess == sizes  # the usual upload is never HEADed part by part


def file_digests_of(data: bytes, sizes: list[int]) -> str:
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return etag_of_parts([hashlib.md5(data[bounds[i]:bounds[i + 1]]).digest() for i in range(len(sizes))])
