"""materialize against moto's S3 server over HTTP, and against local directories."""

import base64
import hashlib
import json
import itertools
import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelops import ManifestError
from tasks.materialize import COMPLETION_RECORD, materialize

from tests.conftest import parsed_manifest as _manifest, write_fake_model


def _upload(s3, bucket, prefix, files):
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    for rel, data in files.items():
        s3.put_object(Bucket=bucket, Key=prefix + rel, Body=data)



def test_s3_to_fsx_then_cache_hit(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "m/1/", files)
    first = materialize(_manifest("s3://models/m/1/"))
    assert first.path == home.resolve() / "fsx" / "m" / "1"
    assert (first.files, first.bytes, first.transferred) == (4, sum(map(len, files.values())), first.bytes)
    for rel, data in files.items():
        assert hashlib.sha256((first.path / rel).read_bytes()).digest() == hashlib.sha256(data).digest()
    record = json.loads((first.path / COMPLETION_RECORD).read_text())
    assert {k: v["size"] for k, v in record["files"].items()} == {k: len(v) for k, v in files.items()}
    # botocore's uploads carry CRC32; each file is verified against the one S3 stores (zlib's here).
    assert {k: v["digest"] for k, v in record["files"].items()} == {
        k: "crc32:" + base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode() for k, data in files.items()}
    assert not [p for p in first.path.parent.iterdir() if p.name.startswith(".staging")]

    again = materialize(_manifest("s3://models/m/1/"))
    assert again.transferred == 0 and again.path == first.path


def test_incomplete_copy_is_replaced(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "m/2/", files)
    dest = home.resolve() / "fsx" / "m" / "2"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("partial")  # no completion record: not trusted
    result = materialize(_manifest("s3://models/m/2/", "2"))
    assert result.transferred == result.bytes
    assert (dest / "config.json").read_bytes() == files["config.json"]


def test_local_directory_and_file_uri(home, tmp_path):
    write_fake_model(tmp_path / "src")
    a = materialize(_manifest(str(tmp_path / "src")))
    b = materialize(_manifest(f"file://{tmp_path / 'src'}"))
    assert a.path == b.path and a.files == 4 and b.transferred == 0


def test_a_local_copy_records_its_crc32c_and_verify_finds_a_changed_byte(home, tmp_path, monkeypatch):
    from awscrt import checksums

    from tasks.materialize import verify_cached

    assert checksums.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720, B.4)
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(1 << 20))  # 3 ranges: their CRCs combined
    files = write_fake_model(tmp_path / "src")
    weights = tmp_path / "src" / "model.safetensors"
    data = random.Random(7).randbytes(2 * (1 << 20) + 5)
    weights.write_bytes(data)
    files["model.safetensors"] = data
    result = materialize(_manifest(str(tmp_path / "src")))
    record = json.loads((result.path / COMPLETION_RECORD).read_text())["files"]
    assert {k: v["digest"] for k, v in record.items()} == {
        k: "crc32c:" + base64.b64encode(checksums.crc32c(d).to_bytes(4, "big")).decode() for k, d in files.items()}
    report = verify_cached("m", "1")
    assert report["problems"] == [] and report["checked"] == {"crc32c": 4}
    with (result.path / "model.safetensors").open("r+b") as f:
        f.seek(1 << 20)
        f.write(bytes([data[1 << 20] ^ 0x10]))
    problems = verify_cached("m", "1")["problems"]
    assert len(problems) == 1 and problems[0].startswith("model.safetensors: crc32c is "), problems
    assert problems[0].endswith(f"the record says {record['model.safetensors']['digest'].split(':')[1]}")


_versions = itertools.count(100)


@given(size=st.integers(0, 3 * (1 << 20) + 9), range_size=st.sampled_from([0, 1 << 20, (1 << 20) + 3, 2 << 20]),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_local_copy_of_any_size_split_any_way_records_the_files_crc32c(home, tmp_path, monkeypatch, size,
                                                                         range_size, seed):
    from awscrt import checksums

    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(range_size))
    version = str(next(_versions))
    src = tmp_path / f"src-{version}"
    write_fake_model(src)
    data = random.Random(seed).randbytes(size)
    (src / "tokenizer.model").write_bytes(data)  # any size, 0 included (not a weights file)
    result = materialize(_manifest(str(src), version))
    assert (result.path / "tokenizer.model").read_bytes() == data
    record = json.loads((result.path / COMPLETION_RECORD).read_text())["files"]
    assert record["tokenizer.model"]["digest"] == \
        "crc32c:" + base64.b64encode(checksums.crc32c(data).to_bytes(4, "big")).decode()


