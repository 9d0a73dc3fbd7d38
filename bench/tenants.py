"""Tenants at the router (issue 37): what API keys cost, how exact an rpm limit is, and whether one
key's flood of long requests slows another key's first tokens. Writes bench/results/tenants.json.

- ``auth_overhead_ms_p50``: one small POST at a time through two routers in front of the same
  stub instance (a separate process), one with keys off and one checking a key (scope, rpm,
  max_concurrency, tpm map), requests alternating between them; p50 of (keyed - open).
- ``rate_limit_error_ratio``: a key with rpm 120 sends 4 requests a second (twice its limit) for
  60 s; |admitted - 120| / 120.
- ``fairness_ttft_p50_ratio``: SmolLM2-135M-Instruct behind the router; key B sends short
  streamed requests one at a time, alone, then while key A (max_concurrency 2), a client process
  of its own, keeps 8 long streams coming; B's TTFT p50 with the flood / alone. Also measured
  with A unlimited, to show what the limit does.
- ``vllm_serve_ttft_p50_ratio_a_streams_2``: the same B and A straight at vLLM's own server on
  the same weights, A with the 2 streams its limit lets in (and with 8): the engine's own
  slowdown, which no router in front can undo while A runs at all. ``fairness_over_vllm_serve``:
  ours / that.
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

from bench._servers import (free_port, load_client, percentile, smollm2, started, stream_request,  # noqa: E402
                            vllm_serve_command, wait_ready)

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


_B_BODY = {"model": MODEL, "prompt": "Name one color.", "max_tokens": 8, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}, "ignore_eos": True}
# A: 256-token streams back to back, a 429 sent again after 50 ms (bench/_load.py).
_FLOOD_BODY = {"model": MODEL, "prompt": "Write a long story about a router.", "max_tokens": 256, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}


async def _ttfts(url: str, key: str | None, count: int) -> list[float]:
    """B: ``count`` short streamed completions one at a time; their TTFTs (s)."""
    out = []
    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {key}"} if key else {}) as client:
        for _ in range(count):
            r = await stream_request(client, f"{url}/v1/completions", _B_BODY)
            assert r["ok"], r
            out.append(r["ttft"])
    return out


def _b_alone_and_flooded(url: str, a_key: str | None, b_key: str | None, count: int, streams: int) -> dict:
    """B's TTFTs alone, then while A (a client process of its own) keeps ``streams`` long streams
    coming; p50s (ms), their ratio and what A got."""
    asyncio.run(_ttfts(url, b_key, 3))  # warm-up
    alone = asyncio.run(_ttfts(url, b_key, count))
    with load_client(url, "/v1/completions", _FLOOD_BODY, streams=streams, key=a_key) as a:
        time.sleep(5)  # A's streams are running
        flooded = asyncio.run(_ttfts(url, b_key, count))
    assert a.counts.get("answered", 0) + a.counts.get("refused_429", 0) > 0, f"A's client failed: {a.counts}"
    p50_alone, p50_flood = statistics.median(alone), statistics.median(flooded)
    return {"b_ttft_p50_ms_alone": round(p50_alone * 1000, 1), "b_ttft_p50_ms_with_flood": round(p50_flood * 1000, 1),
            "ttft_p50_ratio": round(p50_flood / p50_alone, 3), "a_streams": streams, "a": a.counts}


def fairness(work: Path, count: int = 30) -> dict:
    image, weights, _, manifest, env = smollm2("bench-tenants-")
    port = free_port()
    cmd = [str(REPO / ".venv" / "bin" / "modelops"), "serve", str(manifest), "--port", str(port)]
    out = {}
    with started(cmd, env, work / "instance.log", REPO) as proc:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout=900)
        for case, a_limits in (("a_max_concurrency_2", {"max_concurrency": 2}), ("a_unlimited", {})):
            with keyed_router(work / f"fair-{case}", f"127.0.0.1:{port}", {"a": a_limits, "b": {}}) as (url, keys):
                out[case] = _b_alone_and_flooded(url, keys["a"], keys["b"], count, streams=8)
    # The engine's own share: vLLM's server, no router, with A's 2 streams (what max_concurrency 2
    # lets in) and with 8. No scheduler in front can do better than this while A runs at all.
    port = free_port()
    with started(vllm_serve_command(image, str(weights), port), env, work / "vllm.log", REPO) as proc:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=900)
        url = f"http://127.0.0.1:{port}"
        floor = {f"a_streams_{n}": _b_alone_and_flooded(url, None, None, count, streams=n) for n in (2, 8)}
    ours, engine = out["a_max_concurrency_2"]["ttft_p50_ratio"], floor["a_streams_2"]["ttft_p50_ratio"]
    return {"engine": "SmolLM2-135M-Instruct float32 (bench/_servers.py SMOLLM2_ENGINE_ARGS), one instance",
            "b_requests": count, **out, "vllm_serve": floor, "fairness_ttft_p50_ratio": ours,
            "vllm_serve_ttft_p50_ratio_a_streams_2": engine, "fairness_over_vllm_serve": round(ours / engine, 3)}


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
        for k in ("fairness_ttft_p50_ratio", "vllm_serve_ttft_p50_ratio_a_streams_2", "fairness_over_vllm_serve"):
            report[k] = fair[k]
    report["targets"] = {"auth_overhead_ms_p50_max": 1.0, "rate_limit_error_ratio_max": 0.1,
                         "fairness_ttft_p50_ratio_max": 1.2}
    met = {"auth_overhead": report["auth_overhead_ms_p50"] <= 1.0,
           "rate_limit": report["rate_limit_error_ratio"] <= 0.1}
    if "fairness_ttft_p50_ratio" in report:
        met["fairness"] = report["fairness_ttft_p50_ratio"] <= 1.2
    report["met"] = met
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("auth_overhead_ms_p50", "rate_limit_error_ratio", "fairness_ttft_p50_ratio",
            "vllm_serve_ttft_p50_ratio_a_streams_2", "fairness_over_vllm_serve", "met")
    print(json.dumps({k: report[k] for k in keys if k in report}))


if __name__ == "__main__":
    main()
