"""Tenants at the router (issue 37): what API keys cost, how exact an rpm limit is, and whether one
key's flood of long requests slows another key's first tokens. Writes bench/results/tenants.json.

- ``auth_overhead_ms_p50``: one small POST at a time through two routers in front of the same
  stub instance (a separate process), one with keys off and one checking a key (scope, rpm,
  max_concurrency, tpm map), requests alternating between them; p50 of (keyed - open).
- ``rate_limit_error_ratio``: a key with rpm 120 sends 4 requests a second (twice its limit) for
  60 s; |admitted - 120| / 120.
- ``fairness_ttft_p50_ratio``: SmolLM2-135M-Instruct behind the router; key B sends short
  streamed requests one at a time, alone, then while key A (max_concurrency 2) keeps 8 long
  streams coming; B's TTFT p50 with the flood / alone. Also measured with A unlimited, to show
  what the limit does.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._servers import free_port, percentile, smollm2, started, stream_request, wait_ready  # noqa: E402

OUT = Path(__file__).with_name("results") / "tenants.json"
REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
RPM = 120

_STUB = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # one write per answer (flushed after each), and no Nagle: no 40 ms delayed-ACK stalls
    disable_nagle_algorithm = True
    def do_GET(self):
        self._send(b'{"ready": true}')
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(b'{"object": "list", "data": [{"embedding": [0.0]}]}')
    def _send(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Model-Version", "1")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
server.handle_error = lambda *a: None  # health checks close their connections early
server.serve_forever()
"""


@contextmanager
def keyed_router(home: Path, address: str, keys: dict[str, dict] | None = None):
    """Our HAProxy router in ``home`` over one server at ``address`` for model ``MODEL``, with
    ``keys`` (name → limits) created first; yields ``(router URL, {name: key})``."""
    from modelops.registry import Registry
    from modelops.settings import Settings
    from modelops.tenancy import key_hash, new_key
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import ModelRoute, Server

    settings = Settings(home=home, router_port=free_port(), router_grpc_port=free_port())
    registry = Registry(settings.registry)
    made = {}
    for name, limits in (keys or {}).items():
        made[name] = new_key()
        registry.create_key(name, key_hash(made[name]), (MODEL,), **limits)
    router = HAProxyRouter(settings)  # it reads the keys from its settings' registry
    router.apply([ModelRoute(MODEL, {"1": (Server(f"{MODEL}-1-1", address, 100),)})])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                ",UP," in line for line in router._command("show stat").splitlines() if line.startswith(f"m_{MODEL},")):
            time.sleep(0.1)
        yield f"http://127.0.0.1:{settings.router_port}", made
    finally:
        router.stop()


def auth_overhead(work: Path, rounds: int = 3000) -> dict:
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", _STUB, str(port)], start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", stub, timeout=30)
        address = f"127.0.0.1:{port}"
        with keyed_router(work / "open", address) as (open_url, _), \
                keyed_router(work / "keyed", address, {"bench": {"rpm": 10**6, "max_concurrency": 64,
                                                                 "tpm": 10**9}}) as (keyed_url, keys):
            body = {"model": MODEL, "input": "x"}
            auth = {"Authorization": f"Bearer {keys['bench']}"}
            times: dict[str, list[float]] = {"open": [], "keyed": []}
            with httpx.Client() as client:
                pair = (("open", open_url, {}), ("keyed", keyed_url, auth))
                for i in range(rounds + 200):
                    for name, url, headers in pair if i % 2 else pair[::-1]:  # neither always goes first
                        t0 = time.perf_counter()
                        r = client.post(f"{url}/v1/embeddings", json=body, headers=headers)
                        took = time.perf_counter() - t0
                        assert r.status_code == 200, r.text
                        if i >= 200:  # after the warm-up
                            times[name].append(took)
        p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
        return {"requests_each": rounds, "open_p50_ms": round(p50["open"], 3), "keyed_p50_ms": round(p50["keyed"], 3),
                "open_p99_ms": round(percentile(times["open"], 0.99) * 1000, 3),
                "keyed_p99_ms": round(percentile(times["keyed"], 0.99) * 1000, 3),
                "auth_overhead_ms_p50": round(p50["keyed"] - p50["open"], 3)}
    finally:
        os.killpg(stub.pid, 15)
        stub.wait(timeout=10)


def rate_limit(work: Path, seconds: float = 60.0, per_second: float = 4.0) -> dict:
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", _STUB, str(port)], start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", stub, timeout=30)
        with keyed_router(work / "rpm", f"127.0.0.1:{port}", {"limited": {"rpm": RPM}}) as (url, keys):
            codes, retry_after = [], set()
            auth = {"Authorization": f"Bearer {keys['limited']}"}
            t0 = time.monotonic()
            with httpx.Client() as client:
                for i in range(int(seconds * per_second)):
                    time.sleep(max(0.0, t0 + i / per_second - time.monotonic()))
                    r = client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=auth)
                    codes.append(r.status_code)
                    if r.status_code == 429:
                        retry_after.add(r.headers.get("Retry-After"))
            admitted = codes.count(200)
            return {"rpm": RPM, "sent": len(codes), "seconds": seconds, "admitted": admitted,
                    "refused_429": codes.count(429), "other": len(codes) - admitted - codes.count(429),
                    "retry_after_values": sorted(v for v in retry_after if v),
                    "rate_limit_error_ratio": round(abs(admitted - RPM) / RPM, 4)}
    finally:
        os.killpg(stub.pid, 15)
        stub.wait(timeout=10)


