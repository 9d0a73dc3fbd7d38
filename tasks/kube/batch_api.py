"""The batch API on Kubernetes: OpenAI's Files and Batches endpoints (tasks/batch/api.py) served
by one pod of the control-plane image behind the Gateway, rendered as plain dicts (no cluster).

- :func:`render_batch_api`: its ``NetworkPolicy`` (ingress from the Gateway's proxies only: the
  API trusts the ``x-modelops-key`` they set), ``Service`` and ``Deployment``, printed by
  ``python -m tasks.kube batch-api --image CONTROL_PLANE_IMAGE`` for ``kubectl apply``. The pod
  runs ``python -m tasks.batch`` with the flow-run pods' environment (the work pool's base job
  template: the same Prefect server, registry Secret, S3 credentials block and service account),
  so the API and the batch runner, a flow run of ``batch-inference``, share every record.
- :func:`render_batch_api_route` and :func:`render_batch_api_securitypolicy`: its ``HTTPRoute``
  (``/v1/files`` and ``/v1/batches``) and, with API keys on, Envoy Gateway's ``SecurityPolicy``
  admitting every active key; the Gateway router applies both with the models' routes whenever
  the batch API's Service exists, to the Service's port (tasks/traffic/gateway_api.py), so every
  process that applies routes agrees without a setting of its own.

One replica, replaced with ``Recreate``: the API also sweeps for batches whose runner went
silent and starts them a new flow run, and two sweepers could start two.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from modelops.settings import Settings
from modelops.tenancy import KEY_HEADER, PLATFORM_KEY, KeyGrant
from tasks.kube.manifests import (
    ENVOY_GATEWAY_API,
    MANAGED_BY,
    api_key_auth,
    check_key_grants,
    gateway_parent_ref,
    gateway_proxy_peer,
    namespace_setting,
    pullable_reference,
)

__all__ = ["BATCH_API_NAME", "BATCH_API_PATHS", "BATCH_ROUTE_NAME", "JOB_TEMPLATE", "render_batch_api",
           "render_batch_api_route", "render_batch_api_securitypolicy", "service_port"]

BATCH_API_NAME = "modelops-batch-api"  # the Deployment, Service and NetworkPolicy
# The HTTPRoute and SecurityPolicy: a model's are named by its id, which has no "." (a DNS label),
# so no model can take this name.
BATCH_ROUTE_NAME = "modelops.batch-api"
# Path prefixes the batch API serves (PathPrefix matches whole path elements). Longer than the
# models' /v1 prefix, so the Gateway prefers this route whatever model header a client sends
# (Gateway API: the longest matching path prefix wins before header matches are counted).
BATCH_API_PATHS = ("/v1/files", "/v1/batches")
# The flow-run pods' template (prefect work-pool create --base-job-template): its env defaults,
# registry Secret and service account are the batch API's too.
JOB_TEMPLATE = Path(__file__).resolve().parents[2] / "deployments" / "kubernetes" / "base-job-template.json"
# Of its env defaults: the Prefect server (the stale-batch sweep starts flow runs) and S3's credentials
# block (the batch bucket). Not MODELOPS_HOME and the FSx root: the API has no FSx mount.
_FROM_JOB_ENV = ("PREFECT_API_URL", "MODELOPS_AWS_CREDENTIALS_BLOCK")
_LABELS = {"app.kubernetes.io/name": BATCH_API_NAME, "app.kubernetes.io/component": "batch-api", **MANAGED_BY}
# A model's pods are labelled app.kubernetes.io/name: <model id>; none carries this component.
_SELECTOR = {"app.kubernetes.io/name": BATCH_API_NAME, "app.kubernetes.io/component": "batch-api"}
_WORKDIR = "/opt/modelops"  # where the control-plane image holds this repository (docs/kubernetes.md)


def _metadata(settings: Settings, name: str = BATCH_API_NAME) -> dict:
    return {"name": name, "namespace": settings.k8s_namespace, "labels": dict(_LABELS)}


def service_port(service: dict) -> int | None:
    """The port of the batch API's Service (``python -m tasks.kube batch-api``) named ``http``,
    as the cluster stores it; None when it has none."""
    ports = (service.get("spec") or {}).get("ports") or []
    return next((p.get("port") for p in ports if p.get("name") == "http"), None)


def _job_defaults() -> tuple[dict[str, str], str, str]:
    """From the base job template: ``(its env defaults the API needs, registry Secret, service account)``."""
    variables = json.loads(JOB_TEMPLATE.read_text())["variables"]["properties"]
    env = variables["env"]["default"]
    return ({k: env[k] for k in _FROM_JOB_ENV if env.get(k)}, variables["registry_secret"]["default"],
            variables["service_account_name"]["default"])


def render_batch_api(image: str, settings: Settings) -> list[dict]:
    """The batch API's ``NetworkPolicy``, ``Service`` and ``Deployment`` (``modelops-batch-api`` in
    ``k8s_namespace``), in the order to apply them.

    The container runs ``python -m tasks.batch`` in ``/opt/modelops`` on ``batch_port`` (named
    ``http``), bound to 0.0.0.0, with the base job template's ``PREFECT_API_URL`` and
    ``MODELOPS_AWS_CREDENTIALS_BLOCK`` defaults, ``MODELOPS_REGISTRY_URL`` from its registry Secret
    (key ``url``), ``MODELOPS_K8S_NAMESPACE`` from the pod, ``MODELOPS_PROVIDER=kubernetes`` and
    ``MODELOPS_ROUTER=gateway-api`` (no instance secret: the NetworkPolicy admits only the
    Gateway's proxies), and ``batch_bucket``, ``batch_max_requests``, ``batch_stale_after_s``,
    ``batch_cache_mb``, ``router_max_body_mb`` (the largest upload) and ``k8s_gateway_url`` as
    ``settings`` has them: the work pool's flow runs must have the same. Probes ``GET /health``.

    The pod runs as the flow runs' service account (its IAM role reaches S3) without a mounted API
    token: the API never calls the Kubernetes API, and that account may read the keys' Secrets.

    Args:
        image: the control-plane image, a full reference (``REGISTRY/REPOSITORY:TAG`` or a digest).

    Raises:
        ValueError: ``k8s_network_policy`` is false (nothing would keep other pods from sending a
            key name of their choosing), ``k8s_gateway_url`` is unset (the pod would send cache
            misses to 127.0.0.1), ``image`` is not a full reference a cluster can pull, or
            ``k8s_namespace``, ``k8s_gateway_namespace`` or ``k8s_gateway_proxy_namespace`` is not
            a namespace name.
    """
    if not settings.k8s_network_policy:
        raise ValueError("MODELOPS_K8S_NETWORK_POLICY is false, but the batch API takes its caller's key name "
                         "(x-modelops-key) from whoever reaches its pod: it is rendered only behind its NetworkPolicy, "
                         "which admits Envoy Gateway's proxies alone (docs/kubernetes.md)")
    if not settings.k8s_gateway_url:
        raise ValueError("MODELOPS_K8S_GATEWAY_URL is unset, but the batch API sends a live request's result-cache "
                         "miss to the Gateway, and in its pod the default (the local router, 127.0.0.1) reaches "
                         "nothing: set it to the Gateway listener's in-cluster OpenAI base URL, such as "
                         "http://inference.gateways.svc/v1 (the work pool's flow runs need the same)")
    image = pullable_reference(image, "control-plane image")
    for setting in ("k8s_namespace", "k8s_gateway_namespace"):
        namespace_setting(settings, setting)
    env_defaults, registry_secret, service_account = _job_defaults()
    env = {**env_defaults, "MODELOPS_PROVIDER": "kubernetes", "MODELOPS_ROUTER": "gateway-api",
           "MODELOPS_BATCH_HOST": "0.0.0.0", "MODELOPS_BATCH_PORT": str(settings.batch_port),
           "MODELOPS_BATCH_BUCKET": settings.batch_bucket,
           "MODELOPS_BATCH_MAX_REQUESTS": str(settings.batch_max_requests),
           "MODELOPS_BATCH_STALE_AFTER_S": str(settings.batch_stale_after_s),
           "MODELOPS_BATCH_CACHE_MB": str(settings.batch_cache_mb),
           "MODELOPS_ROUTER_MAX_BODY_MB": str(settings.router_max_body_mb),
           "MODELOPS_K8S_GATEWAY_URL": settings.k8s_gateway_url}
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": "batch-api",
        "image": image,
        "command": ["python", "-m", "tasks.batch"],
        "workingDir": _WORKDIR,
        "ports": [{"name": "http", "containerPort": settings.batch_port, "protocol": "TCP"}],
        "env": [
            {"name": "MODELOPS_REGISTRY_URL", "valueFrom": {"secretKeyRef": {"name": registry_secret, "key": "url"}}},
            {"name": "MODELOPS_K8S_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *({"name": k, "value": v} for k, v in sorted(env.items())),
        ],
        "readinessProbe": {**probe, "failureThreshold": 2},
        "livenessProbe": {**probe, "failureThreshold": 6, "initialDelaySeconds": 30},
        # An upload (at most router_max_body_mb) is read whole before it goes to S3.
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    }
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _metadata(settings),
         "spec": {"podSelector": {"matchLabels": dict(_SELECTOR)}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [gateway_proxy_peer(settings)],
                               "ports": [{"protocol": "TCP", "port": settings.batch_port}]}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(settings),
         "spec": {"type": "ClusterIP", "selector": dict(_SELECTOR),
                  "ports": [{"name": "http", "port": settings.batch_port, "targetPort": "http", "protocol": "TCP",
                             "appProtocol": "http"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(settings),
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": dict(_SELECTOR)},
                  "template": {"metadata": {"labels": dict(_LABELS)},
                               "spec": {"serviceAccountName": service_account,
                                        "automountServiceAccountToken": False, "containers": [container]}}}},
    ]


def render_batch_api_route(settings: Settings, keys_on: bool, port: int) -> dict:
    """The batch API's ``HTTPRoute`` (:data:`BATCH_ROUTE_NAME`): ``PathPrefix`` :data:`BATCH_API_PATHS`
    on the Gateway (:func:`~tasks.kube.manifests.gateway_parent_ref`) to the Service
    :data:`BATCH_API_NAME` at ``port`` (:func:`service_port`), with ``timeouts.request``
    ``k8s_route_timeout_s`` (an upload of a large input file).

    With keys off (``keys_on`` False) a ``RequestHeaderModifier`` removes a client's own
    ``x-modelops-key``, which would otherwise name another owner's files and batches; with keys
    on Envoy's API key filter replaces it (and the route's filter would run after that one,
    removing the authenticated name too)."""
    rule: dict = {"matches": [{"path": {"type": "PathPrefix", "value": p}} for p in BATCH_API_PATHS]}
    if not keys_on:
        rule["filters"] = [{"type": "RequestHeaderModifier", "requestHeaderModifier": {"remove": [KEY_HEADER]}}]
    rule["backendRefs"] = [{"group": "", "kind": "Service", "name": BATCH_API_NAME, "port": port}]
    if settings.k8s_route_timeout_s:
        rule["timeouts"] = {"request": f"{math.ceil(settings.k8s_route_timeout_s)}s"}
    spec: dict = {"parentRefs": [gateway_parent_ref(settings)], "rules": [rule]}
    if settings.k8s_route_hostnames:
        spec["hostnames"] = list(settings.k8s_route_hostnames)
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": _metadata(settings, BATCH_ROUTE_NAME), "spec": spec}


def render_batch_api_securitypolicy(grants: Iterable[KeyGrant], settings: Settings) -> dict:
    """Envoy Gateway's ``SecurityPolicy`` (:data:`BATCH_ROUTE_NAME`) on :func:`render_batch_api_route`:
    every key in ``grants`` (and the platform's) may call the Files and Batches API, whatever its
    model scope; each line of a batch is then sent as its key's request, so the model's own policy
    checks the scope (tasks/batch/run.py). The key's name reaches the API as ``x-modelops-key``,
    and the key itself does not. No rate limit: as locally, these calls are outside a key's
    limits (a batch's lines are inside them).

    Raises:
        ValueError: what :func:`~tasks.kube.manifests.check_key_grants` raises.
    """
    grants = list(grants)
    check_key_grants(grants)
    names = [PLATFORM_KEY, *sorted(g.name for g in grants)]
    target = {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": BATCH_ROUTE_NAME}
    return {"apiVersion": ENVOY_GATEWAY_API, "kind": "SecurityPolicy",
            "metadata": _metadata(settings, BATCH_ROUTE_NAME),
            "spec": {"targetRefs": [target], "apiKeyAuth": api_key_auth(names)}}
