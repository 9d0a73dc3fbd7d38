"""Scale-out on Kubernetes, checked without a cluster.

- Every rendered object is validated offline: core kinds with kubernetes-validate (strict: unknown
  fields refused) against two Kubernetes releases, Gateway API kinds with the schema generated from
  the Gateway API's types (tests/k8s/validate-crds.mjs, `npm ci` in tests/k8s; also strict).
- Both validators are shown to refuse broken objects, so a pass means something.
- Weights, probes, volumes and budgets are asserted as values, per strategy, with the weights
  taken from a real registry through routes_from_registry.
- The provider and the router run against a loopback stand-in of the API server
  (tests/unit/fake_kube_api.py) through the real `kubernetes` client: this checks the requests
  (server-side apply, scale subresource, deletes) and our handling of statuses, not a cluster.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from modelops.artifacts import Package
from modelops.errors import ModelLoadError, ProvisionError, TrafficError
from modelops.manifest import parse_manifest
from modelops.registry import Registry
from modelops.settings import REPO_ROOT, Settings
from tasks.kube.client import KubeClient
from tasks.kube.manifests import (
    FSX_CSI_DRIVER,
    MEMORY_VOLUMES_MIB,
    METRICS_DIR,
    PORTS,
    ServingSpec,
    image_reference,
    label_value,
    object_name,
    render_deployment,
    render_fsx_storage,
    render_httproute,
    render_inferencepool,
    render_service,
    service_endpoints,
)
from tasks.provision.kubernetes import KubernetesProvider
from tasks.traffic.gateway_api import GatewayAPIRouter
from tasks.traffic.interface import ModelRoute, Server, routes_from_registry
from tests.unit.fake_kube_api import FakeKubeAPI

# The oldest and the newest release kubernetes-validate 1.37 bundles schemas for that an EKS
# fleet plausibly runs; every core object must pass both.
K8S_VERSIONS = ("1.33.0", "1.37.0")
NODE_VALIDATOR = REPO_ROOT / "tests" / "k8s" / "validate-crds.mjs"
MODEL = "all-minilm-l6-v2"
REGISTRY_HOST = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ml"
PLAN_TAG = "modelops-runtime:26.07-vllm0.24.0-22b5357401b0"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def make_settings(mount: Path | str = "/fsx", **over) -> Settings:
    mount = Path(mount)
    values = {"home": mount / "modelops", "fsx_root": mount / "models", "k8s_fsx_mount_path": mount,
              "k8s_image_registry": REGISTRY_HOST, "k8s_namespace": "modelops", "k8s_gateway_name": "inference",
              "k8s_gateway_namespace": "gateways", "provision_timeout_s": 600.0, "drain_timeout_s": 30.0,
              "k8s_fsx_filesystem_id": "fs-0123456789abcdef0",
              "k8s_fsx_dns_name": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", "k8s_fsx_mount_name": "abcdefgh",
              "registry_url": None, "k8s_kubeconfig": None, "k8s_context": None}
    values.update(over)
    return Settings(**values)


def spec(settings: Settings, version: str = "1", **over) -> ServingSpec:
    values = {"model_id": MODEL, "version": version, "image": image_reference(PLAN_TAG, settings),
              "package": f"{settings.k8s_fsx_mount_path}/modelops/packages/{MODEL}/{version}", "cpus": 4,
              "memory_gb": 16, "gpus": 1, "replicas": 1}
    values.update(over)
    return ServingSpec(**values)


def k8s_validate(obj: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def gateway_validate(objects: list[dict]) -> list[dict]:
    """Results of tests/k8s/validate-crds.mjs, one per object."""
    if not (NODE_VALIDATOR.parent / "node_modules" / "@kubernetes-models" / "gateway-api").is_dir():
        pytest.fail("the Gateway API validator is not installed: run `make test-unit`, or `npm ci` in tests/k8s")
    node = shutil.which("node")
    assert node, "node (20+) is needed for the Gateway API validator"
    proc = subprocess.run([node, str(NODE_VALIDATOR)], input=json.dumps(objects), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    results = json.loads(proc.stdout)
    assert len(results) == len(objects)
    assert proc.returncode == (0 if all(r["ok"] for r in results) else 1)
    return results


POOL_SCHEMA = REPO_ROOT / "tests" / "k8s" / "inferencepool-v1.schema.json"


def inferencepool_problems(pool: dict) -> list[str]:
    """What the InferencePool CRD (inference.networking.k8s.io/v1) would refuse in ``pool``: its
    schema (POOL_SCHEMA, strict) and its two CEL rules, one line each; [] when it is admitted."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads(POOL_SCHEMA.read_text()))
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '(object)'}: {e.message}"
                for e in validator.iter_errors(pool)]
    spec = pool.get("spec") if isinstance(pool.get("spec"), dict) else {}
    numbers = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, dict)]
    if len(numbers) != len(set(numbers)):
        problems.append("spec.targetPorts: port number must be unique")
    ref = spec.get("endpointPickerRef")
    if isinstance(ref, dict) and ref.get("kind", "Service") == "Service" and "port" not in ref:
        problems.append("spec.endpointPickerRef: port is required when kind is 'Service' or unspecified")
    return problems


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


# -- validators refuse what they should -----------------------------------------------------------

def test_kubernetes_validate_refuses_broken_deployments():
    s = make_settings()
    good = render_deployment(spec(s), s)
    k8s_validate(good)
    bad = json.loads(json.dumps(good))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    assert list(e.value.path) == ["spec", "replicas"] and "'one' is not of type 'integer'" in e.value.message
    typo = json.loads(json.dumps(good))
    container(typo)["readinessprobe"] = container(typo).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(typo, K8S_VERSIONS[-1], strict=True)
    assert "'readinessprobe' was unexpected" in e.value.message
    # HTTPRoute has no bundled schema: kubernetes-validate cannot be the Gateway API's validator.
    route = render_httproute(MODEL, {"1": (object_name(MODEL, "1"), 100)}, s)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(route, K8S_VERSIONS[-1], strict=True)


def test_gateway_validator_refuses_broken_httproutes():
    s = make_settings()
    good = render_httproute(MODEL, {"1": (object_name(MODEL, "1"), 90), "2": (object_name(MODEL, "2"), 10)}, s)

    def broken(edit) -> dict:
        obj = json.loads(json.dumps(good))
        edit(obj["spec"])
        return obj

    cases = [
        good,
        broken(lambda sp: sp["rules"][-1]["backendRefs"][0].update(weight=-1)),
        broken(lambda sp: sp["rules"][-1]["backendRefs"][1].pop("name")),
        broken(lambda sp: sp["rules"][0]["matches"][0]["headers"][1].update(type="Glob")),
        broken(lambda sp: sp["rules"][0].update(backendRef=sp["rules"][0].pop("backendRefs"))),
        broken(lambda sp: sp["rules"][0]["matches"][0]["headers"][0].update(vaule="x")),
        broken(lambda sp: sp.update(rules=sp["rules"] * 6)),  # 18 rules > 16
    ]
    results = gateway_validate(cases)
    assert results[0] == {"kind": "HTTPRoute", "name": MODEL, "ok": True, "errors": []}
    errors = [" | ".join(r["errors"]) for r in results[1:]]
    assert "backendRefs/0/weight must be >= 0" in errors[0]
    assert "backendRefs/1 must have required property name" in errors[1]
    assert "headers/1/type must be equal to one of the allowed values" in errors[2]
    assert "/spec/rules/0/backendRef: unknown field" in errors[3]
    assert "/spec/rules/0/matches/0/headers/0/vaule: unknown field" in errors[4]
    assert "rules must NOT have more than 16 items" in errors[5]
    assert not any(r["ok"] for r in results[1:])


