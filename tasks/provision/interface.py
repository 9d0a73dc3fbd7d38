"""The provider contract: start, stop and inspect serving instances."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

__all__ = ["Endpoints", "Provider"]


@dataclass(frozen=True)
class Endpoints:
    """URLs of one instance: OpenAI API base (``.../v1``), KServe v2 HTTP base, KServe v2 gRPC
    ``host:port``, Triton's Prometheus metrics URL."""

    openai: str
    kserve_http: str
    kserve_grpc: str
    metrics: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class Provider(ABC):
    """Starts serving instances of a sealed package.

    Implementations record every instance in the registry *before* starting it, so a retried
    provision finds and reuses a live instance instead of starting a second one.
    """

    @abstractmethod
    def ensure_instance(self, package, image) -> tuple[str, Endpoints]:
        """Return ``(instance name, endpoints)`` of a ready instance of the package's version,
        starting one only if none is alive. Blocks until ready or raises ProvisionError."""

    @abstractmethod
    def is_alive(self, instance) -> bool:
        """Whether ``instance`` (a registry :class:`~modelops.registry.Instance` row) still runs,
        without asking it anything: its process exists (local), its Deployment has ready replicas
        (Kubernetes). Cheap enough to poll every half second during a gate window."""

    @abstractmethod
    def is_ready(self, instance) -> bool:
        """Whether ``instance`` takes traffic now: alive and its readiness (``/ready``) is true
        (local: one GET; Kubernetes: every replica of the current generation ready, which is
        the readinessProbe's verdict on ``/ready``)."""

    @abstractmethod
    def stop(self, instance_name: str) -> None:
        """Drain and stop one instance (SIGTERM, then SIGKILL after the drain timeout)."""

    @abstractmethod
    def scale(self, model_id: str, version: str, count: int, package, image) -> None:
        """Bring a version to ``count`` running instances (replicas in Kubernetes); scaling up
        needs its package and image, scaling down drains the surplus."""
