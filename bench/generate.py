"""Benchmark: generation on SmolLM2-135M-Instruct, our instance against `vllm serve`, one run.

Same runtime image, same model folder (tests/models/make_smollm2.py), same engine args
(float32, max_model_len 2048, max_num_seqs 16); each server started alone and warmed up. Load:
64 streamed completions of 64 tokens (``ignore_eos``, so every one is 64 tokens) at concurrency
1, 8 and 16, and 64 streamed chat completions (the model's chat template) at concurrency 8, from
an httpx load generator on the same 2 cores. Per server and load: output tokens/s, TTFT p50/p99
(first content chunk), inter-token latency p50 (gaps between chunks), e2e p50, and the peak RSS of
the process tree (ours: frontend + tritonserver + backend stub with the engine; vLLM: API server
+ engine core), sampled every 100 ms. Last, the same model announced on an isolated local stack
and the c16 load sent through the router (HAProxy), against our direct c16 figure.

    .venv/bin/python bench/generate.py [--requests 64] [--no-router]   → bench/results/generate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _servers import (SMOLLM2_ENGINE_ARGS, PeakRSS, free_port, percentile, smollm2, started,  # noqa: E402
                      stream_request, vllm_serve_command, wait_ready)

from modelops.io_contract import VLLM_CPU_ENV  # noqa: E402

OUT = REPO / "bench" / "results" / "generate.json"
MODEL = "smollm2"
TOKENS = 64
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def _one(client: httpx.AsyncClient, base: str, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        return await stream_request(client, f"{base}/v1/chat/completions",
                                    {**body, "messages": [{"role": "user", "content": PROMPT}]})
    return await stream_request(client, f"{base}/v1/completions", {**body, "prompt": PROMPT})


async def _load(base: str, n: int, concurrency: int, chat: bool = False) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for _ in range(n):
        queue.put_nowait(None)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            while not queue.empty():
                queue.get_nowait()
                results.append(await _one(client, base, chat))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    return {"requests": n, "concurrency": concurrency, "failed": n - len(ok), "seconds": round(wall, 2),
            "out_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
            "ttft_p50_ms": round(statistics.median(r["ttft"] for r in ok) * 1000, 1),
            "ttft_p99_ms": round(percentile([r["ttft"] for r in ok], 0.99) * 1000, 1),
            "itl_p50_ms": round(statistics.median(gaps) * 1000, 2) if gaps else None,
            "e2e_p50_ms": round(statistics.median(r["e2e"] for r in ok) * 1000, 1)}


def _measure(name: str, cmd: list[str], env: dict, ready_url: str, base: str, n: int, log: Path) -> dict:
    print(f"[{name}] starting ...", flush=True)
    with started(cmd, env, log, REPO) as proc:
        startup = wait_ready(ready_url, proc, timeout=900)
        asyncio.run(_load(base, 8, 8))  # warm-up, not measured
        out: dict = {"startup_s": round(startup, 1)}
        with PeakRSS(proc.pid) as rss:
            for c in (1, 8, 16):
                out[f"c{c}"] = asyncio.run(_load(base, n, c))
                print(f"[{name}] c{c}: {out[f'c{c}']}", flush=True)
            out["chat_c8"] = asyncio.run(_load(base, n, 8, chat=True))
            print(f"[{name}] chat c8: {out['chat_c8']}", flush=True)
        out["peak_rss_mib"] = round(rss.peak / 2**20, 1)
        return out


def _through_router(manifest: Path, env: dict, n: int, work: Path) -> dict:
    """The same model announced on an isolated local stack (own home and ports), then the c16
    load through HAProxy (the router) instead of straight to the instance."""
    ports = {"MODELOPS_ROUTER_PORT": free_port(), "MODELOPS_ROUTER_GRPC_PORT": free_port(),
             "MODELOPS_PREFECT_PORT": free_port(), "MODELOPS_S3_PORT": free_port()}
    home = work / "stack"
    env = {**env, **{k: str(v) for k, v in ports.items()}, "MODELOPS_HOME": str(home),
           "PREFECT_PROFILES_PATH": str(work / "profiles.toml")}
    cli = str(REPO / ".venv" / "bin" / "modelops")

    def run(*a: str, timeout: float = 1200) -> None:
        out = subprocess.run([cli, *a], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise SystemExit(f"modelops {' '.join(a)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")

    print("[router] modelops up + announce ...", flush=True)
    run("up", timeout=300)
    try:
        run("announce", str(manifest), "--wait")
        base = f"http://127.0.0.1:{ports['MODELOPS_ROUTER_PORT']}"
        asyncio.run(_load(base, 8, 8))  # warm-up, not measured
        result = asyncio.run(_load(base, n, 16))
        print(f"[router] c16: {result}", flush=True)
        return result
    finally:
        run("down", timeout=300)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--no-router", action="store_true", help="skip the run through the local stack's router")
    args = p.parse_args()

    image, weights, work, manifest, env = smollm2("bench-generate-")
    engine_args = SMOLLM2_ENGINE_ARGS

    port = free_port()
    ours = _measure("ours", [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port)],
                    env, f"http://127.0.0.1:{port}/ready", f"http://127.0.0.1:{port}", args.requests,
                    work / "ours.log")
    port = free_port()
    vllm = _measure("vllm serve", vllm_serve_command(image, weights, port), {**env, **image.env(), **VLLM_CPU_ENV},
                    f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}", args.requests, work / "vllm.log")

    router = None if args.no_router else _through_router(manifest, env, args.requests, work)

    def ratio(key: str, load: str) -> float:
        return round(ours[load][key] / vllm[load][key], 3)

    report = {
        "benchmark": f"SmolLM2-135M-Instruct float32, {args.requests} streamed completions of {TOKENS} tokens at "
                     "concurrency 1/8/16 and chat (model's template) at 8; ours vs vllm serve, same image",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "runtime": {"vllm": image.vllm, "tritonserver": image.pin.tritonserver, "lock_hash": image.lock_hash},
        "engine_args": engine_args,
        "ours": ours,
        "vllm_serve": vllm,
        "ratio_out_tok_s_c1": ratio("out_tok_s", "c1"),
        "ratio_out_tok_s_c8": ratio("out_tok_s", "c8"),
        "ratio_out_tok_s_c16": ratio("out_tok_s", "c16"),
        "ratio_out_tok_s_chat_c8": ratio("out_tok_s", "chat_c8"),
        "ttft_p50_ratio_c8": ratio("ttft_p50_ms", "c8"),
        "rss_ratio": round(ours["peak_rss_mib"] / vllm["peak_rss_mib"], 3),
        "router_c16": router,
        "router_over_direct_out_tok_s_c16": round(router["out_tok_s"] / ours["c16"]["out_tok_s"], 3) if router else None,
        "targets": {"ratio_out_tok_s_min": 1.0, "ttft_p50_ratio_max": 1.0, "rss_ratio_max": 1.3,
                    "router_over_direct_min": 0.95},
    }
    report["targets_met"] = {
        "throughput_c8": report["ratio_out_tok_s_c8"] >= 1.0,
        "throughput_c16": report["ratio_out_tok_s_c16"] >= 1.0,
        "ttft_p50_c8": report["ttft_p50_ratio_c8"] <= 1.0,
        "rss": report["rss_ratio"] <= 1.3,
    }
    if router:
        report["targets_met"]["router_c16"] = report["router_over_direct_out_tok_s_c16"] >= 0.95
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("ratio", "ttft", "rss", "router_over",
                                                                         "targets_met"))}))


if __name__ == "__main__":
    main()
