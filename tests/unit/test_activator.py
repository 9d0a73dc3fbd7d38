"""The router's hold for a version at zero instances: real HAProxy in front of the real activator
(tasks/autoscale/activator.py) on its Unix socket, a real registry, and an instance stand-in
that says who answered (tests/unit/test_haproxy_routing.py's Backend)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelops import get_settings
from modelops.manifest import parse_manifest
from modelops.registry import Registry
from tasks.autoscale.activator import Activator
from tasks.traffic.haproxy import HAProxyRouter
from tasks.traffic.interface import commit_routes, routes_from_registry
from tests.unit.test_haproxy_routing import Backend

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed (make haproxy)")

MANIFEST = {"model_id": "m", "version": "1", "source": "s3://b/m/", "task": "generate",
            "scaling": {"min": 0, "max": 1}}


@pytest.fixture
def stack(home):
    """A serving version at zero instances behind HAProxy and an activator (hold 3 s)."""
    settings = get_settings()
    registry = Registry(settings.registry)
    registry.record_announcement(parse_manifest(MANIFEST))
    registry.set_state("m", "1", "serving")
    registry.set_weights("m", {"1": 100})
    woken: list[tuple[str, str]] = []
    failing: dict[tuple[str, str], tuple[float, str]] = {}
    activator = Activator(registry, settings.router_url.removesuffix("/v1"), settings.activator_socket, hold_s=3.0, wake=lambda m, v: woken.append((m, v)),
                          backoff=lambda m, v: failing.get((m, v)))
    activator.start()
    router = HAProxyRouter(settings)
    commit_routes(registry, router)
    backend = Backend("i0")
    yield registry, router, activator, woken, failing, backend
    backend.stop()
    router.stop()
    activator.stop()


def _start_instance(registry: Registry, backend: Backend, router: HAProxyRouter) -> None:
    """What the autoscaler's scale-up leaves in the registry and the router."""
    registry.add_instance("m", "1", "m-1-1", "")
    registry.update_instance("m-1-1", state="running", pid=1, endpoints={
        "openai": f"http://{backend.address}/v1", "kserve_http": f"http://{backend.address}", "kserve_grpc": "",
        "metrics": f"http://{backend.address}/metrics"})
    commit_routes(registry, router)


def test_a_version_at_zero_routes_to_one_hold_server_with_its_whole_weight(stack):
    registry = stack[0]
    (route,) = routes_from_registry(registry)
    ((server,),) = route.versions.values()
    assert (server.name, server.hold, server.weight) == ("hold__m__1", True, 100)
    assert "server hold__m__1 unix@" in stack[1].cfg.read_text()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v2/models/m/generate"])
def test_a_held_request_waits_for_the_instance_and_gets_its_answer_with_the_time_held(stack, path):
    registry, router, activator, woken, _, backend = stack
    url = f"http://127.0.0.1:{get_settings().router_port}{path}"
    out: dict = {}

    def ask():
        out["r"] = httpx.post(url, json={"model": "m", "messages": [], "text_input": "x"}, timeout=30)

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 5
    while activator.demand("m", "1") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert activator.demand("m", "1") == 1 and woken == [("m", "1")]  # the autoscaler was told at once
    time.sleep(1.0)
    _start_instance(registry, backend, router)
    t.join(timeout=20)
    r = out["r"]
    assert r.status_code == 200 and r.json() == {"served_by": "i0"}
    assert 1.0 <= float(r.headers["x-modelops-held-s"]) < 3.0
    assert activator.demand("m", "1") == 0
    # Once routed, requests go to the instance directly: no hold header.
    r = httpx.post(url, json={"model": "m", "messages": [], "text_input": "x"}, timeout=10)
    assert r.status_code == 200 and "x-modelops-held-s" not in r.headers


