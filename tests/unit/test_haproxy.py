"""The HAProxy router, real haproxy on loopback, in front of small HTTP servers."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from modelops import get_settings
from tasks.traffic.haproxy import HAProxyRouter, render_config
from tasks.traffic.interface import ModelRoute, Server

pytestmark = pytest.mark.skipif(not HAProxyRouter().binary or not __import__("shutil").which("haproxy"),
                                reason="haproxy is not installed (make haproxy)")


def _backend(name: str, echo_path: bool = False):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(200, {"ready": True, **self._who()})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(200, self._who())

        def _who(self):
            return {"served_by": name, **({"path": self.path} if echo_path else {})}

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

    def raw(body: str) -> httpx.Response:
        return httpx.post(f"{get_settings().router_url}/embeddings", content=body, timeout=5,
                          headers={"content-type": "application/json"})

    # `model` is read as a JSON parser reads it: a number is no model id, a key twice is refused
    # (a parser keeps the last, the router would route by the other), an escaped key or value is
    # decoded, and one after a 300 KB field is found.
    for body, why in (('{"model": 5, "input": "x"}', "must be a string"), ('{"model": ["m"]}', "must be a string"),
                      ('{"model": "m", "input": "x", "model": "nope"}', "more than once")):
        refused = raw(body)
        assert refused.status_code == 400 and why in refused.json()["error"]["message"], (body, refused.text)
        assert refused.json()["error"]["param"] == "model"
    assert raw('{"mod\\u0065l": "\\u006d", "input": "x"}').json()["served_by"] == "v1"
    # A control character is in no model id (HAProxy compares C strings: "m\\u0000x" matched m).
    for escaped in ("m\\u0000", "m\\u0000junk", "m\\t"):
        unknown = raw('{"model": "%s", "input": "x"}' % escaped)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
    # Escapes decode as a JSON parser decodes them: the 404 names the model the instance would
    # have read; one with a control character is named as sent (no model id has one).
    for name, named in (("caf\u00e9", "caf\u00e9"), ("\u4e2d\u6587", "\u4e2d\u6587"), ("tab\ttab", "tab\\ttab")):
        message = raw(json.dumps({"model": name, "input": "x"})).json()["error"]["message"]
        assert message == f'model "{named}" is not served by this router', (name, message)
    assert raw(json.dumps({"input": "x" * 300_000, "model": "m"})).json()["served_by"] == "v1"
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



def test_a_config_written_but_never_reloaded_is_reloaded_by_the_next_apply(router, monkeypatch):
    """A control plane killed between writing the config and reloading (seen in CI: a worker
    killed mid-shift) left the file ahead of the running worker; the resumed run's weight change
    must reload, not ask the runtime API about a server the worker never loaded."""
    b1, b2 = _backend("v1"), _backend("v2")
    s1 = Server("m-1-1", f"127.0.0.1:{b1.server_port}", 100)
    router.apply([ModelRoute("m", {"1": (s1,)})])
    s2 = Server("m-2-1", f"127.0.0.1:{b2.server_port}", 0)

    def shift(weight: int) -> list[ModelRoute]:
        return [ModelRoute("m", {"1": (Server("m-1-1", s1.address, 100 - weight),),
                                 "2": (Server("m-2-1", s2.address, weight),)})]

    def killed(routes):
        raise KeyboardInterrupt("killed before the reload")

    with monkeypatch.context() as patch:
        patch.setattr(router, "_reload", killed)
        with pytest.raises(KeyboardInterrupt):
            router.apply(shift(10))
    assert "m-2-1" in router.cfg.read_text() and router.weights() == {("m", "m-1-1"): 100}

    # The resumed run, in a new process: the file's topology (a shift), version 2 at 20 %.
    fresh = HAProxyRouter(get_settings())
    fresh.apply(shift(20))
    assert fresh.weights() == {("m", "m-1-1"): 80, ("m", "m-2-1"): 20}
    assert _post("m", version="2").json()["served_by"] == "v2"
    b1.shutdown()
    b2.shutdown()

def _grpc_backend(name: str):
    """A KServe v2 gRPC server (tritonclient's service definition) whose ModelMetadata says which
    instance answered."""
    from concurrent import futures

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ModelMetadata(self, request, context):
            return service_pb2.ModelMetadataResponse(name=request.name, platform=name)

        def ModelStreamInfer(self, requests, context):  # a decoupled model: three responses per request
            for request in requests:
                for i in range(3):
                    yield service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(
                        model_name=request.model_name, id=f"{name}-{request.id}-{i}"))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_kserve_http_and_grpc_are_routed_weighted_and_pinned(router):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    ready, kserve = [_backend(f"ready-{v}") for v in "12"], [_backend(f"kserve-{v}", echo_path=True) for v in "12"]
    grpcs = [_grpc_backend(f"grpc-{v}") for v in "12"]

    def server(v: int, weight: int) -> Server:
        return Server(f"m-{v + 1}-1", f"127.0.0.1:{ready[v].server_port}", weight,
                      kserve_http=f"127.0.0.1:{kserve[v].server_port}", kserve_grpc=f"127.0.0.1:{grpcs[v][1]}")

    router.apply([ModelRoute("m", {"1": (server(0, 100),), "2": (server(1, 0),)})])
    base = get_settings().router_url.removesuffix("/v1")
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    r = httpx.post(f"{base}/v2/models/m/infer", json=body, timeout=5)
    assert r.json() == {"served_by": "kserve-1", "path": "/v2/models/m/infer"}
    assert r.headers["X-Model-Version"] == "1"  # Triton does not say which version answered; the router does
    assert httpx.get(f"{base}/v2/models/m/ready", timeout=5).json()["served_by"] == "kserve-1"  # GET passes too
    pinned = httpx.post(f"{base}/v2/models/m/infer", json=body, headers={"X-Model-Version": "2"}, timeout=5)
    assert pinned.json()["served_by"] == "kserve-2" and pinned.headers["X-Model-Version"] == "2"
    assert httpx.post(f"{base}/v1/embeddings", json={"model": "m", "input": "x"}, timeout=5).json()["served_by"] == \
        "ready-1"  # the OpenAI routes go to the frontend as before
    # KServe's HTTP generate routes go to the frontend too, which passes them to Triton with their key.
    for path in ("/v2/models/m/generate", "/v2/models/m/generate_stream"):
        r = httpx.post(f"{base}{path}", json={"text_input": "x"}, timeout=5)
        assert (r.json()["served_by"], r.headers["X-Model-Version"]) == ("ready-1", "1"), path
    pinned = httpx.post(f"{base}/v2/models/m/versions/2/generate", json={"text_input": "x"}, timeout=5)
    assert (pinned.json()["served_by"], pinned.headers["X-Model-Version"]) == ("ready-2", "2")
    unknown = httpx.post(f"{base}/v2/models/nope/infer", json=body, timeout=5)
    assert unknown.status_code == 404 and unknown.json() == {"error": 'model "nope" is not served by this router'}
    unpinned = httpx.get(f"{base}/v2/models/m/ready", headers={"X-Model-Version": "9"}, timeout=5)
    assert unpinned.status_code == 404 and unpinned.json() == {"error": 'version "9" of model "m" is not served by this router'}
    for path in ("/v2/health/ready", "/v2", "/v2/"):
        r = httpx.get(f"{base}{path}", timeout=5)
        assert r.status_code == 404 and "per model" in r.json()["error"], (path, r.text)
    # A model's statistics and trace settings are the operators', on the instance: never reached here.
    for method, path in (("GET", "/v2/models/m/stats"), ("GET", "/v2/models/m/versions/1/stats"),
                         ("POST", "/v2/models/m/trace/setting"), ("GET", "/v2/models/m/trace/setting"),
                         ("POST", "/v2/models/m/infer/extra")):
        r = httpx.request(method, f"{base}{path}", json={}, timeout=5)
        assert r.status_code == 404 and "this router serves the inference of a model" in r.json()["error"], (path, r.text)
    for path in ("/v2/models/m", "/v2/models/m/ready", "/v2/models/m/config", "/v2/models/m/versions/2/ready"):
        assert httpx.get(f"{base}{path}", timeout=5).status_code == 200, path  # metadata, readiness, config pass

    grpc_url = f"127.0.0.1:{get_settings().router_grpc_port}"
    client = grpcclient.InferenceServerClient(grpc_url)
    assert client.get_model_metadata("m", headers={"x-model-id": "m"}).platform == "grpc-1"
    assert client.get_model_metadata("m", headers={"x-model-id": "m", "x-model-version": "2"}).platform == "grpc-2"
    # A bidirectional stream (ModelStreamInfer, decoupled models) passes unbuffered: every response
    # of two requests on one open stream arrives before the client closes it.
    import queue

    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers={"x-model-id": "m"})
    for rid in ("a", "b"):
        client.async_stream_infer("m", [], request_id=rid)
        ids = [got.get(timeout=5) for _ in range(3)]
        assert [r.get_response().id for r, e in ids] == [f"grpc-1-{rid}-{i}" for i in range(3)], ids
    client.stop_stream()
    for headers, status in (({"x-model-id": "nope"}, "StatusCode.NOT_FOUND"), ({}, "StatusCode.INVALID_ARGUMENT"),
                            ({"x-model-id": "m", "x-model-version": "1,2"}, "StatusCode.INVALID_ARGUMENT")):
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("m", headers=headers)
        assert e.value.status() == status, e.value
    for admin in (lambda h: client.get_inference_statistics("m", headers=h), lambda h: client.get_trace_settings(
            "m", headers=h), lambda h: client.get_system_shared_memory_status(headers=h),
                  lambda h: client.unload_model("m", headers=h)):
        with pytest.raises(InferenceServerException) as e:
            admin({"x-model-id": "m"})
        assert e.value.status() == "StatusCode.UNIMPLEMENTED" and "this router serves ModelInfer" in str(e.value)

    # A weight shift moves KServe traffic with the OpenAI traffic, without a reload.
    pid = router.pid()
    router.apply([ModelRoute("m", {"1": (server(0, 0),), "2": (server(1, 100),)})])
    assert router.pid() == pid
    shifted = [httpx.post(f"{base}/v2/models/m/infer", json=body, timeout=5) for _ in range(4)]
    assert {(r.json()["served_by"], r.headers["X-Model-Version"]) for r in shifted} == {("kserve-2", "2")}
    assert {client.get_model_metadata("m", headers={"x-model-id": "m"}).platform for _ in range(4)} == {"grpc-2"}
    requests = router.server_requests("m")
    assert requests["m-1-1"] >= 3 and requests["m-2-1"] >= 10  # every protocol's calls are counted
    client.close()
    for b in ready + kserve:
        b.shutdown()
    for g, _ in grpcs:
        g.stop(0)


def test_a_kserve_version_path_pins_its_version_and_a_label_reaches_its_triton_version(router):
    """Each instance's Triton serves its own version folder (modelops.manifest.triton_version): a
    path naming a version goes to that version, a label's path to the folder it is served as."""
    ready = {v: _backend(f"ready-{v}", echo_path=True) for v in ("2", "2024-rc1")}
    kserve = {v: _backend(f"kserve-{v}", echo_path=True) for v in ("2", "2024-rc1")}
    router.apply([ModelRoute("m", {v: (Server(f"m-{v}-1", f"127.0.0.1:{ready[v].server_port}", 50,
                                              kserve_http=f"127.0.0.1:{kserve[v].server_port}"),)
                                   for v in ("2", "2024-rc1")})])
    base = get_settings().router_url.removesuffix("/v1")
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    for version, sent, reached in (("2", "/v2/models/m/versions/2/infer", "/v2/models/m/versions/2/infer"),
                                   ("2024-rc1", "/v2/models/m/versions/2024-rc1/infer", "/v2/models/m/versions/1/infer"),
                                   ("2024-rc1", "/v2/models/m/versions/2024-rc1", "/v2/models/m/versions/1")):
        for _ in range(4):  # every time, not by the weights' luck
            r = httpx.post(f"{base}{sent}", json=body, timeout=5)
            assert r.status_code == 200, r.text
            assert (r.json(), r.headers["X-Model-Version"]) == ({"served_by": f"kserve-{version}", "path": reached},
                                                                version)
    # The generate routes, at the frontend, are pinned and relabelled alike.
    for _ in range(4):
        r = httpx.post(f"{base}/v2/models/m/versions/2024-rc1/generate_stream", json={"text_input": "x"}, timeout=5)
        assert r.json() == {"served_by": "ready-2024-rc1", "path": "/v2/models/m/versions/1/generate_stream"}
    agree = httpx.post(f"{base}/v2/models/m/versions/2/infer", json=body, headers={"X-Model-Version": "2"}, timeout=5)
    assert agree.status_code == 200 and agree.json()["served_by"] == "kserve-2"
    clash = httpx.post(f"{base}/v2/models/m/versions/2/infer", json=body, headers={"X-Model-Version": "2024-rc1"},
                       timeout=5)
    assert clash.status_code == 400 and clash.json() == {
        "error": 'the path names version "2" and X-Model-Version names "2024-rc1"; name one version, or leave one out'}
    # One version or none: any of several values would match a pin (the first in the config won).
    for headers in ([("X-Model-Version", "2"), ("X-Model-Version", "2024-rc1")], [("X-Model-Version", "2, 2024-rc1")]):
        kserve_twice = httpx.post(f"{base}/v2/models/m/versions/2/infer", json=body, headers=headers, timeout=5)
        assert kserve_twice.status_code == 400 and "more than one version" in kserve_twice.json()["error"]
        openai_twice = httpx.post(f"{base}/v1/embeddings", json={"model": "m", "input": "x"}, headers=headers,
                                  timeout=5)
        assert openai_twice.status_code == 400 and openai_twice.json()["error"]["code"] == "invalid_header"
    unknown = httpx.post(f"{base}/v2/models/m/versions/9/infer", json=body, timeout=5)
    assert unknown.status_code == 404 and unknown.json() == {"error": 'version "9" of model "m" is not served by this router'}
    # Unversioned paths keep the weights and reach Triton as sent.
    seen = {httpx.post(f"{base}/v2/models/m/infer", json=body, timeout=5).json()["path"] for _ in range(4)}
    assert seen == {"/v2/models/m/infer"}
    for b in (*ready.values(), *kserve.values()):
        b.shutdown()


def test_a_keep_alive_connection_idle_across_a_reload_is_still_answered(router):
    """A client's idle keep-alive connection to the old worker is answered once more, then closed,
    instead of being closed under it by the reload: a request sent just as the old worker closed
    it failed with "Server disconnected" during a red-black rollout."""
    import socket

    b1, b2 = _backend("v1"), _backend("v2")
    s1 = Server("m-1-1", f"127.0.0.1:{b1.server_port}", 100)
    router.apply([ModelRoute("m", {"1": (s1,)})])
    body = b'{"model": "m", "input": "x"}'
    request = (b"POST /v1/embeddings HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def answer(conn: socket.socket) -> bytes:
        conn.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    with socket.create_connection(("127.0.0.1", get_settings().router_port), timeout=5) as conn:
        assert answer(conn).split(b" ")[1] == b"200"
        router.apply([ModelRoute("m", {"1": (s1,), "2": (Server("m-2-1", f"127.0.0.1:{b2.server_port}", 0),)})])
        time.sleep(0.5)  # the old worker has begun its soft stop
        again = answer(conn)
        assert again.split(b" ")[1:2] == [b"200"], again
        assert conn.recv(1) == b"", "the old worker closes the connection after that answer"
    b1.shutdown()
    b2.shutdown()
