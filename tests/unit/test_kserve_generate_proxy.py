"""KServe's HTTP generate routes at the frontend (runtime/frontend/kserve_generate.py): served by
uvicorn, passed to a stand-in for Triton's HTTP endpoint that records what reached it and
answers JSON, or server-sent events one at a time. (Against the real Triton and engine, with the
key counted: tests/integration/test_e2e.py.)"""

import json
import threading
import time
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from modelops.tenancy import INSTANCE_SECRET_HEADER, KEY_HEADER, KEY_MAC_HEADER
from tests.conftest import free_port

EVENT_GAP_S = 0.4


class _Triton:
    """Records (path, headers, body) of each request; ``/generate_stream`` answers three events
    EVENT_GAP_S apart, ``/generate`` the body it got, with status 400 when it has ``"refuse"``."""

    def __init__(self) -> None:
        seen = self.seen = []

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the answer ends when the connection closes: no length needed

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.path, dict(self.headers), body))
                if self.path.endswith("_stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for i in range(3):
                        self.wfile.write(f'data: {{"text_output": "{i}", "sent_at": {time.monotonic()}}}\n\n'.encode())
                        self.wfile.flush()
                        time.sleep(EVENT_GAP_S)
                    return
                status = 400 if b'"refuse"' in body else 200
                data = json.dumps({"error": "refused as asked"} if status == 400 else {"got": body.decode()}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def proxied():
    """(the frontend's base URL, the stand-in Triton)."""
    import uvicorn
    from fastapi import FastAPI

    from runtime.frontend.kserve_generate import kserve_generate_routes

    triton, clients = _Triton(), {}

    @asynccontextmanager
    async def lifespan(app):
        clients["http"] = httpx.AsyncClient()
        yield
        await clients["http"].aclose()

    app = FastAPI(lifespan=lifespan)
    app.include_router(kserve_generate_routes(clients, triton.url, instance_secret="s3cret"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", triton
    server.should_exit = True
    triton.server.shutdown()


SIGNED = {KEY_HEADER: "team-a", KEY_MAC_HEADER: "ab" * 32}


@pytest.mark.parametrize("body", [b'{"text_input": "Hi", "parameters": {"max_tokens": 4}}', b"{}", b' \n{ }',
                                  b'{"text_input": "\\u00e9t\xc3\xa9", "x": [1, {"y": null}]}'])
def test_the_routers_key_goes_into_the_body_as_its_first_fields_and_the_rest_as_sent(proxied, body):
    base, triton = proxied
    r = httpx.post(f"{base}/v2/models/m/generate", content=body, headers=SIGNED, timeout=10)
    assert r.status_code == 200, r.text
    path, headers, reached = triton.seen[-1]
    assert path == "/v2/models/m/generate" and headers[INSTANCE_SECRET_HEADER] == "s3cret"
    pairs = list(json.loads(reached).items())  # in the order sent
    assert pairs[:2] == [(KEY_HEADER, "team-a"), (KEY_MAC_HEADER, "ab" * 32)]
    assert dict(pairs[2:]) == json.loads(body)
    assert r.json() == {"got": reached.decode()}  # Triton's answer, as it sent it
    # Without the router's headers (no keys) the body reaches Triton byte for byte.
    httpx.post(f"{base}/v2/models/m/versions/2/generate", content=body, timeout=10)
    assert triton.seen[-1][0] == "/v2/models/m/versions/2/generate" and triton.seen[-1][2] == body


def test_a_streams_events_pass_one_by_one(proxied):
    base, _ = proxied
    with httpx.stream("POST", f"{base}/v2/models/m/generate_stream", json={"text_input": "Hi"}, headers=SIGNED,
                      timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append((json.loads(line[6:]), time.monotonic()))
    assert [e["text_output"] for e, _ in got] == ["0", "1", "2"]
    # Each arrived soon after Triton sent it, not at the end (time.monotonic is one clock in one process).
    assert all(at - e["sent_at"] < EVENT_GAP_S / 2 for e, at in got), [(at - e["sent_at"]) for e, at in got]


@pytest.mark.parametrize("body, says", [
    (b"not json", "the request body is not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
    (b'{"text_input": "x", "X-Modelops-Key": "team-b"}', "X-Modelops-Key: the router sets it"),
    (b'{"x-modelops-key-mac": "00"}', "x-modelops-key-mac: the router sets it"),
    ('{"text_input": "x"}'.encode("utf-16"), "must be UTF-8 JSON"),
    (b'\xef\xbb\xbf{"text_input": "x"}', "is not JSON"),  # a byte order mark
    (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nests JSON too deeply"),
])
def test_bad_bodies_are_kserve_400s_before_triton(proxied, body, says):
    base, triton = proxied
    r = httpx.post(f"{base}/v2/models/m/generate", content=body, headers=SIGNED, timeout=10)
    assert r.status_code == 400 and says in r.json()["error"], r.text
    assert triton.seen == []


def test_tritons_own_errors_pass_and_an_absent_triton_is_a_502(proxied):
    base, triton = proxied
    refused = httpx.post(f"{base}/v2/models/m/generate", json={"text_input": "refuse"}, timeout=10)
    assert (refused.status_code, refused.json()) == (400, {"error": "refused as asked"})
    triton.server.shutdown()
    triton.server.server_close()
    gone = httpx.post(f"{base}/v2/models/m/generate", json={"text_input": "x"}, timeout=10)
    assert gone.status_code == 502 and "the model server did not answer" in gone.json()["error"]