async def _ttfts(url: str, key: str, count: int) -> list[float]:
    """B: ``count`` short streamed completions one at a time; their TTFTs (s)."""
    body = {"model": MODEL, "prompt": "Name one color.", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    out = []
    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(count):
            r = await stream_request(client, f"{url}/v1/completions", body)
            assert r["ok"], r
            out.append(r["ttft"])
    return out


async def _flood(url: str, key: str, stop: asyncio.Event, streams: int = 8) -> dict:
    """A: ``streams`` workers sending 256-token streams back to back; a 429 is retried after 50 ms
    (a client that floods). Returns what A got."""
    body = {"model": MODEL, "prompt": "Write a long story about a router.", "max_tokens": 256, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    got = {"answered": 0, "refused_429": 0}

    async def worker(client):
        while not stop.is_set():
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code == 429:
                    got["refused_429"] += 1
                    await r.aread()
                    await asyncio.sleep(0.05)
                    continue
                async for _ in r.aiter_lines():
                    if stop.is_set():
                        break
                got["answered"] += 1

    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {key}"}) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(streams)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return got


async def _with_flood(url: str, a_key: str, b_key: str, count: int) -> tuple[list[float], dict]:
    stop = asyncio.Event()
    flood = asyncio.create_task(_flood(url, a_key, stop))
    await asyncio.sleep(5)  # A's streams are running
    ttfts = await _ttfts(url, b_key, count)
    stop.set()
    return ttfts, await flood


def fairness(work: Path, count: int = 30) -> dict:
    image, _weights, _, manifest, env = smollm2("bench-tenants-")
    port = free_port()
    cmd = [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port)]
    with started(cmd, env, work / "instance.log", REPO) as proc:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout=900)
        out = {}
        for case, a_limits in (("a_max_concurrency_2", {"max_concurrency": 2}), ("a_unlimited", {})):
            with keyed_router(work / f"fair-{case}", f"127.0.0.1:{port}", {"a": a_limits, "b": {}}) as (url, keys):
                asyncio.run(_ttfts(url, keys["b"], 3))  # warm-up
                alone = asyncio.run(_ttfts(url, keys["b"], count))
                flooded, a_got = asyncio.run(_with_flood(url, keys["a"], keys["b"], count))
                p50_alone, p50_flood = statistics.median(alone), statistics.median(flooded)
                out[case] = {"b_ttft_p50_ms_alone": round(p50_alone * 1000, 1),
                             "b_ttft_p50_ms_with_flood": round(p50_flood * 1000, 1),
                             "ttft_p50_ratio": round(p50_flood / p50_alone, 3), "a": a_got}
        return {"engine": "SmolLM2-135M-Instruct float32 (bench/_servers.py SMOLLM2_ENGINE_ARGS), one instance",
                "b_requests": count, **out, "fairness_ttft_p50_ratio": out["a_max_concurrency_2"]["ttft_p50_ratio"]}


def main() -> None:
    import argparse

    from tasks.image import build_runtime_image

    p = argparse.ArgumentParser()
    p.add_argument("--skip-fairness", action="store_true", help="the router-only parts (no engine)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    report: dict = json.loads(OUT.read_text()) if OUT.exists() else {}
    report.update({
        "benchmark": "API keys at the router (HAProxy): overhead against the same router with keys off, rpm "
                     "accuracy at twice the limit, B's TTFT p50 while A floods against B alone",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    })
    overhead = auth_overhead(work)
    report["overhead"] = overhead
    report["auth_overhead_ms_p50"] = overhead["auth_overhead_ms_p50"]
    limit = rate_limit(work)
    report["rate_limit"] = limit
    report["rate_limit_error_ratio"] = limit["rate_limit_error_ratio"]
    if not args.skip_fairness:
        image = build_runtime_image()
        report["runtime"] = {"vllm": image.vllm, "tritonserver": image.pin.tritonserver}
        fair = fairness(work)
        report["fairness"] = fair
        report["fairness_ttft_p50_ratio"] = fair["fairness_ttft_p50_ratio"]
    report["targets"] = {"auth_overhead_ms_p50_max": 1.0, "rate_limit_error_ratio_max": 0.1,
                         "fairness_ttft_p50_ratio_max": 1.2}
    met = {"auth_overhead": report["auth_overhead_ms_p50"] <= 1.0,
           "rate_limit": report["rate_limit_error_ratio"] <= 0.1}
    if "fairness_ttft_p50_ratio" in report:
        met["fairness"] = report["fairness_ttft_p50_ratio"] <= 1.2
    report["met"] = met
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("auth_overhead_ms_p50", "rate_limit_error_ratio", "met")
                      if k in report} | ({"fairness_ttft_p50_ratio": report["fairness_ttft_p50_ratio"]}
                                         if "fairness_ttft_p50_ratio" in report else {})))


if __name__ == "__main__":
    main()