# -- every rendered object is valid ---------------------------------------------------------------

def test_rendered_objects_validate_offline():
    s = make_settings()
    core = [render_deployment(spec(s, gpus=g, replicas=r, cpus=c), s) for g, r, c in ((1, 1, 4), (0, 3, 1.5), (8, 0, 32))]
    core += [render_service(MODEL, "1", s), *render_fsx_storage(s)]
    core += list(yaml.safe_load_all((REPO_ROOT / "deployments" / "kubernetes" / "rbac.yaml").read_text()))
    for obj in core:
        k8s_validate(obj)
    routes = [render_httproute(MODEL, {"1": (object_name(MODEL, "1"), 100)}, s),
              render_httproute(MODEL, {v: (object_name(MODEL, v), w) for v, w in (("1", 0), ("2.0-rc", 100))},
                               make_settings(k8s_route_hostnames=["models.example.com"], k8s_gateway_listener="https",
                                             k8s_route_timeout_s=0))]
    assert all(r["ok"] for r in gateway_validate(routes)), gateway_validate(routes)
    # The CEL rule the generated schema does not check: a Service backendRef needs a port.
    for route in routes:
        for rule in route["spec"]["rules"]:
            assert all(ref["kind"] == "Service" and ref["port"] == PORTS["openai"] for ref in rule["backendRefs"])


def test_inferencepool_validator_refuses_broken_pools():
    good = render_inferencepool(MODEL, "1", make_settings())
    assert inferencepool_problems(good) == []

    def broken(change) -> list[str]:
        pool = json.loads(json.dumps(good))
        change(pool["spec"])
        return inferencepool_problems(pool)

    assert any("targetPorts" in p for p in broken(lambda s: s.update(targetPorts=[])))
    assert any("targetPorts" in p for p in broken(lambda s: s.update(targetPorts=[{"number": n} for n in range(1, 10)])))
    assert any("unique" in p for p in broken(lambda s: s.update(targetPorts=[{"number": 80}, {"number": 80}])))
    assert any("65535" in p for p in broken(lambda s: s.update(targetPorts=[{"number": 70000}])))
    assert any("port is required" in p for p in broken(lambda s: s["endpointPickerRef"].pop("port")))
    assert any("failureMode" in p for p in broken(lambda s: s["endpointPickerRef"].update(failureMode="Open")))
    assert any("appProtocol" in p for p in broken(lambda s: s.update(appProtocol="grpc")))
    assert any("selector" in p for p in broken(lambda s: s.pop("selector")))
    assert any("matchLabels" in p for p in broken(lambda s: s["selector"].update(matchLabels={"a": "b c"})))
    assert any("backendRef" in p for p in broken(lambda s: s.update(backendRef={})))  # strict: an unknown field
    # A picker that is not a Service: no port needed.
    assert broken(lambda s: s["endpointPickerRef"].update(kind="Backend", group="example.com", port=None) or
                  s["endpointPickerRef"].pop("port")) == []


def test_inference_pools_front_each_version_and_validate_offline():
    """With k8s_inference_pool, each routed version gets an InferencePool that selects exactly
    its Deployment's pods on their OpenAI port, and the OpenAI route's weighted backendRefs name
    the pools; the KServe routes stay on the Services."""
    s = make_settings(k8s_inference_pool=True, k8s_endpoint_picker_failure_mode="FailOpen")
    versions = {"1": 75, "2.0-rc": 25}
    route = ModelRoute(MODEL, {v: (Server(object_name(MODEL, v), "", w),) for v, w in versions.items()})
    objects = GatewayAPIRouter(s).render([route])
    pools = [o for o in objects if o["kind"] == "InferencePool"]
    assert [p["metadata"]["name"] for p in pools] == [object_name(MODEL, v) for v in sorted(versions)]
    for pool, version in zip(pools, sorted(versions)):
        assert inferencepool_problems(pool) == [], pool
        pod = render_deployment(spec(s, version=version), s)["spec"]["template"]
        assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        other = render_deployment(spec(s, version="1" if version != "1" else "2.0-rc"), s)["spec"]["template"]
        assert not pool["spec"]["selector"]["matchLabels"].items() <= other["metadata"]["labels"].items()
        [port] = pool["spec"]["targetPorts"]
        assert {"name": "openai", "containerPort": port["number"], "protocol": "TCP"}.items() <= \
            next(p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "openai").items()
        assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": f"{pool['metadata']['name']}-epp",
                                                     "port": {"number": 9002}, "failureMode": "FailOpen"}
    routes = [o for o in objects if o["kind"] in ("HTTPRoute", "GRPCRoute")]
    assert all(r["ok"] for r in gateway_validate(routes)), gateway_validate(routes)
    openai = next(r for r in routes if r["metadata"]["name"] == MODEL and r["kind"] == "HTTPRoute")
    refs = default_rule(openai)["backendRefs"]
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": object_name(MODEL, v),
                     "weight": versions[v]} for v in sorted(versions)]
    for other in routes:
        if other is not openai:
            assert {ref["kind"] for rule in other["spec"]["rules"] for ref in rule["backendRefs"]} == {"Service"}
    for picker, why in (("{pool}-" + "e" * 60, "not a Service name"), ("{pool}", "the version's own Service")):
        bad = make_settings(k8s_inference_pool=True, k8s_endpoint_picker=picker)
        with pytest.raises(TrafficError, match=f"{why}.*MODELOPS_K8S_ENDPOINT_PICKER"):
            GatewayAPIRouter(bad).render([route])


def test_router_applies_and_prunes_inference_pools(tmp_path, fake_api):
    s = make_settings(k8s_inference_pool=True)
    router = GatewayAPIRouter(s, KubeClient(s, TrafficError, api_client=fake_api.api_client()))
    router.poll_s = 0.02
    reg = registry_with(tmp_path / "r.db", s, {"1": 50, "2": 50})
    router.apply(routes_from_registry(reg))
    pools = {k[3] for k in fake_api.cluster.objects if k[1] == "inferencepools"}
    assert pools == {object_name(MODEL, "1"), object_name(MODEL, "2")}
    assert router.weights() == {(MODEL, object_name(MODEL, "1")): 50, (MODEL, object_name(MODEL, "2")): 50}
    reg.set_weights(MODEL, {"2": 100})
    reg.set_state(MODEL, "1", "retired")
    router.apply(routes_from_registry(reg))
    assert {k[3] for k in fake_api.cluster.objects if k[1] == "inferencepools"} == {object_name(MODEL, "2")}


# -- red-black and versioned weights from the registry ----------------------------------------------

def registry_with(path: Path, settings: Settings, weights: dict[str, int], gpus: int = 1) -> Registry:
    """A registry where each version of MODEL is serving with one running Deployment-instance."""
    reg = Registry(f"sqlite:///{path}")
    for version in weights:
        reg.record_announcement(parse_manifest({"model_id": MODEL, "version": version, "source": "s3://models/m/",
                                                "task": "embed", "resources": {"cpus": 4, "memory_gb": 16,
                                                                               "gpus": gpus}}))
        reg.set_state(MODEL, version, "serving")
        name = object_name(MODEL, version)
        reg.add_instance(MODEL, version, name, "")
        reg.update_instance(name, state="running", endpoints=service_endpoints(MODEL, version, settings))
    reg.set_weights(MODEL, weights)
    return reg