def test_a_stream_held_for_a_version_at_zero_comes_back_event_by_event(stack):
    registry, router, _, _, _, backend = stack
    settings = get_settings()
    threading.Timer(0.5, _start_instance, (registry, backend, router)).start()
    events = []
    with httpx.stream("POST", f"{settings.router_url}/stream", json={"model": "m"}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
    assert events == [f"data: {i}" for i in range(8)]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v2/models/m/generate"])
def test_past_the_hold_bound_the_client_gets_one_503_with_retry_after_in_its_protocols_shape(stack, path):
    settings = get_settings()
    t0 = time.monotonic()
    r = httpx.post(f"http://127.0.0.1:{settings.router_port}{path}", json={"model": "m", "text_input": "x"},
                   timeout=30)
    waited = time.monotonic() - t0
    assert r.status_code == 503 and r.headers["retry-after"] == "10"
    assert 3.0 <= waited < 6.0  # held once: no retry-on replay of the give-up
    message = r.json()["error"] if path.startswith("/v2/") else r.json()["error"]["message"]
    assert "has no instance up after 3 s (MODELOPS_ROUTER_HOLD_S)" in message
    if not path.startswith("/v2/"):
        assert r.json()["error"]["code"] == "no_instance_available"


def test_while_the_version_backs_off_a_failed_start_the_client_is_told_at_once(stack):
    failing = stack[4]
    failing[("m", "1")] = (42.4, "instance m-1-1 exited during startup (exit status 1)")
    t0 = time.monotonic()
    r = httpx.post(f"{get_settings().router_url}/chat/completions", json={"model": "m", "messages": []}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "43" and time.monotonic() - t0 < 2
    assert "its last start failed (instance m-1-1 exited during startup" in r.json()["error"]["message"]


def test_a_request_that_does_not_come_from_the_router_is_refused(stack):
    transport = httpx.HTTPTransport(uds=str(get_settings().activator_socket))
    with httpx.Client(transport=transport) as c:
        r = c.post("http://activator/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 400 and "x-modelops-server" in r.json()["error"]["message"]


def test_a_body_that_is_not_json_is_answered_at_once_and_starts_nothing(stack):
    activator, woken = stack[2], stack[3]
    r = httpx.post(f"{get_settings().router_url}/chat/completions", content=b'{"model": "m", "messages": [',
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body"
    assert "not valid JSON" in r.json()["error"]["message"] and "server" not in r.headers
    assert woken == [] and activator.demand("m", "1") == 0


def test_a_grpc_call_for_a_version_at_zero_is_told_why(stack):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{get_settings().router_grpc_port}")
    with pytest.raises(InferenceServerException) as e:
        client.is_model_ready("m", headers={"x-model-id": "m"})
    assert "is at zero instances (scaling.min 0) and gRPC calls are not held" in str(e.value)
    assert "UNAVAILABLE" in str(e.value)


def test_a_request_held_for_a_version_that_stops_being_served_goes_back_to_the_router(stack):
    registry, router, activator, _, _, backend = stack
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        f"{get_settings().router_url}/chat/completions", json={"model": "m", "messages": []}, timeout=30)))
    t.start()
    deadline = time.monotonic() + 5
    while activator.demand("m", "1") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    # What a red-black from version 1 at zero to version 2 leaves: 2 serving with an instance, 1 off.
    registry.record_announcement(parse_manifest({**MANIFEST, "version": "2"}))
    registry.add_instance("m", "2", "m-2-1", "")
    registry.update_instance("m-2-1", state="running", pid=1, endpoints={
        "openai": f"http://{backend.address}/v1", "kserve_http": "", "kserve_grpc": "", "metrics": ""})
    registry.set_state("m", "2", "serving")
    registry.set_state("m", "1", "draining")
    registry.set_weights("m", {"1": 0, "2": 100})
    commit_routes(registry, router)
    t.join(timeout=20)
    assert out["r"].status_code == 200 and out["r"].json() == {"served_by": "i0"}


def test_a_client_that_hangs_up_is_no_longer_held(stack):
    activator = stack[2]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{get_settings().router_url}/chat/completions", json={"model": "m", "messages": []}, timeout=1.0)
    deadline = time.monotonic() + 2
    while activator.demand("m", "1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert activator.demand("m", "1") == 0  # the router closed the held connection, the hold ended


def test_many_held_requests_share_one_registry_read_per_poll(stack, monkeypatch):
    registry, router, activator, _, _, backend = stack
    reads = []
    real = activator._running
    monkeypatch.setattr(activator, "_running", lambda m, v: reads.append(time.monotonic()) or real(m, v))
    with __import__("concurrent.futures").futures.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(httpx.post, f"{get_settings().router_url}/chat/completions",
                               json={"model": "m", "messages": []}, timeout=30) for _ in range(20)]
        time.sleep(1.5)
        _start_instance(registry, backend, router)
        answers = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in answers)
    held_s = max(float(r.headers["x-modelops-held-s"]) for r in answers)
    assert len(reads) <= held_s / 0.25 + 3, (len(reads), held_s)  # not 20 reads per poll


