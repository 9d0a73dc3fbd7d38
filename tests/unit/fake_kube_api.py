"""A loopback stand-in of the few Kubernetes API paths modelops uses, for tests without a cluster.

It answers discovery (``/version``, ``/api``, ``/apis``, the resource lists), GET/LIST/DELETE of
objects, server-side apply (``PATCH`` with ``application/apply-patch+yaml``) and merge patches of
``deployments/<name>/scale``, and records every request so tests can check what the real
``kubernetes`` client sent. It plays the controllers crudely: a Deployment gets pods and a status
(ready, or crash-looping), a deleted one's pods can linger for a few pod LISTs (draining), an
HTTPRoute gets an Accepted (or refused) parent status, with or without ``observedGeneration``.

It is not Kubernetes: no validation, no field ownership, no real apply merge (an applied object
replaces the stored one's metadata labels/annotations and spec). What it proves is the wire
format of our calls; what a cluster would do with them is proved only on a cluster.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import parse_qs, urlparse

_RESOURCES = {
    "api/v1": [("services", "Service", True), ("pods", "Pod", True),
               ("persistentvolumeclaims", "PersistentVolumeClaim", True),
               ("persistentvolumes", "PersistentVolume", False), ("secrets", "Secret", True)],
    "apis/apps/v1": [("deployments", "Deployment", True), ("deployments/scale", "Scale", True)],
    "apis/networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "apis/gateway.networking.k8s.io/v1": [("httproutes", "HTTPRoute", True), ("grpcroutes", "GRPCRoute", True),
                                          ("gateways", "Gateway", True)],
    "apis/gateway.envoyproxy.io/v1alpha1": [("securitypolicies", "SecurityPolicy", True),
                                            ("backendtrafficpolicies", "BackendTrafficPolicy", True)],
    "apis/inference.networking.k8s.io/v1": [("inferencepools", "InferencePool", True)],
    "apis/keda.sh/v1alpha1": [("scaledobjects", "ScaledObject", True)],
}
_API_VERSION = {gp: gp.removeprefix("apis/").removeprefix("api/") for gp in _RESOURCES}
_POLICIES = ("securitypolicies", "backendtrafficpolicies")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: dict | None


@dataclass
class FakeCluster:
    """Objects by (group path, plural, namespace, name); behaviours that tests switch."""

    objects: dict[tuple[str, str, str, str], dict] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    deployment_behaviour: str = "ready"  # ready | crashloop | pending
    route_behaviour: str = "accepted"  # accepted | refused
    refused_routes: set = field(default_factory=set)  # names of routes refused whatever route_behaviour says
    # Envoy Gateway's policies: Accepted, or refused (Invalid) as for a Secret it cannot find.
    policy_behaviour: str = "accepted"  # accepted | refused
    # Whether the route controller sets the (optional) observedGeneration on its conditions.
    route_observed_generation: bool = True
    # How many pod LISTs a deleted Deployment's pods outlive it (terminating: draining).
    drain_lists: int = 0
    # Deleted Deployments whose pods are still terminating: [deployment, pod LISTs left].
    terminating: list[list] = field(default_factory=list)
    # With deployment_behaviour "kubelet": runs the pods (tests/integration/kube_cluster.py):
    # ``status(deployment) -> status``, ``pods(namespace, selector) -> [pod]`` and
    # ``changed(plural, name, object or None)`` after each apply, scale or delete.
    kubelet: object | None = None
    next_cluster_ip: int = 20  # Services get 127.0.0.<n> (all of 127/8 is loopback on Linux)
    lock: threading.Lock = field(default_factory=threading.RLock)

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        """A pod LIST request: running pods, and those of deleted Deployments still draining."""
        out = self.pods(namespace, selector)
        for entry in self.terminating:
            dep, left = entry
            labels = dep["spec"]["template"]["metadata"]["labels"]
            if left <= 0 or dep["metadata"].get("namespace", namespace) != namespace \
                    or any(labels.get(k) != v for k, v in selector.items()):
                continue
            entry[1] -= 1
            out += [{"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{dep['metadata']['name']}-{i}", "namespace": namespace,
                                  "labels": dict(labels), "deletionTimestamp": "2026-01-01T00:00:00Z"},
                     "status": {"phase": "Running"}} for i in range(dep["spec"].get("replicas", 1))]
        return out

    def pods(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        """Pods the fake "controller" runs for the Deployments whose labels match ``selector``."""
        if self.deployment_behaviour == "kubelet":
            return self.kubelet.pods(namespace, selector)
        out = []
        for (g, plural, ns, name), dep in self.objects.items():
            if plural != "deployments" or ns != namespace:
                continue
            labels = dep["spec"]["template"]["metadata"]["labels"]
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            for i in range(dep["spec"].get("replicas", 1)):
                status: dict = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}
                if self.deployment_behaviour == "crashloop":
                    status["containerStatuses"] = [{
                        "name": "runtime", "restartCount": 3, "ready": False,
                        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                        "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                                     "message": "failed to load 'm' version 1: CUDA out of memory"}}}]
                elif self.deployment_behaviour == "pending":
                    status = {"phase": "Pending", "conditions": [{
                        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
                out.append({"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": f"{name}-{i}", "namespace": ns, "labels": dict(labels)},
                            "status": status})
        return out

    def _changed(self, plural: str, name: str, obj: dict | None) -> None:
        if self.kubelet is not None:
            self.kubelet.changed(plural, name, obj)

    def _controllers(self, group: str, plural: str, obj: dict) -> None:
        gen = obj["metadata"]["generation"]
        if plural == "deployments" and self.deployment_behaviour == "kubelet":
            obj["status"] = self.kubelet.status(obj)
        elif plural == "services" and self.kubelet is not None:
            if not obj["spec"].get("clusterIP"):
                obj["spec"]["clusterIP"] = f"127.0.0.{self.next_cluster_ip}"
                self.next_cluster_ip += 1
        elif plural == "deployments":
            n = obj["spec"].get("replicas", 1)
            ready = n if self.deployment_behaviour == "ready" else 0
            obj["status"] = {"observedGeneration": gen, "replicas": n, "updatedReplicas": n,
                             "readyReplicas": ready, "availableReplicas": ready}
        elif plural in ("httproutes", "grpcroutes"):
            accepted = self.route_behaviour == "accepted" and obj["metadata"]["name"] not in self.refused_routes
            obj["status"] = {"parents": [{
                "parentRef": obj["spec"]["parentRefs"][0], "controllerName": "example.com/gateway",
                "conditions": [
                    {"type": "Accepted", "status": "True" if accepted else "False",
                     "reason": "Accepted" if accepted else "NotAllowedByListeners",
                     "message": "" if accepted else "listener does not allow routes from this namespace",
                     "observedGeneration": gen},
                    {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs", "observedGeneration": gen}]}]}
            if not self.route_observed_generation:
                for cond in obj["status"]["parents"][0]["conditions"]:
                    del cond["observedGeneration"]
            for (g, p, ns, _), policy in self.objects.items():  # a policy's ancestors are its routes' Gateways
                if p in _POLICIES and ns == obj["metadata"].get("namespace"):
                    self._policy_status(policy)
        elif plural in _POLICIES:
            self._policy_status(obj)
        elif plural == "persistentvolumeclaims":
            obj["status"] = {"phase": "Bound"}

    def _policy_status(self, policy: dict) -> None:
        """Envoy Gateway's PolicyStatus: one ancestor per Gateway of the routes the policy targets
        that exist, Accepted (or not) at the policy's generation."""
        ns = policy["metadata"].get("namespace")
        gateways = []
        for ref in policy["spec"].get("targetRefs") or []:
            plural = {"HTTPRoute": "httproutes", "GRPCRoute": "grpcroutes"}[ref["kind"]]
            route = self.objects.get(("apis/gateway.networking.k8s.io/v1", plural, ns, ref["name"]))
            for parent in (route or {}).get("spec", {}).get("parentRefs") or []:
                if parent not in gateways:
                    gateways.append(parent)
        accepted = self.policy_behaviour == "accepted"
        policy["status"] = {"ancestors": [{
            "ancestorRef": parent, "controllerName": "gateway.envoyproxy.io/gatewayclass-controller",
            "conditions": [{"type": "Accepted", "status": "True" if accepted else "False",
                            "reason": "Accepted" if accepted else "Invalid",
                            "message": "" if accepted else "Secret modelops/modelops-key-x does not exist",
                            "observedGeneration": policy["metadata"]["generation"]}]} for parent in gateways]}


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}


def _handler(cluster: FakeCluster):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            with cluster.lock:
                cluster.requests.append(Request(method, url.path, parse_qs(url.query),
                                                self.headers.get("Content-Type", ""), body))
                code, out = self._answer(method, url.path.strip("/"), parse_qs(url.query), body)
            self._send(code, out)

        def _answer(self, method: str, path: str, query: dict, body: dict | None) -> tuple[int, dict]:
            if path == "version":
                return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0"}
            if path == "api":
                return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
            if path == "apis":
                groups = []
                for gp in _RESOURCES:
                    if gp.startswith("apis/"):
                        name, version = gp.split("/")[1:]
                        gv = {"groupVersion": f"{name}/{version}", "version": version}
                        groups.append({"name": name, "versions": [gv], "preferredVersion": gv})
                return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
            for gp, resources in _RESOURCES.items():
                if path == gp:
                    return 200, {"kind": "APIResourceList", "groupVersion": _API_VERSION[gp], "resources": [
                        {"name": plural, "singularName": "", "namespaced": namespaced, "kind": kind,
                         "verbs": ["get", "list", "patch", "delete", "create", "update"]}
                        for plural, kind, namespaced in resources]}
                if path.startswith(gp + "/"):
                    return self._object(method, gp, path[len(gp) + 1:].split("/"), query, body)
            return 404, _status(404, "NotFound", f"no path /{path}")

        def _object(self, method, gp, parts, query, body):
            ns = ""
            if parts[0] == "namespaces" and len(parts) >= 3:
                ns, parts = parts[1], parts[2:]
            plural, name, sub = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)
            key = (gp, plural, ns, name)
            if name is None:  # list
                selector = dict(kv.split("=", 1) for kv in (query.get("labelSelector", [""])[0].split(",")) if kv)
                if plural == "pods":
                    items = cluster.list_pods(ns, selector)
                else:
                    items = [o for (g, p, n, _), o in cluster.objects.items() if (g, p, n) == (gp, plural, ns)
                             and all(o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
                return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items}
            if method == "GET":
                if key in cluster.objects:
                    return 200, cluster.objects[key]
                return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
            if method == "DELETE":
                gone = cluster.objects.pop(key, None)
                if gone is None:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                if plural == "deployments" and cluster.drain_lists:
                    gone["metadata"].setdefault("namespace", ns)
                    cluster.terminating.append([gone, cluster.drain_lists])
                cluster._changed(plural, name, None)
                return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
            if method == "PATCH" and sub == "scale":
                obj = cluster.objects.get(key)
                if obj is None:
                    return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
                obj["spec"]["replicas"] = body["spec"]["replicas"]
                obj["metadata"]["generation"] += 1
                cluster._changed(plural, name, obj)
                cluster._controllers(gp, plural, obj)
                return 200, {"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": body["spec"]}
            if method == "PATCH":
                old = cluster.objects.get(key)
                obj = json.loads(json.dumps(body))
                gen = (old or {}).get("metadata", {}).get("generation", 0)
                changed = old is None or old.get("spec") != obj.get("spec")
                obj["metadata"]["generation"] = gen + 1 if changed else gen
                obj["metadata"].setdefault("namespace", ns) if ns else None
                if old is not None and "status" in old:
                    obj.setdefault("status", old["status"])  # apply of the spec keeps the status
                if old is not None and plural == "services" and old["spec"].get("clusterIP"):
                    obj["spec"].setdefault("clusterIP", old["spec"]["clusterIP"])  # immutable once assigned
                cluster.objects[key] = obj
                cluster._controllers(gp, plural, obj)
                cluster._changed(plural, name, obj)
                return 200, obj
            return 405, _status(405, "MethodNotAllowed", method)

        def do_GET(self):
            self._route("GET")

        def do_PATCH(self):
            self._route("PATCH")

        def do_DELETE(self):
            self._route("DELETE")

    return Handler


class FakeKubeAPI:
    """``with FakeKubeAPI() as api:`` serves on ``api.url``; ``api.cluster`` is the state."""

    def __init__(self) -> None:
        self.cluster = FakeCluster()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.cluster))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def api_client(self):
        from kubernetes import client

        conf = client.Configuration()
        conf.host = self.url
        return client.ApiClient(conf)