def default_rule(route: dict) -> dict:
    [rule] = [r for r in route["spec"]["rules"] if len(r["matches"][0]["headers"]) == 1]
    return rule


def test_red_black_steps_are_backend_weights(tmp_path):
    s = make_settings()
    assert s.redblack_steps == [10, 25, 50, 100]
    rendered = []
    for step in s.redblack_steps:
        reg = registry_with(tmp_path / f"r{step}.db", s, {"1": 100 - step, "2": step})
        route, kserve_http, kserve_grpc = GatewayAPIRouter(s).render(routes_from_registry(reg))
        rendered += [route, kserve_http, kserve_grpc]
        for kserve in (kserve_http, kserve_grpc):  # the same weights on the KServe routes
            assert {ref["name"]: ref["weight"] for ref in kserve["spec"]["rules"][-1]["backendRefs"]} == {
                "all-minilm-l6-v2-v1": 100 - step, "all-minilm-l6-v2-v2": step}
        weights = {ref["name"]: ref["weight"] for ref in default_rule(route)["backendRefs"]}
        assert weights == {"all-minilm-l6-v2-v1": 100 - step, "all-minilm-l6-v2-v2": step}
        rule = default_rule(route)
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"},
                                    "headers": [{"type": "Exact", "name": "X-Gateway-Model-Name", "value": MODEL}]}]
        assert rule["timeouts"] == {"request": "600s"}
        assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                                "name": "inference", "namespace": "gateways"}]
    assert all(r["ok"] for r in gateway_validate(rendered))


def test_versioned_adds_header_matches(tmp_path):
    s = make_settings()
    # Versioned: the new version 2 serves only when pinned; 1 keeps the default route.
    reg = registry_with(tmp_path / "r.db", s, {"1": 100, "2": 0})
    route, kserve_http, kserve_grpc = GatewayAPIRouter(s).render(routes_from_registry(reg))
    # KServe: the model in the path (HTTP) or the x-model-id metadata (gRPC), X-Model-Version pins as here.
    assert kserve_http["metadata"]["name"] == f"{MODEL}.kserve-http" and kserve_grpc["kind"] == "GRPCRoute"
    assert kserve_http["spec"]["rules"][1]["matches"] == [
        {"path": {"type": "PathPrefix", "value": f"/v2/models/{MODEL}"},
         "headers": [{"type": "Exact", "name": "X-Model-Version", "value": "2"}]}]
    assert kserve_http["spec"]["rules"][1]["backendRefs"][0]["port"] == PORTS["kserve-http"]
    assert kserve_grpc["spec"]["rules"][2] == {
        "matches": [{"headers": [{"type": "Exact", "name": "x-model-id", "value": MODEL}]}],
        "backendRefs": [{"group": "", "kind": "Service", "name": f"{MODEL}-v1", "port": PORTS["kserve-grpc"],
                         "weight": 100}, {"group": "", "kind": "Service", "name": f"{MODEL}-v2",
                                          "port": PORTS["kserve-grpc"], "weight": 0}]}
    assert all(r["ok"] for r in gateway_validate([kserve_http, kserve_grpc])), gateway_validate([kserve_http, kserve_grpc])
    assert [o["kind"] for o in GatewayAPIRouter(make_settings(k8s_kserve_routes=False)).render(
        routes_from_registry(reg))] == ["HTTPRoute"]
    pins = {r["matches"][0]["headers"][1]["value"]: r for r in route["spec"]["rules"]
            if len(r["matches"][0]["headers"]) == 2}
    assert sorted(pins) == ["1", "2"]
    pin = pins["2"]
    assert pin["matches"][0]["headers"] == [
        {"type": "Exact", "name": "X-Gateway-Model-Name", "value": MODEL},
        {"type": "Exact", "name": "X-Model-Version", "value": "2"}]
    assert pin["backendRefs"] == [{"group": "", "kind": "Service", "name": "all-minilm-l6-v2-v2", "port": 8080,
                                   "weight": 1}]
    # Precedence: same path, more header matches wins, so a pin outranks the default rule.
    assert len(pin["matches"][0]["headers"]) > len(default_rule(route)["matches"][0]["headers"])
    assert {r["name"]: r["weight"] for r in default_rule(route)["backendRefs"]} == {
        "all-minilm-l6-v2-v1": 100, "all-minilm-l6-v2-v2": 0}
    assert gateway_validate([route])[0]["ok"]


def test_httproute_limits():
    s = make_settings()
    many = {str(i): (object_name(MODEL, str(i)), 0) for i in range(16)}
    with pytest.raises(ValueError, match="16 routed versions need 17 HTTPRoute rules"):
        render_httproute(MODEL, many, s)
    with pytest.raises(ValueError, match="weight 1000001 outside"):
        render_httproute(MODEL, {"1": ("svc", 1_000_001)}, s)


# -- the Deployment: command, probes, resources, volumes ----------------------------------------------

def test_command_runs_the_runtime_on_the_named_ports(capsys):
    s = make_settings()
    c = container(render_deployment(spec(s), s))
    cmd = c["command"]
    assert cmd[:3] == ["python", "-m", "runtime.startup"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--package": "/fsx/modelops/packages/all-minilm-l6-v2/1", "--workdir": "/var/lib/modelops/work",
                     "--host": "0.0.0.0", "--openai-port": "8080", "--http-port": "8000", "--grpc-port": "8001",
                     "--metrics-port": "8002", "--drain-timeout": "30"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"openai": 8080, "kserve-http": 8000, "kserve-grpc": 8001, "metrics": 8002}
    # Every flag is one runtime.startup accepts (its own argparse help).
    from runtime.startup import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert all(flag in help_text for flag in flags)
    assert c["image"] == f"{REGISTRY_HOST}/modelops-runtime:26.07-vllm0.24.0-22b5357401b0"
    assert {"name": "MODELOPS_TRITON_HOME", "value": "/opt/tritonserver"} in c["env"]


def test_probes_budgets_and_grace():
    for timeout, drain in ((600.0, 30.0), (1234.5, 7.5), (5.0, 120.0)):
        s = make_settings(provision_timeout_s=timeout, drain_timeout_s=drain)
        dep = render_deployment(spec(s), s)
        c = container(dep)
        startup = c["startupProbe"]
        assert startup["httpGet"] == {"path": "/ready", "port": "openai"}
        assert startup["failureThreshold"] * startup["periodSeconds"] >= timeout
        assert (startup["failureThreshold"] - 1) * startup["periodSeconds"] < timeout  # not wildly more
        assert dep["spec"]["progressDeadlineSeconds"] >= timeout
        ready = c["readinessProbe"]  # the frontend's /ready: it sees a dead or stalled engine, Triton's does not
        assert ready["httpGet"] == {"path": "/ready", "port": "openai"}
        assert ready["periodSeconds"] * ready["failureThreshold"] <= 5
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + 10 and grace == math.ceil(drain) + 15
        assert "lifecycle" not in c  # no preStop: SIGTERM drains (comment in the renderer says why)
        assert c["command"][c["command"].index("--drain-timeout") + 1] == str(math.ceil(drain))