def test_weights_move_without_a_reload_while_a_version_is_at_zero(stack):
    registry, router, _, _, _, backend = stack
    registry.record_announcement(parse_manifest({**MANIFEST, "version": "2", "scaling": {"min": 1, "max": 1}}))
    registry.add_instance("m", "2", "m-2-1", "")
    registry.update_instance("m-2-1", state="running", pid=1, endpoints={
        "openai": f"http://{backend.address}/v1", "kserve_http": f"http://{backend.address}",
        "kserve_grpc": "127.0.0.1:1", "metrics": ""})
    registry.set_state("m", "2", "serving")
    registry.set_weights("m", {"1": 100, "2": 0})
    commit_routes(registry, router)  # a new server: a reload
    registry.set_weights("m", {"1": 70, "2": 30})
    commit_routes(registry, router)  # weights only: the runtime API, the hold server included
    assert router.weights() == {("m", "hold__m__1"): 70, ("m", "m-2-1"): 30}
    r = httpx.post(f"{get_settings().router_url}/chat/completions", json={"model": "m", "messages": []},
                   headers={"X-Model-Version": "2"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"served_by": "i0"}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(versions=st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 2), st.integers(0, 100)), min_size=1,
                         max_size=4))
def test_any_mix_of_versions_at_zero_and_with_instances_renders_a_valid_router(tmp_path_factory, versions):
    """Generated models: each version's ``(scaling.min, live instances, weight)``. Every serving
    min-0 version without an instance gets exactly one hold server with its whole share (gRPC
    none), every other routed version its instances, and HAProxy takes the config."""
    import subprocess

    from tasks.traffic.haproxy import render_config
    from tasks.traffic.weights import server_weights

    tmp = tmp_path_factory.mktemp("mix")
    registry = Registry(f"sqlite:///{tmp / 'r.db'}")
    for n, (low, count, weight) in enumerate(versions, start=1):
        registry.record_announcement(parse_manifest({**MANIFEST, "version": str(n),
                                                     "scaling": {"min": low, "max": max(1, low)}}))
        for i in range(count):
            registry.add_instance("m", str(n), f"m-{n}-{i}", "")
            registry.update_instance(f"m-{n}-{i}", state="running", pid=1, endpoints={
                "openai": f"http://127.0.0.1:{20000 + 10 * n + i}/v1", "kserve_http": f"http://127.0.0.1:{21000 + n}",
                "kserve_grpc": f"127.0.0.1:{22000 + n}", "metrics": ""})
        registry.set_state("m", str(n), "serving")
    registry.set_weights("m", {str(n): w for n, (_, _, w) in enumerate(versions, start=1)})
    routes = routes_from_registry(registry)
    routed = {str(n): (low, count, w) for n, (low, count, w) in enumerate(versions, start=1) if count or low == 0}
    if not routed:
        assert routes == []
        return
    (route,) = routes
    assert set(route.versions) == set(routed)
    for v, (low, count, _) in routed.items():
        names = [s.name for s in route.versions[v]]
        assert names == ([f"hold__m__{v}"] if count == 0 else [f"m-{v}-{i}" for i in range(count)])
    want = server_weights({v: (w, max(1, count)) for v, (_, count, w) in routed.items()})
    assert {v: [s.weight for s in ss] for v, ss in route.versions.items()} == want
    cfg = render_config(routes, port=1, stats_socket=tmp / "s.sock", grpc_port=2, hold_socket=tmp / "a.sock")
    grpc = cfg.split("backend g_m\n", 1)[1].split("\nbackend ", 1)[0]
    assert "hold__" not in grpc
    (tmp / "h.cfg").write_text(cfg)
    check = subprocess.run(["haproxy", "-c", "-f", str(tmp / "h.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
