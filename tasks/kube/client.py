"""The cluster side: load a kubeconfig or the in-cluster service account, server-side-apply
rendered objects, read them back, delete them.

Built on the official ``kubernetes`` client (the ``k8s`` extra), imported only when a client is
made, so rendering and the local stack never need it. Writes use server-side apply
(``PATCH`` with ``Content-Type: application/apply-patch+yaml``, ``fieldManager=modelops``,
``force=true`` as the Kubernetes docs advise for controllers): applying the same object twice
changes nothing, and modelops owns exactly the fields it renders.

Nothing in this module has run against a real API server here (no cluster on the build machine);
tests/unit/test_kubernetes.py drives it against a loopback HTTP server that answers the API
paths it uses, which checks the requests it sends, not a cluster's behaviour.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from modelops.errors import ModelopsError, ProvisionError
from modelops.settings import Settings
from tasks.kube.manifests import FIELD_MANAGER

__all__ = ["IN_CLUSTER_TOKEN", "KubeClient", "cluster_source"]

log = logging.getLogger(__name__)

IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")

_HOW = ("set MODELOPS_K8S_KUBECONFIG (or KUBECONFIG) to a kubeconfig with access to namespace {ns}, "
        "optionally MODELOPS_K8S_CONTEXT, or run inside the cluster with a service account "
        "(deployments/kubernetes/rbac.yaml)")


def cluster_source(settings: Settings) -> tuple[str, Path | None] | None:
    """Where cluster credentials would come from, without loading them.

    Returns:
        ``("kubeconfig", path)`` for ``k8s_kubeconfig``, ``$KUBECONFIG`` (its first existing file)
        or ``~/.kube/config``; ``("in-cluster", None)`` inside a pod (``KUBERNETES_SERVICE_HOST``
        and a mounted service-account token); ``None`` when there is no cluster configured.
    """
    if settings.k8s_kubeconfig is not None:
        return "kubeconfig", settings.k8s_kubeconfig.expanduser()
    for item in filter(None, os.environ.get("KUBECONFIG", "").split(os.pathsep)):
        if Path(item).expanduser().is_file():
            return "kubeconfig", None  # the client merges every file of $KUBECONFIG
    default = Path("~/.kube/config").expanduser()
    if default.is_file():
        return "kubeconfig", default
    if os.environ.get("KUBERNETES_SERVICE_HOST") and IN_CLUSTER_TOKEN.is_file():
        return "in-cluster", None
    return None


class KubeClient:
    """A namespace-scoped handle on one cluster.

    Args:
        settings: ``k8s_namespace``, ``k8s_kubeconfig``, ``k8s_context``.
        error: the exception type raised for every failure (ProvisionError for the provider,
            TrafficError for the router), so callers see their own stage's error.
        api_client: an already configured ``kubernetes.client.ApiClient`` (tests); default:
            from :func:`cluster_source`.

    Raises:
        error: no cluster is configured (saying how to configure one), the ``kubernetes``
            package is missing, the kubeconfig cannot be loaded, or the API server cannot be reached.
    """

    def __init__(self, settings: Settings, error: type[ModelopsError] = ProvisionError, api_client: Any = None) -> None:
        self.settings, self.error, self.namespace = settings, error, settings.k8s_namespace
        try:
            from kubernetes import client, config
            from kubernetes.dynamic import DynamicClient
        except ImportError:
            raise error("the kubernetes client is not installed: pip install 'modelops[k8s]'") from None
        if api_client is None:
            source = cluster_source(settings)
            if source is None:
                raise error("no Kubernetes cluster is configured: " + _HOW.format(ns=self.namespace))
            kind, path = source
            try:
                if kind == "in-cluster":
                    conf = client.Configuration()
                    config.load_incluster_config(client_configuration=conf)
                    api_client = client.ApiClient(conf)
                else:
                    api_client = config.new_client_from_config(config_file=str(path) if path else None,
                                                               context=settings.k8s_context)
            except (config.ConfigException, OSError, KeyError, ValueError, yaml.YAMLError) as e:
                where = path or os.environ.get("KUBECONFIG") or "in-cluster service account"
                raise error(f"cannot load Kubernetes credentials from {where}"
                            f"{f' (context {settings.k8s_context})' if settings.k8s_context else ''}: {e}") from None
        self.api_client = api_client
        try:
            self._dynamic = DynamicClient(api_client)  # reads the API server's discovery documents
        except Exception as e:  # noqa: BLE001 - urllib3, ApiException, TLS errors alike
            host = getattr(api_client.configuration, "host", "?")
            raise error(f"cannot reach the Kubernetes API server at {host}: {e}") from None

    # -- resources -----------------------------------------------------------------------------
    def _resource(self, api_version: str, kind: str):
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self._dynamic.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            hint = (" install the Gateway API CRDs (standard channel) and a Gateway implementation"
                    if api_version.startswith("gateway.networking.k8s.io") else
                    " install KEDA (its CRDs and operator; keda.sh/docs/deploy), which scales the versions whose "
                    "manifest's scaling has max above min" if api_version.startswith("keda.sh") else
                    " API keys are on (modelops keys ls) and Envoy Gateway enforces them on Kubernetes: install "
                    "Envoy Gateway (v1.5 or later) as the Gateway's implementation (docs/kubernetes.md)"
                    if api_version.startswith("gateway.envoyproxy.io") else "")
            raise self.error(f"the cluster does not serve {kind} ({api_version});{hint}") from None

    def _fail(self, what: str, e: Exception):
        status = getattr(e, "status", None)
        summary = getattr(e, "summary", lambda: str(e))()
        hint = ""
        if status == 403:
            hint = (f"; the credentials lack RBAC permission (the control plane's role is in "
                    f"deployments/kubernetes/rbac.yaml, namespace {self.namespace})")
        elif status == 422:
            hint = "; the API server refused the object's fields (its message names them)"
        return self.error(f"{what} failed{f' (HTTP {status})' if status else ''}: {summary}{hint}")

    def apply(self, obj: dict) -> dict:
        """Server-side apply ``obj`` (created if absent, its rendered fields set otherwise) and
        return the object as stored (``status`` included)."""
        res = self._resource(obj["apiVersion"], obj["kind"])
        what = f"applying {obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"
        try:
            out = self._dynamic.server_side_apply(res, body=obj, name=obj["metadata"]["name"],
                                                  namespace=obj["metadata"].get("namespace"),
                                                  field_manager=FIELD_MANAGER, force_conflicts=True)
        except Exception as e:  # noqa: BLE001 - ApiException and transport errors
            raise self._fail(what, e) from None
        return out.to_dict()

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = "") -> dict | None:
        """The stored object, or None when it does not exist. ``namespace=""`` = this client's;
        None for cluster-scoped kinds."""
        from kubernetes.dynamic.exceptions import NotFoundError

        res = self._resource(api_version, kind)
        ns = self.namespace if namespace == "" else namespace
        try:
            return res.get(name=name, namespace=ns if res.namespaced else None).to_dict()
        except NotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"reading {kind} {ns or ''}/{name}", e) from None

    def list(self, api_version: str, kind: str, label_selector: str) -> list[dict]:
        """Objects of ``kind`` in this client's namespace matching ``label_selector``
        (``key=value,...``)."""
        res = self._resource(api_version, kind)
        try:
            items = res.get(namespace=self.namespace, label_selector=label_selector).to_dict().get("items") or []
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"listing {kind} ({label_selector}) in {self.namespace}", e) from None
        return items

    def delete(self, api_version: str, kind: str, name: str) -> bool:
        """Delete an object of this namespace (background propagation: a Deployment's pods get
        SIGTERM and drain); False when it did not exist."""
        from kubernetes.dynamic.exceptions import NotFoundError

        res = self._resource(api_version, kind)
        try:
            res.delete(name=name, namespace=self.namespace, propagation_policy="Background")
        except NotFoundError:
            return False
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"deleting {kind} {self.namespace}/{name}", e) from None
        return True

    def scale(self, name: str, replicas: int) -> None:
        """Set a Deployment's replicas through its ``scale`` subresource (a merge patch of
        ``spec.replicas``; the rest of the Deployment is untouched)."""
        res = self._resource("apps/v1", "Deployment")
        try:
            self._dynamic.patch(res.subresources["scale"], body={"spec": {"replicas": replicas}}, name=name,
                                namespace=self.namespace, content_type="application/merge-patch+json",
                                field_manager=FIELD_MANAGER)
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"scaling Deployment {self.namespace}/{name} to {replicas}", e) from None