def test_resources_per_manifest():
    s = make_settings()
    gpu = render_deployment(spec(s, gpus=2, cpus=1.5, memory_gb=7.5), s)
    res = container(gpu)["resources"]
    # 7.5 GiB for the model + 1 GiB /dev/shm + 256 MiB metrics (memory emptyDirs share the limit).
    assert res == {"requests": {"cpu": "1500m", "memory": "8960Mi", "nvidia.com/gpu": "2"},
                   "limits": {"memory": "8960Mi", "nvidia.com/gpu": "2"}}
    assert gpu["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    cpu_only = render_deployment(spec(s, gpus=0), s)
    assert "nvidia.com/gpu" not in container(cpu_only)["resources"]["requests"]
    assert "tolerations" not in cpu_only["spec"]["template"]["spec"]


def mebibytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) * (1024 if unit == "Gi" else 1)


def test_memory_emptydirs_are_added_to_the_memory_limit():
    """tmpfs pages of a memory emptyDir are charged to the container's memory cgroup: the limit
    (= request) must hold the model's memory_gb plus every memory emptyDir at its size limit,
    or a small model that fills /dev/shm is OOM-killed."""
    s = make_settings()
    for memory_gb in (0.5, 1, 2, 7.5, 16, 80):
        dep = render_deployment(spec(s, memory_gb=memory_gb), s)
        res = container(dep)["resources"]
        memory_volumes = sum(mebibytes(v["emptyDir"]["sizeLimit"]) for v in dep["spec"]["template"]["spec"]["volumes"]
                             if v.get("emptyDir", {}).get("medium") == "Memory")
        assert memory_volumes == MEMORY_VOLUMES_MIB == 256 + 1024
        assert mebibytes(res["limits"]["memory"]) == mebibytes(res["requests"]["memory"]) \
            == math.ceil(memory_gb * 1024) + memory_volumes
        # The model keeps its full memory_gb even with both tmpfs volumes full.
        assert mebibytes(res["limits"]["memory"]) - memory_volumes >= memory_gb * 1024
    small = container(render_deployment(spec(s, memory_gb=0.5), s))["resources"]
    assert small["limits"]["memory"] == "1792Mi"


def test_volumes_fsx_read_only_and_metrics_dir():
    s = make_settings()
    dep = render_deployment(spec(s), s)
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert volumes["fsx"] == {"name": "fsx", "persistentVolumeClaim": {"claimName": "modelops-fsx", "readOnly": True}}
    assert mounts["fsx"] == {"name": "fsx", "mountPath": "/fsx", "readOnly": True}
    env = {e["name"]: e["value"] for e in c["env"]}
    mp = Path(env["PROMETHEUS_MULTIPROC_DIR"])
    assert volumes["metrics"]["emptyDir"]["medium"] == "Memory"
    # Inside the memory emptyDir, one level below its mount: runtime.startup rmtree+mkdirs it.
    assert mp.parent == Path(mounts["metrics"]["mountPath"]) == Path(METRICS_DIR)
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"]["mountPath"] == "/dev/shm"
    # The weights and the package are read by absolute path: both under the read-only mount.
    flags = dict(zip(c["command"][3::2], c["command"][4::2]))
    assert Path(flags["--package"]).is_relative_to(mounts["fsx"]["mountPath"])
    assert s.fsx_dir.is_relative_to(mounts["fsx"]["mountPath"])
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"], annotations["prometheus.io/path"]) \
        == ("true", "8080", "/metrics")


def test_paths_off_the_fsx_mount_are_refused():
    s = make_settings()
    with pytest.raises(ValueError, match="package /home/me/packages/m/1 is not on the FSx volume.*MODELOPS_HOME"):
        render_deployment(spec(s, package="/home/me/packages/m/1"), s)
    off = make_settings(fsx_root=Path("/data/models"))
    with pytest.raises(ValueError, match="MODELOPS_FSX_ROOT.*model.json names the weights"):
        render_deployment(spec(off), off)


def test_service_selects_the_deployments_pods():
    s = make_settings()
    dep, svc = render_deployment(spec(s, version="2.0-rc"), s), render_service(MODEL, "2.0-rc", s)
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert labels["app.kubernetes.io/name"] == MODEL and labels["modelops.io/version"] == "2.0-rc"
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        n: (p, n) for n, p in PORTS.items()}
    assert svc["metadata"]["name"] == dep["metadata"]["name"]


def test_names_and_labels():
    assert object_name(MODEL, "1") == "all-minilm-l6-v2-v1"
    assert object_name(MODEL, "2024-11-30") == "all-minilm-l6-v2-v2024-11-30"
    a, b = object_name(MODEL, "1.0"), object_name(MODEL, "1-0")
    assert a != b and a.startswith("all-minilm-l6-v2-v1-0-") and b == "all-minilm-l6-v2-v1-0"
    for model, version in ((MODEL, "V2"), ("m" * 63, "1"), ("7b-chat", "1"), (MODEL, "x" * 64)):
        name = object_name(model, version)
        assert DNS_1035.match(name) and len(name) <= 63, name
    assert label_value("2.0-rc") == "2.0-rc"
    for version in ("1.", "x" * 64, "_a"):
        value = label_value(version)
        assert re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$", value), value
        assert value != label_value(version + "x")


def test_image_reference_from_the_production_plan():
    from tasks.image import plan_image

    s = make_settings()
    plan = plan_image("26.07")  # the PRODUCTION pin; offline (matrix data in modelops/data)
    ref = image_reference(plan.tag, s)
    assert ref == f"{REGISTRY_HOST}/modelops-runtime:{plan.tag.split(':', 1)[1]}"
    assert image_reference(ref, s) == ref
    with pytest.raises(ValueError, match="MODELOPS_K8S_IMAGE_REGISTRY"):
        image_reference(plan.tag, make_settings(k8s_image_registry=None))
    digest = f"{REGISTRY_HOST}/modelops-runtime@sha256:{'ab' * 32}"
    assert image_reference(digest, s) == digest
    assert image_reference(f"@sha256:{'ab' * 32}", s) == digest  # a digest alone goes to the runtime's repository
    assert image_reference(f"modelops-runtime@sha256:{'ab' * 32}", s) == digest
    assert image_reference("localhost:5000/ml/runtime:t", s) == "localhost:5000/ml/runtime:t"
    assert image_reference(f"reg.io/x@sha512:{'c' * 128}", s) == f"reg.io/x@sha512:{'c' * 128}"


@pytest.mark.parametrize(("image", "why"), [
    ("", "its tag ''"), (":", "its tag ''"), ("modelops-runtime:a b", "its tag 'a b'"),
    ("modelops-runtime:" + "t" * 129, "is not 1-128"), ("reg.io/ml/runtime", "neither a tag"),
    ("reg.io/ml/runtime:", "its tag ''"), ("reg.io/ML/runtime:t", "its repository 'ML/runtime'"),
    ("reg.io/ml//runtime:t", "its repository"), ("https://reg.io/ml/runtime:t", "its registry 'https:'"),
    ("reg.io/ml/runtime:t\n", "its tag"), ("reg.io/x@sha256:" + "0" * 32, "its digest"),
    ("reg.io/x@sha256:" + "A" * 64, "its digest"), ("reg.io/x@md5:" + "0" * 32, "its digest"),
    ("reg.io/x@sha512:" + "a" * 64, "its digest"), ("reg.io/" + "x" * 250 + ":t", "at most 255"),
])
def test_an_image_reference_a_cluster_cannot_pull_is_refused_saying_which_part(image, why):
    with pytest.raises(ValueError, match="is not a reference a cluster can pull") as e:
        image_reference(image, make_settings())
    assert f"image {image!r}" in str(e.value) and why in str(e.value), str(e.value)


