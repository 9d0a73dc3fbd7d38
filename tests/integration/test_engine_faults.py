"""Engine faults on the real runtime (Triton + the vllm backend + the OpenAI frontend).

A plugin wheel (built here, installed from the package like any model's plugin) ends the
engine's process, Triton's Python backend stub, with the exit code written to
$MODELOPS_TEST_CRASH_FILE once that file exists: while the instance serves, or before it
warmed up. SIGSTOP/SIGCONT of the stub is a wedged engine that recovers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from modelops.io_contract import ENGINE_DIED_EXIT
from tasks.health import instance_headers
from tests.conftest import SMALL_ENGINE_ARGS, free_port, manifest_file
from tests.integration.conftest import MODELOPS, REPO, build_wheel, isolated_env, stub_pid

pytestmark = pytest.mark.e2e

MODEL = "tiny-faults"
CRASH_PLUGIN = (b"import os, threading, time\n\n_started = False\n\n\n"
                b"def register():\n"
                b"    global _started\n"
                b"    with open('/proc/self/comm') as f:\n"
                b"        if _started or not f.read().startswith('triton_python_b'):\n"
                b"            return  # the engine's process only, not vLLM's helper subprocesses\n"
                b"    _started = True\n"
                b"    path = os.environ['MODELOPS_TEST_CRASH_FILE']\n\n"
                b"    def watch():\n"
                b"        while not os.path.exists(path):\n"
                b"            time.sleep(0.05)\n"
                b"        os._exit(int(open(path).read() or 3))\n\n"
                b"    threading.Thread(target=watch, daemon=True).start()\n")


def _manifest(work: Path, version: str, weights: Path) -> Path:
    wheel = build_wheel(work, "modelops-test-crash", CRASH_PLUGIN)
    return Path(manifest_file(work, model_id=MODEL, version=version, source=str(weights), task="generate",
                              engine_args={**SMALL_ENGINE_ARGS, "max_model_len": 512},
                              plugins=[{"name": "modelops-test-crash", "wheel": wheel.name}]))


def _first_503(base: str, seconds: float) -> float | None:
    """Seconds until GET /ready answers 503 (or the instance is gone: connection refused),
    polled every 50 ms (None: not within ``seconds``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 503:
                return time.monotonic() - t0
        except httpx.ConnectError:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _request(base: str, **fields) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=60, headers=instance_headers(),
                      json={"model": MODEL, "prompt": "The engine", "max_tokens": 4, "temperature": 0, **fields})


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    from tests.models.make_tiny_llama import make

    return make(tmp_path_factory.mktemp("faults-model") / "model")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, weights):
    """One instance of the crash-plugin model started by the local provider (under its
    supervisor), in a home of its own: ``base`` (OpenAI base URL without /v1), ``pid`` (the
    supervisor, leader of the instance's process group), ``crash`` (the plugin's trigger file)."""
    from modelops.manifest import load_manifest
    from modelops.settings import Settings
    from tasks.image import build_runtime_image
    from modelops.artifacts import Package
    from tasks.provision.local import LocalProvider

    work = tmp_path_factory.mktemp("faults")
    home, crash = work / "home", work / "crash"
    manifest = _manifest(work, "1", weights)
    built = subprocess.run([MODELOPS, "package", str(manifest), "--json"], env=isolated_env(home), cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    meta = json.loads(built.stdout)
    with pytest.MonkeyPatch.context() as mp:  # what the provider's instances inherit
        for key in [k for k in os.environ if k.startswith(("MODELOPS_", "PREFECT_"))]:
            mp.delenv(key)
        mp.setenv("MODELOPS_HOME", str(home))
        mp.setenv("MODELOPS_TEST_CRASH_FILE", str(crash))
        mp.setenv("MODELOPS_ROUTER_PORT", str(free_port()))  # restore_stopped starts this home's HAProxy
        mp.setenv("MODELOPS_ROUTER_GRPC_PORT", str(free_port()))
        settings = Settings(home=home)
        provider = LocalProvider(settings)
        provider.registry.record_announcement(load_manifest(manifest))  # what the lifecycle flow does first
        package = Package(Path(meta["path"]), meta["triton_model"], meta["model_id"], meta["version"], meta["task"])
        image = build_runtime_image(settings)
        name, endpoints = provider.ensure_instance(package, image)
        (inst,) = provider.registry.instances(MODEL, "1")
        try:
            yield {"base": endpoints.openai.removesuffix("/v1"), "pid": inst.pid, "name": name, "crash": crash,
                   "log": Path(inst.log_path), "provider": provider, "package": package, "image": image,
                   "home": home, "settings": settings, "manifest": manifest}
        finally:
            from tasks.traffic.haproxy import HAProxyRouter

            for i in provider.registry.instances(MODEL):
                provider.stop(i.name)
            HAProxyRouter(settings).stop()


def test_a_stopped_engine_is_not_ready_refuses_fast_and_recovers(faulty):
    base, stub = faulty["base"], stub_pid(faulty["pid"])
    assert _request(base).status_code == 200
    in_flight: dict = {}

    def stream():
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120, headers=instance_headers(), json={
                "model": MODEL, "prompt": "The engine", "max_tokens": 480, "temperature": 0, "stream": True}) as r:
            in_flight["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    streaming = threading.Thread(target=stream)
    streaming.start()
    time.sleep(0.5)
    os.kill(stub, signal.SIGSTOP)
    stopped_mid_stream = streaming.is_alive()
    try:
        not_ready = _first_503(base, 10)
        refusals = []
        t_stop = time.monotonic()
        while time.monotonic() - t_stop < 30:  # stopped for 30 s: every check and request answered at once
            t0 = time.monotonic()
            r = _request(base)
            ready = httpx.get(f"{base}/ready", timeout=2)
            refusals.append((r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"],
                             ready.status_code, round(time.monotonic() - t0, 2)))
            time.sleep(1)
        ready_body = httpx.get(f"{base}/ready", timeout=2).json()
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    finally:
        os.kill(stub, signal.SIGCONT)
    t0 = time.monotonic()
    while httpx.get(f"{base}/ready", timeout=2).status_code != 200 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    recovered = time.monotonic() - t0
    streaming.join(timeout=120)
    assert not_ready is not None and not_ready <= 5, not_ready
    assert len(refusals) >= 20 and all(r[:4] == (503, "1", "engine_unavailable", 503) for r in refusals), refusals
    assert max(r[4] for r in refusals) < 2.0, refusals
    assert "is stopped" in ready_body["engine"] and ready_body["ready"] is False
    # What the gates read: the engine is down and the refusals are counted (Triton never saw them).
    assert "\nmodelops_engine_up 0\n" in metrics
    refused = re.search(r'modelops_requests_refused_total\{code="engine_unavailable"\} (\d+)', metrics)
    assert refused and int(refused.group(1)) >= len(refusals), metrics[-800:]
    assert recovered < 5, recovered
    assert _request(base).status_code == 200
    # The stream that was in the engine when it stopped resumed and ran to its end.
    assert stopped_mid_stream and in_flight["events"][-1] == "data: [DONE]" and \
        json.loads(in_flight["events"][-2][6:])["choices"][0]["finish_reason"] == "length"
    log = faulty["log"].read_text()
    assert "engine stalled: the engine process" in log and "engine serves again; readiness restored" in log
    print(f"SIGSTOP: /ready 503 after {not_ready:.2f} s; {len(refusals)} requests refused in at most "
          f"{max(r[4] for r in refusals):.2f} s; ready {recovered:.2f} s after SIGCONT")


def _runtime_pid(supervisor: int) -> int | None:
    from runtime.frontend.engine_watch import _children

    kids = _children(supervisor)
    return kids[0] if kids else None


def test_an_engine_that_dies_while_serving_fails_fast_and_the_instance_is_restarted(faulty):
    base, provider = faulty["base"], faulty["provider"]
    runtime = _runtime_pid(faulty["pid"])
    results: list = []

    def unary():
        r = _request(base, max_tokens=480)
        results.append(("unary", r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))

    def stream():
        with httpx.stream("POST", f"{base}/v1/completions", timeout=120, headers=instance_headers(), json={
                "model": MODEL, "prompt": "The engine", "max_tokens": 480, "temperature": 0, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        results.append(("stream", r.status_code, events[-2:]))

    threads = [threading.Thread(target=f) for f in (unary, unary, stream, stream)]
    for t in threads:
        t.start()
    time.sleep(0.7)  # all four in the engine
    assert all(t.is_alive() for t in threads), results
    t0 = time.monotonic()
    faulty["crash"].write_text("3")
    not_ready = _first_503(base, 10)
    for t in threads:
        t.join(timeout=30)
    answered = time.monotonic() - t0
    while _runtime_pid(faulty["pid"]) == runtime and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    exited = time.monotonic() - t0
    faulty["crash"].unlink()  # the restarted engine must live (the supervisor waits 1 s first)
    while not _ready(base):
        assert time.monotonic() - t0 < 180, "the instance did not come back"
        time.sleep(0.5)
    back = time.monotonic() - t0
    assert not_ready is not None and not_ready <= 5, not_ready
    assert len(results) == 4 and answered < 10, (results, answered)  # nothing hangs on the dead engine
    for kind, status, detail in results:
        if kind == "unary":  # no byte was sent: a 503 the router retries elsewhere
            assert (status, detail) == (503, "engine_unavailable")
        else:  # the stream had begun: it ends with an error event
            assert status == 200 and detail[-1] == "data: [DONE]" and \
                json.loads(detail[0][6:])["error"]["code"] == "engine_unavailable", detail
    assert exited <= 10, exited
    log = faulty["log"].read_text()
    assert ("engine died while serving: the engine process (Triton's Python backend stub, pid "
            in log and "ended: exit code 3; judged deterministic" in log), log[-3000:]
    assert "instance stopped" in log and f"exit status {ENGINE_DIED_EXIT}" in log
    (inst,) = provider.registry.instances(MODEL, "1")
    while inst.state == "restarting" and time.monotonic() - t0 < back + 10:  # the supervisor polls /ready too
        time.sleep(0.1)
        (inst,) = provider.registry.instances(MODEL, "1")
    assert (inst.state, inst.restarts, inst.pid) == ("running", 1, faulty["pid"])
    assert inst.last_exit.startswith(f"exit status {ENGINE_DIED_EXIT}: engine died while serving: the engine process")
    assert _request(base).status_code == 200
    status = subprocess.run([MODELOPS, "status"], env=isolated_env(faulty["home"]), cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert "restarted 1x, last: exit status 70: engine died while serving" in " ".join(status.stdout.split()), \
        status.stdout
    print(f"engine death: /ready 503 after {not_ready:.2f} s, requests answered within {answered:.2f} s, runtime "
          f"exited after {exited:.2f} s, serving again after {back:.1f} s (restarted by its supervisor)")


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:  # the runtime is between its death and its restart
        return False


def test_down_then_up_serves_the_same_versions_with_their_weights_and_reports_what_is_gone(faulty):
    from modelops.manifest import load_manifest
    from tasks.restore import restore_stopped, stop_serving_instances

    settings, registry = faulty["settings"], faulty["provider"].registry
    registry.set_state(MODEL, "1", "serving")  # what a red-black at 70/30 recorded
    gone = load_manifest(faulty["manifest"]).model_copy(update={"version": "3"})
    registry.record_announcement(gone)  # the other side of the split, whose package is gone by the restart
    registry.set_state(MODEL, "3", "serving")
    registry.set_weights(MODEL, {"1": 70, "3": 30})
    t0 = time.monotonic()
    stop_serving_instances(settings)  # modelops down's instance part; the instance is idle
    idle_stop = time.monotonic() - t0
    before = {v.version: (v.state, v.weight) for v in registry.versions(MODEL)}
    assert before == {"1": ("stopped", 70), "3": ("stopped", 30)} and not registry.instances(MODEL)
    t0 = time.monotonic()
    restored = restore_stopped(settings)  # modelops up's last step
    took = time.monotonic() - t0
    assert [(r.version, r.ok, r.weight) for r in restored] == [("1", True, 70), ("3", False, 30)]
    after = {v.version: (v.state, v.weight, v.reason) for v in registry.versions(MODEL)}
    assert after["1"] == ("serving", 70, "served again after the restart (weight 70)")
    # Reported, not dropped silently; and no weight claims it is routed.
    assert after["3"][:2] == ("failed", 0) and "its sealed package" in after["3"][2] and "is gone" in after["3"][2]
    (inst,) = registry.instances(MODEL, "1")
    assert inst.state == "running"
    r = httpx.post(f"{settings.router_url}/completions", timeout=60,
                   json={"model": MODEL, "prompt": "The engine", "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-model-version"] == "1", r.text
    assert idle_stop < 10, idle_stop  # SIGTERM of an idle instance: drain, Triton's unload, exit
    print(f"down: idle instance stopped in {idle_stop:.1f} s; up: version 1 serving again at weight 70 in "
          f"{took:.1f} s, version 3 reported: {after['3'][2]}")


def test_an_engine_that_dies_during_warm_up_fails_provisioning_fast_with_the_cause(faulty):
    from modelops.errors import ModelLoadError

    provider = faulty["provider"]
    for inst in provider.registry.instances(MODEL):
        provider.stop(inst.name)
    faulty["crash"].write_text("3")  # the engine exits as soon as the plugin loads, long before it is ready
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELOPS_HOME", str(faulty["home"]))
        mp.setenv("MODELOPS_TEST_CRASH_FILE", str(faulty["crash"]))
        t0 = time.monotonic()
        with pytest.raises(ModelLoadError) as failed:
            provider.ensure_instance(faulty["package"], faulty["image"])
        took = time.monotonic() - t0
    message = str(failed.value)
    assert took < 60, took
    assert f"exit status {ENGINE_DIED_EXIT}" in message and "engine died during warm-up: the engine process" in message
    assert "ended: exit code 3; judged deterministic" in message, message
    assert {i.state for i in provider.registry.instances(MODEL, "1", live=False)} == {"stopped"}
    print(f"provisioning failed after {took:.1f} s: {message.splitlines()[0]}")
