"""modelops.supervisor on real processes: a child that serves GET /ready on a loopback port and
exits with the status written to its "die" file, under `python -m modelops.supervisor`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from modelops import parse_manifest
from modelops.registry import Registry
from modelops.settings import get_settings
from modelops.supervisor import supervisor_command
from runtime.frontend.engine_watch import _children
from tests.conftest import free_port

CHILD = '''
import http.server, os, sys, threading, time
port, die = int(sys.argv[1]), sys.argv[2]

class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass

if os.environ.get("NEVER_READY") is None and not os.path.exists(die + ".noready"):
    server = http.server.HTTPServer(("127.0.0.1", port), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
print(f"child {os.getpid()} up", flush=True)
while not os.path.exists(die):
    time.sleep(0.05)
code = int(open(die).read())
print(f"engine died while serving: the engine process ended: exit code {code}; judged deterministic", flush=True)
sys.exit(70)
'''


@pytest.fixture
def instance(home, tmp_path):
    registry = Registry(get_settings().registry)
    registry.record_announcement(parse_manifest({"model_id": "m", "version": "1", "source": "s3://b/m/",
                                                 "task": "embed"}))
    registry.add_instance("m", "1", "m-1-1", str(tmp_path / "m-1-1.log"))
    port = free_port()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return {"registry": registry, "port": port, "die": tmp_path / "die", "log": tmp_path / "m-1-1.log",
            "command": [sys.executable, str(script), str(port), str(tmp_path / "die")]}


def _start(instance, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = supervisor_command("m-1-1", f"http://127.0.0.1:{instance['port']}/ready", instance["log"],
                             get_settings().registry, instance["command"])
    cmd[cmd.index("--"):cmd.index("--")] = list(extra)
    out = instance["log"].open("ab")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _until(predicate, seconds: float = 15.0):
    deadline = time.monotonic() + seconds
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _served(instance, times: int) -> bool:
    """The supervisor has seen the child ready ``times`` times (it logs each)."""
    return _until(lambda: instance["log"].read_text().count("supervisor: m-1-1 ready") >= times)


def _row(instance):
    (row,) = instance["registry"].instances("m", "1", live=False)
    return row


def test_a_death_after_serving_is_restarted_and_recorded_then_sigterm_stops_for_good(instance):
    sup = _start(instance, "--backoff", "1")
    try:
        assert _served(instance, 1)
        (first,) = _children(sup.pid)
        instance["die"].write_text("3")
        assert _until(lambda: _row(instance).state == "restarting")
        row = _row(instance)
        assert row.restarts == 1 and row.last_exit == ("exit status 70: engine died while serving: the engine "
                                                       "process ended: exit code 3; judged deterministic")
        instance["die"].unlink()
        assert _until(lambda: _row(instance).state == "running")  # ready again: recorded
        (second,) = _children(sup.pid)
        assert second != first and _ready(instance["port"])
        os.kill(sup.pid, signal.SIGTERM)  # what the provider's stop sends: passed on, nothing restarted
        assert sup.wait(timeout=10) == 0  # a stop, not a fault
        assert not _until(lambda: _ready(instance["port"]), 1.0)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    log = instance["log"].read_text()
    assert "exited (exit status 70: engine died while serving" in log and "restart 1 in 1.0 s" in log


def test_a_child_that_never_served_is_not_restarted(instance):
    instance["die"].write_text("3")
    sup = _start(instance, env={"NEVER_READY": "1"})
    assert sup.wait(timeout=15) == 70  # the child's status: provisioning decides
    assert _row(instance).restarts == 0 and "restart" not in instance["log"].read_text()


def test_a_crash_loop_gives_up_after_max_restarts(instance):
    sup = _start(instance, "--backoff", "0.5", "--max-restarts", "2")
    try:
        for n in (1, 2):
            assert _served(instance, n)
            instance["die"].write_text("3")
            assert _until(lambda: _row(instance).restarts == n)
            instance["die"].unlink()
        assert _served(instance, 3)
        instance["die"].write_text("3")
        assert sup.wait(timeout=15) == 70
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    row = _row(instance)
    assert (row.state, row.restarts) == ("failed", 2) and "giving up" in instance["log"].read_text()


def test_a_restarted_child_that_dies_before_it_is_ready_again_counts_as_a_death(instance):
    sup = _start(instance, "--backoff", "0.3", "--max-restarts", "1")
    try:
        assert _served(instance, 1)
        Path(str(instance["die"]) + ".noready").touch()  # the restarted child will never be ready
        instance["die"].write_text("3")
        assert sup.wait(timeout=20) == 70  # restarted once, died again before ready: bound reached
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    row = _row(instance)
    assert (row.state, row.restarts) == ("failed", 1) and row.last_exit.startswith("before it was ready again: ")


def test_bad_arguments_are_one_clear_line(instance):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "modelops.supervisor", *args], capture_output=True, text=True,
                              timeout=30)

    bad_url = run("--instance", "m-1-1", "--ready-url", "localhost:1/ready", "--registry", "sqlite://", "--", "true")
    assert bad_url.returncode == 2 and "--ready-url 'localhost:1/ready': must be an http(s) URL" in bad_url.stderr
    no_cmd = run("--instance", "m-1-1", "--ready-url", "http://127.0.0.1:1/ready", "--registry", "sqlite://", "--")
    assert no_cmd.returncode == 2 and "give the instance's command after --" in no_cmd.stderr
    missing = run("--instance", "m-1-1", "--ready-url", "http://127.0.0.1:1/ready", "--registry", "sqlite://", "--",
                  "/no/such/runtime")
    assert missing.returncode == 127 and "cannot start /no/such/runtime" in missing.stderr


def test_cpus_puts_the_instance_on_those_cores(instance):
    core = max(os.sched_getaffinity(0))
    sup = _start(instance, "--cpus", str(core))
    try:
        log = instance["log"]
        up = _until(lambda: re.search(r"child (\d+) up", log.read_text()) if log.exists() else None)
        assert up, instance["log"].read_text()
        assert os.sched_getaffinity(sup.pid) == {core} and os.sched_getaffinity(int(up.group(1))) == {core}
        assert f"instance m-1-1 runs on cores {core}" in instance["log"].read_text()
    finally:
        sup.terminate()
        sup.wait(timeout=30)


def test_bad_cpus_are_one_clear_line(instance):
    def run(cpus: str):
        return subprocess.run([sys.executable, "-m", "modelops.supervisor", "--instance", "m-1-1", "--ready-url",
                               "http://127.0.0.1:1/ready", "--registry", "sqlite://", "--cpus", cpus, "--", "true"],
                              capture_output=True, text=True, timeout=30)

    for cpus in ("x", "-1", "0,,1", "", "+0", "1_0", " 1", "99999999999999999999"):
        bad = run(cpus)
        assert bad.returncode == 2, (cpus, bad.stderr)
        assert "give core numbers separated by commas, e.g. 0,1" in bad.stderr, (cpus, bad.stderr)
    allowed = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    for cpus, missing in (("4096", "4096"), ("0,4096", "4096")):  # Linux would keep core 0 and drop 4096 silently
        absent = run(cpus)
        assert absent.returncode == 2, absent.stderr
        assert f"--cpus {cpus}: no core {missing} here; this process may use cores {allowed}" in absent.stderr