@pytest.mark.parametrize("image", ["foo:bar", "localhost:5000", f"x@sha256:{'ab' * 32}"])
def test_a_short_image_naming_another_repository_is_refused(image):
    with pytest.raises(ValueError, match="names repository .* MODELOPS_K8S_IMAGE_REPOSITORY"):
        image_reference(image, make_settings())
    # The configured repository's own name is taken, and the plan's tag still fits it.
    s = make_settings(k8s_image_repository="custom-runtime")
    assert image_reference("custom-runtime:t", s) == image_reference("modelops-runtime:t", s) == \
        f"{REGISTRY_HOST}/custom-runtime:t"


def test_registry_settings_that_make_no_reference_are_named():
    with pytest.raises(ValueError, match="MODELOPS_K8S_IMAGE_REGISTRY 'https://reg.io/ml' makes"):
        image_reference("26.07-vllm0.24.0-0123456789ab", make_settings(k8s_image_registry="https://reg.io/ml"))
    for repository in ("", "Modelops-Runtime", "x:1"):
        with pytest.raises(ValueError, match=f"MODELOPS_K8S_IMAGE_REPOSITORY {repository!r} is not a repository"):
            image_reference("abc", make_settings(k8s_image_repository=repository))


def test_fsx_static_volume():
    s = make_settings(k8s_fsx_storage_class="", k8s_fsx_capacity_gib=2400)
    pv, pvc = render_fsx_storage(s)
    assert pv["spec"]["csi"] == {"driver": FSX_CSI_DRIVER, "volumeHandle": "fs-0123456789abcdef0",
                                 "volumeAttributes": {"dnsname": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
                                                      "mountname": "abcdefgh"}}
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pv["spec"]["capacity"] == {"storage": "2400Gi"} and pvc["spec"]["resources"]["requests"] == {"storage": "2400Gi"}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pv["spec"]["claimRef"]["name"] == pvc["metadata"]["name"] == "modelops-fsx"
    assert pvc["spec"]["storageClassName"] == pv["spec"]["storageClassName"] == ""
    with pytest.raises(ValueError, match="MODELOPS_K8S_FSX_DNS_NAME, MODELOPS_K8S_FSX_MOUNT_NAME must be set"):
        render_fsx_storage(make_settings(k8s_fsx_dns_name=None, k8s_fsx_mount_name=None))


# -- against the loopback stand-in of the API server ----------------------------------------------

@pytest.fixture
def fake_api(tmp_path, monkeypatch):
    import tempfile

    # The client caches API discovery in <tempdir>/osrcp-<hash of host>.json: keep it per test.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with FakeKubeAPI() as api:
        yield api


def provider_setup(tmp_path: Path, api: FakeKubeAPI, **over):
    s = make_settings(mount=tmp_path / "fsx", **over)
    reg = registry_with(tmp_path / "registry.db", s, {"1": 100})
    # registry_with marks the instance running; start from an announced version without instances.
    reg.update_instance(object_name(MODEL, "1"), state="stopped")
    pkg = Package(s.packages_dir / MODEL / "1", MODEL, MODEL, "1", "embed")
    provider = KubernetesProvider(s, reg, KubeClient(s, api_client=api.api_client()))
    provider.poll_s = 0.02
    return s, reg, pkg, provider


def test_provider_applies_waits_and_reuses(tmp_path, fake_api):
    _, reg, pkg, provider = provider_setup(tmp_path, fake_api)
    name, endpoints = provider.ensure_instance(pkg, PLAN_TAG)
    assert name == "all-minilm-l6-v2-v1"
    assert endpoints.openai == "http://all-minilm-l6-v2-v1.modelops.svc:8080/v1"
    assert endpoints.kserve_grpc == "all-minilm-l6-v2-v1.modelops.svc:8001"
    applies = [r for r in fake_api.cluster.requests if r.method == "PATCH"]
    # The NetworkPolicy before the pods exist: none of them is ever reachable from elsewhere.
    assert [r.path.rsplit("/", 2)[-2] for r in applies] == ["persistentvolumes", "persistentvolumeclaims",
                                                            "networkpolicies", "services", "deployments"]
    assert all(r.content_type == "application/apply-patch+yaml" and r.query == {"fieldManager": ["modelops"],
                                                                                "force": ["true"]} for r in applies)
    dep = applies[-1].body
    assert container(dep)["image"] == f"{REGISTRY_HOST}/modelops-runtime:26.07-vllm0.24.0-22b5357401b0"
    assert container(dep)["resources"]["requests"]["nvidia.com/gpu"] == "1"  # from the announced manifest
    [inst] = reg.instances(MODEL, "1")
    assert (inst.state, inst.endpoints["openai"]) == ("running", endpoints.openai)
    # Again: the same objects applied (idempotent), the same registry row reused.
    before = len(fake_api.cluster.requests)
    assert provider.ensure_instance(pkg, PLAN_TAG) == (name, endpoints)
    again = [r for r in fake_api.cluster.requests[before:] if r.method == "PATCH"]
    assert [r.body for r in again] == [r.body for r in applies]
    assert len(reg.instances(MODEL, "1", live=False)) == 1
    # Scale through the scale subresource, then to zero (= stop: Deployment and Service deleted).
    provider.scale(MODEL, "1", 3, None, None)
    [scale] = [r for r in fake_api.cluster.requests if r.path.endswith("/scale")]
    assert scale.content_type == "application/merge-patch+json" and scale.body == {"spec": {"replicas": 3}}
    assert len(fake_api.cluster.pods("modelops", {"app.kubernetes.io/name": MODEL})) == 3
    provider.scale(MODEL, "1", 0, None, None)
    deletes = {r.path.rsplit("/", 2)[-2] for r in fake_api.cluster.requests if r.method == "DELETE"}
    assert deletes == {"services", "deployments", "networkpolicies"}
    assert reg.instances(MODEL, "1") == []


def deletes_and_pod_lists(api: FakeKubeAPI, since: int = 0) -> list[str]:
    """``DELETE <plural>`` and ``LIST pods`` requests in order."""
    out = []
    for r in api.cluster.requests[since:]:
        plural = r.path.rstrip("/").rsplit("/", 2)
        if r.method == "DELETE":
            out.append(f"DELETE {plural[-2]}")
        elif r.method == "GET" and plural[-1] == "pods":
            out.append("LIST pods")
    return out


def test_stop_deletes_the_service_after_the_pods_are_gone(tmp_path, fake_api):
    _, reg, pkg, provider = provider_setup(tmp_path, fake_api)
    name, _ = provider.ensure_instance(pkg, PLAN_TAG)
    provider.scale(MODEL, "1", 2, None, None)
    fake_api.cluster.drain_lists = 3  # the deleted Deployment's pods drain for three pod LISTs
    before = len(fake_api.cluster.requests)
    provider.stop(name)
    # Deployment first; its pods drain while the Service still routes to them; then the Service.
    assert deletes_and_pod_lists(fake_api, before) == [
        "DELETE deployments", "LIST pods", "LIST pods", "LIST pods", "LIST pods", "DELETE services",
        "DELETE networkpolicies"]  # the pods' fence goes last
    assert not any(k[1] in ("deployments", "services") for k in fake_api.cluster.objects)
    assert reg.instances(MODEL, "1") == []


