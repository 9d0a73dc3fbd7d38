"""What an instance's engine holds, read from its merged /metrics, and clients that hang up.

Shared by the tests of abort on disconnect and request limits (test_runtime.py, test_e2e.py).
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager

import httpx
import numpy as np


def engine_load(base: str) -> dict[str, float]:
    """``running`` and ``waiting`` sequences (vLLM's gauges) and ``cancelled`` requests
    (``modelops_requests_cancelled_total``, both protocols) of the instance at ``base``."""
    out = {"running": 0.0, "waiting": 0.0, "cancelled": 0.0}
    names = {"vllm:num_requests_running{": "running", "vllm:num_requests_waiting{": "waiting",
             "modelops_requests_cancelled_total{": "cancelled"}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        for prefix, key in names.items():
            if line.startswith(prefix):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def wait_for(base: str, test, seconds: float) -> tuple[dict[str, float], float]:
    """Poll :func:`engine_load` every 50 ms until ``test(load)``; returns the load and the
    seconds it took. Raises AssertionError past ``seconds``."""
    t0 = time.monotonic()
    while True:
        load = engine_load(base)
        if test(load):
            return load, time.monotonic() - t0
        assert time.monotonic() - t0 < seconds, f"engine load still {load} after {seconds} s"
        time.sleep(0.05)


@contextmanager
def http_request(url: str, path: str, body: dict, headers: dict[str, str] | None = None):
    """Send one HTTP/1.1 POST and hold the connection without reading the answer; leaving the
    block closes the socket (the client hangs up)."""
    target = httpx.URL(url)
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection((target.host, target.port))
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {target.host}\r\nContent-Type: application/json\r\n{extra}"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        yield sock
    finally:
        sock.close()


@contextmanager
def grpc_stream(address: str, model: str, prompt: str, params: dict, headers: dict[str, str] | None = None):
    """A KServe ``ModelStreamInfer`` call of one generate request; leaving the block cancels
    the stream (tritonclient's ``stop_stream(cancel_requests=True)``)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    client.start_stream(callback=lambda result, error: None, headers=headers)
    inputs = []
    for name, value, dtype in (("text_input", prompt.encode(), "BYTES"),
                               ("sampling_parameters", json.dumps(params).encode(), "BYTES"), ("stream", True, "BOOL")):
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(np.asarray([value], dtype=np.object_ if dtype == "BYTES" else bool))
        inputs.append(tensor)
    client.async_stream_infer(model, inputs)
    try:
        yield client
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
