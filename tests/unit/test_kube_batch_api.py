"""The batch API on Kubernetes (tasks/kube/batch_api.py): its pod, Service and NetworkPolicy pass
Kubernetes' own schemas; its HTTPRoute and SecurityPolicy pass the Gateway API and Envoy Gateway
validators (tests/k8s) and Envoy Gateway's CEL rules; the pod's environment makes the settings
the API serves with; the Gateway router applies, protects and prunes the route against the API
server's stand-in (tests/unit/fake_kube_api.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from modelops.errors import TrafficError
from modelops.settings import REPO_ROOT, Settings
from modelops.tenancy import KEY_HEADER, PLATFORM_KEY, key_hash, new_key
from tasks.batch.api import create_app
from tasks.kube.batch_api import (
    BATCH_API_NAME,
    BATCH_API_PATHS,
    BATCH_ROUTE_NAME,
    JOB_TEMPLATE,
    render_batch_api,
    render_batch_api_route,
    render_batch_api_securitypolicy,
)
from tasks.kube.client import KubeClient
from tasks.kube.manifests import ServingSpec, key_secret_name, render_deployment, render_networkpolicy
from tasks.traffic.gateway_api import GatewayAPIRouter
from tasks.traffic.interface import routes_from_registry
from tests.unit.test_kube_tenancy import GRANTS, _route, envoy_cel_problems, envoy_validate, fake_api  # noqa: F401
from tests.unit.test_kubernetes import MODEL, container, k8s_validate, registry_with
from tests.unit.test_kubernetes import make_settings as kube_settings

IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/modelops-control-plane:1.4.0"
GATEWAY = "http://inference.gateways.svc/v1"
POLICIES = "apis/gateway.envoyproxy.io/v1alpha1"
ROUTES = "apis/gateway.networking.k8s.io/v1"


def make_settings(**over):
    """The Kubernetes tests' settings with the Gateway's URL, without which the API is not rendered."""
    return kube_settings(**{"k8s_gateway_url": GATEWAY, **over})


def _command(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m tasks.kube batch-api ARGS`` with the Gateway's URL set unless ``env`` says otherwise."""
    import os

    environ = {**os.environ, "MODELOPS_K8S_GATEWAY_URL": GATEWAY, **env}
    return subprocess.run([sys.executable, "-m", "tasks.kube", "batch-api", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60, env={k: v for k, v in environ.items() if v})


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def test_the_batch_apis_objects_validate_offline():
    s = make_settings()
    objects = render_batch_api(IMAGE, s)
    assert [o["kind"] for o in objects] == ["NetworkPolicy", "Service", "Deployment"]  # the fence first
    for obj in objects:
        k8s_validate(obj)
    gateway = [render_batch_api_route(s, True, 8082), render_batch_api_route(s, False, 8082),
               render_batch_api_route(make_settings(k8s_route_hostnames=["api.example.com"],
                                                    k8s_gateway_listener="https", k8s_route_timeout_s=0), True, 9000),
               render_batch_api_securitypolicy(GRANTS, s)]
    results = envoy_validate(gateway)
    assert all(r["ok"] for r in results), results
    assert envoy_cel_problems(gateway[-1]) == []


def test_the_pod_serves_the_api_with_the_flow_runs_environment(monkeypatch):
    """The pod's literal env makes Settings that serve on 0.0.0.0:<the container port> as the
    kubernetes provider (no instance secret); the Prefect server, registry Secret and service
    account are the flow-run pods' (the work pool's base job template)."""
    s = make_settings(batch_port=9090, batch_bucket="team-batches", k8s_gateway_url="http://gw.example/v1")
    objects = _by_kind(render_batch_api(IMAGE, s))
    deployment, service = objects["Deployment"], objects["Service"]
    c = container(deployment)
    assert (c["image"], c["command"], c["workingDir"]) == (IMAGE, ["python", "-m", "tasks.batch"], "/opt/modelops")
    template = json.loads(JOB_TEMPLATE.read_text())["variables"]["properties"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MODELOPS_REGISTRY_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": template["registry_secret"]["default"], "key": "url"}
    assert env["MODELOPS_K8S_NAMESPACE"]["valueFrom"]["fieldRef"] == {"fieldPath": "metadata.namespace"}
    for name in ("PREFECT_API_URL", "MODELOPS_AWS_CREDENTIALS_BLOCK"):
        assert env[name]["value"] == template["env"]["default"][name]
    assert "MODELOPS_HOME" not in env  # under the FSx mount, which this pod does not have
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == template["service_account_name"]["default"]
    for name in list(Settings.model_fields):  # nothing from this machine leaks into the pod's settings
        monkeypatch.delenv(f"MODELOPS_{name.upper()}", raising=False)
    for name, e in env.items():
        if "value" in e:
            monkeypatch.setenv(name, e["value"])
    pod = Settings()
    assert (pod.provider, pod.router, str(pod.batch_host), pod.batch_port, pod.batch_bucket, pod.router_url) == (
        "kubernetes", "gateway-api", "0.0.0.0", 9090, "team-batches", "http://gw.example/v1")
    port = c["ports"][0]
    assert (port["containerPort"], service["spec"]["ports"][0]["targetPort"]) == (9090, port["name"])
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # The probes ask what the API answers without a key.
    paths = {r.path for r in create_app(s, None, None).routes}
    assert c["readinessProbe"]["httpGet"]["path"] in paths and c["livenessProbe"]["httpGet"]["path"] in paths
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    # Its account reaches S3 (IRSA); no API token: the keys' Secrets are readable with it.
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert env["MODELOPS_ROUTER_MAX_BODY_MB"]["value"] == str(s.router_max_body_mb)  # the largest upload


def test_only_the_gateways_proxies_reach_the_batch_api():
    s = make_settings()
    objects = _by_kind(render_batch_api(IMAGE, s))
    fence = objects["NetworkPolicy"]["spec"]
    assert fence["podSelector"]["matchLabels"].items() <= \
        objects["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    assert fence["policyTypes"] == ["Ingress"]
    # One source, the same proxy pods a serving version admits, on the API's port only.
    serving = render_networkpolicy(MODEL, "1", s)["spec"]["ingress"][0]["from"]
    assert fence["ingress"] == [{"from": serving, "ports": [{"protocol": "TCP", "port": s.batch_port}]}]
    # A model named like the batch API: its pods match none of the API's selectors.
    namesake = render_deployment(ServingSpec(BATCH_API_NAME, "1", IMAGE, "/fsx/modelops/packages/x/1", 1, 1, 0, 1), s)
    pod_labels = namesake["spec"]["template"]["metadata"]["labels"].items()
    for obj in objects.values():
        selector = obj["spec"].get("podSelector", obj["spec"].get("selector", {}))
        assert not (selector.get("matchLabels", selector).items() <= pod_labels), obj["kind"]


def test_without_its_network_policy_or_with_a_bad_namespace_the_batch_api_is_not_rendered():
    """No NetworkPolicy (K8S_NETWORK_POLICY false, a Gateway that is not Envoy Gateway): any pod could
    send a key name of its choosing, so nothing is rendered; a namespace the cluster would refuse is
    named."""
    with pytest.raises(ValueError, match="MODELOPS_K8S_NETWORK_POLICY is false"):
        render_batch_api(IMAGE, make_settings(k8s_network_policy=False))
    for setting in ("k8s_namespace", "k8s_gateway_namespace", "k8s_gateway_proxy_namespace"):
        with pytest.raises(ValueError, match=f"MODELOPS_{setting.upper()} 'Bad_NS' is not a namespace name"):
            render_batch_api(IMAGE, make_settings(**{setting: "Bad_NS"}))
    run = _command("--image", IMAGE, MODELOPS_K8S_NAMESPACE="Bad_NS")
    assert run.returncode == 2 and "MODELOPS_K8S_NAMESPACE 'Bad_NS'" in run.stderr and run.stdout == ""


@pytest.mark.parametrize("url, says", [
    ("", "MODELOPS_K8S_GATEWAY_URL is unset, but the batch API sends a live request's result-cache miss"),
    ("inference.gateways.svc:80", "MODELOPS_K8S_GATEWAY_URL: Value error, not an http:// or https:// URL"),
    ("http:///v1", "MODELOPS_K8S_GATEWAY_URL: Value error, not an http:// or https:// URL"),
])
def test_without_the_gateways_url_the_batch_api_is_not_rendered(url, says):
    """In the API's pod the default router URL is 127.0.0.1, where nothing answers: its cache misses
    would fail at request time; a URL that is none is named at once."""
    if not url:
        with pytest.raises(ValueError, match="MODELOPS_K8S_GATEWAY_URL is unset"):
            render_batch_api(IMAGE, kube_settings())
    run = _command("--image", IMAGE, MODELOPS_K8S_GATEWAY_URL=url)
    assert run.returncode == 2 and says in run.stderr and run.stdout == "", run.stderr


@pytest.mark.parametrize("image, says", [
    ("modelops-control-plane:1", "names no registry"),
    ("reg.example.com/ml/Control:1", "repository"),
    ("reg.example.com/ml/control-plane", "neither a tag"),
])
def test_a_control_plane_image_a_cluster_cannot_pull_is_refused(image, says):
    with pytest.raises(ValueError, match=says):
        render_batch_api(image, make_settings())
    run = _command("--image", image)
    assert run.returncode == 2 and says in run.stderr and run.stdout == ""


def test_the_command_prints_the_objects_to_apply():
    run = _command("--image", IMAGE)
    assert run.returncode == 0, run.stderr
    assert [(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(run.stdout)] == [
        ("NetworkPolicy", BATCH_API_NAME), ("Service", BATCH_API_NAME), ("Deployment", BATCH_API_NAME)]


def test_the_route_takes_files_and_batches_and_removes_a_clients_key_name_while_keys_are_off():
    s = make_settings()
    on, off = render_batch_api_route(s, True, 9000), render_batch_api_route(s, False, 9000)
    rule = on["spec"]["rules"][0]
    assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": p} for p in BATCH_API_PATHS]
    assert rule["backendRefs"] == [{"group": "", "kind": "Service", "name": BATCH_API_NAME, "port": 9000}]
    assert "filters" not in rule  # Envoy's key filter sets the name; a route filter would run after it
    assert off["spec"]["rules"][0]["filters"] == [
        {"type": "RequestHeaderModifier", "requestHeaderModifier": {"remove": [KEY_HEADER]}}]
    assert on["spec"]["parentRefs"] == GatewayAPIRouter(s).render([_route(MODEL)])[0]["spec"]["parentRefs"]


def test_every_active_key_may_call_the_batch_api_whatever_its_scope():
    policy = render_batch_api_securitypolicy(GRANTS, make_settings())
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                             "name": BATCH_ROUTE_NAME}]
    assert [r["name"] for r in policy["spec"]["apiKeyAuth"]["credentialRefs"]] == [
        key_secret_name(n) for n in (PLATFORM_KEY, *sorted(g.name for g in GRANTS))]
    assert policy["spec"]["apiKeyAuth"]["forwardClientIDHeader"] == KEY_HEADER
    assert policy["spec"]["apiKeyAuth"]["sanitize"] is True


def test_the_router_routes_the_batch_api_while_its_service_exists(tmp_path, fake_api, caplog):  # noqa: F811
    """Every process that applies routes (a flow run, `keys create`, the autoscaler) sees the same
    Service, so none prunes what another applied; the route takes the Service's port."""
    s = make_settings(k8s_kserve_routes=False)
    reg = registry_with(tmp_path / "r.db", s, {"1": 100})
    client = KubeClient(s, TrafficError, api_client=fake_api.api_client())
    router = GatewayAPIRouter(s, client, registry=reg)
    router.poll_s = 0.02
    stored = fake_api.cluster.objects
    router.apply(routes_from_registry(reg))
    assert not any(k[3] == BATCH_ROUTE_NAME for k in stored)  # no Service yet: no route
    client.apply(_by_kind(render_batch_api(IMAGE, make_settings(batch_port=9000)))["Service"])
    # Keys off: the route, to the Service's port, no policy, a client's key name removed.
    router.apply(routes_from_registry(reg))
    route = stored[(ROUTES, "httproutes", "modelops", BATCH_ROUTE_NAME)]
    assert route["spec"]["rules"][0]["backendRefs"][0]["port"] == 9000
    assert route["spec"]["rules"][0]["filters"][0]["requestHeaderModifier"] == {"remove": [KEY_HEADER]}
    assert not any(k[1] == "securitypolicies" for k in stored)
    # Keys on: the policy before the route, with every key that has its Secret.
    keys = {n: new_key() for n in ("team-a", "elsewhere")}
    reg.create_key("team-a", key_hash(keys["team-a"]), (MODEL,))
    reg.create_key("elsewhere", key_hash(keys["elsewhere"]), ("another-model",))
    for name, key in keys.items():
        router.put_key(name, key)
    before = len(fake_api.cluster.requests)
    router.apply(routes_from_registry(reg))
    applied = [(r.path.rsplit("/", 2)[-2], r.path.rsplit("/", 1)[-1]) for r in fake_api.cluster.requests[before:]
               if r.method == "PATCH"]
    assert applied.index(("securitypolicies", BATCH_ROUTE_NAME)) < applied.index(("httproutes", BATCH_ROUTE_NAME))
    policy = stored[(POLICIES, "securitypolicies", "modelops", BATCH_ROUTE_NAME)]
    assert [r["name"] for r in policy["spec"]["apiKeyAuth"]["credentialRefs"]] == [
        key_secret_name(n) for n in (PLATFORM_KEY, "elsewhere", "team-a")]
    assert "filters" not in stored[(ROUTES, "httproutes", "modelops", BATCH_ROUTE_NAME)]["spec"]["rules"][0]
    # A Gateway that refuses the batch route fails no model's traffic change: it is logged.
    fake_api.cluster.refused_routes.add(BATCH_ROUTE_NAME)
    reg.set_weights(MODEL, {"1": 50})
    router.apply(routes_from_registry(reg))
    assert stored[(ROUTES, "httproutes", "modelops", MODEL)]["spec"]["rules"][-1]["backendRefs"][0]["weight"] == 50
    assert "the batch API is not served through the Gateway" in caplog.text and "not Accepted" in caplog.text
    fake_api.cluster.refused_routes.clear()
    # The Service deleted: the route and its policy go; the model's stay.
    client.delete("v1", "Service", BATCH_API_NAME)
    router.apply(routes_from_registry(reg))
    assert {k[3] for k in stored if k[1] in ("httproutes", "securitypolicies")} == {MODEL}


def test_a_model_named_like_the_batch_api_is_routed_beside_it():
    s = make_settings()
    objects = GatewayAPIRouter(s).render([_route(BATCH_API_NAME)], GRANTS, batch_api_port=8082)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)) and ("HTTPRoute", BATCH_ROUTE_NAME) in names


def test_a_plain_text_429_is_the_gateways_rate_limit_and_is_waited_out():
    """Envoy Gateway's local rate limit (a key's rpm on Kubernetes) answers a plain-text 429 without
    Retry-After: a batch line waits instead of spending its tries; other 429s are tries."""
    import httpx

    from tasks.batch.run import _key_limit_wait

    assert _key_limit_wait(httpx.Response(429, text="local_rate_limited")) == 5.0
    assert _key_limit_wait(httpx.Response(429, text="local_rate_limited", headers={"retry-after": "30"})) == 30.0
    assert _key_limit_wait(httpx.Response(429, json={"error": {"code": "rate_limit_exceeded"}},
                                          headers={"retry-after": "7"})) == 7.0
    assert _key_limit_wait(httpx.Response(429, json={"error": {"code": "engine_overloaded"}})) is None
    assert _key_limit_wait(httpx.Response(429, json=["not", "openai"])) is None
    assert _key_limit_wait(httpx.Response(503, text="busy")) is None
