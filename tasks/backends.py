"""The one place a concrete serving backend is chosen: flows and tasks ask for ``provider()`` and
``router()`` and never name LocalProvider, KubernetesProvider, HAProxyRouter or GatewayAPIRouter.

The choice is a setting (``MODELOPS_PROVIDER``: ``local`` | ``kubernetes``; ``MODELOPS_ROUTER``:
``haproxy`` | ``gateway-api``), so a Prefect work pool's job variables pick production backends
for the same flows (docs/kubernetes.md).
"""

from __future__ import annotations

from modelops.registry import Registry
from modelops.settings import Settings, get_settings
from tasks.provision.interface import Provider
from tasks.traffic.interface import Router

__all__ = ["parts", "provider", "router"]


def provider(settings: Settings | None = None, registry: Registry | None = None) -> Provider:
    """The serving-capacity backend of ``settings.provider``.

    Args:
        settings: default :func:`get_settings`; registry: default the settings' registry.
    """
    settings = settings or get_settings()
    if settings.provider == "kubernetes":
        from tasks.provision.kubernetes import KubernetesProvider

        return KubernetesProvider(settings, registry)
    from tasks.provision.local import LocalProvider

    return LocalProvider(settings, registry)


def router(settings: Settings | None = None) -> Router:
    """The traffic router of ``settings.router``."""
    settings = settings or get_settings()
    if settings.router == "gateway-api":
        from tasks.traffic.gateway_api import GatewayAPIRouter

        return GatewayAPIRouter(settings)
    from tasks.traffic.haproxy import HAProxyRouter

    return HAProxyRouter(settings)


def parts(settings: Settings | None = None) -> tuple[Registry, Router, Provider]:
    """``(registry, router, provider)`` of ``settings`` (default :func:`get_settings`), the
    provider sharing the registry: what every traffic stage works with."""
    settings = settings or get_settings()
    registry = Registry(settings.registry)
    return registry, router(settings), provider(settings, registry)
