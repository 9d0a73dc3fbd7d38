"""Kubernetes: manifests rendered as plain dicts (``manifests.py``, no cluster needed) and the
thin client that server-side-applies them (``client.py``, needs the ``k8s`` extra and a cluster).

The serving provider (:mod:`tasks.provision.kubernetes`) and the Gateway API router
(:mod:`tasks.traffic.gateway_api`) are built on these two; docs/kubernetes.md says how to run them.
"""

from tasks.kube.manifests import (
    FIELD_MANAGER,
    PORTS,
    ServingSpec,
    image_reference,
    label_value,
    object_name,
    render_deployment,
    render_fsx_storage,
    render_httproute,
    render_service,
    service_endpoints,
)

__all__ = ["FIELD_MANAGER", "PORTS", "ServingSpec", "image_reference", "label_value", "object_name",
           "render_deployment", "render_fsx_storage", "render_httproute", "render_service", "service_endpoints"]
