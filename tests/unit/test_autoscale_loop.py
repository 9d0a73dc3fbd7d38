"""The autoscaler's loop (tasks/autoscale/loop.py) against a real registry and instances' /metrics
served over HTTP; the provider and the router are recorders (the integration test,
tests/integration/test_autoscale.py, runs the real ones)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from modelops.errors import ProvisionError
from modelops.manifest import parse_manifest
from modelops.registry import Registry
from modelops.settings import Settings
from tasks.autoscale.loop import Autoscaler

MODEL = "m"
POLICY = {"min": 1, "max": 3, "target": {"waiting": 2}, "scale_up_window_s": 10, "scale_down_window_s": 30}


def metrics_text(waiting: float | tuple[float, float, float]) -> str:
    """An instance's gauges; ``(waiting, running, finished)`` adds the requests running and the
    finished-requests counter."""
    waiting, running, finished = waiting if isinstance(waiting, tuple) else (waiting, 0, 0)
    return (f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} {waiting}\n'
            f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {running}\n'
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}} {finished}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25\n')


@pytest.fixture
def metrics():
    """``{instance name: waiting requests, or None for a /metrics that answers 503}`` served at
    ``http://127.0.0.1:<port>/<name>``."""
    served: dict[str, float | None] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            waiting = served.get(self.path.strip("/"))
            body = b"loading" if waiting is None else metrics_text(waiting).encode()
            self.send_response(503 if waiting is None else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    served["_base"] = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[assignment]
    yield served
    server.shutdown()


class Provider:
    """Records scale calls; adds or drains registry rows as the local provider would."""

    def __init__(self, registry: Registry, metrics: dict) -> None:
        self.registry, self.metrics, self.calls, self.fail = registry, metrics, [], 0

    def scale(self, model_id, version, count, package, image, unroute=None):
        self.calls.append((version, count, package is not None, unroute is not None))
        if self.fail:
            self.fail -= 1
            raise ProvisionError(f"instance {model_id}-{version}-x exited during startup (exit status 1)")
        live = [i for i in self.registry.instances(model_id, version) if i.state == "running"]
        for _ in range(len(live), count):  # named as the local provider names them: never reused
            n = len(self.registry.instances(model_id, version, live=False)) + 1
            add_instance(self.registry, self.metrics, f"{model_id}-{version}-{n}", 0)
        for inst in live[count:]:
            self.registry.update_instance(inst.name, state="draining")
            unroute()
            self.registry.update_instance(inst.name, state="stopped")


class Router:
    def __init__(self) -> None:
        self.applied = []

    def apply(self, routes):
        self.applied.append({s.name for r in routes for servers in r.versions.values() for s in servers})


def add_instance(registry: Registry, metrics: dict, name: str, waiting: float | None) -> None:
    registry.add_instance(MODEL, "1", name, "")
    registry.update_instance(name, state="running", pid=1, endpoints={
        "openai": f"{metrics['_base']}/v1", "metrics": f"{metrics['_base']}/{name}"})
    metrics[name] = waiting


@pytest.fixture
def policy():
    """The version's scaling policy (a test overrides it by parametrizing this fixture)."""
    return POLICY


@pytest.fixture
def scaler(tmp_path, metrics, monkeypatch, policy):
    import tasks.autoscale.loop as loop

    settings = Settings(home=tmp_path / "home", autoscale_backoff_s=30)
    registry = Registry(settings.registry)
    registry.record_announcement(parse_manifest({"model_id": MODEL, "version": "1", "source": "s3://b/m/",
                                                 "task": "generate", "scaling": policy}))
    registry.set_state(MODEL, "1", "serving")
    registry.set_weights(MODEL, {"1": 100})
    add_instance(registry, metrics, "m-1-1", 0)
    # The package and image of a scale-up: any object will do for the recorder.
    monkeypatch.setattr(loop, "sealed_package", lambda *a: object())
    monkeypatch.setattr("tasks.image.build_runtime_image", lambda *a: object())
    now = [0.0]
    a = Autoscaler(settings, clock=lambda: now[0], parts=(registry, Router(), Provider(registry, metrics)))
    yield a, now, metrics
    a.close()


def ticks(a: Autoscaler, now: list[float], until: float, step: float = 2.0) -> list:
    started = []
    while now[0] < until:
        started += a.tick()
        a.settle()
        now[0] += step
    return started


def test_load_above_target_scales_up_after_the_up_window_and_back_down_after_the_down_window(scaler):
    a, now, metrics = scaler
    metrics["m-1-1"] = 5  # 5 waiting against 2 per instance: ceil(1 × 5 / 2) = 3
    started = ticks(a, now, 12)
    assert started == [("m", "1", 1, 3)] and now[0] >= 10  # not before the up window was covered
    assert a.provider.calls == [("1", 3, True, True)]
    assert a.router.applied[-1] == {"m-1-1", "m-1-2", "m-1-3"}  # the new instances routed
    (decision,) = a.registry.scale_decisions(MODEL)
    assert (decision.before, decision.after, decision.value, decision.outcome) == (1, 3, 5.0, "done")
    for name in ("m-1-1", "m-1-2", "m-1-3"):
        metrics[name] = 0
    start = now[0]
    started = ticks(a, now, start + 40)
    assert started == [("m", "1", 3, 1)]
    assert a.provider.calls[-1] == ("1", 1, False, True)  # drained through unroute, no package needed
    assert a.router.applied[-2] == {"m-1-1"}  # the surplus left the router before it stopped
    assert a.registry.scale_decisions(MODEL)[0].outcome == "done"
    assert a.registry.try_lock_rollout(MODEL, "a rollout", 424242) == ""  # the autoscaler let go of the lock


def test_no_decision_while_an_instance_does_not_answer_and_the_windows_start_over(scaler):
    a, now, metrics = scaler
    add_instance(a.registry, metrics, "m-1-2", 9)
    metrics["m-1-1"] = None  # loading, or dead: 503
    assert ticks(a, now, 30) == []
    assert a.registry.scale_decisions(MODEL) == []
    metrics["m-1-1"] = 9
    now0 = now[0]
    started = ticks(a, now, now0 + 12)
    assert started == [("m", "1", 2, 3)]
    assert a.registry.scale_decisions(MODEL)[0].at is not None
    assert now[0] - now0 >= 10  # a whole up window after the data came back


def test_a_failed_scale_up_is_reported_and_backed_off(scaler):
    a, now, metrics = scaler
    metrics["m-1-1"] = 5
    a.provider.fail = 2
    started = ticks(a, now, 12)
    assert len(started) == 1
    (failed,) = a.registry.scale_decisions(MODEL)
    assert failed.outcome == "failed" and "exited during startup" in failed.detail and "next try in 30 s" in failed.detail
    t_failed = now[0]
    started = ticks(a, now, t_failed + 28)
    assert started == []  # within the 30 s back-off (and the up window covered again)
    started = ticks(a, now, t_failed + 34)
    assert len(started) == 1
    assert "next try in 60 s" in a.registry.scale_decisions(MODEL)[0].detail  # doubled
    assert [i.name for i in a.registry.instances(MODEL)] == ["m-1-1"]  # still serving on what it has


def test_a_model_whose_rollout_lock_is_held_is_left_alone(scaler):
    a, now, metrics = scaler
    metrics["m-1-1"] = 5
    assert a.registry.try_lock_rollout(MODEL, "flow run 1", 1, host="elsewhere") == ""  # a rollout in another pod
    assert ticks(a, now, 30) == []
    assert a.provider.calls == []
    a.registry.unlock_rollout(MODEL, "flow run 1", host="elsewhere", pid=1)
    assert ticks(a, now, 42) == [("m", "1", 1, 3)]  # it decides afresh once the rollout let go
    assert a.registry.scale_decisions(MODEL)[0].outcome == "done"


TO_ZERO = {"min": 0, "max": 1, "scale_down_window_s": 20}


@pytest.mark.parametrize("policy", [TO_ZERO, {**TO_ZERO, "max": 3, "target": {"waiting": 2}}])
def test_a_min_0_version_goes_to_zero_only_after_a_whole_window_without_a_request(scaler):
    a, now, metrics = scaler
    # A request finishing every 10 s keeps it: nothing waits or runs at the reads, but the counter moves.
    for finished in range(1, 5):
        metrics["m-1-1"] = (0, 0, finished)
        assert ticks(a, now, now[0] + 10) == []
    started = ticks(a, now, now[0] + 24)  # then nothing for the down window
    assert started == [("m", "1", 1, 0)]
    (decision,) = a.registry.scale_decisions(MODEL)
    assert (decision.signal, decision.outcome) == ("idle", "done") and "scale to zero" in decision.detail
    assert a.provider.calls[-1] == ("1", 0, False, True)  # drained through unroute
    assert a.router.applied[-1] == {"hold__m__1"}  # the router holds its requests now


@pytest.mark.parametrize("policy", [TO_ZERO])
def test_a_request_held_at_zero_starts_one_instance_at_once_and_nothing_without_one(scaler):
    a, now, metrics = scaler
    metrics["m-1-1"] = (0, 1, 0)  # a long request running: not idle
    assert ticks(a, now, 30) == []
    metrics["m-1-1"] = (0, 0, 1)
    ticks(a, now, 60)
    assert [i.name for i in a.registry.instances(MODEL) if i.state == "running"] == []
    assert ticks(a, now, 120) == []  # at zero with nothing held: it stays there (no data is no demand)
    with a.activator._lock:
        a.activator._held[(MODEL, "1")] += 1  # what a request held by the activator counts
    assert a.tick() == [("m", "1", 0, 1)]  # at once: no window while a client waits
    a.settle()
    decision = a.registry.scale_decisions(MODEL)[0]
    assert (decision.signal, decision.before, decision.after, decision.outcome) == ("held", 0, 1, "done")
    assert decision.detail == "scale from zero: 1 request(s) held by the router"
    assert a.router.applied[-1] == {"m-1-2"}
