"""API keys at the router (modelops/tenancy.py, tasks/traffic/haproxy.py): real HAProxy on
loopback, the registry's keys, and small servers that echo what reached the instance."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelops import get_settings
from modelops.registry import Registry
from modelops.tenancy import key_hash, key_mac, new_key, stack_secret
from tasks.traffic.haproxy import HAProxyRouter
from tasks.traffic.interface import ModelRoute, Server
from tests.unit.test_haproxy import _grpc_backend

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"),
                                reason="haproxy is not installed (make haproxy)")


def _echo(name: str):
    """An instance stand-in: a POST answers the headers that reached it, after ``X-Sleep`` seconds."""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self._send({"ready": True})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(float(self.headers.get("X-Sleep") or 0))
            self._send({"served_by": name, "path": self.path, "key": self.headers.get("x-modelops-key"),
                        "secret": self.headers.get("x-modelops-instance-secret"),
                        "mac": self.headers.get("x-modelops-key-mac")})

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Model-Version", "1")  # as the OpenAI frontend names the version
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    srv.handle_error = lambda *a: None  # health checks close connections early
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def stack(home):
    """A router serving models ``a`` and ``b`` (OpenAI, KServe HTTP and gRPC), the registry, and
    ``make_key(name, models, **limits) -> key`` that creates a key and applies it."""
    router = HAProxyRouter(get_settings())
    registry = Registry(get_settings().registry)
    echo, grpc = _echo("a-1"), _grpc_backend("grpc-a")
    address = f"127.0.0.1:{echo.server_port}"
    routes = [ModelRoute(m, {"1": (Server(f"{m}-1-1", address, 100, kserve_http=address,
                                          kserve_grpc=f"127.0.0.1:{grpc[1]}"),)}) for m in ("a", "b")]

    def make_key(name: str, models: tuple[str, ...], **limits) -> str:
        key = new_key()
        registry.create_key(name, key_hash(key), models, **limits)
        router.apply(routes)
        return key

    router.apply(routes)
    yield router, registry, routes, make_key
    router.stop()
    echo.shutdown()
    grpc[0].stop(0)


def _chat(key: str | None, model: str = "a", **headers) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{get_settings().router_url}/chat/completions", json={"model": model, "messages": []},
                      headers={**auth, **headers}, timeout=10)


def test_without_keys_the_router_is_open_and_the_first_key_closes_it(stack):
    router, _, _, make_key = stack
    pid = router.pid()
    assert _chat(None).json()["served_by"] == "a-1"
    key = make_key("team-a", ("a",))
    assert router.pid() == pid  # a reload, the same master
    closed = _chat(None)
    assert closed.status_code == 401 and closed.json()["error"]["code"] == "invalid_api_key"
    assert closed.headers["WWW-Authenticate"] == "Bearer"
    secret = stack_secret(get_settings().instance_secret_file)
    # The stack's secret (instances take the router's requests only), and the key's name with its
    # HMAC under it, which the engine checks before it counts a KServe answer for the name.
    assert _chat(key).json() == {"served_by": "a-1", "path": "/v1/chat/completions", "key": "team-a",
                                 "secret": secret, "mac": key_mac(secret, "team-a")}
    # A client cannot say it is another tenant, nor bring a secret: the router's headers replace its own.
    forged = _chat(key, **{"x-modelops-key": "team-b", "x-modelops-instance-secret": "guess",
                           "x-modelops-key-mac": key_mac(secret, "team-b")}).json()
    assert (forged["key"], forged["secret"], forged["mac"]) == ("team-a", secret, key_mac(secret, "team-a"))
    assert secret not in router.cfg.read_text()  # HAProxy reads it from its environment


def test_every_protocol_answers_401_403_and_200_in_its_own_shape(stack):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    _, _, _, make_key = stack
    key = make_key("team-a", ("a",))
    base = get_settings().router_url.removesuffix("/v1")
    cases = {None: 401, "mo-not-a-key": 401, key: 200}
    for k, status in cases.items():
        assert _chat(k).status_code == status
        kserve = httpx.post(f"{base}/v2/models/a/infer", json={"inputs": []}, timeout=5,
                            headers={"Authorization": f"Bearer {k}"} if k else {})
        assert kserve.status_code == status, kserve.text
        if status == 401:
            assert "Authorization: Bearer" in kserve.json()["error"]  # KServe's {"error": "..."}
    signed = httpx.post(f"{base}/v2/models/a/infer", json={"inputs": []}, timeout=5,
                        headers={"Authorization": f"Bearer {key}", "x-modelops-key-mac": "forged"}).json()
    assert (signed["key"], signed["mac"]) == ("team-a", key_mac(stack_secret(get_settings().instance_secret_file),
                                                                "team-a"))
    outside = _chat(key, model="b")
    assert outside.status_code == 403 and outside.json()["error"]["code"] == "model_not_allowed"
    assert 'model "b"' in outside.json()["error"]["message"]
    kserve_outside = httpx.post(f"{base}/v2/models/b/infer", json={}, headers={"Authorization": f"Bearer {key}"},
                                timeout=5)
    assert kserve_outside.status_code == 403 and 'model "b"' in kserve_outside.json()["error"]
    # Another scheme is no key, whatever follows it; nor is a key with more after it.
    assert _chat(None, Authorization=f"Basic {key}").status_code == 401
    assert _chat(None, Authorization=f"Bearer {key} extra").status_code == 401
    assert _chat(None, Authorization=f"bearer  {key}").status_code == 200
    # Twice: a proxy reading the first and one reading the last would disagree.
    twice = httpx.post(f"{get_settings().router_url}/chat/completions", json={"model": "a"}, timeout=5,
                       headers=[("Authorization", "Bearer mo-x"), ("Authorization", f"Bearer {key}")])
    assert twice.status_code == 400 and twice.json()["error"]["code"] == "invalid_authorization"

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{get_settings().router_grpc_port}")
    assert client.get_model_metadata("a", headers={"x-model-id": "a", "authorization": f"Bearer {key}"}).platform == \
        "grpc-a"
    for headers, status in (({"x-model-id": "a"}, "StatusCode.UNAUTHENTICATED"),
                            ({"x-model-id": "a", "authorization": "Bearer mo-x"}, "StatusCode.UNAUTHENTICATED"),
                            ({"x-model-id": "b", "authorization": f"Bearer {key}"}, "StatusCode.PERMISSION_DENIED")):
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_metadata("a", headers=headers)
        assert refused.value.status() == status, (headers, refused.value)


def test_models_lists_the_keys_models_only(stack):
    _, _, _, make_key = stack
    only_a, every = make_key("team-a", ("a",)), make_key("ops", ("*",))
    gone = make_key("old", ("retired-model",))
    url = f"{get_settings().router_url}/models"

    def listed(key):
        return [m["id"] for m in httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=5).json()["data"]]

    assert listed(only_a) == ["a"] and listed(every) == ["a", "b"] and listed(gone) == []
    assert httpx.get(url, timeout=5).status_code == 401
    # A key whose model was retired: that model is not served (404), not a crash or a 403.
    assert _chat(gone, model="retired-model").status_code == 404


def test_rpm_admits_the_limit_per_minute_and_max_concurrency_the_requests_in_flight(stack):
    _, _, _, make_key = stack
    limited = make_key("team-a", ("a",), rpm=5)
    answers = [_chat(limited) for _ in range(8)]
    assert [r.status_code for r in answers] == [200] * 5 + [429] * 3
    assert answers[-1].json()["error"]["code"] == "rate_limit_exceeded"
    # Retry-After counts down to when the counter's minute has surely rolled over (60 s from the
    # first refusal): a client that waits that long is admitted.
    waits = [int(r.headers["Retry-After"]) for r in answers[5:]]
    assert 58 <= waits[0] <= 60 and waits == sorted(waits, reverse=True), waits
    # Another key has its own minute.
    assert _chat(make_key("team-b", ("a",))).status_code == 200

    narrow = make_key("team-c", ("a",), max_concurrency=2)
    with ThreadPoolExecutor(3) as pool:
        slow = [pool.submit(_chat, narrow, "a", **{"X-Sleep": "1.5"}) for _ in range(2)]
        time.sleep(0.5)
        third = _chat(narrow)
        assert third.status_code == 429 and third.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert third.headers["Retry-After"] == "1"
        assert [f.result().status_code for f in slow] == [200, 200]
    assert _chat(narrow).status_code == 200  # the two ended


def test_revoked_and_rotated_keys_are_refused_within_2_s_without_touching_requests_in_flight(stack):
    router, registry, routes, make_key = stack
    key, other = make_key("team-a", ("a",)), make_key("team-b", ("a",))
    pid = router.pid()
    stop, seen = threading.Event(), []

    def load():
        while not stop.is_set():
            seen.append((time.monotonic(), _chat(key).status_code))

    with ThreadPoolExecutor(4) as pool:
        in_flight = pool.submit(_chat, key, "a", **{"X-Sleep": "2"})
        loaders = [pool.submit(load) for _ in range(2)]
        time.sleep(0.5)
        registry.revoke_key("team-a")
        router.apply(routes)
        revoked_at = time.monotonic()
        time.sleep(2.5)
        stop.set()
        [f.result() for f in loaders]
        assert in_flight.result().status_code == 200  # sent before the revocation, answered after it
    assert {s for _, s in seen} <= {200, 401}, seen  # nothing else: no reset, no 5xx
    assert all(s == 401 for t, s in seen if t > revoked_at + 2), "a revoked key still passed after 2 s"
    assert any(s == 200 for t, s in seen if t < revoked_at)
    assert router.pid() == pid and _chat(other).status_code == 200

    new = new_key()
    registry.rotate_key("team-b", key_hash(new))
    router.apply(routes)
    assert _chat(other).status_code == 401 and _chat(new).status_code == 200


def _sendable(value: bytes) -> bool:  # what HTTP/1.1 lets a header value carry (h11 refuses the rest)
    return all(c >= 0x20 and c != 0x7F or c == 9 for c in value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.binary(max_size=300), st.text(max_size=40).map(lambda t: ("Bearer " + t).encode("utf-8")),
                       st.integers(1, 12_000).map(lambda n: b"Bearer " + b"k" * n)).filter(_sendable))
def test_any_authorization_value_that_is_not_a_key_is_a_401(stack, value):
    _, registry, _, make_key = stack
    if not registry.api_keys():
        make_key("team-a", ("a",))
    r = httpx.post(f"{get_settings().router_url}/chat/completions", content=b'{"model":"a"}',
                   headers=[(b"Authorization", value.strip(b" \t"))], timeout=5)
    assert r.status_code in (400, 401), (value[:80], r.status_code, r.text[:200])
    assert r.status_code == 401 or r.headers.get("content-type") != "application/json"


def test_the_route_check_passes_over_the_internal_socket_while_keys_are_on(stack):
    from tasks.health import verify_route

    router, _, _, make_key = stack
    make_key("team-a", ("b",))
    assert _chat(None).status_code == 401
    with httpx.Client(transport=router.platform_transport()) as platform:
        answer = platform.post(f"{get_settings().router_url}/chat/completions", json={"model": "a"}, timeout=5)
        assert answer.json()["key"] == "modelops"  # the reserved platform key: every model, no limit
        listed = platform.get(f"{get_settings().router_url}/models", timeout=5).json()["data"]
        assert [m["id"] for m in listed] == ["a", "b"]
    assert router.internal_socket.stat().st_mode & 0o777 == 0o600
    assert verify_route("a", "1", "generate", True, attempts=1) == \
        "unpinned request through the router answered by 1"


def test_over_the_internal_socket_a_request_made_for_a_key_has_its_scope_limits_and_name(stack):
    router, _, _, make_key = stack
    make_key("team-a", ("a",), rpm=2)
    secret = stack_secret(get_settings().instance_secret_file)
    with httpx.Client(transport=router.platform_transport(), base_url=get_settings().router_url,
                      headers=router.key_headers("team-a"), timeout=5) as platform:
        def chat(model="a", **headers):
            return platform.post("/chat/completions", json={"model": model}, headers=headers)

        made_for = chat().json()
        assert (made_for["key"], made_for["mac"]) == ("team-a", key_mac(secret, "team-a"))  # its usage
        assert chat("b").json()["error"]["code"] == "model_not_allowed"  # its scope
        # Limits applied where the request came in (a cache miss) count once: not against the rpm here.
        assert [chat(**{"x-modelops-key-checked": "1"}).status_code for _ in range(3)] == [200] * 3
        assert [chat().status_code for _ in range(2)] == [200, 429]  # its rpm: 2 with the first
        assert chat(**{"x-modelops-key": ""}).json()["key"] == "modelops"  # an empty name: the platform's own
