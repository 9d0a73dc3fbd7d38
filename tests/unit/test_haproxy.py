"""The HAProxy router, real haproxy on loopback, in front of small HTTP servers."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from modelops import get_settings
from tasks.traffic.haproxy import HAProxyRouter, render_config
from tasks.traffic.interface import ModelRoute, Server

pytestmark = pytest.mark.skipif(not HAProxyRouter().binary or not __import__("shutil").which("haproxy"),
                                reason="haproxy is not installed (make haproxy)")


def _backend(name: str):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(200, {"ready": True})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(200, {"served_by": name})

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.handle_error = lambda *a: None  # health checks close connections early
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def router(home):
    r = HAProxyRouter(get_settings())
    yield r
    r.stop()


def _post(model, version=None):
    headers = {"X-Model-Version": version} if version else {}
    return httpx.post(f"{get_settings().router_url}/embeddings", json={"model": model, "input": "x"},
                      headers=headers, timeout=5)


def test_config_is_valid_for_haproxy(tmp_path):
    import subprocess

    cfg = render_config([ModelRoute("a", {"1": (Server("a-1-1", "127.0.0.1:1", 100),)})], port=1,
                        stats_socket=tmp_path / "s.sock")
    (tmp_path / "h.cfg").write_text(cfg)
    check = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_routing_pinning_weights_and_reload(router):
    b1, b2 = _backend("v1"), _backend("v2")
    s1 = Server("m-1-1", f"127.0.0.1:{b1.server_port}", 100)
    router.apply([ModelRoute("m", {"1": (s1,)})])
    pid = router.pid()
    assert {_post("m").json()["served_by"] for _ in range(5)} == {"v1"}

    unknown = _post("nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found" and '"nope"' in unknown.json()["error"]["message"]
    pinned = _post("m", version="7")
    assert pinned.status_code == 404 and pinned.json()["error"]["message"] == 'version "7" of model "m" is not served by this router'
    no_model = httpx.post(f"{get_settings().router_url}/embeddings", json={"input": "x"}, timeout=5)
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    wrong_method = httpx.get(f"{get_settings().router_url}/embeddings", timeout=5)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    models = httpx.get(f"{get_settings().router_url}/models", timeout=5).json()
    assert models["data"] == [{"id": "m", "object": "model", "owned_by": "modelops", "versions": ["1"]}]

    # A second version (new topology): reload, still the same master process.
    s2 = Server("m-2-1", f"127.0.0.1:{b2.server_port}", 0)
    router.apply([ModelRoute("m", {"1": (s1,), "2": (s2,)})])
    assert router.pid() == pid
    assert {_post("m").json()["served_by"] for _ in range(6)} == {"v1"}
    assert _post("m", version="2").json()["served_by"] == "v2"

    # Weight-only change: runtime API, no new config topology.
    router.apply([ModelRoute("m", {"1": (Server("m-1-1", s1.address, 0),), "2": (Server("m-2-1", s2.address, 100),)})])
    assert router.weights() == {("m", "m-1-1"): 0, ("m", "m-2-1"): 100}
    assert {_post("m").json()["served_by"] for _ in range(6)} == {"v2"}
    assert _post("m", version="1").json()["served_by"] == "v1"
    b1.shutdown()
    b2.shutdown()
