"""Kubernetes provider: each version is a Deployment (its replicas are the instances), a Service, a
NetworkPolicy that admits only the Gateway's proxies and the platform (``k8s_network_policy``)
and, when its manifest's ``scaling`` is autoscaled, a KEDA ScaledObject that sets the replicas.

Health checks keep working behind the NetworkPolicy: the control plane runs as the flow-run Jobs of
the Kubernetes work pool, whose pods carry ``modelops.io/role: control-plane``
(deployments/kubernetes/base-job-template.json) in ``k8s_namespace``, and the policy admits those
pods on every port; the kubelet's probes come from the pod's own node, which a NetworkPolicy never
blocks. A control plane outside the cluster (or in pods without that label) cannot reach the pods:
set ``MODELOPS_K8S_NETWORK_POLICY=false`` there.

Rendered by :mod:`tasks.kube.manifests` (pure, validated offline in tests/unit/test_kubernetes.py)
and server-side-applied by :class:`tasks.kube.client.KubeClient` when a cluster is configured
(``MODELOPS_K8S_KUBECONFIG``/``KUBECONFIG``/``~/.kube/config`` or the in-cluster service
account; ``MODELOPS_K8S_NAMESPACE``, ``MODELOPS_K8S_CONTEXT``). Without one, every call that
needs the cluster raises ProvisionError saying how to configure it.

In the registry one instance row stands for one Deployment (named like it, ``pid`` unused,
``log_path`` the ``kubectl logs`` command), recorded before the Deployment is applied, so a
retried provision finds and reuses it. Readiness is read from the Deployment's status
(``observedGeneration``, ``updatedReplicas``, ``readyReplicas``) and its pods' container states.

Not run against a real cluster here (none on the build machine): the apply/read/delete paths are
exercised against a loopback stand-in of the API server in the unit tests.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from modelops.artifacts import Package
from modelops.errors import ModelLoadError, ProvisionError
from modelops.registry import Registry
from modelops.scaling import Scaling
from modelops.settings import Settings, get_settings
from tasks.kube.client import KubeClient
from tasks.kube.manifests import (
    DRAIN_MARGIN_S,
    KEDA_API,
    ServingSpec,
    image_reference,
    object_name,
    render_deployment,
    render_fsx_storage,
    render_networkpolicy,
    render_scaledobject,
    render_service,
    selector_labels,
    service_endpoints,
)
from tasks.provision.interface import Endpoints, Provider

__all__ = ["KubernetesProvider"]

log = logging.getLogger(__name__)

# Container waiting reasons that no amount of waiting fixes.
_IMAGE_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
_CONFIG_REASONS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
NETWORK_POLICY_API = "networking.k8s.io/v1"


def _image_tag(image: Any, settings: Settings) -> str:
    """The runtime image a version's pods run: an ImagePlan's ``tag``, a tag or reference given
    as a string, else (the lifecycle's image stage built the control plane's own runtime, a
    :class:`~tasks.image.RuntimeImage`) ``k8s_runtime_image``.

    Raises:
        ProvisionError: none of them is given.
    """
    if isinstance(image, str):
        return image
    if getattr(image, "tag", None):
        return image.tag
    if settings.k8s_runtime_image:
        return settings.k8s_runtime_image
    raise ProvisionError("MODELOPS_K8S_RUNTIME_IMAGE is not set: serving pods need a pushed runtime image; set it to "
                         "the tag of `modelops image plan` (built and pushed by CI from the same lock) or a full "
                         "image reference")


def _rolled_out(dep: dict, replicas: int) -> bool:
    """Whether a Deployment's controller has seen its current generation and it has
    ``replicas`` updated, ready replicas."""
    st = dep.get("status") or {}
    return ((st.get("observedGeneration") or 0) >= (dep["metadata"].get("generation") or 0)
            and (st.get("updatedReplicas") or 0) >= replicas and (st.get("readyReplicas") or 0) >= replicas)


def _selector(model_id: str, version: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(model_id, version).items())


class KubernetesProvider(Provider):
    """Serving capacity as Deployments; see the module docstring.

    Args:
        settings: the ``k8s_*`` block, ``provision_timeout_s`` (readiness budget, also the startup
            probe's), ``drain_timeout_s`` (the pods' grace period minus a margin).
        registry: version rows (resources come from the announced manifest) and instance rows.
        client: a :class:`KubeClient` (tests); default: one made on first use.
    """

    poll_s = 2.0  # seconds between reads of a Deployment's status

    def __init__(self, settings: Settings | None = None, registry: Registry | None = None,
                 client: KubeClient | None = None) -> None:
        self.settings = settings or get_settings()
        self.registry = registry or Registry(self.settings.registry)
        self._client = client

    @property
    def client(self) -> KubeClient:
        """The cluster; raises ProvisionError when none is configured."""
        if self._client is None:
            self._client = KubeClient(self.settings, ProvisionError)
        return self._client

    # -- rendering (no cluster) ----------------------------------------------------------------
    def spec(self, package: Package, image: Any, replicas: int = 1) -> ServingSpec:
        """The version's :class:`ServingSpec`: resources from its announced manifest (registry),
        the image reference from ``image`` (an ImagePlan or its tag) and the registry settings.

        Raises:
            ProvisionError: the version was never announced, or the image has no registry.
        """
        row = self.registry.get_version(package.model_id, package.version)
        if row is None:
            raise ProvisionError(f"{package.model_id} {package.version} is not in the registry; announce it first "
                                 "(its manifest's resources size the pods)")
        res = row.manifest.resources
        try:
            ref = image_reference(_image_tag(image, self.settings), self.settings)
        except ValueError as e:
            raise ProvisionError(str(e)) from None
        return ServingSpec(package.model_id, package.version, ref, str(package.path), res.cpus, res.memory_gb,
                           res.gpus, replicas)

    def manifests(self, package: Package, image: Any, replicas: int = 1) -> list[dict]:
        """Everything :meth:`ensure_instance` applies, in order: the FSx PersistentVolume and
        claim (only with ``k8s_fsx_filesystem_id``), with ``k8s_network_policy`` the version's
        NetworkPolicy (:func:`render_networkpolicy`: before any pod exists, so none is ever
        reachable from elsewhere), the Service, the Deployment, and for a version whose
        ``scaling`` is autoscaled its KEDA ScaledObject (:func:`render_scaledobject`).

        Raises:
            ProvisionError: a manifest cannot be rendered (the message names the setting).
        """
        spec = self.spec(package, image, replicas)
        scaling = self._scaling(spec.model_id, spec.version)
        try:
            storage = render_fsx_storage(self.settings) if self.settings.k8s_fsx_filesystem_id else []
            scaled = [render_scaledobject(spec.model_id, spec.version, scaling, self.settings)] \
                if scaling.autoscaled else []
            fence = [render_networkpolicy(spec.model_id, spec.version, self.settings)] \
                if self.settings.k8s_network_policy else []
            return [*storage, *fence, render_service(spec.model_id, spec.version, self.settings),
                    render_deployment(spec, self.settings), *scaled]
        except ValueError as e:
            raise ProvisionError(f"cannot render the Kubernetes objects of {spec.model_id} {spec.version}: {e}") \
                from None

    # -- Provider ------------------------------------------------------------------------------
    def ensure_instance(self, package: Package, image: Any) -> tuple[str, Endpoints]:
        """Apply the version's Service and Deployment (server-side apply: idempotent) and block
        until its replicas are ready.

        A live Deployment keeps its replica count (the rollout may have scaled it); a new one
        starts with one replica. If this call created the Deployment and it does not become
        ready, it is deleted again so its pods do not hold GPUs.

        Raises:
            ProvisionError: no cluster configured, the FSx claim missing or unbound, an object
                refused by the API server, an image that cannot be pulled, or not ready within
                ``provision_timeout_s``.
            ModelLoadError: the runtime container keeps exiting (CrashLoopBackOff); the message
                quotes its last termination.
        """
        client = self.client
        name = object_name(package.model_id, package.version)
        live = client.get("apps/v1", "Deployment", name)
        if live is not None:
            self._check_owner(live, package.model_id, package.version)
        replicas = max(1, (live or {}).get("spec", {}).get("replicas") or 0)
        objects = self.manifests(package, image, replicas)
        self._ensure_storage(client, [o for o in objects if o["kind"] in ("PersistentVolume", "PersistentVolumeClaim")])
        self._record(name, package.model_id, package.version)
        for obj in objects:
            if obj["kind"] in ("NetworkPolicy", "Service", "Deployment", "ScaledObject"):
                client.apply(obj)
        (dep,) = [o for o in objects if o["kind"] == "Deployment"]
        log.info("applied Service and Deployment %s/%s (%d replica(s), image %s)%s", client.namespace, name, replicas,
                 dep["spec"]["template"]["spec"]["containers"][0]["image"],
                 " and its ScaledObject" if objects[-1]["kind"] == "ScaledObject" else "")
        try:
            self._wait_ready(name, package.model_id, package.version, replicas)
        except ProvisionError:
            if live is None:
                self.stop(name)
            raise
        endpoints = self._endpoints(name, package.model_id, package.version)
        self.registry.update_instance(name, state="running", endpoints=endpoints.as_dict())
        return name, endpoints

    def _endpoints(self, name: str, model_id: str, version: str) -> Endpoints:
        """The Service's endpoints: by cluster DNS name, or by ``spec.clusterIP``
        (``k8s_service_address``)."""
        host = None
        if self.settings.k8s_service_address == "cluster-ip":
            svc = self.client.get("v1", "Service", name) or {}
            host = (svc.get("spec") or {}).get("clusterIP")
            if not host or host == "None":
                raise ProvisionError(f"Service {self.client.namespace}/{name} has no spec.clusterIP (headless or not "
                                     "yet assigned); use MODELOPS_K8S_SERVICE_ADDRESS=dns")
        return Endpoints(**service_endpoints(model_id, version, self.settings, host))

    def is_alive(self, instance) -> bool:
        """Whether the instance's Deployment exists and has a ready replica (its pods'
        readinessProbe on ``/ready``). Raises ProvisionError when the API cannot be read."""
        dep = self.client.get("apps/v1", "Deployment", instance.name)
        return dep is not None and ((dep.get("status") or {}).get("readyReplicas") or 0) >= 1

    def is_ready(self, instance) -> bool:
        """Whether every replica of the Deployment's current generation is ready."""
        dep = self.client.get("apps/v1", "Deployment", instance.name)
        want = ((dep or {}).get("spec") or {}).get("replicas", 1)
        return dep is not None and want >= 1 and _rolled_out(dep, want)

    def scale(self, model_id: str, version: str, count: int, package: Package | None, image: Any,
              unroute=None) -> None:
        """Set the version's replicas to ``count`` through the Deployment's scale subresource and
        wait: for ``count`` ready replicas when scaling up, for the surplus pods to be gone
        (drained: SIGTERM, then up to the grace period) when scaling down. ``count == 0``
        removes the Deployment and Service (:meth:`stop`), as the local provider stops every
        instance, also when the registry has no row for a live Deployment of the version;
        scaling up from nothing needs ``package`` and ``image``. ``unroute`` is not called: a
        terminating pod leaves its Service's endpoints, so the Gateway stops sending to it.

        Raises:
            ProvisionError: as :meth:`ensure_instance`, the package is not at hand, or (count 0)
                a Deployment of that name belongs to another model or version.
        """
        name = object_name(model_id, version)
        live = self.client.get("apps/v1", "Deployment", name)
        if count <= 0:
            rows = [i for i in self.registry.instances(model_id, version, live=False) if i.name == name]
            if rows and (live is not None or any(i.state != "stopped" for i in rows)):
                self.stop(name)
            elif not rows and live is not None:
                # A Deployment the registry has no row for (a lost row, a registry restored from a
                # backup): still ours by its annotations, so removed all the same.
                self._check_owner(live, model_id, version)
                log.warning("Deployment %s/%s has no instance row in the registry; deleting it anyway",
                            self.client.namespace, name)
                self._teardown(name, model_id, version)
            return
        if live is None:
            if package is None or image is None:
                raise ProvisionError(f"cannot scale {model_id} {version} up to {count}: its package is not at hand")
            self.ensure_instance(package, image)
        self.client.scale(name, count)
        self._wait_ready(name, model_id, version, count)
        self._wait_pods_at_most(model_id, version, count)

    def stop(self, instance_name: str) -> None:
        """Delete the version's Deployment, wait until its pods are gone (each gets SIGTERM and
        drains within its grace period), then delete its Service (:meth:`_teardown`).

        Raises:
            KeyError: no instance of that name in the registry (as the local provider);
                :meth:`scale` to 0 removes a Deployment that has no row.
            ProvisionError: the cluster refused a deletion or the pods outlived the wait (the
                Service is then kept; stopping again finishes the job).
        """
        rows = [i for i in self.registry.instances(live=False) if i.name == instance_name]
        if not rows:
            raise KeyError(f"no instance named {instance_name!r} in the registry")
        v = rows[0].model_version
        self._teardown(instance_name, v.model_id, v.version)
        self.registry.update_instance(instance_name, state="stopped")

    def _teardown(self, name: str, model_id: str, version: str) -> None:
        """The ScaledObject (an autoscaled version's) first, so its HPA does not scale a
        Deployment that is going; the Deployment next; the Service after its pods: draining
        pods keep answering the requests they hold (and the HTTPRoute's backendRef keeps
        resolving) until the last pod has exited; the NetworkPolicy last, so no pod of the
        version is ever open (deleted also when ``k8s_network_policy`` was turned off since)."""
        if self._scaling(model_id, version).autoscaled:
            self.client.delete(KEDA_API, "ScaledObject", name)
        self.client.delete("apps/v1", "Deployment", name)
        self._wait_pods_at_most(model_id, version, 0)
        self.client.delete("v1", "Service", name)
        self.client.delete(NETWORK_POLICY_API, "NetworkPolicy", name)
        log.info("stopped %s/%s", self.client.namespace, name)

    # -- helpers -------------------------------------------------------------------------------
    def _scaling(self, model_id: str, version: str) -> Scaling:
        """The version's announced scaling policy (the default when it was never announced)."""
        row = self.registry.get_version(model_id, version)
        return row.manifest.scaling if row is not None else Scaling()

    def _check_owner(self, obj: dict, model_id: str, version: str) -> None:
        notes = obj.get("metadata", {}).get("annotations") or {}
        mine = (notes.get("modelops.io/model-id"), notes.get("modelops.io/version"))
        if mine != (model_id, version):
            name = obj["metadata"]["name"]
            raise ProvisionError(f"Deployment {self.settings.k8s_namespace}/{name} already exists for "
                                 f"{mine[0] or '(not modelops)'} {mine[1] or ''}, not {model_id} {version}: the names "
                                 "clash; delete it or serve from another MODELOPS_K8S_NAMESPACE")

    def _record(self, name: str, model_id: str, version: str) -> None:
        # One row per Deployment, reused across stops and re-provisions (names are unique).
        if any(i.name == name for i in self.registry.instances(model_id, version, live=False)):
            self.registry.update_instance(name, state="starting")
        else:
            self.registry.add_instance(model_id, version, name,
                                       f"kubectl logs -n {self.settings.k8s_namespace} deployment/{name} --all-containers")

    def _ensure_storage(self, client: KubeClient, storage: list[dict]) -> None:
        """Apply the static FSx PV and claim when rendered, then require the claim to be Bound."""
        for obj in storage:
            client.apply(obj)
        pvc = self.settings.k8s_fsx_pvc
        deadline = time.monotonic() + (60 if storage else 0)
        while True:
            claim = client.get("v1", "PersistentVolumeClaim", pvc)
            if claim is None:
                raise ProvisionError(
                    f"PersistentVolumeClaim {client.namespace}/{pvc} (MODELOPS_K8S_FSX_PVC) does not exist: create a "
                    "static PersistentVolume on CSI driver fsx.csi.aws.com and a ReadWriteMany claim bound to it, or "
                    "set MODELOPS_K8S_FSX_FILESYSTEM_ID, _DNS_NAME and _MOUNT_NAME and modelops applies both "
                    "(docs/kubernetes.md)")
            phase = (claim.get("status") or {}).get("phase")
            if phase == "Bound":
                return
            if time.monotonic() >= deadline:
                raise ProvisionError(f"PersistentVolumeClaim {client.namespace}/{pvc} is {phase or 'not bound'}, "
                                     "not Bound: check its events (kubectl describe pvc) and that the FSx CSI driver "
                                     "is installed")
            time.sleep(self.poll_s)

    def _pod_problem(self, model_id: str, version: str) -> tuple[type[ProvisionError], str] | None:
        """A failure that waiting will not fix, read from the version's pods, else None."""
        for pod in self.client.list("v1", "Pod", _selector(model_id, version)):
            pname = pod["metadata"]["name"]
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                reason = waiting.get("reason")
                if reason == "CrashLoopBackOff":
                    last = (cs.get("lastState") or {}).get("terminated") or {}
                    cause = last.get("message") or last.get("reason") or "no termination message"
                    return ModelLoadError, (f"pod {pname} keeps exiting while loading (exit code {last.get('exitCode')},"
                                            f" {cs.get('restartCount', 0)} restarts): {cause.strip()[-800:]}\n  "
                                            f"(kubectl logs -n {self.client.namespace} {pname} --previous)")
                if reason in _IMAGE_REASONS:
                    return ProvisionError, (f"pod {pname} cannot pull its image ({reason}): {waiting.get('message', '')}"
                                            "; check MODELOPS_K8S_IMAGE_REGISTRY and that the image was pushed")
                if reason in _CONFIG_REASONS:
                    return ProvisionError, f"pod {pname} cannot start its container ({reason}): {waiting.get('message', '')}"
        return None

    def _pending_note(self, model_id: str, version: str) -> str:
        for pod in self.client.list("v1", "Pod", _selector(model_id, version)):
            for cond in (pod.get("status") or {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                    return f"; pod {pod['metadata']['name']} unschedulable: {cond.get('message', cond.get('reason'))}"
        return ""

    def _wait_ready(self, name: str, model_id: str, version: str, replicas: int) -> None:
        """Block until the Deployment's current generation has ``replicas`` updated, ready replicas."""
        deadline = time.monotonic() + self.settings.provision_timeout_s
        seen = "not read yet"
        while True:
            dep = self.client.get("apps/v1", "Deployment", name)
            if dep is None:
                raise ProvisionError(f"Deployment {self.client.namespace}/{name} disappeared while starting")
            st = dep.get("status") or {}
            seen = f"{st.get('readyReplicas') or 0}/{replicas} ready, {st.get('updatedReplicas') or 0} updated"
            if _rolled_out(dep, replicas):
                log.info("Deployment %s/%s: %s", self.client.namespace, name, seen)
                return
            for cond in st.get("conditions") or []:
                if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                    raise ProvisionError(f"Deployment {self.client.namespace}/{name} exceeded its progress deadline "
                                         f"({seen}): {cond.get('message', '')}{self._pending_note(model_id, version)}")
            if problem := self._pod_problem(model_id, version):
                cls, message = problem
                raise cls(f"{model_id} {version}: {message}")
            if time.monotonic() >= deadline:
                raise ProvisionError(f"Deployment {self.client.namespace}/{name} not ready after "
                                     f"{self.settings.provision_timeout_s:.0f} s ({seen})"
                                     f"{self._pending_note(model_id, version)}")
            time.sleep(self.poll_s)

    def _wait_pods_at_most(self, model_id: str, version: str, count: int) -> None:
        """Block until at most ``count`` pods of the version exist (terminating ones included)."""
        budget = math.ceil(self.settings.drain_timeout_s) + DRAIN_MARGIN_S + 30
        deadline = time.monotonic() + budget
        while True:
            pods = self.client.list("v1", "Pod", _selector(model_id, version))
            if len(pods) <= count:
                return
            if time.monotonic() >= deadline:
                raise ProvisionError(f"{model_id} {version}: {len(pods)} pod(s) still exist after {budget} s, expected "
                                     f"at most {count}: {', '.join(p['metadata']['name'] for p in pods)}")
            time.sleep(self.poll_s)