def test_stop_keeps_the_service_while_pods_outlive_the_wait(tmp_path, fake_api, monkeypatch):
    from types import SimpleNamespace

    import tasks.provision.kubernetes as kmod

    _, reg, pkg, provider = provider_setup(tmp_path, fake_api, drain_timeout_s=1.0)
    name, _ = provider.ensure_instance(pkg, PLAN_TAG)
    fake_api.cluster.drain_lists = 10 ** 6  # the pods never finish draining
    # The wait's budget is drain + 15 + 30 s: the provider's clock runs 10 s per read.
    clock = iter(range(0, 10 ** 6, 10))
    monkeypatch.setattr(kmod, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda _: None))
    with pytest.raises(ProvisionError, match=r"1 pod\(s\) still exist after 46 s, expected at most 0"):
        provider.stop(name)
    monkeypatch.undo()
    assert ("api/v1", "services", "modelops", name) in fake_api.cluster.objects  # still routed to the drainers
    assert [i.state for i in reg.instances(MODEL, "1")] == ["running"]
    fake_api.cluster.terminating.clear()  # the pods are gone: stopping again finishes the job
    provider.stop(name)
    assert ("api/v1", "services", "modelops", name) not in fake_api.cluster.objects
    assert reg.instances(MODEL, "1") == []


def test_scale_to_zero_without_a_registry_row(tmp_path, fake_api):
    s = make_settings(mount=tmp_path / "fsx")
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    reg.record_announcement(parse_manifest({"model_id": MODEL, "version": "1", "source": "s3://models/m/",
                                            "task": "embed", "resources": {"cpus": 4, "memory_gb": 16}}))
    pkg = Package(s.packages_dir / MODEL / "1", MODEL, MODEL, "1", "embed")
    client = KubeClient(s, api_client=fake_api.api_client())
    provider = KubernetesProvider(s, reg, client)
    provider.poll_s = 0.02
    name = object_name(MODEL, "1")
    # A live Deployment and Service of the version, but no instance row (a lost or restored registry).
    for obj in provider.manifests(pkg, PLAN_TAG)[-2:]:
        client.apply(obj)
    assert reg.instances(MODEL, "1", live=False) == []
    with pytest.raises(KeyError, match="no instance named 'all-minilm-l6-v2-v1' in the registry"):
        provider.stop(name)
    provider.scale(MODEL, "1", 0, None, None)
    assert not any(k[1] in ("deployments", "services") for k in fake_api.cluster.objects)
    assert deletes_and_pod_lists(fake_api)[-2:] == ["DELETE services", "DELETE networkpolicies"]
    provider.scale(MODEL, "1", 0, None, None)  # nothing left: a no-op
    # A Deployment of that name that is not this version's is refused, not deleted.
    other = provider.manifests(pkg, PLAN_TAG)[-1]
    other["metadata"]["annotations"] = {"modelops.io/model-id": "other-model", "modelops.io/version": "9"}
    client.apply(other)
    with pytest.raises(ProvisionError, match="already exists for other-model 9, not all-minilm-l6-v2 1"):
        provider.scale(MODEL, "1", 0, None, None)
    assert ("apis/apps/v1", "deployments", "modelops", name) in fake_api.cluster.objects


def test_provider_crashloop_is_a_model_load_error(tmp_path, fake_api):
    _, reg, pkg, provider = provider_setup(tmp_path, fake_api)
    fake_api.cluster.deployment_behaviour = "crashloop"
    with pytest.raises(ModelLoadError, match=r"keeps exiting while loading \(exit code 1, 3 restarts\): "
                                             r"failed to load 'm' version 1: CUDA out of memory"):
        provider.ensure_instance(pkg, PLAN_TAG)
    # Created by this call, so removed again: no pod holds a GPU for a model that cannot load.
    assert not any(k[1] == "deployments" for k in fake_api.cluster.objects)
    assert reg.instances(MODEL, "1") == []


def test_provider_unschedulable_times_out_with_the_reason(tmp_path, fake_api):
    _, _, pkg, provider = provider_setup(tmp_path, fake_api, provision_timeout_s=0.2)
    fake_api.cluster.deployment_behaviour = "pending"
    with pytest.raises(ProvisionError, match=r"not ready after 0 s \(0/1 ready.*Insufficient nvidia.com/gpu"):
        provider.ensure_instance(pkg, PLAN_TAG)


def test_provider_requires_the_fsx_claim(tmp_path, fake_api):
    _, _, pkg, provider = provider_setup(tmp_path, fake_api, k8s_fsx_filesystem_id=None)
    with pytest.raises(ProvisionError, match="PersistentVolumeClaim modelops/modelops-fsx .* does not exist"):
        provider.ensure_instance(pkg, PLAN_TAG)


def test_router_applies_prunes_and_reads_weights(tmp_path, fake_api):
    s = make_settings()
    client = KubeClient(s, TrafficError, api_client=fake_api.api_client())
    stale = render_httproute("retired-model", {"1": ("retired-model-v1", 100)}, s)
    client.apply(stale)
    router = GatewayAPIRouter(s, client)
    router.poll_s = 0.02
    reg = registry_with(tmp_path / "r.db", s, {"1": 75, "2": 25})
    router.apply(routes_from_registry(reg))
    assert router.weights() == {(MODEL, "all-minilm-l6-v2-v1"): 75, (MODEL, "all-minilm-l6-v2-v2"): 25}
    assert ("apis/gateway.networking.k8s.io/v1", "httproutes", "modelops", "retired-model") not in fake_api.cluster.objects
    with pytest.raises(TrafficError, match="needs the Gateway implementation's metrics \\(Prometheus\\)"):
        router.server_requests(MODEL)
    assert router.server_errors(MODEL) is None  # no counters: the gate judges from the instances' metrics
    assert router.route_headers(MODEL) == {"X-Gateway-Model-Name": MODEL}
    fake_api.cluster.route_behaviour = "refused"
    reg.set_weights(MODEL, {"1": 50, "2": 50})
    with pytest.raises(TrafficError, match="not Accepted: NotAllowedByListeners"):
        router.apply(routes_from_registry(reg))


def test_router_accepts_conditions_without_observed_generation(tmp_path, fake_api):
    """observedGeneration is optional on status conditions; a controller that omits it must
    not make every apply wait out k8s_route_accept_timeout_s."""
    s = make_settings(k8s_route_accept_timeout_s=0.5)
    router = GatewayAPIRouter(s, KubeClient(s, TrafficError, api_client=fake_api.api_client()))
    router.poll_s = 0.02
    fake_api.cluster.route_observed_generation = False
    reg = registry_with(tmp_path / "r.db", s, {"1": 90, "2": 10})
    router.apply(routes_from_registry(reg))
    stored = fake_api.cluster.objects[("apis/gateway.networking.k8s.io/v1", "httproutes", "modelops", MODEL)]
    assert all("observedGeneration" not in c for c in stored["status"]["parents"][0]["conditions"])
    assert router.weights()[(MODEL, "all-minilm-l6-v2-v2")] == 10
    # A refusal without observedGeneration is still a refusal.
    fake_api.cluster.route_behaviour = "refused"
    reg.set_weights(MODEL, {"1": 75, "2": 25})
    with pytest.raises(TrafficError, match="not Accepted: NotAllowedByListeners"):
        router.apply(routes_from_registry(reg))


