"""API keys, scopes and limits at the Gateway on Kubernetes, and the NetworkPolicy that keeps the
serving pods behind it, checked without a cluster.

- Envoy Gateway's SecurityPolicy and BackendTrafficPolicy pass the schema that
  @kubernetes-models/envoy-gateway 2.0.0 generates from Envoy Gateway's CRDs (tests/k8s, strict),
  and the CEL rules that schema leaves out are checked here (:func:`envoy_cel_problems`).
- The Secret and the NetworkPolicy pass kubernetes-validate (strict) for two Kubernetes releases.
- Values: a key outside a model's scope is absent from its SecurityPolicy; rpm becomes a per-minute
  rule on the forwarded key name; the NetworkPolicy selects exactly the version's pods and admits
  only the Gateway's proxies, the control plane, the metrics namespace (and the endpoint picker).
- The router and the provider through the real `kubernetes` client against the loopback stand-in
  of the API server (tests/unit/fake_kube_api.py), and `modelops keys` on the gateway-api router.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from modelops.errors import TrafficError
from modelops.registry import Registry
from modelops.settings import REPO_ROOT
from modelops.tenancy import ALL_MODELS, PLATFORM_KEY, KeyGrant, key_hash, new_key
from tasks.kube.client import KubeClient
from tasks.kube.manifests import (
    CONTROL_PLANE_LABELS,
    KEY_HEADER,
    PORTS,
    check_key_grants,
    key_secret_name,
    object_name,
    render_api_key_secret,
    render_backendtrafficpolicy,
    render_deployment,
    render_inferencepool,
    render_networkpolicy,
    render_securitypolicy,
)
from tasks.provision.kubernetes import KubernetesProvider
from tasks.traffic.gateway_api import GatewayAPIRouter
from tasks.traffic.interface import routes_from_registry
from tests.unit.fake_kube_api import FakeKubeAPI
from tests.unit.test_kubernetes import (
    MODEL,
    NODE_VALIDATOR,
    PLAN_TAG,
    gateway_validate,
    k8s_validate,
    make_settings,
    registry_with,
    spec,
)

OTHER = "smollm2-135m-instruct"


def envoy_validate(objects: list[dict]) -> list[dict]:
    if not (NODE_VALIDATOR.parent / "node_modules" / "@kubernetes-models" / "envoy-gateway").is_dir():
        pytest.fail("the Envoy Gateway validator is not installed: run `npm ci` in tests/k8s (make test-unit does)")
    return gateway_validate(objects)


# The rules of Envoy Gateway's CRDs that are CEL (x-kubernetes-validations) or checks of its translator,
# which the generated schema does not carry. Source: github.com/envoyproxy/gateway at tag v1.9.0:
# api/v1alpha1/securitypolicy_types.go and backendtrafficpolicy_types.go (targetRef/targetRefs rules),
# api_key_auth_types.go (ExtractFrom: exactly one of headers, params, cookies), ratelimit_types.go
# (RateLimitSelectCondition needs one condition; Local rules: no response cost, no fromMetadata),
# internal/gatewayapi/backendtrafficpolicy.go buildRateLimitRule (Exact and RegularExpression header
# matches need a value, Distinct must have none) and buildLocalRateLimit (at most one rule without
# clientSelectors), securitypolicy.go buildAPIKeyAuth (credentialRefs are Secrets; a cross-namespace
# one needs a ReferenceGrant, which modelops never writes, so none may name another namespace).
_ROUTE_KINDS = {"SecurityPolicy": {"Gateway", "ListenerSet", "HTTPRoute", "GRPCRoute", "TCPRoute"},
                "BackendTrafficPolicy": {"Gateway", "ListenerSet", "HTTPRoute", "GRPCRoute", "UDPRoute", "TCPRoute",
                                         "TLSRoute"}}


def envoy_cel_problems(obj: dict) -> list[str]:
    """What Envoy Gateway (v1.9.0) would refuse in a rendered policy beyond its schema; [] when none."""
    spec, out = obj["spec"], []
    if ("targetRef" in spec) == ("targetRefs" in spec) and not spec.get("targetSelectors"):
        out.append("either targetRef or targetRefs must be used")
    for ref in spec.get("targetRefs") or []:
        if ref.get("group") != "gateway.networking.k8s.io" or ref.get("kind") not in _ROUTE_KINDS[obj["kind"]]:
            out.append(f"targetRefs: {ref} is not a Gateway API target of {obj['kind']}")
    auth = spec.get("apiKeyAuth")
    if auth is not None:
        for source in auth.get("extractFrom") or []:
            if sum(k in source for k in ("headers", "params", "cookies")) != 1:
                out.append("extractFrom: exactly one of headers, params, or cookies must be specified")
        for ref in auth.get("credentialRefs") or []:
            if ref.get("kind", "Secret") != "Secret" or ref.get("group", "") != "" or "namespace" in ref:
                out.append(f"credentialRefs: {ref} is not a Secret of the policy's namespace")
    local = ((spec.get("rateLimit") or {}).get("local") or {})
    if local and (spec["rateLimit"].get("type") not in (None, "Local")):
        out.append("rateLimit.type must be Local for a local rate limit")
    if sum(not r.get("clientSelectors") for r in local.get("rules") or []) > 1:
        out.append("local rateLimit can not have more than one rule without clientSelectors")
    for rule in local.get("rules") or []:
        if (rule.get("cost") or {}).get("response") or "fromMetadata" in rule.get("limit", {}):
            out.append("response cost and limit fromMetadata are not supported for Local Rate Limits")
        for selector in rule.get("clientSelectors") or []:
            if not any(k in selector for k in ("headers", "methods", "path", "sourceCIDR", "queryParams")):
                out.append("at least one of headers, methods, path, sourceCIDR or queryParams must be specified")
            for header in selector.get("headers") or []:
                distinct = header.get("type") == "Distinct"
                if distinct == ("value" in header):
                    out.append(f"header match {header}: Distinct takes no value, Exact/RegularExpression need one")
    return out


GRANTS = [KeyGrant("team-a", "a" * 64, (MODEL,), rpm=600),
          KeyGrant("team-b", "b" * 64, (OTHER,), rpm=60),
          KeyGrant("ops", "c" * 64, (ALL_MODELS,)),
          KeyGrant("batch", "d" * 64, (MODEL, OTHER), rpm=6000, max_concurrency=4)]


# -- rendering ------------------------------------------------------------------------------------

def test_a_keys_secret_holds_the_key_as_envoy_reads_it():
    """One Opaque Secret per key: its one data entry maps the client id (the key's name) to the key
    (api_key_auth_types.go: "each API key is stored in the key representing the client id")."""
    s = make_settings()
    key = new_key()
    secret = render_api_key_secret("team-a", key, s)
    k8s_validate(secret)
    assert secret["metadata"]["name"] == key_secret_name("team-a") == "modelops-key-team-a"
    assert secret["type"] == "Opaque" and secret["metadata"]["namespace"] == "modelops"
    assert secret["metadata"]["labels"]["modelops.io/api-key"] == "team-a"
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {"team-a": key}
    for name, bad, why in (("Team A", key, "not a key name"), ("t", "", "empty"), ("t", "mo-a b", "whitespace")):
        with pytest.raises(ValueError, match=why) as e:
            render_api_key_secret(name, bad, s)
        assert key not in str(e.value)


def test_policies_pass_the_envoy_gateway_schema_and_its_cel_rules():
    s = make_settings()
    objects = [render_securitypolicy(MODEL, GRANTS, s), render_backendtrafficpolicy(MODEL, GRANTS, s),
               render_securitypolicy(OTHER, GRANTS, make_settings(k8s_kserve_routes=False))]
    results = envoy_validate(objects)
    assert all(r["ok"] for r in results), results
    assert [envoy_cel_problems(o) for o in objects] == [[], [], []]
    # The policies target exactly the routes the router renders for the model.
    routes = GatewayAPIRouter(s).render([_route(MODEL)])
    assert [(t["kind"], t["name"]) for t in objects[0]["spec"]["targetRefs"]] == \
        [(r["kind"], r["metadata"]["name"]) for r in routes]
    assert objects[0]["spec"]["targetRefs"] == objects[1]["spec"]["targetRefs"]
    assert [t["kind"] for t in objects[2]["spec"]["targetRefs"]] == ["HTTPRoute"]


def test_validators_refuse_broken_policies():
    """A pass means something: the schema check refuses a misspelled field, a bad enum, a string
    count and 17 local rules; the CEL checks refuse what only the API server or the translator would."""
    s = make_settings()
    security, limits = render_securitypolicy(MODEL, GRANTS, s), render_backendtrafficpolicy(MODEL, GRANTS, s)

    def broken(obj: dict, edit) -> dict:
        copy = json.loads(json.dumps(obj))
        edit(copy["spec"])
        return copy

    schema_cases = [
        broken(security, lambda sp: sp["apiKeyAuth"].update(extractFrm=sp["apiKeyAuth"].pop("extractFrom"))),
        broken(security, lambda sp: sp["apiKeyAuth"].update(forwardClientIdHeader="x")),
        broken(limits, lambda sp: sp["rateLimit"]["local"]["rules"][0]["limit"].update(unit="Minutes")),
        broken(limits, lambda sp: sp["rateLimit"]["local"]["rules"][0]["limit"].update(requests="600")),
        broken(limits, lambda sp: sp["rateLimit"]["local"]["rules"][0]["clientSelectors"][0]["headers"][0]
               .update(type="Prefix")),
        broken(limits, lambda sp: sp["rateLimit"]["local"].update(rules=sp["rateLimit"]["local"]["rules"] * 17)),
        broken(limits, lambda sp: sp["rateLimit"].update(type="Regional")),
    ]
    results = envoy_validate(schema_cases)
    errors = [" | ".join(r["errors"]) for r in results]
    assert not any(r["ok"] for r in results), results
    assert "extractFrm: unknown field" in errors[0] and "forwardClientIdHeader: unknown field" in errors[1]
    assert "unit must be equal to one of the allowed values" in errors[2]
    assert "requests must be integer" in errors[3]
    assert "type must be equal to one of the allowed values" in errors[4]
    assert "rules must NOT have more than 16 items" in errors[5]
    assert "type must be equal to one of the allowed values" in errors[6]
    cel_cases = {
        "either targetRef or targetRefs": broken(security, lambda sp: sp.update(targetRef=sp["targetRefs"][0])),
        "not a Gateway API target": broken(limits, lambda sp: sp["targetRefs"][0].update(kind="Service")),
        "exactly one of headers, params, or cookies": broken(
            security, lambda sp: sp["apiKeyAuth"]["extractFrom"][0].update(params=["key"])),
        "not a Secret of the policy's namespace": broken(
            security, lambda sp: sp["apiKeyAuth"]["credentialRefs"][0].update(namespace="elsewhere")),
        "at least one of headers": broken(limits, lambda sp: sp["rateLimit"]["local"]["rules"][0]
                                          .update(clientSelectors=[{}])),
        "Distinct takes no value": broken(limits, lambda sp: sp["rateLimit"]["local"]["rules"][0]["clientSelectors"][0]
                                          ["headers"][0].update(type="Distinct")),
    }
    for says, obj in cel_cases.items():
        assert any(says in p for p in envoy_cel_problems(obj)), (says, envoy_cel_problems(obj))


def test_a_key_outside_a_models_scope_is_absent_from_its_security_policy():
    s = make_settings()
    for model, admitted in ((MODEL, ["batch", "ops", "team-a"]), (OTHER, ["batch", "ops", "team-b"]),
                            ("never-named", ["ops"])):
        policy = render_securitypolicy(model, GRANTS, s)
        refs = [r["name"] for r in policy["spec"]["apiKeyAuth"]["credentialRefs"]]
        # The platform's own key (the route checks) first, then the keys in scope, sorted.
        assert refs == [key_secret_name(PLATFORM_KEY), *map(key_secret_name, admitted)], (model, refs)
        auth = policy["spec"]["apiKeyAuth"]
        assert auth["extractFrom"] == [{"headers": ["Authorization"]}]  # Envoy strips "Bearer "
        assert (auth["forwardClientIDHeader"], auth["sanitize"]) == (KEY_HEADER, True)
    assert render_securitypolicy(MODEL, [], s)["spec"]["apiKeyAuth"]["credentialRefs"] == [
        {"group": "", "kind": "Secret", "name": key_secret_name(PLATFORM_KEY)}]  # keys on, none yet: all refused


def test_rpm_renders_a_per_minute_rule_on_the_forwarded_key_name():
    s = make_settings()
    rules = render_backendtrafficpolicy(MODEL, GRANTS, s)["spec"]["rateLimit"]
    assert rules["type"] == "Local"
    assert rules["local"]["rules"] == [  # ops has no rpm; team-b is not in scope
        {"clientSelectors": [{"headers": [{"type": "Exact", "name": KEY_HEADER, "value": "batch"}]}],
         "limit": {"requests": 6000, "unit": "Minute"}},
        {"clientSelectors": [{"headers": [{"type": "Exact", "name": KEY_HEADER, "value": "team-a"}]}],
         "limit": {"requests": 600, "unit": "Minute"}}]
    # max_concurrency (batch's 4) has no counterpart in the policy.
    assert "4" not in json.dumps(rules) and "maxParallel" not in json.dumps(rules)
    assert render_backendtrafficpolicy("never-named", GRANTS, s) is None  # only ops covers it, without rpm


@pytest.mark.parametrize(("grants", "says"), [
    ([KeyGrant("empty", "e" * 64, ())], "API key 'empty' names no model"),
    ([KeyGrant("Bad_Name", "e" * 64, (MODEL,))], "'Bad_Name' is not a key name"),
    ([KeyGrant("zero", "e" * 64, (MODEL,), rpm=0)], "rpm 0 outside 1..4294967295"),
    ([KeyGrant("huge", "e" * 64, (MODEL,), rpm=2**32)], "rpm 4294967296 outside"),
    ([KeyGrant("twice", "e" * 64, (MODEL,)), KeyGrant("twice", "f" * 64, (OTHER,))], "given twice"),
    ([KeyGrant(PLATFORM_KEY, "e" * 64, (MODEL,))], "reserved for the platform"),
    ([KeyGrant(f"k{i}", f"{i}" * 64, (MODEL,), rpm=10) for i in range(10)] +
     [KeyGrant(f"s{i}", f"s{i}", (ALL_MODELS,), rpm=10) for i in range(7)],
     "17 API keys with an rpm limit cover model"),
    ([KeyGrant(f"s{i}", f"s{i}", (ALL_MODELS,), rpm=10) for i in range(17)], "cover every model"),
])
def test_grants_the_gateway_cannot_enforce_are_refused_naming_the_fix(grants, says):
    for render in (render_securitypolicy, render_backendtrafficpolicy):
        with pytest.raises(ValueError, match=says):
            render(MODEL, grants, make_settings())
    with pytest.raises(ValueError, match=says):
        check_key_grants(grants)
    # 16 keys with an rpm on one model is the most: one local rule each.
    check_key_grants([KeyGrant(f"k{i}", f"{i}", (MODEL,), rpm=10) for i in range(16)])


def test_the_network_policy_admits_only_the_gateway_and_the_platform():
    s = make_settings()
    policy = render_networkpolicy(MODEL, "2.0-rc", s)
    k8s_validate(policy)
    assert policy["metadata"]["name"] == object_name(MODEL, "2.0-rc")
    pod = render_deployment(spec(s, version="2.0-rc"), s)
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == pod["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["spec"]["template"]["metadata"]["labels"].items()
    other = render_deployment(spec(s, version="1"), s)["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= other.items()  # another version's pods are not this policy's
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
    rules = policy["spec"]["ingress"]
    assert all(set(rule) == {"from", "ports"} and rule["from"] for rule in rules)  # no rule admits everyone
    proxies, control, scrape = rules
    # Envoy Gateway's proxies of this Gateway, in Envoy Gateway's namespace, on the serving ports only.
    assert proxies["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "envoy",
                                        "gateway.envoyproxy.io/owning-gateway-name": "inference",
                                        "gateway.envoyproxy.io/owning-gateway-namespace": "gateways"}}}]
    assert {p["port"] for p in proxies["ports"]} == {PORTS["openai"], PORTS["kserve-http"], PORTS["kserve-grpc"]}
    # The control plane's flow-run pods (health and route checks through the Service, the gate's /metrics).
    assert control["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "modelops"}},
                                "podSelector": {"matchLabels": CONTROL_PLANE_LABELS}}]
    assert {p["port"] for p in control["ports"]} == set(PORTS.values())
    assert scrape == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
                      "ports": [{"protocol": "TCP", "port": PORTS["openai"]}]}
    # The same labels are on the control plane's pods: the work pool's Job template puts them on its pod
    # template, and prefect-kubernetes (0.8.0, worker.py _propagate_labels_to_pod) keeps them there.
    template = json.loads((REPO_ROOT / "deployments" / "kubernetes" / "base-job-template.json").read_text())
    assert template["job_configuration"]["job_manifest"]["spec"]["template"]["metadata"]["labels"] == \
        CONTROL_PLANE_LABELS
    # Without a metrics namespace only two peers; the proxies' namespace follows the setting.
    lean = render_networkpolicy(MODEL, "1", make_settings(k8s_metrics_namespace=None, k8s_gateway_namespace=None,
                                                          k8s_gateway_proxy_namespace="modelops"))
    k8s_validate(lean)
    assert len(lean["spec"]["ingress"]) == 2
    assert lean["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "gateway.envoyproxy.io/owning-gateway-namespace"] == "modelops"
    for setting in ("k8s_gateway_proxy_namespace", "k8s_metrics_namespace"):
        with pytest.raises(ValueError, match=f"MODELOPS_{setting.upper()} 'Not A Namespace'"):
            render_networkpolicy(MODEL, "1", make_settings(**{setting: "Not A Namespace"}))


def test_with_inference_pools_the_network_policy_admits_the_versions_endpoint_picker():
    s = make_settings(k8s_inference_pool=True)
    policy = render_networkpolicy(MODEL, "1", s)
    k8s_validate(policy)
    picker = policy["spec"]["ingress"][-1]
    service = render_inferencepool(MODEL, "1", s)["spec"]["endpointPickerRef"]["name"]
    # The inferencepool Helm chart selects its picker's pods by `inferencepool: <its Service name>`.
    assert picker == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "modelops"}},
                                "podSelector": {"matchLabels": {"inferencepool": service}}}],
                      "ports": [{"protocol": "TCP", "port": PORTS["openai"]}]}


# -- against the loopback stand-in of the API server ----------------------------------------------

@pytest.fixture
def fake_api(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the client's discovery cache, per test
    with FakeKubeAPI() as api:
        yield api


def _route(model_id: str):
    from tasks.traffic.interface import ModelRoute, Server

    return ModelRoute(model_id, {"1": (Server(object_name(model_id, "1"), "", 100),)})


def _secret_names(api: FakeKubeAPI) -> set[str]:
    return {k[3] for k in api.cluster.objects if k[1] == "secrets"}


def test_the_router_applies_each_models_key_policies_before_its_routes(tmp_path, fake_api, caplog):
    s = make_settings(k8s_kserve_routes=False)
    reg = registry_with(tmp_path / "r.db", s, {"1": 100})
    client = KubeClient(s, TrafficError, api_client=fake_api.api_client())
    router = GatewayAPIRouter(s, client, registry=reg)
    router.poll_s = 0.02
    keys = {name: new_key() for name in ("team-a", "late", "gone")}
    for name, models, rpm in (("team-a", (MODEL,), 120), ("late", (MODEL,), None), ("gone", (ALL_MODELS,), None)):
        reg.create_key(name, key_hash(keys[name]), models, rpm=rpm)
    router.put_key("team-a", keys["team-a"])
    router.put_key("gone", keys["gone"])  # "late" never got its Secret (a create that did not finish)
    reg.revoke_key("gone")
    before = len(fake_api.cluster.requests)
    router.apply(routes_from_registry(reg))
    applied = [r.path.rsplit("/", 2)[-2] for r in fake_api.cluster.requests[before:] if r.method == "PATCH"]
    # The platform's key first, then the policies, then the route they protect.
    assert applied == ["secrets", "securitypolicies", "backendtrafficpolicies", "httproutes"]
    stored = fake_api.cluster.objects
    policy = stored[("apis/gateway.envoyproxy.io/v1alpha1", "securitypolicies", "modelops", MODEL)]
    assert [r["name"] for r in policy["spec"]["apiKeyAuth"]["credentialRefs"]] == [
        key_secret_name(PLATFORM_KEY), key_secret_name("team-a")]  # no Secret for "late": left out, refused
    assert "late have no Secret at the Gateway" in caplog.text
    limits = stored[("apis/gateway.envoyproxy.io/v1alpha1", "backendtrafficpolicies", "modelops", MODEL)]
    assert limits["spec"]["rateLimit"]["local"]["rules"][0]["limit"] == {"requests": 120, "unit": "Minute"}
    assert _secret_names(fake_api) == {key_secret_name(PLATFORM_KEY), key_secret_name("team-a")}  # "gone" deleted
    # The route checks present the platform's key, which exists only in its Secret.
    platform = stored[("api/v1", "secrets", "modelops", key_secret_name(PLATFORM_KEY))]["data"][PLATFORM_KEY]
    assert router.route_headers(MODEL) == {"X-Gateway-Model-Name": MODEL,
                                           "Authorization": f"Bearer {base64.b64decode(platform).decode()}"}
    # A batch's lines present their owner's key, read from its Secret; a key without one is an error.
    assert router.key_headers("team-a") == {"Authorization": f"Bearer {keys['team-a']}"}
    with pytest.raises(TrafficError, match="'late' has no Secret"):
        router.key_headers("late")
    # Applying again keeps the platform's key; a revoked key leaves the policy and loses its Secret.
    reg.revoke_key("team-a")
    router.apply(routes_from_registry(reg))
    assert stored[("api/v1", "secrets", "modelops", key_secret_name(PLATFORM_KEY))]["data"][PLATFORM_KEY] == platform
    policy = stored[("apis/gateway.envoyproxy.io/v1alpha1", "securitypolicies", "modelops", MODEL)]
    assert [r["name"] for r in policy["spec"]["apiKeyAuth"]["credentialRefs"]] == [key_secret_name(PLATFORM_KEY)]
    assert _secret_names(fake_api) == {key_secret_name(PLATFORM_KEY)}
    assert not any(k[1] == "backendtrafficpolicies" for k in stored)  # no rpm left: its policy is gone
    # A model no longer routed loses its route, then its policy.
    reg.set_state(MODEL, "1", "retired")
    router.apply(routes_from_registry(reg))
    assert not any(k[1] in ("httproutes", "securitypolicies") for k in stored)
    # The keys were never written to this machine's disk by the router.
    on_disk = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert not any(k.encode() in on_disk for k in keys.values())


def test_a_policy_the_gateway_refuses_fails_the_apply(tmp_path, fake_api):
    s = make_settings(k8s_route_accept_timeout_s=0.5)
    reg = registry_with(tmp_path / "r.db", s, {"1": 100})
    router = GatewayAPIRouter(s, KubeClient(s, TrafficError, api_client=fake_api.api_client()), registry=reg)
    router.poll_s = 0.02
    reg.create_key("team-a", key_hash(new_key()), (MODEL,))
    fake_api.cluster.policy_behaviour = "refused"
    with pytest.raises(TrafficError, match="SecurityPolicy modelops/all-minilm-l6-v2 generation 1 not Accepted: "
                                           "Invalid"):
        router.apply(routes_from_registry(reg))


def test_without_keys_the_router_writes_no_policy(tmp_path, fake_api):
    """Keys off (router_auth auto, none ever made): routes only, and the cluster needs no Envoy
    Gateway CRDs; router_auth on with no key: every model's policy admits only the platform."""
    s = make_settings()
    reg = registry_with(tmp_path / "r.db", s, {"1": 100})
    router = GatewayAPIRouter(s, KubeClient(s, TrafficError, api_client=fake_api.api_client()), registry=reg)
    router.poll_s = 0.02
    router.apply(routes_from_registry(reg))
    assert not any("envoyproxy" in r.path or "/secrets" in r.path for r in fake_api.cluster.requests)
    assert router.route_headers(MODEL) == {"X-Gateway-Model-Name": MODEL}
    on = make_settings(router_auth="on")
    router = GatewayAPIRouter(on, KubeClient(on, TrafficError, api_client=fake_api.api_client()), registry=reg)
    router.poll_s = 0.02
    router.apply(routes_from_registry(reg))
    policy = fake_api.cluster.objects[("apis/gateway.envoyproxy.io/v1alpha1", "securitypolicies", "modelops", MODEL)]
    assert [r["name"] for r in policy["spec"]["apiKeyAuth"]["credentialRefs"]] == [key_secret_name(PLATFORM_KEY)]
    with pytest.raises(ValueError, match="--max-concurrency"):
        router.check_new_key(KeyGrant("t", "", (MODEL,), max_concurrency=2), [])


def test_the_provider_fences_the_pods_first_and_removes_the_fence_last(tmp_path, fake_api):
    from modelops.artifacts import Package

    for fenced in (True, False):
        s = make_settings(mount=tmp_path / "fsx", k8s_network_policy=fenced, k8s_fsx_filesystem_id=None)
        reg = registry_with(tmp_path / f"r{fenced}.db", s, {"1": 100})
        reg.update_instance(object_name(MODEL, "1"), state="stopped")
        client = KubeClient(s, api_client=fake_api.api_client())
        client.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
            "name": "modelops-fsx", "namespace": "modelops"}, "spec": {}})
        provider = KubernetesProvider(s, reg, client)
        provider.poll_s = 0.02
        before = len(fake_api.cluster.requests)
        name, _ = provider.ensure_instance(Package(s.packages_dir / MODEL / "1", MODEL, MODEL, "1", "embed"), PLAN_TAG)
        applied = [r.path.rsplit("/", 2)[-2] for r in fake_api.cluster.requests[before:] if r.method == "PATCH"]
        assert applied == (["networkpolicies"] if fenced else []) + ["services", "deployments"]
        if fenced:
            stored = fake_api.cluster.objects[("apis/networking.k8s.io/v1", "networkpolicies", "modelops", name)]
            assert stored["spec"] == render_networkpolicy(MODEL, "1", s)["spec"]
        provider.stop(name)
        deleted = [r.path.rsplit("/", 2)[-2] for r in fake_api.cluster.requests[before:] if r.method == "DELETE"]
        assert deleted == ["deployments", "services", "networkpolicies"]  # also deleted once turned off
        assert not any(k[1] == "networkpolicies" for k in fake_api.cluster.objects)