def test_a_cached_file_truncated_or_grown_is_fetched_again_by_the_next_pull(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "damaged/", files)
    first = materialize(_manifest("s3://models/damaged/"))
    with (first.path / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    with (first.path / "config.json").open("ab") as f:
        f.write(b" ")
    again = materialize(_manifest("s3://models/damaged/"))
    assert again.transferred == len(files["model.safetensors"]) + len(files["config.json"])
    assert {k: (again.path / k).read_bytes() for k in files} == files


def test_a_local_file_written_to_during_its_copy_is_named_not_published(home, tmp_path, monkeypatch):
    from tasks.materialize.sources import ObjectChanged

    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(1 << 20))
    monkeypatch.setenv("MODELOPS_MATERIALIZE_CONCURRENCY", "1")
    write_fake_model(tmp_path / "src")
    weights = tmp_path / "src" / "model.safetensors"
    weights.write_bytes(random.Random(3).randbytes(3 << 20))
    touched = []

    def rewrite_the_tail(n: int) -> None:  # after the first range: a writer changes the file
        if not touched and n == 1 << 20:
            with weights.open("r+b") as f:
                f.seek((3 << 20) - 10)
                f.write(b"new bytes!")
            touched.append(n)

    with pytest.raises(ObjectChanged, match=r"^model.safetensors: \(local directory .*\) changed while it was copied"):
        materialize(_manifest(str(tmp_path / "src")), progress=rewrite_the_tail)
    assert touched and not (home.resolve() / "fsx" / "m" / "1").exists()
    again = materialize(_manifest(str(tmp_path / "src")))
    assert (again.path / "model.safetensors").read_bytes() == weights.read_bytes()


def test_missing_source_names_it(home, s3):
    _upload(s3, "models", "other/1/", {"config.json": b"{}"})  # the bucket exists, the prefix does not
    with pytest.raises(ManifestError, match=r"source: s3://models/absent/1/ does not exist or is empty"):
        materialize(_manifest("s3://models/absent/1/"))
    assert not (home / "fsx" / "m").exists()


def test_source_without_weights_is_refused(home, s3):
    _upload(s3, "models", "noweights/", {"README.md": b"hello", "config.json": b"{}"})
    with pytest.raises(ManifestError, match="holds no model weights"):
        materialize(_manifest("s3://models/noweights/"))
    assert not (home / "fsx" / "m").exists()


def test_traversal_key_refused_before_writing(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "evil/", {**files, "../../escape.txt": b"x"})
    with pytest.raises(ManifestError, match="would land outside the model directory"):
        materialize(_manifest("s3://models/evil/"))
    assert not (home / "fsx").exists() or not any((home / "fsx").rglob("*"))


def test_a_copied_cache_folder_as_source_is_a_cache_hit_the_second_time(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "c/1/", files)
    first = materialize(_manifest("s3://models/c/1/"))
    _upload(s3, "models", "c/2/", {COMPLETION_RECORD: (first.path / COMPLETION_RECORD).read_bytes(), **files})
    second = materialize(_manifest("s3://models/c/2/", "2"))
    # The copied record vouches for nothing: version 2's files are version 1's verified bytes
    # (same objects: linked, not pulled), under a record of its own source.
    assert second.files == 4 and second.transferred == 0 and (second.path / "config.json").stat().st_nlink == 2
    assert json.loads((second.path / COMPLETION_RECORD).read_text())["source"] == "s3://models/c/2/"
    assert materialize(_manifest("s3://models/c/2/", "2")).transferred == 0


