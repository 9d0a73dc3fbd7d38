"""modelops_cli.local_s3: the local stack's moto S3 server keeps its buckets across restarts."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest
from boto3.s3.transfer import TransferConfig

from modelops_cli.local_s3 import SAVE_AFTER_S
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path):
    """start() → (process, boto3 client) of a local_s3 server on one port and state file."""
    port, procs = free_port(), []

    def start():
        proc = subprocess.Popen([sys.executable, "-m", "modelops_cli.local_s3", "--port", str(port), "--state",
                                 str(tmp_path / "s3" / "state.pickle")], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(proc)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/moto-api/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "local_s3 did not start"
            time.sleep(0.1)
        return proc, boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="modelops",
                                  aws_secret_access_key="modelops", region_name="us-east-1")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_buckets_objects_etags_and_part_sizes_survive_a_restart(server):
    proc, s3 = server()
    s3.create_bucket(Bucket="models")
    data = os.urandom(12 * 2**20 + 123)
    s3.upload_fileobj(io.BytesIO(data), "models", "m/1/model.safetensors",
                      Config=TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20))
    s3.put_object(Bucket="models", Key="m/1/config.json", Body=b"{}", Metadata={"source": "test"})
    head = s3.head_object(Bucket="models", Key="m/1/model.safetensors")
    parts = [s3.head_object(Bucket="models", Key="m/1/model.safetensors", PartNumber=n)["ContentLength"]
             for n in (1, 2, 3)]
    assert head["ETag"].endswith('-3"') and parts == [5 * 2**20, 5 * 2**20, 2 * 2**20 + 123]
    _stop(proc)
    proc, s3 = server()
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["models"]
    assert s3.head_object(Bucket="models", Key="m/1/model.safetensors")["ETag"] == head["ETag"]
    assert [s3.head_object(Bucket="models", Key="m/1/model.safetensors", PartNumber=n)["ContentLength"]
            for n in (1, 2, 3)] == parts
    body = s3.get_object(Bucket="models", Key="m/1/model.safetensors")["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(data).digest()
    ranged = s3.get_object(Bucket="models", Key="m/1/model.safetensors", Range="bytes=5242880-5242889")["Body"].read()
    assert ranged == data[5 * 2**20:5 * 2**20 + 10]
    assert s3.head_object(Bucket="models", Key="m/1/config.json")["Metadata"] == {"source": "test"}
    _stop(proc)


def test_changes_are_saved_soon_after_so_a_crash_keeps_them(server):
    proc, s3 = server()
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="a", Body=b"1")
    s3.put_object(Bucket="models", Key="b", Body=b"2")
    time.sleep(SAVE_AFTER_S + 2)
    s3.delete_object(Bucket="models", Key="a")
    time.sleep(SAVE_AFTER_S + 2)
    proc.kill()  # no chance to save at exit
    proc.wait()
    proc, s3 = server()
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="models")["Contents"]] == ["b"]
    _stop(proc)
