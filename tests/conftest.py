"""Shared fixtures: an isolated MODELOPS_HOME per test and one moto S3 server per session."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server over HTTP on a loopback port (one per session)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield {"port": port, "endpoint": f"http://127.0.0.1:{port}"}
    server.stop()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server) -> Path:
    """A fresh MODELOPS_HOME whose settings point at the session's S3 server."""
    h = tmp_path / "home"
    monkeypatch.setenv("MODELOPS_HOME", str(h))
    monkeypatch.setenv("MODELOPS_S3_PORT", str(s3_server["port"]))
    monkeypatch.setenv("MODELOPS_ROUTER_PORT", str(free_port()))
    monkeypatch.setenv("MODELOPS_ROUTER_GRPC_PORT", str(free_port()))
    return h


@pytest.fixture
def s3(s3_server):
    """A boto3 client with botocore's defaults: its uploads carry a CRC32 checksum (botocore
    ≥ 1.36 sends one unless told otherwise), as S3 stores a checksum with every new object."""
    return boto3.client("s3", endpoint_url=s3_server["endpoint"], aws_access_key_id="modelops",
                        aws_secret_access_key="modelops", region_name="us-east-1")


@pytest.fixture
def s3_no_checksum(s3_server):
    """A boto3 client whose uploads carry no checksum: objects verified by their ETag alone, as
    objects uploaded before S3 stored checksums (or through older SDKs) are."""
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=s3_server["endpoint"], aws_access_key_id="modelops",
                        aws_secret_access_key="modelops", region_name="us-east-1",
                        config=Config(request_checksum_calculation="when_required"))


# Engine args of the small models the integration tests roll out again and again (the tiny random
# Llama, MiniLM). enforce_eager: at every engine start vLLM's CPU warm-up traces the model for
# torch.compile, 6-8 s on an idle machine here and 10-30 s on the suite's busy cores; eager skips
# it and answers as fast on these models (measured idle: MiniLM 20 calls of 4 embeddings 0.22 s
# eager, 0.23 s compiled; tiny Llama 3 × 2 × 48 tokens 0.42 s, 0.37 s). Tests that compare with
# `vllm serve` or time the router keep vLLM's defaults.
SMALL_ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True}


def parsed_manifest(source: str = "s3://b/m/", version: str = "1", **fields):
    """A parsed Manifest of model ``m``, task ``embed`` unless ``fields`` say otherwise."""
    from modelops import parse_manifest

    return parse_manifest({"model_id": "m", "version": version, "source": source, "task": "embed", **fields})


