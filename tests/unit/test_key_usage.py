"""Usage per API key across instances and the tpm limit (tasks/autoscale/usage.py): a real
registry, instances' /metrics served over HTTP, and real HAProxy enforcing the throttle."""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from modelops import get_settings
from modelops.manifest import parse_manifest
from modelops.registry import Registry
from modelops.tenancy import key_hash, new_key
from tasks.autoscale.usage import UsageMeter, read_key_counters
from tasks.traffic.haproxy import HAProxyRouter
from tasks.traffic.interface import commit_routes

MODEL = "m"


def _counters(counts: dict[str, tuple[int, int, int]]) -> str:
    """An instance's ``/metrics`` with the per-key counters of runtime/frontend/usage.py."""
    from runtime.frontend.usage import KeyUsage

    usage = KeyUsage()
    for key, (requests, prompt, completion) in counts.items():
        for i in range(requests):  # the first request carries the tokens
            usage.record(key, prompt if i == 0 else 0, completion if i == 0 else 0)
    return 'vllm:num_requests_waiting{model_name="m"} 0\n' + usage.exposition(MODEL)


@pytest.fixture
def fleet(home):
    """A serving version with instances whose ``/metrics`` say ``served[name]`` (per-key counts);
    ``add(name)`` registers one. Each instance answers ``/ready`` and POSTs (200)."""
    served: dict[str, dict] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - http.server's name
            name = self.path.strip("/").removeprefix("metrics/")
            body = _counters(served[name]).encode() if name in served else b'{"ready": true}'
            self._send(body)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(json.dumps({"key": self.headers.get("x-modelops-key")}).encode())

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    registry = Registry(get_settings().registry)
    registry.record_announcement(parse_manifest({"model_id": MODEL, "version": "1", "source": "s3://b/m/",
                                                 "task": "generate"}))
    registry.set_state(MODEL, "1", "serving")
    registry.set_weights(MODEL, {"1": 100})

    def add(name: str, counts: dict) -> None:
        registry.add_instance(MODEL, "1", name, "")
        registry.update_instance(name, state="running", pid=1, endpoints={"openai": f"{base}/v1",
                                                                          "metrics": f"{base}/metrics/{name}"})
        served[name] = counts

    yield registry, served, add
    server.shutdown()


def _usage(registry: Registry) -> dict[str, tuple[int, int, int]]:
    return {r["key"]: (r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in registry.usage(0)}


def test_read_key_counters_reads_what_the_instance_counted_for_key_names_only():
    text = _counters({"team-a": (2, 30, 7), "b": (1, 1, 0), 'odd"key': (1, 1, 1), "": (1, 1, 1)})
    assert read_key_counters(text) == {("team-a", MODEL): (2, 30, 7), ("b", MODEL): (1, 1, 0)}


def test_usage_adds_what_each_instance_counted_since_the_last_read(fleet):
    registry, served, add = fleet
    registry.create_key("team-a", key_hash(new_key()), (MODEL,))
    add("m-1-1", {"team-a": (3, 100, 50)})  # before the meter: counted by an earlier one
    time.sleep(0.01)
    with httpx.Client() as client:
        meter = UsageMeter(registry, HAProxyRouter(get_settings()), client)
        meter.tick()
        assert _usage(registry) == {}  # its baseline
        served["m-1-1"] = {"team-a": (5, 160, 70), "team-b": (1, 9, 2)}
        add("m-1-2", {"team-a": (1, 10, 5)})  # started after the meter: everything is new
        meter.tick()
        assert _usage(registry) == {"team-a": (3, 70, 25), "team-b": (1, 9, 2)}
        meter.tick()  # nothing grew
        assert _usage(registry) == {"team-a": (3, 70, 25), "team-b": (1, 9, 2)}
        served["m-1-1"] = {"team-a": (1, 7, 3)}  # restarted under the same name: counts afresh
        registry.update_instance("m-1-2", state="stopped")
        meter.tick()
        assert _usage(registry) == {"team-a": (4, 77, 28), "team-b": (1, 9, 2)}
        assert set(meter._last) == {"m-1-1"}
    assert registry.usage(time.time() + 3600) == []  # nothing counted in the future


@pytest.mark.skipif(not shutil.which("haproxy"), reason="haproxy is not installed (make haproxy)")
def test_a_key_over_its_tpm_is_refused_with_retry_after_until_its_minute_passes(fleet):
    registry, served, add = fleet
    limited, free = new_key(), new_key()
    registry.create_key("team-a", key_hash(limited), (MODEL,), tpm=100)
    registry.create_key("team-b", key_hash(free), (MODEL,))
    router = HAProxyRouter(get_settings())
    now = [time.time()]
    add("m-1-1", {})
    try:
        commit_routes(registry, router)
        url = f"{get_settings().router_url}/completions"

        def call(key: str) -> httpx.Response:
            return httpx.post(url, json={"model": MODEL}, headers={"Authorization": f"Bearer {key}"}, timeout=5)

        with httpx.Client() as client:
            meter = UsageMeter(registry, router, client, clock=lambda: now[0])
            assert call(limited).json() == {"key": "team-a"}
            served["m-1-1"] = {"team-a": (1, 60, 30)}  # 90 tokens: under 100
            assert meter.tick() == {"team-a": 0.0}
            assert call(limited).status_code == 200
            served["m-1-1"] = {"team-a": (2, 90, 40), "team-b": (5, 900, 900)}  # 130: over
            until = meter.tick()["team-a"]
            refused = call(limited)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "token_limit_exceeded"
            assert 0 < int(refused.headers["Retry-After"]) <= until - time.time() + 1 <= 71
            assert call(free).status_code == 200  # team-b has no tpm
            now[0] += 75  # the minute that put it over has passed
            assert meter.tick() == {"team-a": 0.0}
            assert call(limited).status_code == 200
    finally:
        router.stop()
