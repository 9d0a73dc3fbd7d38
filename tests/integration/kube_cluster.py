"""A one-machine stand-in of a Kubernetes cluster that really serves: the fake API server of
tests/unit/fake_kube_api.py, plus

- a kubelet that runs each Deployment's pod as the real runtime (``runtime.startup`` from its
  container command, in the runtime image's interpreter) on its Service's cluster IP
  (``127.0.0.<n>``, loopback on Linux) at the Deployment's container ports; readiness is the
  pod's readinessProbe (``GET /ready``), a deleted Deployment's pod gets SIGTERM and is listed
  as terminating until it has drained and exited, a pod that exits is CrashLoopBackOff with its
  exit code and the tail of its log;
- a Gateway data plane: a real HAProxy that the "Gateway controller" programs from the applied
  HTTPRoutes (default-rule weights, one backend per version Service, ``X-Model-Version`` pins),
  as HAProxy's own Gateway API controllers do. It routes on the OpenAI ``model`` in the body, the
  part a body-based routing extension plays in front of a real Gateway.

One process stands for all replicas of a Deployment (replicas 0 stops it). What it proves: the
lifecycle and rollback flows drive Kubernetes objects (through the real ``kubernetes`` client)
into a fleet that serves and shifts traffic. What it cannot: scheduling, real Service
forwarding, rollout of pod templates, the Gateway implementation's own behaviour.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from modelops.settings import Settings
from tasks.traffic.haproxy import HAProxyRouter
from tasks.traffic.interface import ModelRoute, Server
from tests.unit.fake_kube_api import FakeKubeAPI

log = logging.getLogger(__name__)

VERSION_HEADER = "X-Model-Version"


@dataclass
class Pod:
    deployment: str
    labels: dict[str, str]
    proc: subprocess.Popen
    log_path: Path
    ready: bool = False
    terminating: bool = False


@dataclass
class Node:
    """Kubelet and Gateway data plane of one :class:`FakeKubeAPI` (see the module docstring).

    Args:
        api: the fake API server; its cluster switches to ``deployment_behaviour = "kubelet"``.
        python: the runtime image's interpreter; env: the pods' environment (the local
            provider's :func:`~tasks.provision.local.runtime_env`); workdir: pods' work folders
            and logs; gateway: settings of the data plane's HAProxy (its home and port).
    """

    api: FakeKubeAPI
    python: Path
    env: dict[str, str]
    workdir: Path
    gateway: Settings
    pods_by_deployment: dict[str, Pod] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # Deployment names, in the order their pods started
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.cluster = self.api.cluster
        self.cluster.deployment_behaviour = "kubelet"
        self.cluster.kubelet = self
        self.router = HAProxyRouter(self.gateway)
        self.router.ensure_running([])
        self._prober = threading.Thread(target=self._probe_loop, daemon=True)
        self._prober.start()

    @property
    def url(self) -> str:
        """The Gateway listener's OpenAI base URL."""
        return self.gateway.router_url

    # -- called by the fake API server, under its lock ----------------------------------------
    def changed(self, plural: str, name: str, obj: dict | None) -> None:
        if plural == "deployments":
            replicas = 0 if obj is None else obj["spec"].get("replicas", 1)
            pod = self.pods_by_deployment.get(name)
            if replicas >= 1 and (pod is None or pod.terminating):
                self._run(obj)
            elif replicas == 0 and pod is not None and not pod.terminating:
                self._terminate(pod)
        elif plural in ("httproutes", "services"):
            self._program_gateway()

    def status(self, dep: dict) -> dict:
        n = dep["spec"].get("replicas", 1)
        pod = self.pods_by_deployment.get(dep["metadata"]["name"])
        ready = n if pod is not None and pod.ready and not pod.terminating else 0
        return {"observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
                "readyReplicas": ready, "availableReplicas": ready}

    def pods(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        out = []
        for pod in self.pods_by_deployment.values():
            if any(pod.labels.get(k) != v for k, v in selector.items()):
                continue
            meta = {"name": f"{pod.deployment}-0", "namespace": namespace, "labels": dict(pod.labels)}
            status: dict = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}
            if pod.terminating:
                meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            rc = pod.proc.poll()
            if rc is not None and not pod.terminating:
                status["containerStatuses"] = [{
                    "name": "runtime", "restartCount": 1, "ready": False,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
                    "lastState": {"terminated": {"exitCode": rc, "reason": "Error",
                                                 "message": pod.log_path.read_text(errors="replace")[-2000:]}}}]
            out.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status})
        return out

    # -- pods ----------------------------------------------------------------------------------
    def _service_ip(self, name: str, namespace: str) -> str:
        svc = self.cluster.objects.get(("api/v1", "services", namespace, name))
        if svc is None:
            raise RuntimeError(f"Deployment {name} has no Service of its name: the provider applies it first")
        return svc["spec"]["clusterIP"]

    def _run(self, dep: dict) -> None:
        name, ns = dep["metadata"]["name"], dep["metadata"].get("namespace", "")
        [container] = dep["spec"]["template"]["spec"]["containers"]
        cmd = list(container["command"])
        assert cmd[:3] == ["python", "-m", "runtime.startup"], cmd
        work = self.workdir / name
        work.mkdir(parents=True, exist_ok=True)
        cmd[0] = str(self.python)
        cmd[cmd.index("--workdir") + 1] = str(work / "work")
        cmd[cmd.index("--host") + 1] = self._service_ip(name, ns)
        log_path = self.workdir / f"{name}.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        self.pods_by_deployment[name] = Pod(name, dict(labels), proc, log_path)
        self.started.append(name)
        log.info("kubelet: pod of %s started (pid %d) on %s", name, proc.pid, cmd[cmd.index("--host") + 1])

    def _terminate(self, pod: Pod) -> None:
        pod.terminating, pod.ready = True, False

        def drain() -> None:
            _stop(pod.proc)
            with self.cluster.lock:
                if self.pods_by_deployment.get(pod.deployment) is pod:
                    del self.pods_by_deployment[pod.deployment]

        threading.Thread(target=drain, daemon=True).start()

    def _probe_loop(self) -> None:
        """The readinessProbe: ``GET /ready`` on each pod every half second; a change of
        verdict rewrites its Deployment's status."""
        while not self._stop.wait(0.5):
            with self.cluster.lock:
                targets = [(pod, self._ready_url(pod)) for pod in self.pods_by_deployment.values()
                           if not pod.terminating]
            for pod, url in targets:
                ready = False
                if pod.proc.poll() is None and url:
                    try:
                        ready = httpx.get(url, timeout=2).status_code == 200
                    except httpx.HTTPError:
                        ready = False
                with self.cluster.lock:
                    if ready != pod.ready and not pod.terminating:
                        pod.ready = ready
                        self._write_status(pod.deployment)

    def _ready_url(self, pod: Pod) -> str | None:
        for (g, plural, ns, name), dep in self.cluster.objects.items():
            if plural == "deployments" and name == pod.deployment:
                [c] = dep["spec"]["template"]["spec"]["containers"]
                probe = c["readinessProbe"]["httpGet"]
                port = next(p["containerPort"] for p in c["ports"] if p["name"] == probe["port"])
                return f"http://{self._service_ip(name, ns)}:{port}{probe['path']}"
        return None

    def _write_status(self, deployment: str) -> None:
        for (g, plural, ns, name), dep in self.cluster.objects.items():
            if plural == "deployments" and name == deployment:
                dep["status"] = self.status(dep)

    # -- the Gateway data plane ----------------------------------------------------------------
    def routes(self) -> list[ModelRoute]:
        """The HTTPRoutes' routing as the data plane's routes: every version Service of a route
        with the weight of its default rule (0 when only its pin names it). The KServe routes
        (``<model>.kserve-http``, the GRPCRoute) carry the same weights by construction
        (tests/unit/test_kubernetes.py): their servers are the same Services' KServe ports."""
        out = []
        for (g, plural, ns, name), route in sorted(self.cluster.objects.items()):
            if plural != "httproutes" or name.endswith(".kserve-http"):
                continue
            model = route["metadata"]["annotations"]["modelops.io/model-id"]
            weights: dict[str, int] = {}
            version_of: dict[str, str] = {}
            for rule in route["spec"].get("rules") or []:
                headers = {h["name"]: h["value"] for m in rule.get("matches") or [] for h in m.get("headers") or []}
                for ref in rule.get("backendRefs") or []:
                    if VERSION_HEADER in headers:
                        version_of[ref["name"]] = headers[VERSION_HEADER]
                        weights.setdefault(ref["name"], 0)
                    else:
                        weights[ref["name"]] = ref.get("weight", 1)
            versions = {}
            for svc_name, version in version_of.items():
                svc = self.cluster.objects[("api/v1", "services", ns, svc_name)]
                ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
                ip = svc["spec"]["clusterIP"]
                versions[version] = (Server(svc_name, f"{ip}:{ports['openai']}", weights[svc_name],
                                            kserve_http=f"{ip}:{ports['kserve-http']}",
                                            kserve_grpc=f"{ip}:{ports['kserve-grpc']}"),)
            out.append(ModelRoute(model, versions))
        return out

    def _program_gateway(self) -> None:
        try:
            self.router.apply(self.routes())
        except KeyError:
            pass  # a route names a Service not applied yet: programmed again when it is

    def close(self) -> None:
        """Stop every pod (drained) and the data plane."""
        self._stop.set()
        with self.cluster.lock:
            pods = list(self.pods_by_deployment.values())
        for pod in pods:
            _stop(pod.proc)
        self.router.stop()


def _stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the pod's leader (the runtime drains), wait, then SIGKILL what is left of its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
