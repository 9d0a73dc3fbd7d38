"""The Kubernetes work pool variant on a real Prefect server of its own, without a cluster.

Not the session stack's server: the variant's deployments have the same names as prefect.yaml's
and would take them over (model-lifecycle would then wait for a Kubernetes worker).

`prefect work-pool create --type kubernetes --base-job-template deployments/kubernetes/...` and
`prefect deploy --all --prefect-file deployments/kubernetes/prefect.yaml` must succeed; the API
must show the five deployments on that pool (with the lifecycle trigger, the cleanup schedule,
the rollback and batch-inference parameters); and the Job the Kubernetes worker would submit for a flow run, made by
prefect-kubernetes' own KubernetesWorkerJobConfiguration from the pool's template, must pass
kubernetes-validate in strict mode. No model is served.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from modelops.settings import Settings

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
TEMPLATE = REPO / "deployments" / "kubernetes" / "base-job-template.json"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/modelops-control-plane:0.1.0"
K8S_VERSIONS = ("1.33.0", "1.37.0")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """``(settings, environment)`` of a throwaway Prefect server (started like the stack's, with
    its auth string)."""
    from modelops_cli.local_stack import daemons, prefect_env
    from tests.conftest import free_port

    settings = Settings(home=tmp_path_factory.mktemp("k8s-prefect"), prefect_port=free_port())
    server = daemons(settings)["prefect-server"]
    server.start()
    try:
        yield settings, prefect_env(settings)
    finally:
        server.stop()


def test_kubernetes_work_pool_deploys_and_renders_a_valid_job(prefect_server):
    from modelops_cli.local_stack import prefect_http

    settings, server_env = prefect_server
    env = {**server_env, "MODELOPS_CONTROL_PLANE_IMAGE": IMAGE,
           "MODELOPS_K8S_NAMESPACE": "modelops"}

    def prefect(*args: str) -> None:
        proc = subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"

    prefect("work-pool", "create", "modelops-k8s", "--type", "kubernetes", "--base-job-template", str(TEMPLATE),
            "--overwrite")
    prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/kubernetes/prefect.yaml")

    with prefect_http(settings) as http:
        pool = http.get("/work_pools/modelops-k8s").raise_for_status().json()
        assert pool["type"] == "kubernetes"
        assert pool["base_job_template"] == json.loads(TEMPLATE.read_text())
        deps = http.post("/deployments/filter", json={
            "work_pools": {"name": {"any_": ["modelops-k8s"]}}}).raise_for_status().json()
        by_name = {d["name"]: d for d in deps}
        assert sorted(by_name) == ["batch-inference", "cleanup-idle-versions", "global-rollout", "model-lifecycle",
                                   "rollback"]
        for d in deps:
            assert d["work_pool_name"] == "modelops-k8s"
            assert d["job_variables"] == {"image": IMAGE, "namespace": "modelops"}
            assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {
                "directory": "/opt/modelops"}}]
        assert by_name["model-lifecycle"]["entrypoint"] == "flows/lifecycle.py:model_lifecycle"
        assert by_name["rollback"]["entrypoint"] == "flows/rollback.py:rollback_flow"
        assert by_name["batch-inference"]["entrypoint"] == "flows/batch.py:batch_inference"
        assert by_name["batch-inference"]["parameter_openapi_schema"]["required"] == ["batch_id"]
        assert set(by_name["rollback"]["parameter_openapi_schema"]["properties"]) == {"model_id", "to_version"}
        assert by_name["rollback"]["parameter_openapi_schema"]["required"] == ["model_id"]
        [schedule] = by_name["cleanup-idle-versions"]["schedules"]
        assert schedule["schedule"]["cron"] == "*/15 * * * *"
        automations = http.get(f"/automations/related-to/prefect.deployment.{by_name['model-lifecycle']['id']}") \
            .raise_for_status().json()
        [trigger] = [a["trigger"] for a in automations]
        assert trigger["expect"] == ["modelops.model.announced"]
        assert trigger["match"] == {"prefect.resource.id": "modelops.model.*"}

    auth = server_env["PREFECT_API_AUTH_STRING"]
    job = asyncio.run(_job_for_a_flow_run(settings.prefect_api_url, auth, by_name["rollback"]["id"]))
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    pod = job["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert job["metadata"]["namespace"] == "modelops" and c["image"] == IMAGE
    assert pod["serviceAccountName"] == "modelops-control-plane"
    # The label each serving version's NetworkPolicy admits (health and route checks), beside Prefect's.
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["modelops.io/role"] == "control-plane" and labels["prefect.io/flow-run-id"]
    env_by_name = {e["name"]: e for e in c["env"]}
    assert env_by_name["MODELOPS_REGISTRY_URL"]["valueFrom"] == {"secretKeyRef": {"name": "modelops-registry",
                                                                                  "key": "url"}}
    # The cluster's Prefect server, not the loopback URL of the process that rendered the Job.
    assert env_by_name["PREFECT_API_URL"]["value"] == "http://prefect-server.prefect.svc.cluster.local:4200/api"
    assert env_by_name["PREFECT__FLOW_RUN_ID"]["value"]
    # The worker's own auth string, in clear (docs/kubernetes.md says so, and why).
    assert env_by_name["PREFECT_API_AUTH_STRING"]["value"] == auth
    assert env_by_name["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]["value"] == "30"  # a killed Job's run is marked Crashed
    # The control plane writes weights and packages where serving pods read them.
    mount = Settings().k8s_fsx_mount_path
    assert {"name": "fsx", "mountPath": str(mount)} in c["volumeMounts"]
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": "modelops-fsx"}} in pod["volumes"]
    for var in ("MODELOPS_HOME", "MODELOPS_FSX_ROOT"):
        assert Path(env_by_name[var]["value"]).is_relative_to(mount)
    assert c["args"][:3] == ["prefect", "flow-run", "execute"]
    assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (1, 1)


async def _job_for_a_flow_run(api: str, auth: str, deployment_id: str) -> dict:
    """The Job manifest the Kubernetes worker would submit for a new run of the deployment."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
        async with get_client() as client:
            deployment = await client.read_deployment(deployment_id)
            flow = await client.read_flow(deployment.flow_id)
            pool = await client.read_work_pool("modelops-k8s")
            run = await client.create_flow_run_from_deployment(deployment_id, parameters={"model_id": "m"})
            try:
                config = await KubernetesWorkerJobConfiguration.from_template_and_values(
                    pool.base_job_template, deployment.job_variables or {})
                config.prepare_for_flow_run(run, deployment=deployment, flow=flow, work_pool=pool,
                                            worker_name="test-render")
                return config.job_manifest
            finally:
                await client.delete_flow_run(run.id)
