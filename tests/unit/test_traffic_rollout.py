"""tasks/traffic/rollout.py: how many instances each side of a red-black step runs, and what a gate
does when clients sent the new version too little to judge (real HAProxy, stand-in instances)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tasks.traffic.interface import routes_from_registry
from tasks.traffic.rollout import instances_for
from tests.conftest import register_stand_in

pytestmark = pytest.mark.skipif(not __import__("shutil").which("haproxy"), reason="haproxy is not installed")


def test_instance_counts_follow_the_weights():
    assert [instances_for(w, 4) for w in (10, 25, 50, 100)] == [1, 1, 2, 4]
    assert [instances_for(100 - w, 4) for w in (10, 25, 50, 100)] == [4, 3, 2, 0]
    assert [instances_for(w, 1) for w in (0, 10, 100)] == [0, 1, 1]


# -- gates with too little client traffic (settings gate_require_requests, gate_no_traffic) ----------

class _Instance:
    """An instance stand-in of ``version``: answers every POST with ``status`` and its version
    (``X-Model-Version``, as the OpenAI frontend does) and counts it on ``/metrics`` as Triton does
    (``nv_inference_request_success`` / ``_failure``); ``/ready`` answers 200."""

    def __init__(self, version: str, status: int = 200) -> None:
        inst = self
        self.status, self.success, self.failure = status, 0, 0

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                body = (f"nv_inference_request_success{{model=\"m\"}} {inst.success}\n"
                        f"nv_inference_request_failure{{model=\"m\"}} {inst.failure}\n").encode()
                self._send(200, body)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ok = inst.status == 200
                inst.success, inst.failure = inst.success + ok, inst.failure + (not ok)
                self._send(inst.status, json.dumps({"object": "list", "data": []}).encode())

            def _send(self, code, data):
                self.send_response(code)
                self.send_header("X-Model-Version", version)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.handle_error = lambda *a: None  # the router's checks close connections early
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    @property
    def requests(self) -> int:
        return self.success + self.failure


@pytest.fixture
def rollout(home):
    """Version 1 of model m serving at 100 and version 2 provisioned at 0, each one stand-in
    instance behind a real HAProxy; ``rollout(new_status=200, **settings)`` red-blacks 1 → 2 in
    two steps and returns ``(report or the RolloutFailed, {version: instance}, registry)``."""
    from modelops import Registry, get_settings
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import commit_routes
    from tasks.traffic.rollout import RolloutFailed, red_black

    router = HAProxyRouter(get_settings())
    registry = Registry(get_settings().registry)

    def run(new_status: int = 200, traffic_after_s: float | None = None, scale=None, **overrides):
        instances = {"1": _Instance("1"), "2": _Instance("2", new_status)}
        for version, weight in (("1", 100), ("2", 0)):
            register_stand_in(registry, version, instances[version].url, weight)
        router.ensure_running(routes_from_registry(registry))
        commit_routes(registry, router)
        settings = get_settings().model_copy(update={"gate_window_s": 0.5, **overrides})
        if traffic_after_s is not None:  # a client's requests, unpinned, from then on
            def send():
                time.sleep(traffic_after_s)
                for _ in range(40):
                    try:
                        httpx.post(f"{settings.router_url}/embeddings", json={"model": "m", "input": "x"}, timeout=5)
                    except httpx.HTTPError:
                        return  # the test ended and its router stopped
                    time.sleep(0.05)
            threading.Thread(target=send, daemon=True).start()
        try:
            report = red_black("m", "2", registry, router, settings, drain_and_stop=lambda name: None,
                               is_alive=lambda inst: True, steps=[50, 100], scale=scale)
        except RolloutFailed as e:
            report = e
        return report, instances, registry

    yield run
    router.stop()


def test_a_gate_without_client_traffic_probes_the_new_version_through_the_router(rollout):
    report, instances, _ = rollout()
    assert report.outcome == "completed"
    judged = [s["gate"]["judged"] for s in report.steps]
    assert judged == ["probe: 5 requests of its own"] * 2
    assert [s["gate"]["requests_new"] for s in report.steps] == [5, 5]
    # pinned to the new version: the old one got none of them
    assert (instances["2"].requests, instances["1"].requests) == (10, 0)
    from tasks.observe import _gates_table

    assert "| 50 | pass (probe: 5 requests of its own) | 5 | 0 |" in _gates_table(report.as_dict())


def test_a_probe_the_new_version_fails_rolls_back(rollout):
    failed, instances, registry = rollout(new_status=500)
    assert failed.report.outcome == "rolled-back"
    assert "gate at 50%: error ratio 1.000 > 0.01 (5 of 5 requests failed)" in str(failed)
    assert [(v.version, v.state, v.weight) for v in registry.versions("m")] == [("1", "serving", 100),
                                                                                ("2", "failed", 0)]


def test_gate_no_traffic_fail_rolls_back(rollout):
    failed, instances, _ = rollout(gate_no_traffic="fail")
    assert "0 requests reached the new version in the window, fewer than gate_require_requests (1): nothing to " \
           "judge (gate_no_traffic=fail)" in str(failed)
    assert instances["2"].requests == 0


def test_gate_no_traffic_pass_is_a_blind_pass_the_report_names(rollout):
    report, instances, _ = rollout(gate_no_traffic="pass")
    assert report.outcome == "completed" and instances["2"].requests == 0
    assert [s["gate"]["judged"] for s in report.steps] == ["nothing to judge, gate_no_traffic=pass"] * 2


def test_gate_no_traffic_wait_judges_the_traffic_once_it_comes(rollout):
    report, instances, _ = rollout(gate_no_traffic="wait", traffic_after_s=1.0)
    assert report.outcome == "completed", report
    first = report.steps[0]["gate"]
    assert first["judged"].startswith("traffic after waiting ") and first["requests_new"] >= 1


def test_gate_no_traffic_wait_fails_at_the_rollouts_deadline(rollout):
    failed, _, _ = rollout(gate_no_traffic="wait", rollout_timeout_s=2.0, gate_require_requests=1000)
    assert "requests reached the new version, fewer than gate_require_requests (1000), within " \
           "rollout_timeout_s (gate_no_traffic=wait)" in str(failed)


def test_a_versioned_deployment_at_weight_0_is_no_part_of_a_red_black(rollout, home):
    from modelops import Registry, get_settings

    registry = Registry(get_settings().registry)
    pinned_only = _Instance("3")
    register_stand_in(registry, "3", pinned_only.url, 0)  # a versioned deployment: pinned requests only
    scaled = []
    report, instances, registry = rollout(traffic_after_s=0.1, scale=lambda v, n: scaled.append((v, n)))
    assert report.outcome == "completed" and report.old == ["1"]
    assert {v for v, _ in scaled} <= {"1", "2"}  # never scaled up, nor down
    v3 = registry.get_version("m", "3")
    assert (v3.state, v3.weight) == ("serving", 0) and pinned_only.requests == 0  # no unpinned request reached it
