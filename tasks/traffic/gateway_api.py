"""Gateway API as the router on Kubernetes: one ``HTTPRoute`` per model, weights on its backendRefs
(and, with ``k8s_kserve_routes``, an ``HTTPRoute`` ``<model_id>.kserve-http`` and a ``GRPCRoute``
``<model_id>`` carrying the same weights for KServe v2, as the local router routes it).

The Gateway itself (class, listeners, TLS, the body-based routing extension that copies the
OpenAI ``model`` into ``MODELOPS_K8S_MODEL_HEADER``) belongs to the platform; modelops writes
only HTTPRoutes in ``MODELOPS_K8S_NAMESPACE`` that attach to ``MODELOPS_K8S_GATEWAY_NAME``.
Rendering is :func:`tasks.kube.manifests.render_httproute` (one backendRef per version Service;
a red-black step is a weight change of the default rule; every version also gets an
``X-Model-Version`` rule). Applying is server-side apply, then waiting for the Gateway
controller to report the route ``Accepted`` and its refs ``ResolvedRefs`` for the new
generation (a condition without the optional ``observedGeneration`` counts as current), so a
refused route surfaces as TrafficError (and a rollout rolls back).

API keys (:mod:`modelops.tenancy`), once on (``router_auth`` ``on``, or any key ever made), are
Envoy Gateway's: each model's routes get a ``SecurityPolicy`` admitting the keys whose scope
covers the model and a ``BackendTrafficPolicy`` with their rpm, applied before the routes and
awaited like them; each key lives in its own ``Secret``, written by :meth:`put_key` when
``modelops keys create`` / ``rotate`` hold the key in clear (Envoy compares keys themselves, not
their SHA-256), deleted here once the key is revoked. The platform's own route checks use the
reserved key ``modelops`` from the Secret this router creates (:meth:`route_headers`). Rendering:
:func:`tasks.kube.manifests.render_securitypolicy` and ``render_backendtrafficpolicy``.

What this router cannot do: per-server request and 5xx counters live in the Gateway
implementation's data plane (Envoy, Istio, a cloud load balancer), not in the Gateway API, so
:meth:`server_requests` raises TrafficError naming the gap (idle cleanup then counts a version
from when it was replaced) and :meth:`server_errors` returns None (the red-black gate judges from
the instances' own metrics, without the router's 5xx); a Prometheus query of the implementation's
metrics would close both (docs/kubernetes.md). Weight shifts without dropped requests are the implementation's
promise (xDS updates for Envoy-based ones), not something modelops can check from the API.

Not run against a real cluster here; see tasks/kube/client.py.
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path

from modelops.errors import TrafficError
from modelops.registry import Registry
from modelops.settings import Settings, get_settings
from modelops.tenancy import PLATFORM_KEY, KeyGrant, new_key
from tasks.kube.batch_api import (BATCH_API_NAME, BATCH_ROUTE_NAME, render_batch_api_route,
                                  render_batch_api_securitypolicy, service_port)
from tasks.kube.client import KubeClient
from tasks.kube.manifests import (
    ENVOY_GATEWAY_API,
    INFERENCE_POOL_API,
    KEY_SECRET_LABELS,
    MANAGED_BY,
    VERSION_HEADER,
    check_key_grants,
    key_secret_name,
    render_api_key_secret,
    render_backendtrafficpolicy,
    render_httproute,
    render_inferencepool,
    render_securitypolicy,
)
from tasks.traffic.interface import ModelRoute, Router

__all__ = ["GatewayAPIRouter", "route_backends"]

log = logging.getLogger(__name__)

_API = "gateway.networking.k8s.io/v1"
_POLICIES = ("SecurityPolicy", "BackendTrafficPolicy")


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _stale(condition: dict, generation: int) -> bool:
    """Whether a status condition is about an older generation than ``generation``; one without
    ``observedGeneration`` (optional in the API) counts as current."""
    observed = condition.get("observedGeneration")
    return observed is not None and observed < generation


def route_backends(route: ModelRoute) -> dict[str, tuple[str, int]]:
    """``version → (Service name, weight)`` of a model's route.

    On Kubernetes a registry instance is a Deployment named like its Service, and
    :func:`~tasks.traffic.interface.routes_from_registry` gives each version one server carrying
    the version's whole weight; several servers of a version (rows left from another
    provider) add up.

    Raises:
        TrafficError: a version has servers under different names (not one Service), or is at
            zero instances (``scaling.min: 0``, which only the local router holds requests for).
    """
    out: dict[str, tuple[str, int]] = {}
    for version, servers in route.versions.items():
        if any(s.hold for s in servers):
            raise TrafficError(f"model {route.model_id} version {version} is at zero instances (scaling.min 0): "
                               "Gateway API has no hold for it; give it scaling.min 1 (scale from zero is local)")
        names = sorted({s.name for s in servers})
        if len(names) != 1:
            raise TrafficError(f"model {route.model_id} version {version}: servers {names} are not one Kubernetes "
                               "Service; was it provisioned by the local provider?")
        out[version] = (names[0], sum(s.weight for s in servers))
    return out


class GatewayAPIRouter(Router):
    """HTTPRoutes on the cluster configured in ``settings`` (see the module docstring).

    Args:
        settings: the ``k8s_*`` block; client: a :class:`KubeClient` (tests), default one made
            on first use (TrafficError when no cluster is configured); registry: where the API
            keys are (tests), default the settings' registry.
    """

    poll_s = 1.0

    def __init__(self, settings: Settings | None = None, client: KubeClient | None = None,
                 registry: Registry | None = None) -> None:
        self.settings = settings or get_settings()
        self._client = client
        self._registry = registry

    @property
    def client(self) -> KubeClient:
        if self._client is None:
            self._client = KubeClient(self.settings, TrafficError)
        return self._client

    def render(self, routes: list[ModelRoute], grants: list[KeyGrant] | None = None,
               batch_api_port: int | None = None) -> list[dict]:
        """The route objects of ``routes`` (pure: no cluster): per model, with
        ``k8s_inference_pool`` the InferencePool of each routed version first, then with
        ``grants`` (the active keys, when keys are on; None = off) its SecurityPolicy and, when a
        key covering it has an rpm, its BackendTrafficPolicy, then its OpenAI HTTPRoute, then with
        ``k8s_kserve_routes`` its KServe HTTPRoute and GRPCRoute. Policies come before the routes
        they target, so a new route is never served without them. A route's shadow is the
        OpenAI HTTPRoute's ``RequestMirror`` filter. With ``batch_api_port`` (the batch API's
        Service's port), last, the batch API's SecurityPolicy (keys on: every active key) and
        HTTPRoute (tasks/kube/batch_api.py).

        Raises:
            TrafficError: an object cannot be rendered (too many versions, a bad weight, an
                endpoint picker name that is no Service name, grants the Gateway cannot enforce).
        """
        protocols = ("openai", "kserve-http", "kserve-grpc") if self.settings.k8s_kserve_routes else ("openai",)
        out = []
        for r in routes:
            try:
                if self.settings.k8s_inference_pool:
                    out += [render_inferencepool(r.model_id, v, self.settings) for v in sorted(r.versions)]
                if grants is not None:
                    out.append(render_securitypolicy(r.model_id, grants, self.settings))
                    limits = render_backendtrafficpolicy(r.model_id, grants, self.settings)
                    out += [limits] if limits else []
                mirror = (r.shadow.version, r.shadow.percent) if r.shadow else None
                out += [render_httproute(r.model_id, route_backends(r), self.settings, p, mirror) for p in protocols]
            except ValueError as e:
                raise TrafficError(str(e)) from None
        if batch_api_port is not None:
            try:
                out += [render_batch_api_securitypolicy(grants, self.settings)] if grants is not None else []
            except ValueError as e:
                raise TrafficError(str(e)) from None
            out.append(render_batch_api_route(self.settings, keys_on=grants is not None, port=batch_api_port))
        return out

    def _batch_api_port(self) -> int | None:
        """The port of the batch API's Service when it exists (``python -m tasks.kube batch-api``
        applied): then its route is applied with the models'; else None (and any such route goes)."""
        service = self.client.get("v1", "Service", BATCH_API_NAME)
        if service is None:
            return None
        if (port := service_port(service)) is None:
            log.warning("Service %s has no port named http: the batch API is not routed (render it again with "
                        "`python -m tasks.kube batch-api`)", BATCH_API_NAME)
        return port

    def ensure_running(self, routes: list[ModelRoute]) -> None:
        """Check that the Gateway exists and is ``Programmed``; modelops never creates it.

        Raises:
            TrafficError: no cluster, no such Gateway, or its controller reports it not programmed.
        """
        ns = self.settings.k8s_gateway_namespace or self.settings.k8s_namespace
        gw = self.client.get(_API, "Gateway", self.settings.k8s_gateway_name, namespace=ns)
        if gw is None:
            raise TrafficError(f"Gateway {ns}/{self.settings.k8s_gateway_name} does not exist: the platform creates "
                               "it (docs/kubernetes.md); set MODELOPS_K8S_GATEWAY_NAME / _NAMESPACE to the one to use")
        conds = {c.get("type"): c for c in (gw.get("status") or {}).get("conditions") or []}
        prog = conds.get("Programmed")
        if prog is not None and prog.get("status") == "False":
            raise TrafficError(f"Gateway {ns}/{self.settings.k8s_gateway_name} is not programmed: "
                               f"{prog.get('reason')}: {prog.get('message', '')}")

    def apply(self, routes: list[ModelRoute]) -> None:
        """Server-side apply the HTTPRoute of every model in ``routes`` (and, with API keys on,
        its policies first: :meth:`render`), delete modelops' routes and policies of models no
        longer routed and the Secrets of revoked keys, and wait until the Gateway controller
        accepted each applied generation of every route and policy.

        With keys on, the platform's key Secret is created when missing, and an active key whose
        Secret is missing (a create or rotate that did not finish) is left out of the policies,
        so the Gateway refuses it (it answers 500 on a route whose policy names a missing Secret).
        The batch API's route and policy are applied while its Service exists; a verdict against
        them is logged, not raised (no model's traffic change waits on the batch API).

        Raises:
            TrafficError: the API server refused an object (the cluster does not serve Envoy
                Gateway's policies while keys are on, for one), or the controller reported one
                not Accepted / refs not resolved, or did not report within
                ``k8s_route_accept_timeout_s``. Objects applied before the failure stay applied.
        """
        grants = self._key_grants()
        stored: dict[str, dict] = {}
        if grants is not None:
            self._ensure_platform_key()
            stored = {(s["metadata"].get("labels") or {}).get("modelops.io/api-key"): s
                      for s in self.client.list("v1", "Secret", _selector(KEY_SECRET_LABELS))}
            if missing := sorted(g.name for g in grants if g.name not in stored):
                log.warning("API key(s) %s have no Secret at the Gateway (a create or rotate that did not finish): "
                            "left out of every SecurityPolicy, so the Gateway refuses them; `modelops keys rotate "
                            "NAME` gives each one", ", ".join(missing))
            if unlimited := sorted(g.name for g in grants if g.max_concurrency):
                log.warning("max_concurrency of API key(s) %s is not enforced on Kubernetes: Envoy Gateway has no "
                            "per-client concurrency limit (docs/kubernetes.md)", ", ".join(unlimited))
            grants = [g for g in grants if g.name in stored]
        wanted = self.render(routes, grants, self._batch_api_port())
        applied = [self.client.apply(obj) for obj in wanted]  # pools and policies before the routes naming them
        keep = {(obj["kind"], obj["metadata"]["name"]) for obj in wanted}
        kinds = [(_API, "HTTPRoute")] + ([(_API, "GRPCRoute")] if self.settings.k8s_kserve_routes else [])
        if self.settings.k8s_inference_pool:  # after the routes, which may still name a pool
            kinds.append((INFERENCE_POOL_API, "InferencePool"))
        if grants is not None:  # after the routes they protect
            kinds += [(ENVOY_GATEWAY_API, kind) for kind in _POLICIES]
        for api, kind in kinds:
            for old in self.client.list(api, kind, _selector(MANAGED_BY)):
                if (kind, old["metadata"]["name"]) not in keep:
                    self.client.delete(api, kind, old["metadata"]["name"])
                    log.info("deleted %s %s (no longer routed)", kind, old["metadata"]["name"])
        if grants is not None and self._registry is not None:  # no policy names a revoked key now: its Secret goes
            revoked = {k.name for k in self._registry.api_keys() if k.revoked_at is not None}
            for name in sorted(revoked & set(stored)):
                self.client.delete("v1", "Secret", key_secret_name(name))
                log.info("deleted the Secret of revoked API key %s", name)
        for obj in applied:
            if obj.get("kind") not in ("HTTPRoute", "GRPCRoute", *_POLICIES):
                continue
            try:
                self._wait_accepted(obj["apiVersion"], obj["kind"], obj["metadata"]["name"],
                                    obj["metadata"].get("generation") or 0)
            except TrafficError as e:
                if obj["metadata"]["name"] != BATCH_ROUTE_NAME:
                    raise
                # The batch API's trouble is no model's: their traffic change goes on.
                log.warning("the batch API is not served through the Gateway: %s", e)
        log.info("HTTPRoutes applied: %s", ", ".join(
            f"{r.model_id} {dict(sorted((v, w) for v, (_, w) in route_backends(r).items()))}" for r in routes))

    # -- API keys ------------------------------------------------------------------------------
    def _key_grants(self) -> list[KeyGrant] | None:
        """The active keys' grants while keys are on (``router_auth`` ``on``, or any key ever
        made, revoked ones included, as the local router decides), None while they are off. A
        SQLite registry that does not exist yet has no keys (and is not created here)."""
        if self._registry is None:
            url = self.settings.registry
            if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
                return [] if self.settings.router_auth == "on" else None
            self._registry = Registry(url)
        on = self.settings.router_auth == "on" or bool(self._registry.api_keys())
        return self._registry.grants() if on else None

    def _ensure_platform_key(self) -> None:
        """Create the platform's key Secret (:data:`~modelops.tenancy.PLATFORM_KEY`, a fresh random
        key that exists only there) unless it exists; every SecurityPolicy names it."""
        if self.client.get("v1", "Secret", key_secret_name(PLATFORM_KEY)) is None:
            self.client.apply(render_api_key_secret(PLATFORM_KEY, new_key(), self.settings))
            log.info("created the platform's API key Secret %s", key_secret_name(PLATFORM_KEY))

    def check_new_key(self, new: KeyGrant, active: list[KeyGrant]) -> None:
        """Refuse a key the Gateway could not enforce (:func:`~tasks.kube.manifests.check_key_grants`
        over ``active`` + ``new``), a ``max_concurrency`` (Envoy Gateway has no per-client
        concurrency limit: the circuit breaker's ``maxParallelRequests`` counts every client of a
        backend together) and a ``tpm`` (not rendered for the Gateway).

        Raises:
            ValueError: naming the key and the fix.
        """
        if new.max_concurrency is not None:
            raise ValueError("--max-concurrency: the gateway-api router cannot enforce a per-key concurrency limit "
                             "(Envoy Gateway has none per client; docs/kubernetes.md); leave it out, or use --rpm")
        if new.tpm is not None:
            raise ValueError("--tpm: the gateway-api router cannot enforce a token limit yet (the local router's tpm "
                             "throttle has no Envoy Gateway counterpart here; docs/kubernetes.md); leave it out, or "
                             "use --rpm")
        check_key_grants([*active, new])

    def put_key(self, name: str, key: str) -> None:
        """Server-side apply key ``name``'s Secret (:func:`~tasks.kube.manifests.render_api_key_secret`)
        with ``key`` in clear: the only copy modelops writes, straight to the API server.

        Raises:
            TrafficError: no cluster, or the API server refused the Secret (RBAC: the caller needs
                ``secrets`` in the namespace). The key is never in the message.
        """
        try:
            secret = render_api_key_secret(name, key, self.settings)
        except ValueError as e:
            raise TrafficError(str(e)) from None
        self.client.apply(secret)
        log.info("API key %s: Secret %s/%s applied", name, self.settings.k8s_namespace, key_secret_name(name))

    def _wait_accepted(self, api: str, kind: str, name: str, generation: int) -> None:
        """Wait for the Gateway controller's verdict on ``generation`` of a route (its
        ``status.parents``) or an Envoy Gateway policy (its ``status.ancestors``: the Gateways of
        the routes it targets), as reported for this router's Gateway."""
        gw_ns = self.settings.k8s_gateway_namespace or self.settings.k8s_namespace
        deadline = time.monotonic() + self.settings.k8s_route_accept_timeout_s
        field, ref_field = ("ancestors", "ancestorRef") if kind in _POLICIES else ("parents", "parentRef")
        while True:
            route = self.client.get(api, kind, name) or {}
            for parent in (route.get("status") or {}).get(field) or []:
                ref = parent.get(ref_field) or {}
                if ref.get("name") != self.settings.k8s_gateway_name or (ref.get("namespace") or gw_ns) != gw_ns:
                    continue
                conds = {c.get("type"): c for c in parent.get("conditions") or []}
                # observedGeneration is optional on a condition (metav1.Condition marks it
                # +optional; Gateway API controllers may omit it): a condition without one is
                # taken as current, or apply would wait out its timeout on such a controller.
                # The price: right after an apply such a controller's previous verdict can be
                # read as the new generation's.
                if any(_stale(c, generation) for c in conds.values()):
                    continue  # the controller has not seen this generation yet
                for cond_type in ("Accepted", "ResolvedRefs"):
                    c = conds.get(cond_type)
                    if c is not None and c.get("status") == "False":
                        raise TrafficError(f"{kind} {self.client.namespace}/{name} generation {generation} not "
                                           f"{cond_type}: {c.get('reason')}: {c.get('message', '')}")
                if (conds.get("Accepted") or {}).get("status") == "True":
                    return
            if time.monotonic() >= deadline:
                raise TrafficError(f"{kind} {self.client.namespace}/{name} generation {generation}: the Gateway "
                                   f"controller reported no Accepted condition within "
                                   f"{self.settings.k8s_route_accept_timeout_s:.0f} s; is Gateway {gw_ns}/"
                                   f"{self.settings.k8s_gateway_name} served by a controller, and does its listener "
                                   f"allow routes from namespace {self.client.namespace}?")
            time.sleep(self.poll_s)

    def weights(self) -> dict[tuple[str, str], int]:
        """``{(model_id, Service name): weight}`` read back from the default rule (the one that
        matches only the model header) of every modelops HTTPRoute; a version reachable only by
        its pin (no default rule when every version weighs 0) reads 0."""
        out: dict[tuple[str, str], int] = {}
        for route in self.client.list(_API, "HTTPRoute", _selector(MANAGED_BY)):
            model = (route["metadata"].get("annotations") or {}).get("modelops.io/model-id",
                                                                      route["metadata"]["name"])
            for rule in route.get("spec", {}).get("rules") or []:
                headers = [h.get("name") for m in rule.get("matches") or [] for h in m.get("headers") or []]
                for ref in rule.get("backendRefs") or []:
                    if VERSION_HEADER in headers:  # a version pin: weight 0 unless the default rule has it
                        out.setdefault((model, ref["name"]), 0)
                    else:
                        out[(model, ref["name"])] = ref.get("weight", 1)  # Gateway API default weight: 1
        return out

    def _no_counters(self, what: str) -> TrafficError:
        return TrafficError(f"{what} per server needs the Gateway implementation's metrics (Prometheus); the Gateway "
                            "API does not expose request counters, and this router does not query Prometheus yet "
                            "(docs/kubernetes.md: red-black gates and idle cleanup on Kubernetes)")

    def server_requests(self, model_id: str) -> dict[str, int]:
        """Not derivable from the Gateway API: raises TrafficError (see the module docstring)."""
        raise self._no_counters("counting requests")

    def server_errors(self, model_id: str) -> None:
        """None: the Gateway API keeps no 5xx counters (see the module docstring); the red-black
        gate judges from the instances' metrics alone."""
        return None

    def route_headers(self, model_id: str) -> dict[str, str]:
        """``{k8s_model_header: model_id}``: what the HTTPRoutes match on (a body-based routing
        extension sets it from the OpenAI ``model``; a client may set it itself); with API keys
        on, also ``Authorization: Bearer <the platform's key>``, read from its Secret (the route
        checks' credential; absent until :meth:`apply` created it)."""
        headers = {self.settings.k8s_model_header: model_id}
        if self._key_grants() is not None and (key := self._stored_key(PLATFORM_KEY)):
            headers["Authorization"] = "Bearer " + key
        return headers

    def _stored_key(self, name: str) -> str | None:
        """Key ``name`` in clear, from its Secret (:meth:`put_key`); None without one."""
        secret = self.client.get("v1", "Secret", key_secret_name(name)) or {}
        key = (secret.get("data") or {}).get(name)
        return base64.b64decode(key).decode("utf-8") if key else None

    def key_headers(self, key_name: str) -> dict[str, str]:
        """``Authorization: Bearer <the key>``, read from the key's Secret (:meth:`put_key` wrote
        it there): the Gateway then treats the request as the key's own (none while keys are off).

        Raises:
            TrafficError: keys are on and the key has no Secret (revoked, or made elsewhere).
        """
        if self._key_grants() is None:
            return {}
        if not (key := self._stored_key(key_name)):
            raise TrafficError(f"API key {key_name!r} has no Secret {key_secret_name(key_name)} in namespace "
                               f"{self.settings.k8s_namespace}: it was revoked, or made without this Gateway")
        return {"Authorization": "Bearer " + key}

    def is_running(self) -> bool:
        """Whether the Gateway exists and is not reported unprogrammed (:meth:`ensure_running`)."""
        try:
            self.ensure_running([])
        except TrafficError:
            return False
        return True

    def stop(self) -> None:
        """No-op: the Gateway is the platform's and serves other routes; modelops' HTTPRoutes are
        removed by :meth:`apply` when their model is no longer routed."""
        log.info("the Gateway is shared infrastructure: nothing to stop")
