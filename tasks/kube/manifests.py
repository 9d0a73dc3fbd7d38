"""Kubernetes manifests of a served model, rendered as plain dicts: pure functions, no cluster.

One model version is one ``apps/v1 Deployment`` (its replicas are the version's instances), one
``v1 Service`` and one ``NetworkPolicy`` (only the Gateway's proxies and the platform reach its
pods); one model is one Gateway API ``HTTPRoute`` whose backendRefs carry the versions' weights
(and, for KServe v2, one more ``HTTPRoute`` and a ``GRPCRoute`` with the same weights) and, once
API keys are on, Envoy Gateway's ``SecurityPolicy`` (which keys may call it) and
``BackendTrafficPolicy`` (their rpm) on those routes, with each key in its own ``Secret``. The
FSx for Lustre file system that holds weights and packages is a static ``PersistentVolume`` (CSI
driver ``fsx.csi.aws.com``) and a ``PersistentVolumeClaim`` bound to it.

Every function takes values and :class:`~modelops.settings.Settings` and returns the object as
the API server would receive it (``kubectl apply -f`` of ``json.dumps`` works). Errors are
``ValueError`` naming the field and the fix; the provider and the router turn them into
ProvisionError / TrafficError.

Sources of the facts used here:
- Kubernetes API reference (Deployment, Service, probes, volumes, resource quantities), the
  object-name rules (DNS-1035 labels for Services, label values of at most 63 characters);
- Gateway API ``HTTPRoute`` v1 (``spec.rules[].matches``, ``backendRefs[].weight``: a proportion
  0..1,000,000 of the rule's traffic, 0 = none; match precedence: path, method, then the largest
  number of header matches; at most 16 rules and 16 backendRefs a rule), read from the API's
  field documentation as shipped in ``@kubernetes-models/gateway-api`` (tests/k8s);
- Gateway API Inference Extension ``InferencePool`` v1 (``spec.selector.matchLabels``,
  ``targetPorts`` 1..8 unique numbers, ``endpointPickerRef`` with ``port`` required for a Service,
  ``failureMode`` FailOpen|FailClose; an HTTPRoute backendRef names it by group
  ``inference.networking.k8s.io``, kind and name, without a port), read from its API reference
  (gateway-api-inference-extension.sigs.k8s.io/reference/spec);
- KEDA's ``ScaledObject`` (keda.sh/v1alpha1) and its Prometheus trigger (``serverAddress``,
  ``query``, ``threshold``, ``ignoreNullValues``; ``metricType`` AverageValue | Value), read
  from keda.sh/docs and checked against ``@kubernetes-models/keda`` (tests/k8s);
- the FSx for Lustre CSI driver's static provisioning example (``volumeHandle`` = file system
  id, ``volumeAttributes.dnsname`` / ``mountname``, ReadWriteMany, ``flock`` mount option);
- the image reference grammar of distribution/reference (``reference.go``'s grammar comment:
  lower-case path components joined by ``.``, ``_``, ``__`` or dashes; an optional domain with
  a port; tags ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``; a name of at most 255 characters) and
  OCI's image-spec for digests (registered algorithms: sha256 of 64, sha512 of 128 lower-case
  hex digits);
- Envoy Gateway v1.9.0's API types and translator (SecurityPolicy ``apiKeyAuth``, BackendTrafficPolicy
  ``rateLimit``, its proxy pods' labels and namespace: the comment block above
  :func:`render_securitypolicy` names each file), checked against ``@kubernetes-models/envoy-gateway``
  (tests/k8s); the NetworkPolicy API (``networking.k8s.io/v1``) and the Kubernetes documentation's
  Network Policies page (traffic from a pod's own node is always allowed; the API server labels
  every namespace ``kubernetes.io/metadata.name``);
- the runtime's own contract: ``runtime/startup.py`` (flags, ``PROMETHEUS_MULTIPROC_DIR`` wipe,
  SIGTERM drain) and the NGC image layout (``MODELOPS_TRITON_HOME=/opt/tritonserver``).
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from modelops.manifest import MODEL_ID_PATTERN
from modelops.settings import Settings
from modelops.tenancy import ALL_MODELS, KEY_HEADER, KEY_NAME_PATTERN, PLATFORM_KEY, KeyGrant

__all__ = ["CONTROL_PLANE_LABELS", "DRAIN_MARGIN_S", "ENVOY_GATEWAY_API", "FIELD_MANAGER", "FSX_CSI_DRIVER",
           "GPU_RESOURCE", "GRPC_MODEL_HEADER", "INFERENCE_POOL_API", "KEDA_API", "KEY_HEADER", "KEY_SECRET_LABELS",
           "KEY_SECRET_PREFIX", "MANAGED_BY", "MEMORY_VOLUMES_MIB", "METRICS_DIR", "METRICS_MIB", "PORTS",
           "ROUTE_NAMES", "SHM_MIB", "STARTUP_PERIOD_S", "VERSION_HEADER", "WORK_DIR", "ServingSpec", "api_key_auth",
           "check_key_grants", "gateway_parent_ref", "gateway_proxy_peer", "image_reference", "key_secret_name",
           "label_value", "namespace_setting", "namespaced_pods", "object_name", "pullable_reference",
           "render_api_key_secret", "render_backendtrafficpolicy", "render_deployment", "render_fsx_storage",
           "render_httproute", "render_inferencepool", "render_networkpolicy", "render_scaledobject",
           "render_securitypolicy", "render_service", "selector_labels", "service_endpoints"]

# Server-side apply field manager of every object modelops writes.
FIELD_MANAGER = "modelops"
MANAGED_BY = {"app.kubernetes.io/managed-by": "modelops"}
# Container ports of one instance (name → port): the OpenAI frontend (also /health, /ready and the
# merged /metrics), the public KServe v2 HTTP and gRPC gates, and Triton's own metrics endpoint.
# The KServe ports are Triton's customary 8000/8001/8002; names are IANA_SVC_NAMEs (≤ 15 chars).
PORTS = {"openai": 8080, "kserve-http": 8000, "kserve-grpc": 8001, "metrics": 8002}
# Service appProtocol per port: gRPC is cleartext HTTP/2 (Gateway API GEP-1911 `kubernetes.io/h2c`).
_APP_PROTOCOL = {"openai": "http", "kserve-http": "http", "kserve-grpc": "kubernetes.io/h2c", "metrics": "http"}
VERSION_HEADER = "X-Model-Version"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
# The gRPC metadata that names the model (HAProxy and a GRPCRoute cannot read the protobuf message).
GRPC_MODEL_HEADER = "x-model-id"
# Route object names per protocol (format with the model id); PORTS keys double as the protocols.
ROUTE_NAMES = {"openai": "{}", "kserve-http": "{}.kserve-http", "kserve-grpc": "{}"}
GPU_RESOURCE = "nvidia.com/gpu"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
# The instance's scratch: the unpacked package, plugin wheels, Triton's backend folder.
WORK_DIR = "/var/lib/modelops"
# vLLM's multiprocess metric files live in a memory emptyDir mounted at METRICS_DIR; the env
# var points one level below it because runtime.startup wipes the folder with rmtree + mkdir,
# and a mount point can be emptied but not removed (mkdir would then fail with FileExistsError).
METRICS_DIR = "/var/run/modelops"
_PROMETHEUS_MULTIPROC_DIR = f"{METRICS_DIR}/prometheus"
# Sizes (MiB) of the two memory-medium emptyDirs: vLLM's metric files (a few MiB per process) and
# /dev/shm (Triton's Python backend and NCCL; a container runtime's default is 64 MiB). Pages
# written to a memory emptyDir are charged to the container's memory cgroup, so both sizes are
# added to the memory request and limit on top of the manifest's memory_gb: a small model that
# fills /dev/shm is not OOM-killed for it, and the scheduler reserves what the pod may use.
METRICS_MIB = 256
SHM_MIB = 1024
MEMORY_VOLUMES_MIB = METRICS_MIB + SHM_MIB
# Grace beyond the drain timeout: after the drain the frontend stops Triton and exits
# (tasks/provision/local.py gives a local instance the same margin before SIGKILL).
DRAIN_MARGIN_S = 15
STARTUP_PERIOD_S = 10
# Weight bound of HTTPBackendRef.weight (Gateway API v1: minimum 0, maximum 1000000).
_MAX_WEIGHT = 1_000_000
# HTTPRouteSpec.rules maxItems 16: one rule per version pin plus the default rule.
_MAX_RULES = 16

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def object_name(model_id: str, version: str) -> str:
    """Name of a version's Deployment and Service: ``<model_id>-v<version>``.

    A Service name must be a DNS-1035 label (``[a-z]([-a-z0-9]*[a-z0-9])?``, ≤ 63 characters).
    When the version is not already lowercase letters, digits and ``-`` (``1.0``, ``V2``), or the
    name would be too long or start with a digit, the name is made valid and suffixed with
    ``sha256(model_id, version)[:8]`` so that versions that sanitize alike (``1.0``, ``1-0``) stay
    apart. Example: ``("all-minilm-l6-v2", "1")`` → ``all-minilm-l6-v2-v1``.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", version.lower()).strip("-") or "x"
    name = f"{model_id}-v{slug}"
    if slug == version and _DNS_1035.match(name):
        return name
    base = name if name[0].isalpha() else f"m-{name}"
    return f"{base[:54].rstrip('-')}-{_digest(model_id, version)}"


