"""Materialization under failure: real moto S3 over HTTP, real files, real SIGKILLs."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
from boto3.s3.transfer import TransferConfig

from modelops import MaterializeError, Registry, get_settings
from tasks.materialize import COMPLETION_RECORD, SUMS_FILE, cached_versions, evict, materialize

from tests.conftest import PacedProxy, free_port, parsed_manifest as _manifest

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _model_files(big_mib: int, small: int = 20, seed: int = 1) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = {"config.json": b'{"architectures": ["BertModel"]}',
             "model.safetensors": rnd.randbytes(big_mib * MiB + 12345)}
    files.update({f"extra/part-{i:02d}.bin": rnd.randbytes(20_000 + i) for i in range(small)})
    return files


def _upload(s3, bucket: str, prefix: str, files: dict[str, bytes], *, sums: bool = False, part_mib: int = 5) -> None:
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    cfg = TransferConfig(multipart_threshold=part_mib * MiB, multipart_chunksize=part_mib * MiB)
    import io

    for rel, data in files.items():
        s3.upload_fileobj(io.BytesIO(data), bucket, prefix + rel, Config=cfg)
    if sums:
        text = "".join(f"{hashlib.sha256(d).hexdigest()}  {rel}\n" for rel, d in files.items())
        s3.put_object(Bucket=bucket, Key=prefix + SUMS_FILE, Body=text.encode())


def _assert_same(dest: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert hashlib.sha256((dest / rel).read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest(), rel



def _strays(home: Path) -> list[Path]:
    return [p for p in (home / "fsx").rglob(".*") if p.is_dir() and p.name.startswith((".staging-", ".old-"))]


def test_multipart_etags_and_byte_ranges_are_verified(home, s3_no_checksum, monkeypatch):
    """Objects without a stored checksum: the multipart ETag is the check."""
    s3 = s3_no_checksum
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(3 * MiB))  # smaller than a part: one part per range
    files = _model_files(big_mib=12)
    _upload(s3, "models", "mp/1/", files, part_mib=5)
    etag = s3.head_object(Bucket="models", Key="mp/1/model.safetensors")["ETag"].strip('"')
    assert etag.endswith("-3")  # a real multipart upload
    result = materialize(_manifest("s3://models/mp/1/"))
    _assert_same(result.path, files)
    import json

    record = json.loads((result.path / COMPLETION_RECORD).read_text())
    assert record["files"]["model.safetensors"]["digest"] == f"etag:{etag}"


def test_corrupted_object_fails_naming_the_key_and_publishes_nothing(home, s3):
    files = _model_files(big_mib=1, small=3)
    _upload(s3, "models", "bad/1/", files, sums=True)
    tampered = bytearray(files["model.safetensors"])
    tampered[1000] ^= 0xFF
    s3.put_object(Bucket="models", Key="bad/1/model.safetensors", Body=bytes(tampered))  # after SHA256SUMS
    with pytest.raises(MaterializeError) as e:
        materialize(_manifest("s3://models/bad/1/"))
    msg = str(e.value)
    assert "model.safetensors: sha256 mismatch" in msg
    assert hashlib.sha256(files["model.safetensors"]).hexdigest() in msg
    assert hashlib.sha256(bytes(tampered)).hexdigest() in msg
    dest = get_settings().fsx_dir / "m" / "1"
    assert not dest.exists()
    staging = dest.parent / ".staging-1"
    assert not (staging / "model.safetensors").exists() and not (staging / "model.safetensors.modelops-part").exists()


def _moto_process(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx

    for _ in range(200):
        try:
            httpx.get(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("moto_server did not start")


def test_server_killed_mid_transfer_then_rerun(home, monkeypatch):
    port = free_port()
    # About 8 MB/s per connection: the kill a moment after the first bytes land is mid-transfer
    # however fast the machine (unpaced, 48 MiB can arrive in less than that moment).
    proxy = PacedProxy(port, 0.008)
    monkeypatch.setenv("MODELOPS_S3_PORT", str(proxy.port))
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(1 * MiB))
    monkeypatch.setenv("MODELOPS_MATERIALIZE_CONCURRENCY", "2")
    files = _model_files(big_mib=48, small=5)
    server = _moto_process(port)
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="modelops",
                      aws_secret_access_key="modelops", region_name="us-east-1")
    _upload(s3, "kill", "m/1/", files)
    dest = get_settings().fsx_dir / "m" / "1"
    seen_partial, stop = [], threading.Event()

    def watch() -> None:  # a reader polling the destination must never see a partial model
        while not stop.is_set():
            if dest.exists() and not (dest / COMPLETION_RECORD).exists():
                seen_partial.append(sorted(p.name for p in dest.iterdir()))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            materialize(_manifest("s3://kill/m/1/"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    staging = dest.parent / ".staging-1"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(staging.glob("*.modelops-part")):
        time.sleep(0.01)
    time.sleep(0.5)
    server.kill()  # SIGKILL mid-transfer
    server.wait()
    t.join(300)
    assert errors and isinstance(errors[0], MaterializeError), errors
    assert not dest.exists()
    # The restarted server holds the same objects (moto keeps them in memory: upload them again).
    server = _moto_process(port)
    try:
        _upload(s3, "kill", "m/1/", files)
        result = materialize(_manifest("s3://kill/m/1/"))
    finally:
        server.kill()
        server.wait()
        proxy.srv.close()
        stop.set()
        watcher.join()
    _assert_same(result.path, files)
    assert result.transferred < result.bytes  # ranges and files written before the kill were kept
    assert seen_partial == [] and _strays(home) == []


_CHILD = """
import sys
from modelops import parse_manifest
from tasks.materialize import materialize
m = parse_manifest({"model_id": "m", "version": "1", "source": sys.argv[1], "task": "embed"})
print("start", flush=True)
materialize(m)
print("done", flush=True)
"""


def test_twenty_random_sigkills_then_rerun(home, s3, monkeypatch):
    monkeypatch.setenv("MODELOPS_MATERIALIZE_RANGE_SIZE", str(2 * MiB))
    monkeypatch.setenv("MODELOPS_MATERIALIZE_CONCURRENCY", "4")
    files = _model_files(big_mib=40, small=30, seed=7)
    _upload(s3, "models", "sigkill/1/", files, sums=True)
    rnd = random.Random(20)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    dest = get_settings().fsx_dir / "m" / "1"
    mid_transfer = 0
    for _ in range(20):
        if (dest / COMPLETION_RECORD).exists():
            shutil.rmtree(dest)  # start over, so that every kill can land mid-transfer
        child = subprocess.Popen([sys.executable, "-c", _CHILD, "s3://models/sigkill/1/"], env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "start"
        time.sleep(rnd.uniform(0.0, 0.8))
        child.kill()
        child.wait()
        mid_transfer += (dest.parent / ".staging-1").exists()
        assert not dest.exists() or (dest / COMPLETION_RECORD).exists()  # never a partial model
    assert mid_transfer >= 10, f"only {mid_transfer} of 20 kills landed mid-transfer"
    result = materialize(_manifest("s3://models/sigkill/1/"))
    _assert_same(result.path, files)
    assert _strays(home) == []
    assert not list(result.path.rglob("*.modelops-part"))


def test_eviction_is_lru_and_never_touches_versions_in_use(home, tmp_path):
    from tests.conftest import write_fake_model

    src = tmp_path / "src"
    write_fake_model(src)
    registry = Registry(get_settings().registry)
    for version in ("1", "2", "3"):
        m = _manifest(str(src), version=version)
        materialize(m)
        registry.record_announcement(m)
        time.sleep(0.02)
    registry.set_state("m", "1", "serving")  # the oldest, but in use
    registry.set_state("m", "2", "retired")
    registry.set_state("m", "3", "failed")
    each = cached_versions()[0]["bytes"]
    evicted = evict(budget_bytes=each, registry=registry)
    assert [(v["model_id"], v["version"]) for v in evicted] == [("m", "2"), ("m", "3")]
    assert [v["version"] for v in cached_versions()] == ["1"]
    assert evict(budget_bytes=0, registry=registry) == []  # over budget, but 1 is serving
    assert (get_settings().fsx_dir / "m" / "1" / COMPLETION_RECORD).exists()