# -- `modelops keys` on the gateway-api router ----------------------------------------------------

CLI = str(Path(sys.executable).parent / "modelops")


def test_keys_on_the_gateway_go_into_a_secret_and_nowhere_else(home: Path, tmp_path: Path, fake_api):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake_api.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    # PYTHONPATH: this checkout's code, also where the console script was installed from another one.
    env = {**os.environ, "MODELOPS_ROUTER": "gateway-api", "MODELOPS_K8S_KUBECONFIG": str(kubeconfig),
           "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}

    def keys(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CLI, "keys", *args], capture_output=True, text=True, timeout=120, env=env)

    refused = keys("create", "--name", "t", "--models", MODEL, "--max-concurrency", "2")
    assert refused.returncode == 2 and "--max-concurrency" in refused.stderr, refused.stderr
    made = keys("create", "--name", "team-a", "--models", MODEL, "--rpm", "60")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    secret = fake_api.cluster.objects[("api/v1", "secrets", "modelops", key_secret_name("team-a"))]
    assert base64.b64decode(secret["data"]["team-a"]).decode() == key
    assert "the router is not running" in made.stderr  # no Gateway object in the stand-in
    (row,) = Registry(f"sqlite:///{home / 'registry.db'}").api_keys()
    assert row.key_hash == key_hash(key)
    assert key.encode() not in b"".join(p.read_bytes() for p in home.rglob("*") if p.is_file())
    rotated = keys("rotate", "team-a", "--json")
    new = json.loads(rotated.stdout)["key"]
    secret = fake_api.cluster.objects[("api/v1", "secrets", "modelops", key_secret_name("team-a"))]
    assert base64.b64decode(secret["data"]["team-a"]).decode() == new != key
    # An existing name is refused before its Secret is touched.
    again = keys("create", "--name", "team-a", "--models", MODEL)
    assert again.returncode == 2 and "exists already" in again.stderr
    assert base64.b64decode(fake_api.cluster.objects[("api/v1", "secrets", "modelops", key_secret_name(
        "team-a"))]["data"]["team-a"]).decode() == new