def label_value(version: str) -> str:
    """``version`` as a label value (≤ 63 characters, alphanumeric at both ends); a version that
    is not one already becomes its sanitized prefix plus ``sha256(version)[:8]``. The exact
    version is always in the ``modelops.io/version`` annotation."""
    if _LABEL_VALUE.match(version):
        return version
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", version).strip("-_.")[:54].rstrip("-_.")
    return f"{slug}-{_digest(version)}" if slug else _digest(version)


def selector_labels(model_id: str, version: str) -> dict[str, str]:
    """The labels that select a version's pods (Deployment selector, Service selector)."""
    return {"app.kubernetes.io/name": model_id, "modelops.io/version": label_value(version)}


def _labels(model_id: str, version: str) -> dict[str, str]:
    return {**selector_labels(model_id, version), "app.kubernetes.io/instance": object_name(model_id, version),
            "app.kubernetes.io/component": "serving", **MANAGED_BY}


def _annotations(model_id: str, version: str) -> dict[str, str]:
    return {"modelops.io/model-id": model_id, "modelops.io/version": version}


def _version_metadata(model_id: str, version: str, settings: Settings) -> dict:
    """The metadata of an object that stands for one version (its Service, InferencePool,
    ScaledObject): named like its Deployment, with its labels and ownership annotations."""
    return {"name": object_name(model_id, version), "namespace": settings.k8s_namespace,
            "labels": _labels(model_id, version), "annotations": _annotations(model_id, version)}


_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*")
_DOMAIN = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                     r"|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# The digests a registry verifies (OCI image-spec descriptor.md: registered algorithms).
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}")
_EXAMPLE = "e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/modelops-runtime:26.07-vllm0.24.0-0123456789ab"


def _reference_problem(ref: str) -> str | None:
    """What keeps ``ref`` from being a reference a cluster can pull, or None."""
    rest, at, digest = ref.partition("@")
    name, colon, tag = rest.rpartition(":") if rest.rfind(":") > rest.rfind("/") else (rest, "", "")
    # The first component names a registry when it has a '.' or ':', is localhost, or has upper case.
    first, slash, remainder = name.partition("/")
    registry = slash and ("." in first or ":" in first or first == "localhost" or first != first.lower())
    domain, path = (first, remainder) if registry else ("", name)
    if at and not _DIGEST.fullmatch(digest):
        return f"its digest {digest!r} is not sha256:<64 lower-case hex digits> or sha512:<128>"
    if colon and not _TAG.fullmatch(tag):
        return f"its tag {tag!r} is not 1-128 letters, digits, '_', '.' or '-' (not starting with '.' or '-')"
    if not colon and not at:
        return "it has neither a tag (:TAG) nor a digest (@sha256:...)"
    if domain and not _DOMAIN.fullmatch(domain):
        return f"its registry {domain!r} is not a host name or address with an optional :port"
    if not _PATH.fullmatch(path):
        return (f"its repository {path!r} is not lower-case letters and digits, separated by '.', '_', '__', '-' "
                "or '/'")
    if len(name) > 255:
        return f"its name is {len(name)} characters long (at most 255)"
    return None


def pullable_reference(ref: str, what: str) -> str:
    """``ref`` when it is a full image reference a cluster can pull (``REGISTRY/REPOSITORY:TAG`` or
    ``...@sha256:<digest>``, distribution/reference's grammar), for an image other than the
    runtime's (``what`` names it in the error).

    Raises:
        ValueError: which part of ``ref`` breaks the grammar, or that it names no registry.
    """
    if "/" not in ref.partition("@")[0]:
        raise ValueError(f"{what} {ref!r} names no registry: give REGISTRY/REPOSITORY:TAG "
                         "(e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/modelops-control-plane:1.0)")
    if problem := _reference_problem(ref):
        raise ValueError(f"{what} {ref!r} is not a reference a cluster can pull: {problem}")
    return ref


def image_reference(tag: str, settings: Settings) -> str:
    """The full image reference of a runtime image, checked against the reference grammar
    (distribution/reference; digests as OCI's image-spec registers them).

    Args:
        tag: ``tasks.image.plan_image(...).tag`` (``modelops-runtime:<release>-vllm<v>-<sha12>``),
            its tag part alone, a digest (``@sha256:...``, optionally after the repository), or
            a full reference with a registry (used as it is).

    Returns:
        ``<k8s_image_registry>/<k8s_image_repository>:<tag part>`` (``@<digest>`` for a digest).

    Raises:
        ValueError: naming what to fix: a reference that does not follow the grammar (which
            part), a short form that names another repository than the runtime's, a short form
            with ``MODELOPS_K8S_IMAGE_REGISTRY`` unset (a cluster cannot pull
            ``modelops-runtime:...`` from nowhere), or registry settings that make no reference.
    """
    if "/" in tag.partition("@")[0]:
        if problem := _reference_problem(tag):
            raise ValueError(f"image {tag!r} is not a reference a cluster can pull: {problem} ({_EXAMPLE})")
        return tag  # registry/repository:tag or @digest, as given
    repository = settings.k8s_image_repository
    if problem := _reference_problem(f"{repository}:tag"):
        raise ValueError(f"MODELOPS_K8S_IMAGE_REPOSITORY {repository!r} is not a repository name: {problem} "
                         "(e.g. modelops-runtime)")
    rest, at, digest = tag.partition("@")
    if ":" in rest:
        name, colon, part = rest.rpartition(":")
    else:  # before a digest the name, else the tag alone
        name, colon, part = (rest, "", "") if at else ("", "", rest)
    if name not in ("", "modelops-runtime", repository):  # the plan's name, or the configured one
        raise ValueError(f"image {tag!r} names repository {name!r}, but the runtime images are in "
                         f"MODELOPS_K8S_IMAGE_REPOSITORY ({repository!r}): pass the tag alone, or a full reference "
                         "REGISTRY/REPOSITORY:TAG")
    short = repository + (f":{part}" if colon or not at else "") + (f"@{digest}" if at else "")
    if problem := _reference_problem(short):
        raise ValueError(f"image {tag!r} is not a reference a cluster can pull: {problem} ({_EXAMPLE})")
    if not settings.k8s_image_registry:
        raise ValueError(f"image {tag!r} has no registry: set MODELOPS_K8S_IMAGE_REGISTRY to where the runtime "
                         "images are pushed (e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml)")
    ref = f"{settings.k8s_image_registry.rstrip('/')}/{short}"
    if problem := _reference_problem(ref):
        raise ValueError(f"MODELOPS_K8S_IMAGE_REGISTRY {settings.k8s_image_registry!r} makes {ref!r}, which a "
                         f"cluster cannot pull: {problem} (e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml)")
    return ref