def test_router_waits_for_the_new_generation(tmp_path, fake_api):
    """A condition whose observedGeneration is older than the applied generation is not taken
    as the verdict on it (the check that stays when observedGeneration is present)."""
    s = make_settings(k8s_route_accept_timeout_s=0.3)
    client = KubeClient(s, TrafficError, api_client=fake_api.api_client())
    router = GatewayAPIRouter(s, client)
    router.poll_s = 0.02
    routes = routes_from_registry(registry_with(tmp_path / "r.db", s, {"1": 100}))
    router.apply(routes)
    fake_api.cluster._controllers = lambda *a: None  # the controller stops reporting
    changed = GatewayAPIRouter(make_settings(k8s_route_accept_timeout_s=0.3, k8s_route_timeout_s=120), client)
    changed.poll_s = 0.02
    with pytest.raises(TrafficError, match="generation 2: the Gateway controller reported no Accepted condition"):
        changed.apply(routes)  # a new spec (timeouts.request): generation 2, conditions still at 1
    stored = fake_api.cluster.objects[("apis/gateway.networking.k8s.io/v1", "httproutes", "modelops", MODEL)]
    assert stored["metadata"]["generation"] == 2
    assert {c["observedGeneration"] for c in stored["status"]["parents"][0]["conditions"]} == {1}


def test_kubeconfig_context_is_used(tmp_path, fake_api):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "other",
        "clusters": [{"name": "fake", "cluster": {"server": fake_api.url}},
                     {"name": "other", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}},
                     {"name": "other", "context": {"cluster": "other", "user": "u"}}]}))
    client = KubeClient(make_settings(k8s_kubeconfig=kubeconfig, k8s_context="fake"))
    assert client.get("apps/v1", "Deployment", "absent") is None
    with pytest.raises(ProvisionError, match="cannot load Kubernetes credentials from .*kubeconfig \\(context nope\\)"):
        KubeClient(make_settings(k8s_kubeconfig=kubeconfig, k8s_context="nope"))
    broken = tmp_path / "broken"
    broken.write_text("garbage: [")
    with pytest.raises(ProvisionError, match="cannot load Kubernetes credentials from .*broken: "):
        KubeClient(make_settings(k8s_kubeconfig=broken))


def test_no_cluster_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    s = make_settings(mount=tmp_path / "fsx", registry_url=f"sqlite:///{tmp_path / 'r.db'}")
    pkg = Package(s.packages_dir / MODEL / "1", MODEL, MODEL, "1", "embed")
    with pytest.raises(ProvisionError, match="no Kubernetes cluster is configured: set MODELOPS_K8S_KUBECONFIG"):
        KubernetesProvider(s).ensure_instance(pkg, PLAN_TAG)
    with pytest.raises(TrafficError, match="no Kubernetes cluster is configured"):
        GatewayAPIRouter(s).apply([])


