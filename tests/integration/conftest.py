"""One local stack per test session: real Prefect server + process worker, moto S3, HAProxy.

Isolated from a developer's own stack: its own MODELOPS_HOME and free ports. The runtime image
(~/.cache/modelops/runtime) is shared; `make test` builds it first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
MODELOPS = str(Path(sys.executable).parent / "modelops")


@dataclass
class Stack:
    env: dict[str, str]
    home: Path
    router: str  # OpenAI base URL of the router
    s3_endpoint: str

    def modelops(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([MODELOPS, *args], env={**self.env, "COLUMNS": "200"}, cwd=REPO, capture_output=True,
                              text=True, timeout=timeout)

    def s3(self):
        return boto3.client("s3", endpoint_url=self.s3_endpoint, aws_access_key_id="modelops",
                            aws_secret_access_key="modelops", region_name="us-east-1")


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    home = tmp_path_factory.mktemp("stack") / "home"
    ports = {"MODELOPS_ROUTER_PORT": free_port(), "MODELOPS_PREFECT_PORT": free_port(), "MODELOPS_S3_PORT": free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MODELOPS_"))}
    env.update({k: str(v) for k, v in ports.items()}, MODELOPS_HOME=str(home))
    st = Stack(env, home, f"http://127.0.0.1:{ports['MODELOPS_ROUTER_PORT']}/v1",
               f"http://127.0.0.1:{ports['MODELOPS_S3_PORT']}")
    up = st.modelops("stack", "up", timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield st
    finally:
        down = st.modelops("stack", "down", timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        leftovers = [p for p in (home / "run").rglob("*.pid")]
        assert not leftovers, f"pid files left after stack down: {leftovers}"


def upload_dir(stack: Stack, root: Path, bucket: str, prefix: str) -> None:
    s3 = stack.s3()
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, prefix + path.relative_to(root).as_posix())