@dataclass(frozen=True)
class ServingSpec:
    """What one version's Deployment runs.

    Attributes:
        model_id, version: the registry's keys.
        image: full image reference (:func:`image_reference`).
        package: absolute path of the sealed package folder (``package.tar.gz`` + ``package.json``)
            as the pods see it: on the FSx volume, under ``k8s_fsx_mount_path``.
        cpus: CPU request in cores; memory_gb: the model's memory in GiB (the pod's memory
            request and limit are this plus :data:`MEMORY_VOLUMES_MIB`); gpus: whole
            ``nvidia.com/gpu`` devices (manifest ``resources``).
        replicas: instances of the version.
    """

    model_id: str
    version: str
    image: str
    package: str
    cpus: float = 2
    memory_gb: float = 8
    gpus: int = 0
    replicas: int = 1


def _quantities(spec: ServingSpec) -> tuple[dict, dict]:
    millicores = max(1, round(spec.cpus * 1000))
    # The model's memory plus the memory emptyDirs, which are charged to the same cgroup.
    mem = f"{max(1, math.ceil(spec.memory_gb * 1024)) + MEMORY_VOLUMES_MIB}Mi"
    requests = {"cpu": f"{millicores}m", "memory": mem}
    # Memory limit = request: a runaway engine is OOM-killed rather than starving the node. No
    # CPU limit: CFS throttling adds latency to tokenization and HTTP while the request already
    # reserves the cores for scheduling.
    limits = {"memory": mem}
    if spec.gpus:
        # Extended resources cannot be overcommitted: request and limit must be equal.
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(spec.gpus)
    return requests, limits


def _under_mount(path: str, mount: PurePosixPath, what: str, fix: str) -> None:
    p = PurePosixPath(path)
    if not p.is_absolute() or not p.is_relative_to(mount):
        raise ValueError(f"{what} {path} is not on the FSx volume the pods mount at {mount}: {fix}")


def render_deployment(spec: ServingSpec, settings: Settings) -> dict:
    """The ``apps/v1 Deployment`` of one version.

    The pod runs ``python -m runtime.startup`` from the runtime image (its ENTRYPOINT, written
    out so the manifest says what runs) on fixed container ports (:data:`PORTS`), bound to
    0.0.0.0 so the kubelet's probes and the Service reach them.

    Probes (``core/v1 Probe``):
      - startupProbe ``GET /ready`` on ``openai``: 200 once the engine answered a warm-up request;
        ``failureThreshold × periodSeconds`` ≥ ``provision_timeout_s`` (model load budget), after
        which the kubelet restarts the container; the other probes wait for it;
      - readinessProbe ``GET /ready`` on ``openai`` every 2 s, 2 failures: false while the engine
        loads, once its process is stalled or dead (Triton's own ``/v2/health/ready`` stays 200 over a
        dead Python backend stub, runtime/frontend/engine_watch.py) and from SIGTERM on, so the pod
        leaves the Service's endpoints within about 4 s; a dead engine also exits the container
        (status 70/75), which the kubelet restarts with its back-off;
      - livenessProbe ``GET /health`` on ``openai``: the frontend's event loop answers.

    Volumes: the FSx claim read-only at ``k8s_fsx_mount_path`` (weights are read by absolute
    path from the package's ``model.json``, so the mount path equals the control plane's);
    ``emptyDir`` scratch at :data:`WORK_DIR`; a memory ``emptyDir`` for vLLM's multiprocess
    metric files (``PROMETHEUS_MULTIPROC_DIR``, :data:`METRICS_MIB`) and one at ``/dev/shm``
    (:data:`SHM_MIB`; Triton's Python backend and NCCL exchange tensors through shared memory; a
    container runtime's default is 64 MiB). Both count against the container's memory limit, so
    their sizes are added to the memory request and limit.

    Raises:
        ValueError: the package or the FSx root is not under ``k8s_fsx_mount_path``, or
            replicas / resources are out of range.
    """
    mount = PurePosixPath(settings.k8s_fsx_mount_path)
    _under_mount(spec.package, mount, "package",
                 f"set MODELOPS_HOME under {mount} (e.g. {mount}/modelops) so packages are sealed onto FSx")
    _under_mount(str(settings.fsx_dir), mount, "the FSx root (MODELOPS_FSX_ROOT)",
                 f"set MODELOPS_FSX_ROOT under {mount} (e.g. {mount}/models): model.json names the weights "
                 "by that absolute path")
    if not 0 <= spec.replicas <= 2**31 - 1:  # Deployment spec.replicas is an int32
        raise ValueError(f"replicas {spec.replicas}: must be 0 to 2147483647")
    if spec.cpus <= 0 or spec.memory_gb <= 0 or spec.gpus < 0:
        raise ValueError(f"resources cpus={spec.cpus} memory_gb={spec.memory_gb} gpus={spec.gpus}: cpus and "
                         "memory_gb must be positive, gpus 0 or more")
    name = object_name(spec.model_id, spec.version)
    requests, limits = _quantities(spec)
    drain = math.ceil(settings.drain_timeout_s)
    command = ["python", "-m", "runtime.startup", "--package", spec.package, "--workdir", f"{WORK_DIR}/work",
               "--host", "0.0.0.0",
               "--openai-port", str(PORTS["openai"]), "--http-port", str(PORTS["kserve-http"]),
               "--grpc-port", str(PORTS["kserve-grpc"]), "--metrics-port", str(PORTS["metrics"]),
               "--drain-timeout", str(drain)]
    container = {
        "name": "runtime",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",  # tags are content hashes (tasks.image.plan_image)
        "command": command,
        "env": [
            {"name": "MODELOPS_TRITON_HOME", "value": "/opt/tritonserver"},  # NGC layout (Dockerfile.template)
            {"name": "PROMETHEUS_MULTIPROC_DIR", "value": _PROMETHEUS_MULTIPROC_DIR},
            {"name": "HF_HUB_OFFLINE", "value": "1"},  # weights come from FSx, never from a hub
        ],
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in PORTS.items()],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": {"httpGet": {"path": "/ready", "port": "openai"}, "periodSeconds": STARTUP_PERIOD_S,
                         "timeoutSeconds": 5,
                         "failureThreshold": max(1, math.ceil(settings.provision_timeout_s / STARTUP_PERIOD_S))},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "openai"}, "periodSeconds": 2,
                           "timeoutSeconds": 2, "failureThreshold": 2, "successThreshold": 1},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "openai"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        # No preStop hook: SIGTERM itself drains the runtime (runtime/frontend/readiness.py):
        # readiness turns false at once, the KServe gates close to new connections, new OpenAI
        # requests get 503 `draining` with Retry-After, in-flight ones (streams included) finish
        # within --drain-timeout, then it exits. A `sleep` preStop would only hold SIGTERM back
        # while the endpoint removal propagates; requests that race it get that retryable 503.
        "volumeMounts": [
            {"name": "fsx", "mountPath": str(mount), "readOnly": True},
            {"name": "work", "mountPath": WORK_DIR},
            {"name": "metrics", "mountPath": METRICS_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    pod_spec: dict = {
        # The drain (--drain-timeout) plus the margin for stopping Triton; SIGKILL after that.
        "terminationGracePeriodSeconds": drain + DRAIN_MARGIN_S,
        "automountServiceAccountToken": False,  # the runtime never calls the Kubernetes API
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": [
            {"name": "fsx", "persistentVolumeClaim": {"claimName": settings.k8s_fsx_pvc, "readOnly": True}},
            {"name": "work", "emptyDir": {"sizeLimit": "8Gi"}},
            {"name": "metrics", "emptyDir": {"medium": "Memory", "sizeLimit": f"{METRICS_MIB}Mi"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_MIB}Mi"}},
        ],
    }
    if spec.gpus:
        # GPU node groups are usually tainted so that only GPU workloads land there.
        pod_spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    labels = _labels(spec.model_id, spec.version)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": settings.k8s_namespace, "labels": labels,
                     "annotations": {**_annotations(spec.model_id, spec.version), "modelops.io/package": spec.package}},
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 2,
            # The Progressing condition turns False (ProgressDeadlineExceeded) only after the
            # model-load budget of the startup probe.
            "progressDeadlineSeconds": math.ceil(settings.provision_timeout_s) + 60,
            "selector": {"matchLabels": selector_labels(spec.model_id, spec.version)},
            # A changed template of the same version (a new image) surges one pod and retires an
            # old one only once the new one is ready: capacity never drops.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    **_annotations(spec.model_id, spec.version),
                    # One scrape gives Triton's and vLLM's metrics (runtime/frontend/metrics.py).
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["openai"]),
                    "prometheus.io/path": "/metrics"}},
                "spec": pod_spec,
            },
        },
    }