def test_changing_one_file_refetches_only_that_file(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "one/1/", files)
    first = materialize(_manifest("s3://models/one/1/"))
    _upload(s3, "models", "one/1/", {"tokenizer.json": b'{"version": "2.0"}'})
    again = materialize(_manifest("s3://models/one/1/"))
    assert again.transferred == len(b'{"version": "2.0"}') and again.path == first.path
    assert (again.path / "tokenizer.json").read_bytes() == b'{"version": "2.0"}'
    assert (again.path / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_sums_listing_a_missing_file_fails(home, s3, tmp_path):
    from modelops import MaterializeError
    from tasks.materialize import SUMS_FILE

    files = write_fake_model(tmp_path / "src")
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {k}\n" for k, d in files.items()) + f"{'0' * 64}  shard-2.safetensors\n"
    _upload(s3, "models", "sums/1/", {**files, SUMS_FILE: sums.encode()})
    with pytest.raises(MaterializeError, match="SHA256SUMS lists 1 file.*'shard-2.safetensors'"):
        materialize(_manifest("s3://models/sums/1/"))
    assert not (home / "fsx" / "m" / "1").exists()


def test_file_and_folder_with_one_name_is_refused(home, s3, tmp_path):
    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "clash/1/", {**files, "tok": b"x", "tok/inner.json": b"{}"})
    with pytest.raises(ManifestError, match="'tok' is both a file and a folder prefix"):
        materialize(_manifest("s3://models/clash/1/"))


def test_bad_setting_is_one_clear_line(home):
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).parent / "modelops")
    run = subprocess.run([cli, "cache", "ls"], capture_output=True, text=True,
                         env={**__import__("os").environ, "MODELOPS_MATERIALIZE_CONCURRENCY": "0"})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "MODELOPS_MATERIALIZE_CONCURRENCY: Input should be greater than or equal to 1" in run.stderr
    # a list setting that is not JSON fails in pydantic-settings before validation: the same one line
    run = subprocess.run([cli, "cache", "ls"], capture_output=True, text=True,
                         env={**__import__("os").environ, "MODELOPS_K8S_ROUTE_HOSTNAMES": "notjson"})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "invalid setting: MODELOPS_K8S_ROUTE_HOSTNAMES: not valid JSON" in run.stderr


@pytest.mark.parametrize("variable, value, says", [
    ("MODELOPS_S3_ENDPOINT_URL", "127.0.0.1:9000", "not an http:// or https:// URL"),
    ("MODELOPS_S3_ENDPOINT_URL", "http://", "not an http:// or https:// URL"),
    ("MODELOPS_FSX_ROOT", "", "is empty: give a folder, or unset the variable"),
    ("MODELOPS_HOME", " ", "is empty: give a folder, or unset the variable"),
    ("MODELOPS_HOME", "/etc/passwd", "is a file, not a folder: give a folder")])
def test_a_schemeless_endpoint_or_a_blank_or_file_folder_is_refused_naming_the_variable(home, variable, value, says):
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([str(Path(sys.executable).parent / "modelops"), "cache", "ls"], capture_output=True,
                         text=True, env={**__import__("os").environ, variable: value})
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"invalid setting: {variable}: " in run.stderr and says in run.stderr, run.stderr


def test_a_completion_record_of_an_older_layout_is_stale_not_a_crash(home, tmp_path):
    from tasks.materialize import cached_versions

    write_fake_model(tmp_path / "src")
    first = materialize(_manifest(str(tmp_path / "src")))
    record = first.path / COMPLETION_RECORD
    old = json.loads(record.read_text())
    record.write_text(json.dumps({"files": {k: v["size"] for k, v in old["files"].items()}}))  # sizes only
    assert [v["version"] for v in cached_versions()] == ["1"]  # still listed, so still evictable
    again = materialize(_manifest(str(tmp_path / "src")))
    assert again.path == first.path and again.files == 4
    assert json.loads(record.read_text())["files"] == old["files"]  # verified and rewritten


