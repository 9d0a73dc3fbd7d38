"""S3's stored checksums (CRC32, CRC32C, CRC64NVME; full-object and composite) as the
integrity check of a pull, against moto's S3 server over HTTP.

The expected values come from the endpoint (what moto computed on upload) and, where an
independent implementation exists, from zlib (CRC32). moto quirks worked around here: a
multipart CRC64NVME upload stores a 4-byte value, and a multipart CRC32C one stores the CRC32,
so multipart objects are tested with CRC32 only.
"""

import base64
import json
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelops import MaterializeError
from modelops.settings import get_settings
from tasks.materialize import COMPLETION_RECORD, materialize, verify_cached
from tasks.materialize.digests import CRCS, StreamHasher, combine_crcs, composite_crc, crc_b64, new_hash
from tasks.materialize.sources import ObjectChanged, StoredChecksum

from tests.conftest import FlippingProxy, parsed_manifest as _manifest

MiB = 1 << 20
CONFIG = b'{"architectures": ["BertModel"]}'



def _bucket(s3) -> None:
    if "models" not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket="models")


def _single(s3, key: str, data: bytes, algo: str) -> str:
    """Upload ``data`` in one PUT with ``algo``; returns the checksum S3 stores."""
    _bucket(s3)
    s3.put_object(Bucket="models", Key=key, Body=data, ChecksumAlgorithm=algo.upper())
    return s3.head_object(Bucket="models", Key=key, ChecksumMode="ENABLED")[f"Checksum{algo.upper()}"]


def _multipart(s3, key: str, parts: list[bytes], kind: str) -> dict:
    """A CRC32 multipart upload of ``parts`` with ChecksumType ``kind`` (or none given: None);
    returns HeadObject's checksum fields."""
    _bucket(s3)
    extra = {"ChecksumType": kind} if kind else {}
    upload = s3.create_multipart_upload(Bucket="models", Key=key, ChecksumAlgorithm="CRC32", **extra)["UploadId"]
    done = []
    for n, data in enumerate(parts, 1):
        r = s3.upload_part(Bucket="models", Key=key, UploadId=upload, PartNumber=n, Body=data, ChecksumAlgorithm="CRC32")
        done.append({"PartNumber": n, "ETag": r["ETag"], "ChecksumCRC32": r["ChecksumCRC32"]})
    s3.complete_multipart_upload(Bucket="models", Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    head = s3.head_object(Bucket="models", Key=key, ChecksumMode="ENABLED")
    return {k: v for k, v in head.items() if k.startswith("Checksum")}


def _zlib_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _record(result, key: str = "model.safetensors") -> dict:
    return json.loads((result.path / COMPLETION_RECORD).read_text())["files"][key]


@pytest.mark.parametrize("mode", ["whole-file", "ranges"])
@pytest.mark.parametrize("algo", ["crc32", "crc32c", "crc64nvme"])
def test_a_single_part_object_verifies_against_its_stored_crc_in_any_range_split(home, s3, monkeypatch, algo, mode):
    # 1 MiB + 1 ranges: the last range is one byte, and no range ends on a power of two.
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", "0" if mode == "whole-file" else str(MiB + 1))
    data = random.Random(algo).randbytes(5 * MiB + 7)
    prefix = f"single/{algo}-{mode}/"
    stored = _single(s3, prefix + "model.safetensors", data, algo)
    _single(s3, prefix + "config.json", CONFIG, "crc32")
    if algo == "crc32":
        assert stored == _zlib_b64(data)  # the endpoint and zlib agree on what is expected
    result = materialize(_manifest(f"s3://models/{prefix}"))
    assert (result.path / "model.safetensors").read_bytes() == data
    assert _record(result)["digest"] == f"{algo}:{stored}"
    assert _record(result, "config.json")["digest"] == f"crc32:{_zlib_b64(CONFIG)}"
    report = verify_cached("m", "1")
    assert report["problems"] == [] and report["checked"] == ({"crc32": 2} if algo == "crc32" else {algo: 1, "crc32": 1})


@pytest.mark.parametrize("mode", ["whole-file", "ranges"])
@pytest.mark.parametrize("kind", ["COMPOSITE", "FULL_OBJECT", None])
@pytest.mark.parametrize("sizes", [[6 * MiB, 5 * MiB, 1 * MiB], [6 * MiB, 5 * MiB, 6 * MiB, 2 * MiB]])
def test_a_multipart_crc32_object_of_unequal_parts_verifies(home, s3, monkeypatch, sizes, kind, mode):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", "0" if mode == "whole-file" else str(4 * MiB))
    rnd = random.Random(len(sizes))
    parts = [rnd.randbytes(n) for n in sizes]
    prefix = f"multi/{len(sizes)}-{kind}-{mode}/"
    head = _multipart(s3, prefix + "model.safetensors", parts, kind)
    _single(s3, prefix + "config.json", CONFIG, "crc32")
    stored = head["ChecksumCRC32"]
    full = _zlib_b64(b"".join(parts))
    composite = _zlib_b64(b"".join(zlib.crc32(p).to_bytes(4, "big") for p in parts))  # S3's composite rule
    assert stored.split("-")[0] == (full if kind == "FULL_OBJECT" else composite)
    result = materialize(_manifest(f"s3://models/{prefix}"))
    assert (result.path / "model.safetensors").read_bytes() == b"".join(parts)
    record = _record(result)
    # A composite checksum is recorded with its part count (S3 shows it so; moto leaves it off).
    assert record["digest"] == (f"crc32:{full}" if kind == "FULL_OBJECT" else f"crc32:{composite}-{len(sizes)}")
    report = verify_cached("m", "1")
    assert report["problems"] == [] and report["checked"] == {"crc32": 2}


def test_a_bit_flipped_in_transit_is_a_full_object_crc_mismatch_naming_both(home, s3, s3_server, monkeypatch):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(MiB))
    data = random.Random(5).randbytes(4 * MiB)
    stored = _single(s3, "flip-crc/model.safetensors", data, "crc64nvme")
    _single(s3, "flip-crc/config.json", CONFIG, "crc32")
    proxy = FlippingProxy(s3_server["port"])
    monkeypatch.setenv("MODELOPS_S3_PORT", str(proxy.port))
    with pytest.raises(MaterializeError) as e:
        materialize(_manifest("s3://models/flip-crc/"))
    proxy.srv.close()
    assert proxy.flipped.is_set()
    assert str(e.value).startswith(f"model.safetensors: CRC64NVME mismatch: expected {stored} (the full-object "
                                   "checksum S3 stores), got ")
    assert str(e.value).endswith("pull again (a rerun fetches this file again); if it fails again, upload the "
                                 "object again")
    assert not (get_settings().fsx_dir / "m" / "1").exists()  # nothing published
    monkeypatch.setenv("MODELOPS_S3_PORT", str(s3_server["port"]))
    assert (materialize(_manifest("s3://models/flip-crc/")).path / "model.safetensors").read_bytes() == data


