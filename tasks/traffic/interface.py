"""The router contract and the routes it serves, derived from the registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from modelops.experiments import ExperimentSpec
from modelops.registry import LIVE_INSTANCE_STATES, Registry
from modelops.routing import Routing
from modelops.shadow import ShadowSpec
from modelops.tenancy import KeyGrant
from tasks.traffic.weights import server_weights

__all__ = ["HOLD_PREFIX", "ModelRoute", "Router", "Server", "commit_routes", "hold_server", "held_version",
           "routes_from_registry"]

# Versions in these states keep their instances behind the router.
ROUTED_STATES = ("serving", "draining")


@dataclass(frozen=True)
class Server:
    """One instance behind the router: ``name`` unique per model, ``address`` ``host:port`` of
    its OpenAI frontend (its ``/ready`` is the instance's readiness for every protocol),
    ``weight`` 0..256 (0 = reachable only by version pin; see :mod:`tasks.traffic.weights`),
    ``kserve_http`` and ``kserve_grpc`` ``host:port`` of its KServe v2 endpoints ("" when it has
    none). A ``hold`` server stands for a version at zero instances (``scaling.min: 0``): the
    router sends its share to the autoscaler's activator, which holds each request until an
    instance is up (:mod:`tasks.autoscale.activator`); its ``address`` is empty (the router
    knows where its activator listens)."""

    name: str
    address: str
    weight: int
    kserve_http: str = ""
    kserve_grpc: str = ""
    hold: bool = False


@dataclass(frozen=True)
class ModelRoute:
    """All routed versions of one model: ``versions`` maps version → its servers, ``routing``
    version → its manifest's balancing policy (absent: the default :class:`Routing`);
    ``experiment`` the experiment that splits its unpinned requests between versions by key
    (:mod:`modelops.experiments`; then the weights do not apply to them); ``shadow`` the version
    that gets a copy of a fraction of its unpinned requests (:mod:`modelops.shadow`)."""

    model_id: str
    versions: dict[str, tuple[Server, ...]] = field(default_factory=dict)
    routing: dict[str, Routing] = field(default_factory=dict)
    experiment: ExperimentSpec | None = None
    shadow: ShadowSpec | None = None

    def routing_of(self, version: str) -> Routing:
        """The balancing policy among ``version``'s instances."""
        return self.routing.get(version) or Routing()


HOLD_PREFIX = "hold__"


def hold_server(model_id: str, version: str) -> str:
    """The name of the hold server of a version at zero: ``hold__<model_id>__<version>`` (unique
    over every model: the router's per-instance figures are keyed by server name)."""
    return f"{HOLD_PREFIX}{model_id}__{version}"


def held_version(server: str) -> tuple[str, str] | None:
    """``(model_id, version)`` of a :func:`hold_server` name, else None (a model id has no ``_``)."""
    if not server.startswith(HOLD_PREFIX) or "__" not in server[len(HOLD_PREFIX):]:
        return None
    model_id, version = server[len(HOLD_PREFIX):].split("__", 1)
    return (model_id, version) if model_id and version else None


def routes_from_registry(registry: Registry) -> list[ModelRoute]:
    """Routes for every model with a serving or draining version that has running (or
    restarting) instances, or a serving version at zero instances whose policy allows it
    (``scaling.min: 0``: one hold :class:`Server`, :func:`hold_server`); server weights from
    :func:`~tasks.traffic.weights.server_weights` (each version's servers together weigh exactly
    its registry weight's share)."""
    # A restarting instance keeps its server (same ports): HAProxy's /ready check takes it out
    # and back in; dropping it would leave it unrouted once its supervisor brought it back.
    routed = [i for i in registry.instances() if i.model_version.state in ROUTED_STATES
              and i.state in LIVE_INSTANCE_STATES and "openai" in i.endpoints]
    by_model: dict[str, dict[str, list]] = {}
    rows = {}
    for inst in routed:
        by_model.setdefault(inst.model_version.model_id, {}).setdefault(inst.model_version.version, []).append(inst)
        rows[(inst.model_version.model_id, inst.model_version.version)] = inst.model_version
    for v in registry.versions():
        if v.state == "serving" and v.manifest.scaling.min == 0 and v.version not in by_model.get(v.model_id, {}):
            by_model.setdefault(v.model_id, {})[v.version] = []  # at zero: held until one starts
            rows[(v.model_id, v.version)] = v
    experiments = {e.model_id: e for e in registry.experiments()}
    shadows = {s.model_id: s.spec() for s in registry.shadows()}

    def shadow_of(model_id: str, versions: dict) -> ShadowSpec | None:
        # Copies go only to a routed version that takes no traffic of its own (a promoted shadow
        # would copy requests to itself; an unrouted one would 404).
        spec = shadows.get(model_id)
        return spec if spec and spec.version in versions and rows[(model_id, spec.version)].weight == 0 else None

    out = []
    for model_id, versions in sorted(by_model.items()):
        # The router weighs servers: each version's servers together weigh its share exactly.
        split = server_weights({v: (rows[(model_id, v)].weight, max(1, len(insts))) for v, insts in versions.items()})
        out.append(ModelRoute(model_id, {v: tuple(_server(i, w) for i, w in zip(insts, split[v])) if insts else
                                         (Server(hold_server(model_id, v), "", split[v][0], hold=True),)
                                         for v, insts in versions.items()},
                              {v: rows[(model_id, v)].manifest.routing for v in versions},
                              experiments[model_id].spec() if model_id in experiments else None,
                              shadow_of(model_id, versions)))
    return out


def commit_routes(registry: Registry, router: Router) -> list[ModelRoute]:
    """Make ``router`` serve what the registry says now (:func:`routes_from_registry`); the routes
    applied are returned. Raises what :meth:`Router.apply` raises (TrafficError)."""
    routes = routes_from_registry(registry)
    router.apply(routes)
    return routes


def _server(inst, weight: int) -> Server:
    def hostport(url: str | None) -> str:
        if not url:
            return ""
        u = urlparse(url if "//" in url else f"//{url}")  # kserve_grpc is host:port
        return f"{u.hostname}:{u.port}"

    return Server(name=inst.name, address=hostport(inst.endpoints["openai"]), weight=weight,
                  kserve_http=hostport(inst.endpoints.get("kserve_http")),
                  kserve_grpc=hostport(inst.endpoints.get("kserve_grpc")))


class Router(ABC):
    """A traffic router: applies routes with their weights, without dropping requests.
    ``experiments``: whether it renders a route's experiment (split by key); a router that does
    not is never given one (tasks/traffic/experiment.py refuses to start it)."""

    experiments: bool = False

    @abstractmethod
    def ensure_running(self, routes: list[ModelRoute]) -> None:
        """Start the router if it is not running (with ``routes``); no-op otherwise."""

    @abstractmethod
    def apply(self, routes: list[ModelRoute]) -> None:
        """Make the router serve exactly ``routes``. Weight-only changes must not reload or
        drop connections; topology changes may reload seamlessly.

        Raises:
            TrafficError: the router rejected the configuration; the previous one stays live.
        """

    @abstractmethod
    def server_requests(self, model_id: str) -> dict[str, int]:
        """Requests each server (instance name) of the model took so far (default and pinned)."""

    @abstractmethod
    def server_errors(self, model_id: str) -> dict[str, int] | None:
        """HTTP 5xx the router answered so far per server (instance name) of the model; None
        when the router keeps no per-server counters (the red-black gate then judges from the
        instances' own metrics alone, and its report says so)."""

    @abstractmethod
    def weights(self) -> dict[tuple[str, str], int]:
        """Live weights read back from the router: ``{(model_id, server name): weight}``."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the router process."""

    def instance_traffic(self) -> dict[str, dict]:
        """What the router measured per instance name since it (re)started, over every model and
        protocol: ``{"requests", "errors_5xx", "retries", "redispatches"}`` (counts) and
        ``{"ttfb_p50_s", "ttfb_p99_s"}`` (seconds to the response headers, the upper bound of
        the histogram bucket holding the quantile; None before any request or past the last
        bucket). Empty for a
        router that keeps no such metrics."""
        return {}

    def experiment_metrics(self) -> str:
        """The router's counts of the running experiments' requests, Prometheus text
        (``modelops_router_experiment_requests_total{model, version, assigned}``), since each
        started; empty for a router that runs no experiments."""
        return ""

    def platform_transport(self) -> httpx.BaseTransport | None:
        """How the platform's own requests (the route checks) reach the router when API keys
        are on: a transport for an httpx client (the request URL stays ``router_url``'s), or
        None to send them as clients do."""
        return None

    def route_headers(self, model_id: str) -> dict[str, str]:
        """Headers a client sends so that this router routes a request for ``model_id`` without
        reading its body (none for a router that reads the OpenAI ``model`` itself)."""
        return {}

    def key_headers(self, key_name: str) -> dict[str, str]:
        """Headers that make a platform request (sent over :meth:`platform_transport`, beside
        :meth:`route_headers`) the API key ``key_name``'s: the router applies that key's scope
        and limits, and its usage counts for the key (a batch's lines: tasks/batch/run.py).
        The default, for a router without keys, is none."""
        return {}

    def is_running(self) -> bool:
        """Whether the router answers (a process this machine runs, or an API it reaches);
        routers that modelops does not run are taken as running."""
        return True

    def check_new_key(self, new: KeyGrant, active: list[KeyGrant]) -> None:
        """Called by ``modelops keys create`` with the new key's grant and the active keys'
        before anything is stored: raise ValueError (naming the key and the fix) when this
        router could not enforce them. The default accepts any grant that
        :func:`~modelops.tenancy.check_grant` accepted."""

    def put_key(self, name: str, key: str) -> None:
        """Called by ``modelops keys create`` and ``rotate`` with the key in clear, the only
        moment it exists, before the registry stores its hash: override for a router that
        compares keys themselves (it keeps the key where its data plane reads it, never on
        this machine's disk). The default does nothing: a router that looks keys up by
        SHA-256 reads them from the registry. Raises TrafficError when the key cannot be
        stored; the caller then stores nothing."""