def test_a_transfer_past_its_deadline_fails_at_once_and_the_retry_resumes(home, s3, tmp_path, monkeypatch):
    import json
    import os
    import time

    from modelops import MaterializeError
    from tasks.materialize.sources import JOURNAL

    files = {**write_fake_model(tmp_path / "src"), "model.safetensors": os.urandom(48 << 20)}
    _upload(s3, "models", "m/slow/", files)
    # 1 MiB ranges one at a time over loopback HTTP: far longer than the deadline.
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(1 << 20))
    monkeypatch.setenv("MODELOPS_MATERIALIZE_CONCURRENCY", "1")
    journal = home.resolve() / "fsx" / "m" / ".staging-slow" / JOURNAL
    # On a loaded machine nothing may be written before a short deadline: the deadline grows
    # until some bytes were journaled, so that the retry has something to resume.
    for deadline in (0.2, 0.5, 1.0, 2.0):
        monkeypatch.setenv("MODELOPS_MATERIALIZE_TIMEOUT_S", str(deadline))
        t0 = time.monotonic()
        late = rf"did not finish within {deadline} s \(setting materialize_timeout_s\)"
        with pytest.raises(MaterializeError, match=late):
            materialize(_manifest("s3://models/m/slow/", "slow"))
        assert time.monotonic() - t0 < deadline + 3  # returned at the deadline, not when the transfer would end
        assert not (home.resolve() / "fsx" / "m" / "slow").exists()  # nothing published
        entries = json.loads(journal.read_text()) if journal.is_file() else {}
        kept = sum(len(files[k]) if "digest" in e else sum(b - a for a, b in e.get("ranges", []))
                   for k, e in entries.items())
        if kept:
            break
    assert kept > 0, "nothing was journaled even under a 2 s deadline"
    monkeypatch.setenv("MODELOPS_MATERIALIZE_TIMEOUT_S", "3600")
    again = materialize(_manifest("s3://models/m/slow/", "slow"))
    assert again.transferred == again.bytes - kept  # resumed: exactly the journaled bytes were not fetched again
    assert (again.path / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_versions_of_the_same_s3_objects_share_one_copy_and_a_changed_object_is_fetched(home, s3, tmp_path):
    """Version 2 from the same objects pulls nothing and holds hard links to version 1's files;
    version 3, whose weights file was uploaded again with other bytes under the same name, fetches
    that file only (the ETag decides, never the name). Verify and evict stay right."""
    from tasks.materialize import cached_versions, evict_version, stored_bytes, verify_cached

    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "m/1/", files)
    one = materialize(_manifest("s3://models/m/1/", version="1"))
    two = materialize(_manifest("s3://models/m/1/", version="2"))
    assert two.transferred == 0 and two.bytes == one.bytes
    for rel in files:
        a, b = (one.path / rel).stat(), (two.path / rel).stat()
        assert (a.st_ino, a.st_nlink) == (b.st_ino, 2)
    changed = {**files, "model.safetensors": files["model.safetensors"][::-1]}  # same name and size, other bytes
    _upload(s3, "models", "m/3/", changed)
    three = materialize(_manifest("s3://models/m/3/", version="3"))
    assert three.transferred == len(changed["model.safetensors"])
    assert (three.path / "model.safetensors").read_bytes() == changed["model.safetensors"]
    assert (three.path / "model.safetensors").stat().st_nlink == 1
    rows = {v["version"]: v for v in cached_versions()}
    assert rows["1"]["unique_bytes"] == rows["2"]["unique_bytes"] == 0
    assert rows["3"]["unique_bytes"] == len(changed["model.safetensors"])
    assert stored_bytes() == one.bytes + len(changed["model.safetensors"])
    for version in ("1", "2", "3"):
        assert verify_cached("m", version)["problems"] == []
    evict_version("m", "1")
    assert verify_cached("m", "2")["problems"] == [] and (two.path / "config.json").stat().st_nlink == 2  # and 3's
    assert stored_bytes() == one.bytes + len(changed["model.safetensors"])  # v1's bytes live on in v2 and v3


def test_local_sources_are_not_shared(home, tmp_path):
    """A local directory's listing carries no content checksum to match copies on."""
    src = tmp_path / "src"
    write_fake_model(src)
    one = materialize(_manifest(str(src), version="1"))
    two = materialize(_manifest(str(src), version="2"))
    assert two.transferred == two.bytes and (two.path / "config.json").stat().st_nlink == 1
    assert one.path != two.path


@pytest.mark.parametrize(("stage", "kept"), [("package", False), ("provision", True)])
def test_a_version_that_failed_before_serving_keeps_no_copy(home, s3, tmp_path, stage, kept):
    """Failed at package (it never had an instance): its FSx copy goes, the files it shares with
    another version stay there. Failed at provision or later: kept (an instance may read it)."""
    from modelops import get_settings
    from modelops.registry import Registry
    from tasks.validate import record_failure_task

    files = write_fake_model(tmp_path / "src")
    _upload(s3, "models", "f/1/", files)
    good = materialize(_manifest("s3://models/f/1/", version="1"))
    bad_manifest = _manifest("s3://models/f/1/", version="2")
    bad = materialize(bad_manifest)
    Registry(get_settings().registry).record_announcement(bad_manifest, "")
    record_failure_task.fn(bad_manifest, stage, "engine_args.bogus: not an engine arg")
    assert bad.path.exists() is kept
    assert (good.path / "model.safetensors").read_bytes() == files["model.safetensors"]