def test_a_small_file_replaced_after_listing_is_named_not_published(home, s3, monkeypatch):
    """The small-file path learns the checksum from the GET itself: If-Match with the listed
    ETag keeps a replaced object from vouching for itself."""
    import tasks.materialize.transfer as transfer

    _single(s3, "race/model.safetensors", random.Random(11).randbytes(MiB), "crc32")
    _single(s3, "race/config.json", CONFIG, "crc32")
    listed = transfer.list_source

    def list_then_replace(*a, **k):
        files = listed(*a, **k)
        _single(s3, "race/model.safetensors", random.Random(12).randbytes(MiB), "crc32")
        return files

    monkeypatch.setattr(transfer, "list_source", list_then_replace)
    with pytest.raises(ObjectChanged, match="^s3://models/race/model.safetensors changed since it was listed"):
        materialize(_manifest("s3://models/race/"))
    assert not (get_settings().fsx_dir / "m" / "1").exists()


def test_a_composite_mismatch_names_the_parts(home, s3, s3_server, monkeypatch):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(5 * MiB))
    sizes = [5 * MiB, 5 * MiB, 5 * MiB]
    stored = _multipart(s3, "flip-comp/model.safetensors", [random.Random(7).randbytes(n) for n in sizes],
                        "COMPOSITE")["ChecksumCRC32"]
    _single(s3, "flip-comp/config.json", CONFIG, "crc32")
    proxy = FlippingProxy(s3_server["port"])
    monkeypatch.setenv("MODELOPS_S3_PORT", str(proxy.port))
    with pytest.raises(MaterializeError) as e:
        materialize(_manifest("s3://models/flip-comp/"))
    proxy.srv.close()
    msg = str(e.value)
    assert msg.startswith(f"model.safetensors: CRC32 mismatch: expected {stored} (the COMPOSITE checksum S3 "
                          "stores), got ") and "over its 3 parts (sizes read from HeadObject)" in msg
    assert "-" not in msg.split("got ")[1].split(" ")[0]  # shown as S3 showed the expected one


def test_verify_finds_a_flipped_byte_in_full_object_and_composite_records(home, s3):
    data = random.Random(9).randbytes(6 * MiB)
    _single(s3, "flip/model.safetensors", data, "crc64nvme")
    _multipart(s3, "flip/extra.safetensors", [data[:5 * MiB], data[5 * MiB:] + b"x"], "COMPOSITE")
    _single(s3, "flip/config.json", CONFIG, "crc32c")
    result = materialize(_manifest("s3://models/flip/"))
    assert verify_cached("m", "1")["checked"] == {"crc64nvme": 1, "crc32": 1, "crc32c": 1}
    for name in ("model.safetensors", "extra.safetensors"):
        with (result.path / name).open("r+b") as f:
            f.seek(MiB + 3)
            byte = f.read(1)
            f.seek(MiB + 3)
            f.write(bytes([byte[0] ^ 1]))
    problems = verify_cached("m", "1")["problems"]
    assert [p.split(":")[0] for p in problems] == ["extra.safetensors", "model.safetensors"]
    assert problems[0].startswith("extra.safetensors: crc32 is ") and problems[0].endswith("-2")
    assert problems[1].startswith("model.safetensors: crc64nvme is ")


