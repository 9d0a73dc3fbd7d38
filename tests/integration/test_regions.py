"""A global rollout over two local regions on the session stack: real routers, real engines.

Region 1 is the session stack itself; region 2 gets its own work pool and worker, HAProxy
router, home, FSx root and instances (``modelops up`` with a regions file). The tiny Llama
(``file://`` weights) keeps each regional rollout short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import SMALL_ENGINE_ARGS, free_port, manifest_file
from tests.integration.conftest import (MODELOPS, REPO, TINY_CHAT_TEMPLATE, RouterLoad, Stack, build_wheel,
                                       engine_crash_plugin, seeded_chat)

pytestmark = pytest.mark.e2e

MODEL = "tiny-global"
SEED = 39039  # the crashing version's plugin ends its engine on a request with this seed
_chat = seeded_chat(MODEL, SEED)
@pytest.fixture(scope="module")
def regions(stack: Stack, tmp_path_factory):
    """Two regions on the session stack for this module: ``{"home2", "router2" (OpenAI base URL),
    "env2" (region 2's environment), "weights"}``; region 2 stopped and the regions file removed
    after."""
    from tests.models.make_tiny_llama import make

    work = tmp_path_factory.mktemp("regions")
    home2 = work / "region-2"
    port, grpc = free_port(), free_port()
    regions_file = stack.home / "regions.yaml"
    regions_file.write_text(yaml.safe_dump({
        "regions": [{"name": "region-1", "work_pool": "modelops-local"},
                    {"name": "region-2", "work_pool": "modelops-local-region-2",
                     "settings": {"home": str(home2), "router_port": port, "router_grpc_port": grpc}}],
        "bake_s": 2, "region_start_timeout_s": 20}))
    env2 = {**stack.env, "MODELOPS_HOME": str(home2), "MODELOPS_ROUTER_PORT": str(port),
            "MODELOPS_ROUTER_GRPC_PORT": str(grpc), "MODELOPS_WORK_POOL": "modelops-local-region-2",
            "MODELOPS_REGION": "region-2"}
    try:
        up = stack.modelops("up", timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "region-2: prefect-worker: started" in up.stdout, up.stdout
        yield {"home2": home2, "router2": f"http://127.0.0.1:{port}/v1", "env2": env2,
               "weights": make(work / "model")}
    finally:
        down = subprocess.run([MODELOPS, "stack", "region-down"], env=env2, cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        regions_file.unlink()
        assert down.returncode == 0, down.stdout + down.stderr
        assert not list((home2 / "run").glob("*.pid")), "region 2's processes left running"


def _manifest(work: Path, version: str, weights: Path, **fields) -> str:
    (work / "tiny.jinja").write_text(TINY_CHAT_TEMPLATE)
    return manifest_file(work, **{"model_id": MODEL, "version": version, "source": f"file://{weights}",
                                  "task": "generate", "chat_template": "tiny.jinja",
                                  "engine_args": SMALL_ENGINE_ARGS, **fields})


def _regional_status(stack: Stack) -> dict[str, dict[str, dict]]:
    """``{region: {version: row}}`` of MODEL from ``modelops status --json``."""
    status = json.loads(stack.modelops("status", "--json").stdout)
    return {region: {r["version"]: r for r in rows if r["model_id"] == MODEL}
            for region, rows in status["regions"].items()}


def _lifecycle_runs(stack: Stack, region: str, version: str) -> list[dict]:
    """Flow runs of ``model-lifecycle/<region>`` for MODEL ``version``, oldest first."""
    runs = stack.prefect.post("/flow_runs/filter", json={
        "deployments": {"name": {"any_": [region]}}, "flows": {"name": {"any_": ["model-lifecycle"]}},
        "limit": 50, "sort": "START_TIME_ASC"}).json()
    return [r for r in runs if r["parameters"]["manifest"]["model_id"] == MODEL
            and r["parameters"]["manifest"]["version"] == version]


def test_a_regions_file_naming_an_unknown_pool_is_refused_before_any_region_changes(stack, regions, tmp_path):
    regions_file = stack.home / "regions.yaml"
    good = regions_file.read_text()
    data = yaml.safe_load(good)
    data["regions"][1]["work_pool"] = "no-such-pool"
    regions_file.write_text(yaml.safe_dump(data))
    try:
        run = stack.modelops("announce", _manifest(tmp_path, "0", regions["weights"]), "--wait")
    finally:
        regions_file.write_text(good)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1 and "regions refused before any region changed" in out, out
    assert "work pool 'no-such-pool' does not exist on the Prefect server" in out, out
    assert all("0" not in versions for versions in _regional_status(stack).values())


def test_a_global_rollout_goes_wave_by_wave_and_a_region_whose_worker_died_is_resumed(stack, regions, tmp_path):
    """The success path, with a fault on the way: region 2's worker dies while wave 1 runs. Wave 1
    completes, wave 2 is reported (bounded wait), `modelops up` brings the worker back, and
    announcing again rolls region 2 out without rolling region 1 out again."""
    manifest = _manifest(tmp_path, "1", regions["weights"])
    announced = subprocess.Popen([MODELOPS, "announce", manifest, "--wait"], env=stack.env, cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not any(r["state_type"] == "RUNNING" for r in _lifecycle_runs(stack, "region-1", "1")):
        assert time.monotonic() < deadline and announced.poll() is None, announced.stdout.read() if \
            announced.poll() is not None else "region-1's lifecycle never started"
        time.sleep(1)
    worker = int((regions["home2"] / "run" / "prefect-worker.pid").read_text())
    os.killpg(worker, signal.SIGKILL)  # region 2's worker dies while wave 1 runs
    out = " ".join(announced.communicate(timeout=600)[0].split())
    assert announced.returncode == 1, out
    assert "wave 2 failed in region-2 (not_started: no worker of work pool modelops-local-region-2" in out, out
    status = _regional_status(stack)
    assert status["region-1"]["1"]["weight"] == 100 and "1" not in status["region-2"], status
    up = stack.modelops("up", timeout=600)  # the worker back
    assert up.returncode == 0 and "region-2: prefect-worker: started" in up.stdout, up.stdout + up.stderr
    again = stack.modelops("announce", manifest, "--wait")
    out = " ".join((again.stdout + again.stderr).split())
    assert again.returncode == 0 and "serves in every region: wave 1 (region-1)" in out, out
    print("resumed global rollout:", out[out.index("serves in every region"):][:200])
    status = _regional_status(stack)
    for region in ("region-1", "region-2"):
        assert (status[region]["1"]["state"], status[region]["1"]["weight"]) == ("serving", 100), status
    (first,) = _lifecycle_runs(stack, "region-1", "1")  # region 1 was not rolled out again
    # The run no worker took was cancelled; the resumed global rollout's run completed, after wave 1.
    second = {r["state_type"]: r for r in _lifecycle_runs(stack, "region-2", "1")}
    assert sorted(second) == ["CANCELLED", "COMPLETED"], second
    assert first["end_time"] < second["COMPLETED"]["start_time"]
    print(f"region-1 lifecycle {first['total_run_time']:.0f} s, "
          f"region-2 lifecycle {second['COMPLETED']['total_run_time']:.0f} s")
    with httpx.Client(timeout=60) as client:  # each region's router answers from its own instance
        for router in (stack.router, regions["router2"]):
            assert _chat(client, router) is None


def test_a_crashing_version_fails_in_the_canary_region_alone_and_costs_no_request(stack, regions, tmp_path):
    wheel = build_wheel(tmp_path, "modelops-test-global-crash", engine_crash_plugin(SEED))
    crashing = _manifest(tmp_path, "2", regions["weights"],
                         plugins=[{"name": "modelops-test-global-crash", "wheel": wheel.name}])
    with RouterLoad(stack.router, [_chat], workers=1) as load1, RouterLoad(regions["router2"], [_chat],
                                                                           workers=1) as load2:
        time.sleep(2)
        run = stack.modelops("announce", crashing, "--wait")
        time.sleep(2)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1 and "wave 1 failed in region-1" in out and "later waves not started" in out, out
    status = _regional_status(stack)
    assert status["region-1"]["2"]["state"] == "failed", status["region-1"]
    assert (status["region-1"]["1"]["state"], status["region-1"]["1"]["weight"]) == ("serving", 100)
    assert "2" not in status["region-2"] and not _lifecycle_runs(stack, "region-2", "2"), status["region-2"]
    print(f"crashing version: region-1 {load1.sent} requests, {load1.failed} failed; "
          f"region-2 {load2.sent} requests, {load2.failed} failed")
    assert load1.failed == 0 and load2.failed == 0, (load1.failures[:5], load2.failures[:5])
    assert load1.sent > 20 and load2.sent > 10