def manifest_file(folder: Path, **fields) -> str:
    """Write ``fields`` as the manifest ``<model_id>-<version>.yaml`` in ``folder``; its path."""
    import yaml

    path = folder / f"{fields['model_id']}-{fields['version']}.yaml"
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def write_fake_model(root: Path) -> dict[str, bytes]:
    """A small model folder layout (config, weights, tokenizer) with distinct bytes per file."""
    files = {
        "config.json": b'{"architectures": ["BertModel"]}',
        "model.safetensors": os.urandom(300_000),
        "tokenizer.json": b'{"version": "1.0"}',
        "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


class PacedProxy:
    """A TCP proxy in front of a loopback endpoint (moto) that forwards each piece of an answer
    (at most 64 KiB) and then waits ``delay`` seconds: a slow but live endpoint, or, with a small
    delay, one a drill can kill mid-transfer on any machine. An upstream that is down closes the
    client's connection, as the endpoint itself would refuse it."""

    def __init__(self, upstream: int, delay: float) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port, self.upstream, self.delay = self.srv.getsockname()[1], upstream, delay
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pipe, args=(client, up, 0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, client, self.delay), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(64 * 1024):
                dst.sendall(data)
                time.sleep(delay)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass



class FlippingProxy(PacedProxy):
    """A proxy in front of moto that flips one bit of one answer, past its first 256 KiB (so in
    an object's body, never in its headers): a transfer corrupted in transit, which only the
    integrity check can catch."""

    def __init__(self, upstream: int) -> None:
        self.flipped = threading.Event()
        super().__init__(upstream, 0)

    def _pipe(self, src: socket.socket, dst: socket.socket, delay: float) -> None:  # noqa: ARG002
        answers = src.getpeername()[1] == self.upstream
        sent = 0
        try:
            while data := src.recv(64 * 1024):
                if answers and sent > 256 * 1024 and len(data) > 1000 and not self.flipped.is_set():
                    self.flipped.set()
                    data = data[:500] + bytes([data[500] ^ 1]) + data[501:]
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class StandInInstance:
    """A stand-in for a serving instance of model ``m`` behind the real router: embeddings are the
    input's length, chat answers echo the last message; it names its ``version``
    (``X-Model-Version``, as the OpenAI frontend does), records what it answered (by input) and
    reports ``waiting`` requests and those it serves plus ``live`` ones as vLLM's
    ``num_requests_waiting`` and ``num_requests_running`` on ``/metrics``."""

    def __init__(self, version: str = "1") -> None:
        inst = self
        self.version, self.waiting, self.answered, self.in_flight, self.most_in_flight = version, 0, [], 0, 0
        self.live = 0  # requests of others this engine reports running, besides those it serves
        self.chats = 0  # chat completions answered
        self.shadow_marks: list[str | None] = []  # each request's x-modelops-shadow header (the router's mark)
        self.keys: list[str | None] = []  # each request's x-modelops-key header (the key the router named)
        self.lock = threading.Lock()

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self._send(200, (f"vllm:num_requests_waiting{{model_name=\"m\"}} {inst.waiting}\n"
                                 f"vllm:num_requests_running{{model_name=\"m\"}} {inst.in_flight + inst.live}\n"
                                 "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n"
                                 # 3 prompt tokens per request answered, 5 generated per chat answer.
                                 f"vllm:prompt_tokens_total{{model_name=\"m\"}} {3 * len(inst.answered)}\n"
                                 f"vllm:generation_tokens_total{{model_name=\"m\"}} {5 * inst.chats}\n").encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with inst.lock:
                    inst.shadow_marks.append(self.headers.get("x-modelops-shadow"))
                    inst.keys.append(self.headers.get("x-modelops-key"))
                    inst.in_flight += 1
                    inst.most_in_flight = max(inst.most_in_flight, inst.in_flight)
                time.sleep(0.02)
                if self.path.endswith("/embeddings"):
                    text = body["input"]
                    answer = {"object": "list", "data": [{"object": "embedding", "index": 0,
                                                          "embedding": [float(len(text))]}], "model": body["model"]}
                else:
                    text = body["messages"][-1]["content"]
                    inst.chats += 1
                    answer = {"object": "chat.completion", "choices": [{"index": 0, "message": {
                        "role": "assistant", "content": f"echo {text} from {inst.version}"}}]}
                with inst.lock:
                    inst.answered.append(text)
                    inst.in_flight -= 1
                self._send(200, json.dumps(answer).encode())

            def _send(self, code, data):
                self.send_response(code)
                self.send_header("X-Model-Version", inst.version)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.handle_error = lambda *a: None  # the router's checks close connections early
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


def register_stand_in(registry, version: str, url: str, weight: int) -> None:
    """Record version ``version`` of model ``m`` as serving at ``weight`` on one running instance
    ``m-<version>-1`` at ``url`` (a stand-in's base URL: ``/v1`` and ``/metrics`` under it)."""
    registry.record_announcement(parsed_manifest(version=version))
    registry.add_instance("m", version, f"m-{version}-1", "")
    registry.update_instance(f"m-{version}-1", state="running", pid=os.getpid(),
                             endpoints={"openai": f"{url}/v1", "metrics": f"{url}/metrics"})
    registry.set_state("m", version, "serving")
    registry.set_weights("m", {version: weight})


@pytest.fixture
def two_versions(home):
    """Versions 1 (the default, weight 100) and 2 (weight 0) of model ``m``, one
    :class:`StandInInstance` each, behind the real HAProxy router: ``(registry, router,
    settings, {version: instance})``."""
    from modelops import Registry, get_settings
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import commit_routes, routes_from_registry

    settings = get_settings()
    registry, router = Registry(settings.registry), HAProxyRouter(settings)
    instances = {"1": StandInInstance("1"), "2": StandInInstance("2")}
    for version, weight in (("1", 100), ("2", 0)):
        register_stand_in(registry, version, instances[version].url, weight)
    router.ensure_running(routes_from_registry(registry))
    commit_routes(registry, router)
    yield registry, router, settings, instances
    router.stop()