def test_stored_checksum_of_head_responses_as_real_s3_sends_them():
    """HeadObject shapes from the S3 API reference (ChecksumType since 2025; a composite value
    carries ``-<parts>``), and those of older objects and moto (no ChecksumType)."""
    assert StoredChecksum.from_head({"ChecksumCRC64NVME": "pULe1usSOMM=", "ChecksumType": "FULL_OBJECT"}) == \
        StoredChecksum("crc64nvme", "pULe1usSOMM=", "FULL_OBJECT")
    assert StoredChecksum.from_head({"ChecksumCRC32": "nMQp0A==-3", "ChecksumType": "COMPOSITE"}) == \
        StoredChecksum("crc32", "nMQp0A==", "COMPOSITE")
    assert StoredChecksum.from_head({"ChecksumCRC32C": "2BMIcw==-12"}) == StoredChecksum("crc32c", "2BMIcw==", "COMPOSITE")
    assert StoredChecksum.from_head({"ChecksumCRC32": "r72Wwg=="}) == StoredChecksum("crc32", "r72Wwg==", None)
    assert StoredChecksum.from_head({"ChecksumSHA256": "x" * 44}) is None  # not a CRC: the ETag is checked
    assert StoredChecksum.from_head({"ContentLength": 3}) is None


@given(data=st.binary(max_size=4000), cuts=st.lists(st.integers(0, 4000), max_size=12),
       algo=st.sampled_from(sorted(CRCS)))
@settings(max_examples=300, deadline=None)
def test_crcs_of_any_split_combine_to_the_whole(data, cuts, algo):
    """Ranges hashed on their own and combined in order give the CRC of the whole (the
    FULL_OBJECT check of a file fetched in ranges); for CRC32, zlib is the oracle."""
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        h = StreamHasher(algo, a, [])
        h.update(data[a:b])
        pieces.append((b - a, h.digests()[0]))
    whole = new_hash(algo)
    whole.update(data)
    assert combine_crcs(algo, pieces or [(0, whole.digest())]) == whole.digest()
    if algo == "crc32":
        assert crc_b64(whole.digest()) == _zlib_b64(data)
        parts = [data[a:b] for a, b in zip(bounds, bounds[1:])] or [b""]
        assert composite_crc(algo, [zlib.crc32(p).to_bytes(4, "big") for p in parts]) == \
            f"{_zlib_b64(b''.join(zlib.crc32(p).to_bytes(4, 'big') for p in parts))}-{len(parts)}"


@pytest.mark.parametrize("case", ["intact", "damaged_on_disk_later", "bad_when_journaled"])
def test_a_file_journaled_whole_before_a_kill_is_rechecked_and_verified_on_resume(home, s3, case):
    """A small file learns its checksum from its GET; killed after its range was journaled
    but before it was verified, the rerun re-hashes the journaled range (bytes damaged on disk
    since are fetched again), asks HeadObject for the checksum and checks the file (bytes that
    were already bad when journaled fail, naming the checksum)."""
    data = random.Random(10).randbytes(3 * MiB + 1)
    stored = _single(s3, "resume-crc/model.safetensors", data, "crc64nvme")
    _single(s3, "resume-crc/config.json", CONFIG, "crc32")
    etag = s3.head_object(Bucket="models", Key="resume-crc/model.safetensors")["ETag"].strip('"')
    staging = get_settings().fsx_dir / "m" / ".staging-1"
    staging.mkdir(parents=True)
    damaged = bytearray(data)
    damaged[12345] ^= 1
    journaled = bytes(damaged) if case == "bad_when_journaled" else data
    (staging / "model.safetensors.modelops-part").write_bytes(data if case == "intact" else bytes(damaged))
    crc = new_hash("crc64nvme")
    crc.update(journaled)
    (staging / ".modelops-journal.json").write_text(json.dumps({"model.safetensors": {
        "listing": {"size": len(data), "etag": etag}, "ranges": [[0, len(data)]], "hashes": {"0": [crc.digest().hex()]}}}))
    if case == "bad_when_journaled":
        with pytest.raises(MaterializeError, match=f"model.safetensors: CRC64NVME mismatch: expected {stored}"):
            materialize(_manifest("s3://models/resume-crc/"))
        return
    result = materialize(_manifest("s3://models/resume-crc/"))
    # Intact: the weights are not fetched again; damaged since: they are, whole (one range).
    assert result.transferred == len(CONFIG) + (0 if case == "intact" else len(data))
    assert (result.path / "model.safetensors").read_bytes() == data
    assert _record(result)["digest"] == f"crc64nvme:{stored}"
    assert verify_cached("m", "1")["problems"] == []
