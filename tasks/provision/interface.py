"""The provider contract: start, stop and inspect serving instances."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from modelops.errors import ProvisionError

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

    def stop_each(self, names: Iterable[str], say: Callable[[str], None] | None = None) -> list[str]:
        """Drain and stop every instance in ``names``, all at once: each drains on its own (an
        idle one takes ~6 s to exit; one after another, ten took a minute). ``say`` hears each
        one stopped. Returns the names stopped, in the order given.

        Raises:
            ProvisionError: some could not be stopped (every other one was), each named with why.
        """
        names, problems = list(names), {}

        def stop(name: str) -> None:
            try:
                self.stop(name)
            except Exception as e:  # noqa: BLE001 - stop the others, report this one
                problems[name] = e
            else:
                if say:
                    say(f"instance {name}: stopped")

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="stop") as pool:
            list(pool.map(stop, names))
        if problems:
            raise ProvisionError("could not stop: " + "; ".join(f"{n}: {e}" for n, e in problems.items()))
        return names

    @abstractmethod
    def scale(self, model_id: str, version: str, count: int, package, image,
              unroute: Callable[[], None] | None = None) -> None:
        """Bring a version to ``count`` running instances (replicas in Kubernetes); scaling up
        needs its package and image, scaling down drains the surplus. A provider whose router
        sends to each instance by name (local) marks the surplus ``draining`` in the registry and
        calls ``unroute()`` before it stops them, so the router takes them out first and no
        request is sent to an instance that is going (:func:`tasks.traffic.interface.commit_routes`
        leaves draining instances out); Kubernetes takes a terminating pod out of its Service's
        endpoints itself."""