def test_render_command_prints_a_valid_yaml_stream(monkeypatch, capsys):
    from tasks.kube.__main__ import main

    for key, value in {"MODELOPS_HOME": "/fsx/modelops", "MODELOPS_FSX_ROOT": "/fsx/models",
                       "MODELOPS_K8S_IMAGE_REGISTRY": REGISTRY_HOST,
                       "MODELOPS_K8S_FSX_FILESYSTEM_ID": "fs-0123456789abcdef0",
                       "MODELOPS_K8S_FSX_DNS_NAME": "fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com",
                       "MODELOPS_K8S_FSX_MOUNT_NAME": "abcdefgh"}.items():
        monkeypatch.setenv(key, value)
    manifest = REPO_ROOT / "deployments" / "models" / "all-minilm-l6-v2.yaml"
    assert main([str(manifest), "--image", PLAN_TAG, "--replicas", "2"]) == 0
    out = capsys.readouterr().out
    objects = list(yaml.safe_load_all(out))
    assert [o["kind"] for o in objects] == ["PersistentVolume", "PersistentVolumeClaim", "Service", "Deployment",
                                            "HTTPRoute", "HTTPRoute", "GRPCRoute"]
    for obj in objects[:-3]:
        k8s_validate(obj)
    assert all(r["ok"] for r in gateway_validate(objects[-3:]))
    objects = objects[:-2]  # the OpenAI HTTPRoute last, as below
    dep = objects[3]
    assert dep["spec"]["replicas"] == 2
    # manifest defaults (2 CPUs, 8 GiB) + the memory emptyDirs (1 GiB /dev/shm, 256 MiB metrics)
    assert container(dep)["resources"]["requests"] == {"cpu": "2000m", "memory": "9472Mi"}
    assert default_rule(objects[-1])["backendRefs"][0]["weight"] == 100
    assert "&id" not in out  # no YAML anchors: each object reads on its own
    monkeypatch.delenv("MODELOPS_K8S_IMAGE_REGISTRY")
    assert main([str(manifest), "--image", PLAN_TAG]) == 2
    assert "MODELOPS_K8S_IMAGE_REGISTRY" in capsys.readouterr().err
    monkeypatch.setenv("MODELOPS_K8S_ROUTE_TIMEOUT_S", "-1")
    assert main([str(manifest), "--image", PLAN_TAG]) == 2
    assert capsys.readouterr().err.startswith("error: invalid setting: MODELOPS_K8S_ROUTE_TIMEOUT_S: Input should be")
    monkeypatch.setenv("MODELOPS_K8S_ROUTE_TIMEOUT_S", "600")
    monkeypatch.setenv("MODELOPS_K8S_ROUTE_HOSTNAMES", "notjson")
    assert main([str(manifest), "--image", PLAN_TAG]) == 2
    assert "MODELOPS_K8S_ROUTE_HOSTNAMES: not valid JSON" in capsys.readouterr().err
    monkeypatch.setenv("MODELOPS_K8S_ROUTE_HOSTNAMES", "[]")
    monkeypatch.setenv("MODELOPS_K8S_IMAGE_REGISTRY", REGISTRY_HOST)
    monkeypatch.setenv("MODELOPS_K8S_INFERENCE_POOL", "true")
    assert main([str(manifest), "--image", PLAN_TAG]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [o["kind"] for o in objects][2:] == ["Service", "Deployment", "InferencePool", "HTTPRoute", "HTTPRoute",
                                                "GRPCRoute"]
    assert inferencepool_problems(objects[4]) == []
    assert default_rule(objects[5])["backendRefs"][0]["kind"] == "InferencePool"
    monkeypatch.setenv("MODELOPS_K8S_ENDPOINT_PICKER_FAILURE_MODE", "Open")
    assert main([str(manifest), "--image", PLAN_TAG]) == 2
    assert "MODELOPS_K8S_ENDPOINT_PICKER_FAILURE_MODE" in capsys.readouterr().err
    monkeypatch.setenv("MODELOPS_K8S_ENDPOINT_PICKER_FAILURE_MODE", "FailOpen")
    monkeypatch.setenv("MODELOPS_K8S_ENDPOINT_PICKER", "EPP_{pool}")
    assert main([str(manifest), "--image", PLAN_TAG]) == 2
    assert "MODELOPS_K8S_ENDPOINT_PICKER" in capsys.readouterr().err
    monkeypatch.setenv("MODELOPS_K8S_ENDPOINT_PICKER", "")
    # Bad images and replica counts: one error line, no YAML.
    for args, why in ((["--image", "reg.io/ml/runtime"], "neither a tag"), (["--image", "foo:bar"], "names repository"),
                      (["--image", PLAN_TAG, "--replicas", str(2**31)], "must be 0 to 2147483647")):
        assert main([str(manifest), *args]) == 2
        got = capsys.readouterr()
        assert got.out == "" and got.err.startswith("error: ") and why in got.err, got.err


def test_image_references_built_from_the_grammar_pass_unchanged_and_anything_else_is_checked():
    """Generated: full references assembled from the grammar's parts come back as given; arbitrary
    text either is refused or comes back as a reference of that grammar."""
    from hypothesis import given, settings as hsettings, strategies as st

    component = st.from_regex(r"[a-z0-9]{1,5}((\.|_|__|-{1,2})[a-z0-9]{1,5}){0,2}", fullmatch=True)
    host = st.from_regex(r"[a-z0-9]{1,8}(\.[a-z0-9]{1,8}){1,2}(:[0-9]{1,5})?", fullmatch=True)
    tag = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
    digest = st.sampled_from(["sha256:" + "0123456789abcdef" * 4, "sha512:" + "fedcba9876543210" * 8])
    full = st.builds(lambda h, path, t, d: f"{h}/{'/'.join(path)}" + (f":{t}" if t else "") + (f"@{d}" if d else ""),
                     host, st.lists(component, min_size=1, max_size=3), st.one_of(st.none(), tag),
                     st.one_of(st.none(), digest)).filter(lambda ref: ":" in ref.split("/", 1)[1] or "@" in ref)
    s = make_settings()
    grammar = re.compile(r"[^/@]+(/[a-z0-9._-]+)+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha(256|512):[0-9a-f]+)?")

    @hsettings(max_examples=300, deadline=None)
    @given(full)
    def valid(ref):
        assert image_reference(ref, s) == ref

    @hsettings(max_examples=300, deadline=None)
    @given(st.text(max_size=40))
    def anything(text):
        try:
            ref = image_reference(text, s)
        except ValueError as e:
            assert "MODELOPS_K8S" in str(e) or repr(text) in str(e)
        else:
            assert grammar.fullmatch(ref), ref

    valid()
    anything()


# -- autoscaling: KEDA ScaledObject per autoscaled version -----------------------------------------

SIGNALS = {"waiting": (2, "AverageValue", "sum(vllm:num_requests_waiting{"),
           "kv_cache": (0.8, "AverageValue", "sum(vllm:kv_cache_usage_perc{"),
           "ttft_p90_s": (1.5, "Value", "histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_")}


@pytest.mark.parametrize("signal", SIGNALS)
def test_scaledobject_renders_the_policy_and_passes_the_keda_schema(signal):
    from modelops.scaling import Scaling
    from tasks.kube.manifests import render_scaledobject

    s = make_settings(k8s_prometheus_url="http://prometheus.monitoring.svc:9090")
    target, metric_type, query = SIGNALS[signal]
    policy = Scaling(min=1, max=4, target={signal: target}, scale_up_window_s=15, scale_down_window_s=300)
    obj = render_scaledobject(MODEL, "2", policy, s)
    [result] = gateway_validate([obj])
    assert result["ok"], result["errors"]
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": object_name(MODEL, "2")}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == {"scaleUp": {"stabilizationWindowSeconds": 15}, "scaleDown": {"stabilizationWindowSeconds": 300}}
    [trigger] = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", metric_type)
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prometheus.monitoring.svc:9090" and meta["threshold"] == f"{target:g}"
    assert meta["ignoreNullValues"] == "false"  # lost pods are an error (no decision), never a zero
    # The version's pods only: its Deployment's pod names, its namespace, the model's served name.
    assert meta["query"].startswith(query)
    assert f'pod=~"{object_name(MODEL, "2")}-[a-z0-9]+-[a-z0-9]{{5}}"' in meta["query"]
    assert 'namespace="modelops"' in meta["query"] and f'model_name="{MODEL}"' in meta["query"]


@pytest.mark.parametrize("model_id", [MODEL, "meta-llama-3-1-8b-instruct-awq-extended-context"])
def test_scaledobject_queries_match_the_versions_pods_only(model_id):
    """Pod names as Kubernetes makes them (``<deployment>-<hash>-`` cut to 58 characters, then 5
    random ones) match the version's pattern; another version's pods do not."""
    from modelops.scaling import Scaling
    from tasks.kube.manifests import render_scaledobject

    def pod(version: str, template_hash: str, suffix: str) -> str:
        return (f"{object_name(model_id, version)}-{template_hash}-")[:58] + suffix

    s = make_settings()
    for signal in SIGNALS:
        query = render_scaledobject(model_id, "1", Scaling(max=2, target={signal: 0.5}), s)["spec"]["triggers"][0][
            "metadata"]["query"]
        patterns = set(re.findall(r'pod=~"([^"]+)"', query))
        assert len(patterns) == 1 and "\\" not in query, query  # one pattern; no escapes PromQL strings refuse
        (pattern,) = patterns
        assert re.fullmatch(pattern, pod("1", "6d4cf56db6", "x7k2q")), (pattern, pod("1", "6d4cf56db6", "x7k2q"))
        assert re.fullmatch(pattern, pod("1", "58b9c7d", "a1b2c"))
        if len(object_name(model_id, "1")) <= 46:
            assert not re.fullmatch(pattern, pod("1-2", "6d4cf56db6", "x7k2q"))  # version "1-2" is another
    # Idle (no request in the window) reads 0 while the pods report; no series at all is no value.
    selector = re.search(r"_bucket\{(.*)\}\[", query)[1]
    assert query.endswith(f" > 0 or on() (0 * sum(vllm:num_requests_running{{{selector}}}))"), query


def test_keda_validator_refuses_broken_scaledobjects():
    from modelops.scaling import Scaling
    from tasks.kube.manifests import render_scaledobject

    good = render_scaledobject(MODEL, "1", Scaling(max=2, target={"waiting": 1}), make_settings())
    typo = json.loads(json.dumps(good))
    typo["spec"]["triggers"][0]["metricTyp"] = "Value"
    wrong_type = json.loads(json.dumps(good))
    wrong_type["spec"]["minReplicaCount"] = "1"
    nested = json.loads(json.dumps(good))
    nested["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["window"] = 5
    results = gateway_validate([good, typo, wrong_type, nested])
    assert [r["ok"] for r in results] == [True, False, False, False]
    assert "metricTyp: unknown field" in results[1]["errors"][0]
    assert "minReplicaCount must be integer" in results[2]["errors"][0]
    assert "scaleDown/window: unknown field" in results[3]["errors"][0]
    with pytest.raises(ValueError, match="runs a fixed 1 replica"):
        render_scaledobject(MODEL, "1", Scaling(), make_settings())


def test_provider_applies_a_scaledobject_for_an_autoscaled_version_and_deletes_it_first(tmp_path, fake_api):
    s = make_settings(mount=tmp_path / "fsx")
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    reg.record_announcement(parse_manifest({"model_id": MODEL, "version": "1", "source": "s3://models/m/",
                                            "task": "generate", "resources": {"cpus": 4, "memory_gb": 16},
                                            "scaling": {"min": 1, "max": 3, "target": {"kv_cache": 0.7}}}))
    pkg = Package(s.packages_dir / MODEL / "1", MODEL, MODEL, "1", "generate")
    provider = KubernetesProvider(s, reg, KubeClient(s, api_client=fake_api.api_client()))
    provider.poll_s = 0.02
    name, _ = provider.ensure_instance(pkg, PLAN_TAG)
    applies = [r for r in fake_api.cluster.requests if r.method == "PATCH"]
    assert [r.path.rsplit("/", 2)[-2] for r in applies][-3:] == ["services", "deployments", "scaledobjects"]
    assert applies[-1].body["spec"]["triggers"][0]["metadata"]["threshold"] == "0.7"
    before = len(fake_api.cluster.requests)
    provider.stop(name)
    assert deletes_and_pod_lists(fake_api, before)[:2] == ["DELETE scaledobjects", "DELETE deployments"]
    assert not any(k[1] == "scaledobjects" for k in fake_api.cluster.objects)