def render_service(model_id: str, version: str, settings: Settings) -> dict:
    """The ``v1 Service`` (ClusterIP) of one version: its pods by :func:`selector_labels`, every
    port of :data:`PORTS` under the same name, with ``appProtocol`` for Gateway implementations."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _version_metadata(model_id, version, settings),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(model_id, version),
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP", "appProtocol": _APP_PROTOCOL[n]}
                      for n, p in PORTS.items()],
        },
    }


def service_endpoints(model_id: str, version: str, settings: Settings, host: str | None = None) -> dict[str, str]:
    """The version's endpoints through its Service, in the shape of
    :class:`tasks.provision.interface.Endpoints`: by ``host`` (its ``spec.clusterIP``) when
    given, else by its cluster DNS name (``<svc>.<ns>.svc``); reachable from inside the cluster
    (the control-plane jobs run there)."""
    host = host or f"{object_name(model_id, version)}.{settings.k8s_namespace}.svc"
    return {"openai": f"http://{host}:{PORTS['openai']}/v1", "kserve_http": f"http://{host}:{PORTS['kserve-http']}",
            "kserve_grpc": f"{host}:{PORTS['kserve-grpc']}", "metrics": f"http://{host}:{PORTS['openai']}/metrics"}


def render_fsx_storage(settings: Settings) -> list[dict]:
    """The static ``PersistentVolume`` of the FSx for Lustre file system and the claim
    ``k8s_fsx_pvc`` bound to it (FSx CSI driver ``fsx.csi.aws.com``, static provisioning).

    The file system is created by the platform (Terraform, with its S3 data repository
    association); pods of every version share it, so it is ReadWriteMany and ``Retain``.
    ``claimRef`` reserves the volume for the claim and ``volumeName`` binds the claim to it.

    Raises:
        ValueError: ``k8s_fsx_filesystem_id`` is set but ``k8s_fsx_dns_name`` or
            ``k8s_fsx_mount_name`` is not (both come from ``aws fsx describe-file-systems``).
    """
    fs = settings.k8s_fsx_filesystem_id
    if not fs:
        raise ValueError("MODELOPS_K8S_FSX_FILESYSTEM_ID is not set: there is no file system to render a "
                         "PersistentVolume for (or create the claim MODELOPS_K8S_FSX_PVC yourself)")
    missing = [n for n in ("k8s_fsx_dns_name", "k8s_fsx_mount_name") if not getattr(settings, n)]
    if missing:
        raise ValueError(f"{', '.join('MODELOPS_' + n.upper() for n in missing)} must be set with "
                         f"MODELOPS_K8S_FSX_FILESYSTEM_ID={fs} (DNSName and LustreConfiguration.MountName from "
                         "`aws fsx describe-file-systems`)")
    pv_name = f"{settings.k8s_fsx_pvc}-{fs}".lower()[:253]
    capacity = f"{settings.k8s_fsx_capacity_gib}Gi"
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv_name, "labels": dict(MANAGED_BY)},
        "spec": {
            "capacity": {"storage": capacity},
            "volumeMode": "Filesystem",
            "accessModes": ["ReadWriteMany"],
            "mountOptions": ["flock"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": settings.k8s_fsx_storage_class,
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": settings.k8s_namespace,
                         "name": settings.k8s_fsx_pvc},
            "csi": {"driver": FSX_CSI_DRIVER, "volumeHandle": fs,
                    "volumeAttributes": {"dnsname": settings.k8s_fsx_dns_name,
                                         "mountname": settings.k8s_fsx_mount_name}},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": settings.k8s_fsx_pvc, "namespace": settings.k8s_namespace, "labels": dict(MANAGED_BY)},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": settings.k8s_fsx_storage_class,
            "volumeName": pv_name,
            "resources": {"requests": {"storage": capacity}},
        },
    }
    return [pv, pvc]


def render_inferencepool(model_id: str, version: str, settings: Settings) -> dict:
    """The Gateway API Inference Extension ``InferencePool`` (inference.networking.k8s.io/v1) of
    one version, for ``k8s_inference_pool``: the version's pods (:func:`selector_labels`, as its
    Deployment and Service select them) on their OpenAI port, and the endpoint picker that
    chooses among them (``k8s_endpoint_picker``'s Service on ``k8s_endpoint_picker_port``). The
    picker reads what each pod's merged ``/metrics`` exposes: ``vllm:num_requests_waiting``,
    ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` labelled ``model_name``. Named
    like the version's Service.

    Raises:
        ValueError: ``k8s_endpoint_picker`` does not make a Service name (a DNS-1035 label of at
            most 63 characters) for this pool.
    """
    picker = _picker_service(model_id, version, settings)
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _version_metadata(model_id, version, settings),
        "spec": {
            "selector": {"matchLabels": selector_labels(model_id, version)},
            "targetPorts": [{"number": PORTS["openai"]}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker,
                                  "port": {"number": settings.k8s_endpoint_picker_port},
                                  "failureMode": settings.k8s_endpoint_picker_failure_mode},
        },
    }


def _picker_service(model_id: str, version: str, settings: Settings) -> str:
    """The name of the version's endpoint picker Service (``k8s_endpoint_picker``, ``{pool}`` = the
    pool's name); ValueError when it is the version's own Service or no Service name."""
    name = object_name(model_id, version)
    picker = settings.k8s_endpoint_picker.replace("{pool}", name)
    if picker == name:
        raise ValueError(f"k8s_endpoint_picker {settings.k8s_endpoint_picker!r} names the version's own Service "
                         f"{name} (it serves the model, not the endpoint picker's ext-proc port); set "
                         "MODELOPS_K8S_ENDPOINT_PICKER to the picker's Service, e.g. {pool}-epp")
    if not _DNS_1035.match(picker):
        raise ValueError(f"k8s_endpoint_picker {settings.k8s_endpoint_picker!r} makes {picker!r} for InferencePool "
                         f"{name}, not a Service name (a DNS-1035 label: a-z, 0-9 and '-', at most 63 characters, "
                         "starting with a letter): set MODELOPS_K8S_ENDPOINT_PICKER to a pattern that stays one "
                         f"(the pool's name has {len(name)} characters; a shorter model id or version shortens it), "
                         "or to one picker's Service name shared by every pool")
    return picker


KEDA_API = "keda.sh/v1alpha1"


def _pod_pattern(deployment: str) -> str:
    """A PromQL regex for the names of ``deployment``'s pods: ``<deployment>-<pod-template-hash>
    -<5 characters>``, where Kubernetes cuts ``<deployment>-<hash>-`` to 58 characters before the
    5 (its generated-name limit, 63 - 5; the hash has up to 10). Exact while that prefix fits (names
    up to 46 characters); past it, the first 58 characters of ``<deployment>-`` and anything after.
    Object names are DNS labels (``[a-z0-9-]``): nothing in them needs escaping."""
    if len(deployment) + 12 <= 58:
        return f"{deployment}-[a-z0-9]+-[a-z0-9]{{5}}"
    return f"{(deployment + '-')[:58]}[a-z0-9-]*"


def _prometheus_query(model_id: str, version: str, signal: str, settings: Settings) -> tuple[str, str]:
    """``(query, metricType)`` of a version's scaling signal over its pods (:func:`_pod_pattern`).
    Prometheus' Kubernetes service discovery labels each scraped series ``namespace`` and ``pod``
    (a PodMonitor, or a scrape config that keeps them), and vLLM labels its own ``model_name`` (the
    served model id)."""
    pods = (f'namespace="{settings.k8s_namespace}",pod=~"{_pod_pattern(object_name(model_id, version))}",'
            f'model_name="{model_id}"')
    if signal == "waiting":  # summed, then divided by the replicas by the HPA (AverageValue)
        return f"sum(vllm:num_requests_waiting{{{pods}}})", "AverageValue"
    if signal == "kv_cache":
        return f"sum(vllm:kv_cache_usage_perc{{{pods}}})", "AverageValue"
    window = f"{max(1, round(settings.autoscale_ttft_window_s))}s"
    # Without requests in the window the quantile is NaN, which `> 0` drops; then 0 (idle) while the
    # pods report, and nothing (an error: no decision) when Prometheus has no series of them.
    return (f"histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{{{pods}}}[{window}])))"
            f" > 0 or on() (0 * sum(vllm:num_requests_running{{{pods}}}))"), "Value"


def render_scaledobject(model_id: str, version: str, scaling, settings: Settings) -> dict:
    """The KEDA ``ScaledObject`` (keda.sh/v1alpha1) that scales one version's Deployment by its
    manifest's ``scaling`` (:class:`modelops.scaling.Scaling`, autoscaled): replicas between
    ``min`` and ``max``, one Prometheus trigger on the policy's vLLM signal at
    ``k8s_prometheus_url``, and the HPA KEDA makes with the policy's stabilization windows. The
    same rule as the local autoscaler: the HPA asks for ``ceil(replicas × value / target)``,
    the value averaged over the pods (``AverageValue``: waiting, kv_cache) or measured over the
    version (``Value``: ttft_p90_s). ``ignoreNullValues: "false"``: a query that finds no series
    (Prometheus lost the pods) is an error, on which the HPA keeps the count, never a zero.
    Routing stays per version (the HTTPRoute's backendRefs name each version's Service), so the
    replicas of a version share its weight.

    Facts: KEDA's ScaledObject specification and Prometheus scaler (keda.sh/docs/latest); the
    HPA's behavior field (stabilizationWindowSeconds 0..3600; Kubernetes API reference).

    Raises:
        ValueError: the policy is not autoscaled (``max == min``: the Deployment's replicas alone).
    """
    if not scaling.autoscaled:
        raise ValueError(f"scaling: {model_id} {version} runs a fixed {scaling.min} replica(s) (max == min); it has "
                         "no ScaledObject")
    query, metric_type = _prometheus_query(model_id, version, scaling.target.signal, settings)
    name = object_name(model_id, version)
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": _version_metadata(model_id, version, settings),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "pollingInterval": max(1, math.ceil(settings.autoscale_interval_s)),
            "minReplicaCount": scaling.min,
            "maxReplicaCount": scaling.max,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": {"stabilizationWindowSeconds": round(scaling.scale_up_window_s)},
                "scaleDown": {"stabilizationWindowSeconds": round(scaling.scale_down_window_s)}}}},
            "triggers": [{"type": "prometheus", "metricType": metric_type, "metadata": {
                "serverAddress": settings.k8s_prometheus_url, "query": query,
                "threshold": f"{scaling.target.value:g}", "ignoreNullValues": "false"}}],
        },
    }


def gateway_parent_ref(settings: Settings) -> dict:
    """A route's ``parentRefs`` entry: the Gateway ``k8s_gateway_name`` in ``k8s_gateway_namespace``
    (default ``k8s_namespace``), on listener ``k8s_gateway_listener`` when set."""
    parent = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": settings.k8s_gateway_name,
              "namespace": settings.k8s_gateway_namespace or settings.k8s_namespace}
    if settings.k8s_gateway_listener:
        parent["sectionName"] = settings.k8s_gateway_listener
    return parent


def render_httproute(model_id: str, backends: Mapping[str, tuple[str, int]], settings: Settings,
                     protocol: str = "openai", mirror: tuple[str, int] | None = None) -> dict:
    """The Gateway API route (``gateway.networking.k8s.io/v1``) of one model for one protocol.

    Args:
        backends: version → (its Service name, its weight 0..100 in the registry): every routed
            version, serving or draining.
        protocol: ``openai`` (the ``HTTPRoute`` named ``<model_id>``, described below),
            ``kserve-http`` (``HTTPRoute`` ``<model_id>.kserve-http``: the same rules under
            ``PathPrefix /v2/models/<model_id>`` with no model header, to the Services'
            kserve-http port) or ``kserve-grpc`` (``GRPCRoute`` ``<model_id>``: the same rules
            matched on the ``x-model-id`` metadata, to the kserve-grpc port, as the local
            router does). The names cannot collide: model ids have no ``.``.
        mirror: ``(version, percent)`` of a shadow (:mod:`modelops.shadow`), OpenAI route only: the
            default rule gets the standard ``RequestMirror`` filter to that version's Service with
            ``percent`` (Gateway API GEP-3171, ``HTTPRequestMirrorFilter.percent`` 0..100); the
            gateway discards the mirror's answers.

    Rules (all under ``PathPrefix /v1``, matched on ``k8s_model_header: <model_id>``):
      - one per version that also matches ``X-Model-Version: <version>`` and sends everything to
        that version's Service (weight 1): the version pin, as HAProxy's ``mv_`` backends. With
        two header matches it outranks the default rule (precedence: largest number of header
        matches), whatever the order;
      - the default rule: one backendRef per version with the registry's weight, so the
        red-black steps 10/25/50/100 are the backendRefs' weights (a proportion of the rule's
        traffic; 0 sends none, the version stays reachable by its pin). When every version
        weighs 0 there is no default rule (a rule weighing 0 in total is rejected by
        Envoy-based gateways), so only pinned requests are routed.
    ``timeouts.request`` is ``k8s_route_timeout_s`` (long generations stream for minutes). With
    ``k8s_inference_pool`` the OpenAI route's backendRefs are the versions' InferencePools
    (:func:`render_inferencepool`, same names), so the Gateway splits the weights between
    versions and each version's endpoint picker chooses the pod; KServe routes stay on the
    Services (an endpoint picker parses OpenAI bodies).

    Raises:
        ValueError: no backends, a weight outside 0..1,000,000, or more versions than the 16
            rules of an HTTPRoute allow (15 pins + default): retire idle versions first.
    """
    if not backends:
        raise ValueError(f"model {model_id}: an HTTPRoute needs at least one routed version")
    if len(backends) + 1 > _MAX_RULES:
        raise ValueError(f"model {model_id}: {len(backends)} routed versions need {len(backends) + 1} HTTPRoute "
                         f"rules, more than the {_MAX_RULES} allowed; retire idle versions (modelops cleanup)")
    for version, (_, weight) in backends.items():
        if not 0 <= weight <= _MAX_WEIGHT:
            raise ValueError(f"model {model_id} version {version}: weight {weight} outside 0..{_MAX_WEIGHT}")
    if protocol == "openai":
        path = {"type": "PathPrefix", "value": "/v1"}
        model_headers = [{"type": "Exact", "name": settings.k8s_model_header, "value": model_id}]
    elif protocol == "kserve-http":  # the model is in the path; PathPrefix matches whole path elements
        path, model_headers = {"type": "PathPrefix", "value": f"/v2/models/{model_id}"}, []
    else:
        path, model_headers = None, [{"type": "Exact", "name": GRPC_MODEL_HEADER, "value": model_id}]
    extra = {"timeouts": {"request": f"{math.ceil(settings.k8s_route_timeout_s)}s"}} \
        if settings.k8s_route_timeout_s and protocol != "kserve-grpc" else {}  # GRPCRoute rules have no timeouts

    def match(headers: list[dict]) -> dict:
        return {**({"path": path} if path else {}), **({"headers": headers} if headers else {})}

    def ref(service: str, weight: int) -> dict:
        if protocol == "openai" and settings.k8s_inference_pool:  # the pool is named like the Service
            return {"group": INFERENCE_POOL_API.split("/")[0], "kind": "InferencePool", "name": service,
                    "weight": weight}
        return {"group": "", "kind": "Service", "name": service, "port": PORTS[protocol], "weight": weight}

    rules = [{"matches": [match([*model_headers, {"type": "Exact", "name": VERSION_HEADER, "value": v}])],
              "backendRefs": [ref(backends[v][0], 1)], **extra} for v in sorted(backends)]
    if any(weight for _, weight in backends.values()):
        # Only versions that take default traffic: Envoy-based gateways reject a rule whose
        # backendRefs weigh 0 in total (kgateway-dev/kgateway#11548), so with none there is no
        # default rule: unpinned requests match no rule (the gateway's 404), pins still work.
        filters = [{"type": "RequestMirror", "requestMirror": {
            "backendRef": {"group": "", "kind": "Service", "name": backends[mirror[0]][0], "port": PORTS[protocol]},
            "percent": mirror[1]}}] if mirror and protocol == "openai" and mirror[0] in backends else []
        rules.append({"matches": [match(model_headers)], **({"filters": filters} if filters else {}),
                      "backendRefs": [ref(backends[v][0], backends[v][1]) for v in sorted(backends)], **extra})
    spec: dict = {"parentRefs": [gateway_parent_ref(settings)], "rules": rules}
    if settings.k8s_route_hostnames:
        spec["hostnames"] = list(settings.k8s_route_hostnames)
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "GRPCRoute" if protocol == "kserve-grpc" else "HTTPRoute",
        "metadata": {"name": ROUTE_NAMES[protocol].format(model_id), "namespace": settings.k8s_namespace,
                     "labels": {"app.kubernetes.io/name": model_id, **MANAGED_BY},
                     "annotations": {"modelops.io/model-id": model_id}},
        "spec": spec,
    }


# -- No open doors: API keys at the Gateway (Envoy Gateway), and pods that only the Gateway reaches --------
#
# Facts from Envoy Gateway's source at tag v1.9.0 (github.com/envoyproxy/gateway), read field by field:
# - api/v1alpha1/api_key_auth_types.go: APIKeyAuth{credentialRefs (Secrets), extractFrom (exactly one of
#   headers, params, cookies), forwardClientIDHeader, sanitize}; "each API key is stored in the key
#   representing the client id" of an Opaque Secret. internal/gatewayapi/securitypolicy.go (buildAPIKeyAuth)
#   reads every data entry of every referenced Secret as client id -> key, and refuses the policy when two
#   clients share a key; an invalid SecurityPolicy turns its routes into a 500 direct response (fail closed).
# - Envoy's api_key_auth filter (source/extensions/filters/http/api_key_auth/api_key_auth.cc) takes the
#   first value of the header, strips a "Bearer " prefix, looks the rest up among the route's credentials
#   (none, or an unknown key: 401) and sets the forwarded client-id header, replacing a client's own.
# - api/v1alpha1/ratelimit_types.go: RateLimitSpec{type (Global|Local; deprecated since v1.6 for the
#   global/local fields, required before), local{rules (at most 16)}}; RateLimitRule{clientSelectors
#   (headers: Exact|RegularExpression|Distinct), limit{requests, unit Second..Year}}. A Local limit is a
#   token bucket per Envoy proxy replica and per route (internal/xds/translator/local_ratelimit.go: a
#   per-route filter config), refilled whole every unit. Envoy Gateway orders api_key_auth before
#   local_ratelimit (internal/xds/translator/httpfilters.go), so the rate limit sees the client id header.
# - SecurityPolicy and BackendTrafficPolicy target HTTPRoute and GRPCRoute by targetRefs
#   (api/v1alpha1/policy_helpers.go); a policy on a route replaces one on its Gateway unless mergeType
#   is set; their status lists the routes' parent Gateways as ancestors (securitypolicy.go).
# - Proxy pods carry gateway.envoyproxy.io/owning-gateway-name and -namespace (internal/gatewayapi/
#   translator.go, buildIR) and app.kubernetes.io/name=envoy (internal/infrastructure/kubernetes/proxy/
#   resource.go); they run in the controller's namespace, or in the Gateway's in GatewayNamespace mode
#   (internal/infrastructure/kubernetes/proxy_infra.go, GetResourceNamespace). With mergeGateways they
#   carry owning-gatewayclass instead, which render_networkpolicy does not select.
ENVOY_GATEWAY_API = "gateway.envoyproxy.io/v1alpha1"
# KEY_HEADER (modelops.tenancy): the header Envoy Gateway sets to the authenticated key's name
# (forwardClientIDHeader), as HAProxy does for the instances, and what the rate-limit rules match on.
KEY_SECRET_PREFIX = "modelops-key-"
# Labels of an API key's Secret (the second names the key), and of the control plane's flow-run pods
# (deployments/kubernetes/base-job-template.json puts them on the pod template).
KEY_SECRET_LABELS = {**MANAGED_BY, "app.kubernetes.io/component": "api-key"}
CONTROL_PLANE_LABELS = {"modelops.io/role": "control-plane"}
_PROXY_NAME_LABEL = "gateway.envoyproxy.io/owning-gateway-name"
_PROXY_NAMESPACE_LABEL = "gateway.envoyproxy.io/owning-gateway-namespace"
# LocalRateLimit.rules maxItems; RateLimitValue.requests maximum (uint32).
_MAX_RATE_RULES = 16
_MAX_REQUESTS = 4_294_967_295
_NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace (Kubernetes 1.22+)


def key_secret_name(name: str) -> str:
    """The Secret that holds API key ``name`` for the Gateway: ``modelops-key-<name>``."""
    return KEY_SECRET_PREFIX + name


def _check_grant(g: KeyGrant) -> None:
    if not re.match(KEY_NAME_PATTERN, g.name or ""):
        raise ValueError(f"API key name {g.name!r} is not a key name (1-63 lowercase letters, digits and '-'): it "
                         "names a Secret and a rate-limit header value")
    if not g.models:
        raise ValueError(f"API key {g.name!r} names no model: its scope must list model ids or {ALL_MODELS!r} "
                         "(`modelops keys ls`); revoke it and create one with --models")
    if g.rpm is not None and not 1 <= g.rpm <= _MAX_REQUESTS:
        raise ValueError(f"API key {g.name!r}: rpm {g.rpm} outside 1..{_MAX_REQUESTS} (Envoy Gateway's "
                         "RateLimitValue.requests)")


def check_key_grants(grants: Iterable[KeyGrant]) -> None:
    """Whether the Gateway can enforce ``grants`` (the active keys' :class:`~modelops.tenancy.KeyGrant`)
    as rendered by :func:`render_securitypolicy` and :func:`render_backendtrafficpolicy`; the CLI
    calls it before a key is stored, the renderers before rendering.

    Raises:
        ValueError: naming the key and the fix: a name that is not a key name, a grant naming no
            model, an rpm outside 1..4294967295, a name given twice or reserved for the platform
            (:data:`~modelops.tenancy.PLATFORM_KEY`), or more than 16 keys with an rpm covering one
            model (Envoy Gateway's LocalRateLimit takes at most 16 rules, one per key).
    """
    grants = list(grants)
    seen: set[str] = set()
    for g in grants:
        _check_grant(g)
        if g.name in seen or g.name == PLATFORM_KEY:
            raise ValueError(f"API key name {g.name!r} is given twice or reserved for the platform's own requests")
        seen.add(g.name)
    limited = [g for g in grants if g.rpm]
    everywhere = [g.name for g in limited if ALL_MODELS in g.models]
    for model in sorted({m for g in limited for m in g.models if m != ALL_MODELS} | {ALL_MODELS}):
        names = everywhere + [g.name for g in limited if model in g.models and ALL_MODELS not in g.models]
        if len(names) > _MAX_RATE_RULES:
            where = "every model" if model == ALL_MODELS else f"model {model}"
            raise ValueError(f"{len(names)} API keys with an rpm limit cover {where} ({', '.join(sorted(names))}); "
                             f"Envoy Gateway's local rate limit takes at most {_MAX_RATE_RULES} rules, one per key: "
                             "give some of them no rpm, or narrow their --models")


def render_api_key_secret(name: str, key: str, settings: Settings) -> dict:
    """The ``v1 Secret`` (Opaque) that gives the Gateway API key ``name``: ``data`` holds one entry,
    client id ``name`` → the key (base64, as Secret data is), which is how Envoy Gateway's
    ``apiKeyAuth.credentialRefs`` reads keys. Named :func:`key_secret_name`, labelled
    :data:`KEY_SECRET_LABELS` and ``modelops.io/api-key: <name>``.

    Envoy compares the key itself, so this is the one object that holds a key in clear: render it
    only when the key exists in clear (``modelops keys create`` / ``rotate``) and send it straight to
    the API server; modelops writes it nowhere else (the registry keeps the SHA-256 only).

    Raises:
        ValueError: ``name`` is not a key name, or ``key`` is empty or has whitespace (a header
            value could not carry it after ``Bearer ``). The key is never in the message.
    """
    if not re.match(KEY_NAME_PATTERN, name or ""):
        raise ValueError(f"API key name {name!r} is not a key name (1-63 lowercase letters, digits and '-')")
    if not key or any(c.isspace() for c in key):
        raise ValueError(f"API key {name!r}: the key is empty or has whitespace")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": key_secret_name(name), "namespace": settings.k8s_namespace,
                     "labels": {**KEY_SECRET_LABELS, "modelops.io/api-key": name}},
        "data": {name: base64.b64encode(key.encode("utf-8")).decode("ascii")},
    }


def _policy_metadata(model_id: str, settings: Settings) -> dict:
    return {"name": model_id, "namespace": settings.k8s_namespace,
            "labels": {"app.kubernetes.io/name": model_id, **MANAGED_BY},
            "annotations": {"modelops.io/model-id": model_id}}


def _policy_targets(model_id: str, settings: Settings) -> list[dict]:
    """The model's routes (:func:`render_httproute`'s names): the OpenAI HTTPRoute, and with
    ``k8s_kserve_routes`` the KServe HTTPRoute and GRPCRoute."""
    protocols = ("openai", "kserve-http", "kserve-grpc") if settings.k8s_kserve_routes else ("openai",)
    return [{"group": "gateway.networking.k8s.io", "kind": "GRPCRoute" if p == "kserve-grpc" else "HTTPRoute",
             "name": ROUTE_NAMES[p].format(model_id)} for p in protocols]


def api_key_auth(names: Iterable[str]) -> dict:
    """A SecurityPolicy's ``apiKeyAuth`` admitting the keys ``names`` (each one's Secret,
    :func:`key_secret_name`): the key from ``Authorization: Bearer``, its name forwarded as
    :data:`KEY_HEADER` (replacing a client's own), the key removed before the backend."""
    return {"credentialRefs": [{"group": "", "kind": "Secret", "name": key_secret_name(n)} for n in names],
            "extractFrom": [{"headers": ["Authorization"]}], "forwardClientIDHeader": KEY_HEADER, "sanitize": True}


def render_securitypolicy(model_id: str, grants: Iterable[KeyGrant], settings: Settings) -> dict:
    """Envoy Gateway's ``SecurityPolicy`` (gateway.envoyproxy.io/v1alpha1) named ``<model_id>``
    that makes the model's routes (every protocol's) admit only the keys whose scope covers it.

    ``apiKeyAuth``: ``credentialRefs`` are the Secrets (:func:`key_secret_name`) of the platform's
    own key (:data:`~modelops.tenancy.PLATFORM_KEY`, the route checks) and of each grant in
    ``grants`` that :meth:`~modelops.tenancy.KeyGrant.allows` the model, sorted by name;
    ``extractFrom`` the ``Authorization`` header (Envoy strips ``Bearer ``); the key's name is
    forwarded as :data:`KEY_HEADER` (replacing a client's own) and the key itself is removed
    before the request reaches a pod (``sanitize``). A key outside the scope is not among the
    route's credentials, so Envoy answers it 401 (HAProxy answers 403). Every referenced Secret
    must exist, or Envoy Gateway refuses the policy and answers 500 on the routes: pass only
    grants whose Secret is there. Facts: the comment block above (Envoy Gateway v1.9.0).

    Raises:
        ValueError: what :func:`check_key_grants` raises.
    """
    grants = list(grants)
    check_key_grants(grants)
    names = [PLATFORM_KEY, *sorted(g.name for g in grants if g.allows(model_id))]
    return {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "SecurityPolicy",
        "metadata": _policy_metadata(model_id, settings),
        "spec": {
            "targetRefs": _policy_targets(model_id, settings),
            "apiKeyAuth": api_key_auth(names),
        },
    }


def render_backendtrafficpolicy(model_id: str, grants: Iterable[KeyGrant], settings: Settings) -> dict | None:
    """Envoy Gateway's ``BackendTrafficPolicy`` (gateway.envoyproxy.io/v1alpha1) named ``<model_id>``
    with each key's ``rpm``, or None when no key covering the model has one.

    ``rateLimit``: ``type: Local`` (required before Envoy Gateway v1.6, deprecated but honoured
    after) and one ``local`` rule per key covering the model with an rpm: requests whose
    :data:`KEY_HEADER` (set by :func:`render_securitypolicy`'s ``forwardClientIDHeader``) is
    exactly the key's name, limited to ``rpm`` requests per ``Minute``. Envoy's token bucket holds
    ``rpm`` tokens and is refilled whole each minute, counted per Envoy proxy replica and per route
    rule (not a sliding minute over all of them, as HAProxy counts). ``max_concurrency`` has no
    counterpart (the circuit breaker's ``maxParallelRequests`` counts all clients of a backend
    together) and is not rendered. Facts: the comment block above (Envoy Gateway v1.9.0).

    Raises:
        ValueError: what :func:`check_key_grants` raises.
    """
    grants = list(grants)
    check_key_grants(grants)
    limited = sorted((g for g in grants if g.rpm and g.allows(model_id)), key=lambda g: g.name)
    if not limited:
        return None
    rules = [{"clientSelectors": [{"headers": [{"type": "Exact", "name": KEY_HEADER, "value": g.name}]}],
              "limit": {"requests": g.rpm, "unit": "Minute"}} for g in limited]
    return {
        "apiVersion": ENVOY_GATEWAY_API,
        "kind": "BackendTrafficPolicy",
        "metadata": _policy_metadata(model_id, settings),
        "spec": {"targetRefs": _policy_targets(model_id, settings),
                 "rateLimit": {"type": "Local", "local": {"rules": rules}}},
    }


def namespace_setting(settings: Settings, setting: str) -> str | None:
    """The value of the namespace setting ``setting`` (None when unset).

    Raises:
        ValueError: it is not a namespace name (a DNS label), naming the variable.
    """
    value = getattr(settings, setting)
    if value is not None and not re.match(MODEL_ID_PATTERN, value):
        raise ValueError(f"MODELOPS_{setting.upper()} {value!r} is not a namespace name (a DNS label: a-z, 0-9 and "
                         "'-', at most 63 characters)")
    return value


def namespaced_pods(namespace: str, labels: Mapping[str, str]) -> dict:
    """A NetworkPolicy peer: the pods labelled ``labels`` in ``namespace`` (by the label the API
    server puts on every namespace)."""
    return {"namespaceSelector": {"matchLabels": {_NAMESPACE_LABEL: namespace}},
            "podSelector": {"matchLabels": dict(labels)}}


def gateway_proxy_peer(settings: Settings) -> dict:
    """A NetworkPolicy peer: the Gateway's Envoy Gateway proxy pods (``app.kubernetes.io/name:
    envoy`` and the owning-gateway name and namespace labels) in ``k8s_gateway_proxy_namespace``
    (see the comment block above :func:`key_secret_name`).

    Raises:
        ValueError: ``k8s_gateway_proxy_namespace`` is not a namespace name.
    """
    namespace = namespace_setting(settings, "k8s_gateway_proxy_namespace")
    gateway_namespace = settings.k8s_gateway_namespace or settings.k8s_namespace
    return namespaced_pods(namespace, {"app.kubernetes.io/name": "envoy", _PROXY_NAME_LABEL: settings.k8s_gateway_name,
                                       _PROXY_NAMESPACE_LABEL: gateway_namespace})


def render_networkpolicy(model_id: str, version: str, settings: Settings) -> dict:
    """The ``networking.k8s.io/v1 NetworkPolicy`` of one version (named like its Deployment): its pods
    (:func:`selector_labels`) take ingress only from

    - the Gateway's proxy pods, on the OpenAI and KServe ports: pods labelled
      ``gateway.envoyproxy.io/owning-gateway-name: <k8s_gateway_name>``, ``-namespace: <the
      Gateway's namespace>`` and ``app.kubernetes.io/name: envoy`` in ``k8s_gateway_proxy_namespace``
      (Envoy Gateway's labels; see the comment block above);
    - the control plane's flow-run pods (:data:`CONTROL_PLANE_LABELS`, in ``k8s_namespace``) on
      every port: the health checks and route checks reach the pods through their Service
      (kube-proxy keeps the client's pod address), and the red-black gate reads ``/metrics``;
    - every pod of ``k8s_metrics_namespace``, when set, on the OpenAI port (the merged ``/metrics``
      that Prometheus scrapes and KEDA's trigger queries);
    - with ``k8s_inference_pool``, the version's endpoint picker (pods labelled ``inferencepool:
      <picker Service>``, as the Inference Extension's inferencepool Helm chart labels them) on the
      OpenAI port, whose ``/metrics`` it reads.

    The kubelet's probes need no rule: traffic from a pod's own node is always allowed
    (Kubernetes documentation, Network Policies). Egress is not restricted. A NetworkPolicy is
    enforced only by a network plugin that implements it; elsewhere it is stored and ignored.

    Raises:
        ValueError: ``k8s_gateway_proxy_namespace`` or ``k8s_metrics_namespace`` is not a namespace
            name, or the endpoint picker's name is no Service name (:func:`render_inferencepool`).
    """
    proxies = gateway_proxy_peer(settings)
    namespace_setting(settings, "k8s_metrics_namespace")

    def ports(*names: str) -> list[dict]:
        return [{"protocol": "TCP", "port": PORTS[n]} for n in names]

    ingress = [{"from": [proxies], "ports": ports("openai", "kserve-http", "kserve-grpc")},
               {"from": [namespaced_pods(settings.k8s_namespace, CONTROL_PLANE_LABELS)], "ports": ports(*PORTS)}]
    if settings.k8s_metrics_namespace:
        scrapers = {"namespaceSelector": {"matchLabels": {_NAMESPACE_LABEL: settings.k8s_metrics_namespace}}}
        ingress.append({"from": [scrapers], "ports": ports("openai")})
    if settings.k8s_inference_pool:
        picker = _picker_service(model_id, version, settings)
        ingress.append({"from": [namespaced_pods(settings.k8s_namespace, {"inferencepool": picker})],
                        "ports": ports("openai")})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _version_metadata(model_id, version, settings),
        "spec": {"podSelector": {"matchLabels": selector_labels(model_id, version)}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }
