"""Settings of the control plane, read once from the environment (prefix ``MODELOPS_``).

Every path defaults under ``MODELOPS_HOME`` (``.modelops`` in the working directory), so
one local stack is one folder; tests point ``MODELOPS_HOME`` at a temporary directory.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, IPvAnyAddress, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["REPO_ROOT", "Settings", "get_settings", "settings_problem"]

_MIN_RANGE = 1 << 20  # the smallest byte range a pull may use (materialize_range_size)
# What S3 reserves in bucket names (its bucket naming rules, general purpose buckets).
_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")

# The checkout: flows, the runtime code and the pinned locks are read from here.
REPO_ROOT = Path(__file__).resolve().parents[1]


class Settings(BaseSettings):
    """All knobs of the control plane and the local stack.

    Ports are TCP ports on 127.0.0.1; durations are seconds.
    """

    # No setting is a number that inf or nan could mean: "inf" seconds of a wait overflows the
    # wait itself, and nan passes every bound with a message that names the wrong one.
    model_config = SettingsConfigDict(env_prefix="MODELOPS_", extra="ignore", allow_inf_nan=False)

    home: Path = Field(default=Path(".modelops"), description="root of local state")
    fsx_root: Path | None = Field(default=None, description="FSx for Lustre mount; default <home>/fsx")
    registry_url: str | None = Field(default=None, description="SQLAlchemy URL; default SQLite in <home>")
    runtime_root: Path = Field(
        default=Path("~/.cache/modelops/runtime"),
        description="built runtime environments, shared by every home (keyed by lock hash)",
    )

    provider: Literal["local", "kubernetes"] = Field(
        default="local", description="where serving instances run: processes on this machine, or Deployments on "
        "the cluster of the k8s_* settings (tasks.backends.provider)")
    router: Literal["haproxy", "gateway-api"] = Field(
        default="haproxy", description="what routes traffic: the local HAProxy, or Gateway API HTTPRoutes on the "
        "cluster (tasks.backends.router)")
    router_port: int = Field(default=8080, ge=1, le=65535)
    router_grpc_port: int = Field(
        default=8081, ge=1, le=65535,
        description="the router's KServe v2 gRPC listener (HTTP/2); a call names its model in the "
        "x-model-id metadata (tasks/traffic/haproxy.py)")
    router_max_body_mb: int = Field(
        default=4, ge=1, le=64, description="the largest request body the router takes (MiB): a larger one is a "
        "413 naming this setting; up to it the router reads the whole body to find `model` and the affinity key. "
        "It sizes HAProxy's buffers (tune.bufsize), and every request pays for their size: measured here, about "
        "0.7 ms more to the response headers at 4 MiB than at 256 KiB, 1.5 ms at 8 MiB")
    router_auth: Literal["auto", "on"] = Field(
        default="auto", description="API keys at the router (modelops/tenancy.py): auto = required once any key "
        "was created (`modelops keys create`; revoking every key keeps the router closed), on = required even "
        "before (every request is a 401 until a key exists)")
    prefect_port: int = Field(default=4200, ge=1, le=65535)
    s3_port: int = Field(default=9000, ge=1, le=65535)
    s3_endpoint_url: str | None = Field(default=None, description="default: the local moto server")
    aws_access_key_id: str = "modelops"
    aws_secret_access_key: str = "modelops"
    aws_region: str = "us-east-1"
    aws_credentials_block: str | None = Field(
        default=None, description="name of a prefect-aws AwsCredentials block; overrides the key, secret, "
        "region and endpoint above for S3 sources and the batch bucket (tasks/s3.py)")

    @field_validator("s3_endpoint_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        # botocore's own error ("Invalid endpoint") names neither the setting nor the fix.
        if v is not None and not (urlsplit(v).scheme in ("http", "https") and urlsplit(v).hostname):
            raise ValueError("not an http:// or https:// URL; give one such as http://127.0.0.1:9000")
        return v

    @field_validator("home", "fsx_root", mode="before")
    @classmethod
    def _not_blank(cls, v):
        # An empty variable (an unset shell variable in an export) would mean the current folder.
        if isinstance(v, str) and not v.strip():
            raise ValueError("is empty: give a folder, or unset the variable for the default")
        return v

    @field_validator("home")
    @classmethod
    def _a_folder(cls, v: Path) -> Path:
        # Every command makes its folders under it: a file there was a FileExistsError traceback.
        # (A file as fsx_root is materialize's own error, naming the cache it cannot use.)
        if v.expanduser().exists() and not v.expanduser().is_dir():
            raise ValueError("is a file, not a folder: give a folder")
        return v

    materialize_concurrency: int = Field(default=8, ge=1, description="parallel transfers (files and byte ranges)")
    materialize_range_size: int | None = Field(
        default=None, ge=0,
        description="files larger than this are fetched in ranges of this many bytes; 0 = whole files; "
        "unset = a file's size / materialize_concurrency (64 MiB to 1 GiB) for a real S3 endpoint, whole files "
        "for the local moto endpoint (tasks/materialize/sources.py)",
    )

    @field_validator("materialize_range_size")
    @classmethod
    def _whole_or_one_mib(cls, v: int | None) -> int | None:
        # A range is one GET and one journal entry: a few bytes each would make a pull of
        # millions of requests with a journal rewritten for every one.
        if v is not None and 0 < v < _MIN_RANGE:
            raise ValueError(f"{v} bytes is too small a range: use at least {_MIN_RANGE} (1 MiB), or 0 for whole files")
        return v

    materialize_direct_io: bool = Field(
        default=True,
        description="write weights with O_DIRECT (whole blocks; the page cache takes the rest), so a pull neither "
        "fills nor evicts the node's page cache; file systems that refuse it are written through the page cache "
        "(tasks/materialize/writer.py)",
    )
    # Bounded S3 waits (tasks/materialize/sources.py): the read timeout is per socket read, so a
    # silent endpoint fails after about attempts × (connect + read timeout) while a slow one lives.
    s3_connect_timeout_s: float = Field(default=5.0, gt=0, le=3600, description="seconds to open a connection to S3")
    s3_read_timeout_s: float = Field(default=12.0, gt=0, le=3600, description="seconds S3 may stay silent on an open "
                                     "connection (per read, not per object)")
    s3_max_attempts: int = Field(default=3, ge=1, le=20, description="tries of each S3 request, the first "
                                 "included (botocore standard retry mode), and of each stream that drops or stalls")
    cache_budget_gb: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                          description="FSx cache budget; LRU eviction beyond it")
    materialize_timeout_s: float = Field(default=3600.0, gt=0, description="a transfer still running after this "
                                         "fails (what it verified stays staged for the retry)")
    image_build_timeout_s: float = Field(default=3600.0, gt=0, description="each step of a runtime image build "
                                         "(venv, pip install) is killed after this")

    work_pool: str = "modelops-local"
    region: str | None = Field(default=None, description="the region this process works for (set by its work "
                               "pool's job variables, modelops/regions.py); none = the stack itself")
    regions_file: Path | None = Field(default=None, description="the regions file (modelops/regions.py): each "
                                      "region's work pool and settings, and the waves of a global rollout; default "
                                      "<home>/regions.yaml; none = one region, the stack itself")
    provision_timeout_s: float = 600.0
    health_timeout_s: float = 120.0

    # Per-request bounds on a generate engine (modelops/limits.py); a manifest's limits override them.
    max_request_tokens: int | None = Field(default=None, ge=1, description="default bound on one generate request's "
                                           "prompt tokens + n × max_tokens (modelops.limits); unset: 4 × max_model_len")
    max_request_share: float = Field(default=0.5, gt=0, le=1, allow_inf_nan=False, description="default share of "
                                     "the engine's sequence slots (max_num_seqs) one request may hold at once")

    # Red-black rollouts (tasks/traffic/rollout.py).
    redblack_steps: list[int] = Field(default=[10, 25, 50, 100], description="percent to the new version per step")
    @field_validator("redblack_steps")
    @classmethod
    def _rising_to_100(cls, v: list[int]) -> list[int]:
        # Checked here, not first in the traffic stage after the new version was provisioned.
        if not v or v[-1] != 100 or any(not 0 < a < b for a, b in zip(v, v[1:])) or v[0] <= 0:
            raise ValueError(f"{v} must be percentages that rise to 100, each above 0 and the one before, "
                             "e.g. [10, 25, 50, 100]")
        return v

    gate_window_s: float = Field(default=5.0, gt=0, description="metrics window watched after each step")
    gate_max_error_ratio: float = Field(default=0.01, ge=0, le=1, description="new version's failed/all requests")
    gate_max_p99_ratio: float = Field(default=3.0, gt=0, description="new p99 latency / old p99 latency")
    # Unset (not judged) unless asked: during a step the old version keeps its instances until the step
    # holds, so the new one's carry more load each; healthy new versions measured 2.05x (generate, 50 %)
    # and 3.1x (embed, 10 %: pooling requests record TTFT too) here (docs/rollouts.md).
    gate_max_ttft_p90_ratio: float | None = Field(default=None, gt=0, description="new time-to-first-token p90 / "
                                                  "old, in the same window; unset: not judged")
    gate_max_itl_p90_ratio: float | None = Field(default=None, gt=0, description="new inter-token latency p90 / "
                                                 "old, in the same window; unset: not judged")
    gate_min_requests: int = Field(default=20, ge=0, description="requests a window needs before latency is judged")
    gate_require_requests: int = Field(default=1, ge=1, description="requests the new version must receive in a "
                                       "gate window for the window to be judged; with fewer, gate_no_traffic decides")
    gate_no_traffic: Literal["probe", "wait", "fail", "pass"] = Field(
        default="probe", description="a gate whose window brought the new version too few requests: probe (sends "
        "gate_probe_requests of its own through the router, pinned to the new version, and judges those), wait "
        "(keeps watching until enough came, within rollout_timeout_s), fail, or pass (a blind pass, which the "
        "rollout report names)")
    gate_probe_requests: int = Field(default=5, ge=1, le=1000, description="requests a probing gate sends")
    rollout_timeout_s: float = Field(default=900.0, gt=0, description="a red-black rollout longer than this rolls back")
    drain_timeout_s: float = Field(default=30.0, gt=0, description="in-flight requests' grace on SIGTERM")
    rollout_lock_wait_s: float = Field(default=1800.0, ge=0, description="how long a second rollout of a model "
                                       "waits for the first")
    vllm_cpu_kvcache_gib: int = 1

    # The local autoscaler (tasks/autoscale/, modelops/scaling.py), a daemon of `modelops up`.
    autoscale_interval_s: float = Field(default=2.0, gt=0, le=600, description="seconds between two reads of every "
                                        "instance's metrics (and decisions)")
    autoscale_max_instances: int = Field(default=8, ge=1, le=1024, description="the most instances a manifest's "
                                         "scaling.max may ask for (checked at announce)")
    autoscale_ttft_window_s: float = Field(default=30.0, gt=0, le=3600, description="seconds of requests the "
                                           "ttft_p90_s signal is measured over")
    autoscale_backoff_s: float = Field(default=30.0, gt=0, le=3600, description="wait after an instance failed to "
                                       "start while scaling up; doubled at each further failure, up to 10 minutes")
    router_hold_s: float = Field(default=120.0, gt=0, le=590, description="how long the router holds a request "
                                 "for a version at zero instances (scaling.min 0) while one starts; past it the client "
                                 "gets 503 with Retry-After (below HAProxy's 600 s server timeout)")
    # A failure drill (docs/operations.md): the lifecycle stage named here fails on purpose as it
    # starts, so the transaction's rollback hooks can be exercised on a real stack.
    fail_stage: str | None = Field(default=None, description="lifecycle stage to fail on purpose (drills, tests)")

    # -- Kubernetes: serving on a cluster (tasks/kube/, tasks/provision/kubernetes.py,
    # tasks/traffic/gateway_api.py, docs/kubernetes.md). Unused by the local stack.
    k8s_namespace: str = Field(default="modelops", description="namespace of the serving Deployments, Services "
                               "and HTTPRoutes (MODELOPS_K8S_NAMESPACE)")
    k8s_kubeconfig: Path | None = Field(default=None, description="kubeconfig file; default $KUBECONFIG or "
                                        "~/.kube/config; none of them and no in-cluster service account = "
                                        "no cluster configured")
    k8s_context: str | None = Field(default=None, description="kubeconfig context; default its current-context")
    k8s_gateway_name: str = Field(default="modelops", description="Gateway (gateway.networking.k8s.io/v1) the "
                                  "HTTPRoutes attach to; run by the platform, not by modelops")
    k8s_gateway_namespace: str | None = Field(default=None, description="its namespace; default k8s_namespace")
    k8s_gateway_listener: str | None = Field(default=None, description="parentRef sectionName (one listener); "
                                             "default every listener that admits the routes")
    k8s_route_hostnames: list[str] = Field(default=[], description="HTTPRoute hostnames; empty = the listener's")
    k8s_model_header: str = Field(default="X-Gateway-Model-Name", description="request header carrying the OpenAI "
                                  "`model` (set by the Gateway API Inference Extension's body-based routing, or "
                                  "by the client)")
    k8s_route_timeout_s: float = Field(default=600.0, ge=0, description="HTTPRoute timeouts.request (as HAProxy's "
                                       "timeout server); 0 = the Gateway implementation's default")
    k8s_kserve_routes: bool = Field(default=True, description="also route KServe v2: an HTTPRoute "
                                    "<model_id>.kserve-http (/v2/models/<model_id>) and a GRPCRoute <model_id> "
                                    "(x-model-id metadata); false where the Gateway has no GRPCRoute support")
    k8s_inference_pool: bool = Field(default=False, description="route each version's OpenAI traffic through a "
                                     "Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) "
                                     "whose endpoint picker balances on the pods' load and prefix caches, instead of "
                                     "through its Service; needs the Inference Extension's CRDs and one endpoint "
                                     "picker (e.g. llm-d's) per pool, which the platform deploys")
    k8s_endpoint_picker: str = Field(default="{pool}-epp", description="the Service of each InferencePool's endpoint "
                                     "picker; {pool} is the pool's name (the version's Service name), as the "
                                     "Inference Extension's inferencepool Helm chart names it")
    k8s_endpoint_picker_port: int = Field(default=9002, ge=1, le=65535, description="that Service's ext-proc (gRPC) "
                                          "port; 9002 is the endpoint picker's default")
    k8s_endpoint_picker_failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose", description="what the Gateway does while the endpoint picker does not answer: refuse "
        "the request (FailClose) or send it to any pod of the pool (FailOpen)")
    k8s_route_accept_timeout_s: float = Field(default=30.0, gt=0, description="how long an applied HTTPRoute may "
                                              "wait for the Gateway controller's Accepted condition")
    k8s_prometheus_url: str = Field(default="http://prometheus-operated.monitoring.svc:9090", description="the "
                                    "Prometheus that scrapes the serving pods, queried by each autoscaled version's "
                                    "KEDA ScaledObject (prometheus-operated is the Prometheus Operator's Service)")
    k8s_fsx_pvc: str = Field(default="modelops-fsx", description="PersistentVolumeClaim of the FSx for Lustre "
                             "file system (weights and packages), ReadWriteMany, in k8s_namespace")
    k8s_fsx_mount_path: Path = Field(default=Path("/fsx"), description="where that volume is mounted, in serving "
                                     "pods (read-only) and control-plane jobs (read-write); fsx_root and home "
                                     "must lie under it")
    k8s_fsx_filesystem_id: str | None = Field(default=None, description="fs-...: when set, modelops applies a "
                                              "static PersistentVolume (CSI driver fsx.csi.aws.com) and the "
                                              "claim k8s_fsx_pvc bound to it; unset = the claim must exist")
    k8s_fsx_dns_name: str | None = Field(default=None, description="the file system's DNSName "
                                         "(aws fsx describe-file-systems)")
    k8s_fsx_mount_name: str | None = Field(default=None, description="the file system's LustreConfiguration."
                                           "MountName")
    k8s_fsx_storage_class: str = Field(default="", description="storageClassName of the static PV and its claim; "
                                       "'' = none, so no dynamic provisioner takes the claim")
    k8s_fsx_capacity_gib: int = Field(default=1200, gt=0, description="the file system's storage capacity (PV "
                                      "capacity and claim request)")
    k8s_image_registry: str | None = Field(default=None, description="registry (and path) the runtime images are "
                                           "pushed to, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/ml")
    k8s_image_repository: str = Field(default="modelops-runtime", description="repository of the runtime images "
                                      "in that registry; the tag is `modelops image plan`'s")
    k8s_runtime_image: str | None = Field(default=None, description="the runtime image serving pods run when the "
                                          "lifecycle's image stage built the control plane's own runtime (the one "
                                          "it packages and probes against): `modelops image plan`'s tag, or a full "
                                          "reference, of CI's build of the same lock")
    k8s_service_address: Literal["dns", "cluster-ip"] = Field(
        default="dns", description="how the control plane reaches a version's Service: its cluster DNS name "
        "(<svc>.<ns>.svc), or its spec.clusterIP when the control plane's resolver does not serve cluster DNS")
    k8s_gateway_url: str | None = Field(default=None, description="OpenAI base URL (.../v1) of the Gateway's "
                                        "listener, for the route checks after a traffic change; default http://127.0.0.1:<router_port>/v1")

    @field_validator("k8s_gateway_url", mode="before")
    @classmethod
    def _gateway_url(cls, v):
        if v is None or (isinstance(v, str) and not v):  # an empty variable: unset, as `export VAR=` means
            return None
        parts = urlsplit(v) if isinstance(v, str) else None
        try:
            port_ok = parts is not None and (parts.port is None or parts.port > 0)
        except ValueError:  # a port out of 0..65535, or not a number
            port_ok = False
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
                or any(c.isspace() for c in v):
            raise ValueError("not an http:// or https:// URL: give the Gateway listener's OpenAI base URL, such as "
                             "http://inference.gateways.svc/v1")
        if parts.username is not None or parts.password is not None:
            raise ValueError("has a user or password in it, which would be written as is into the batch API's "
                             "Deployment: give the URL without them (the Gateway takes API keys in headers)")
        return v

    k8s_network_policy: bool = Field(default=True, description="give each version a NetworkPolicy that admits "
                                     "ingress only from the Gateway's Envoy Gateway proxies, the control plane's "
                                     "pods, k8s_metrics_namespace and (with k8s_inference_pool) its endpoint picker "
                                     "(tasks/kube/manifests.py render_networkpolicy); false where the Gateway is "
                                     "not Envoy Gateway, whose proxy pods it could not name")
    k8s_gateway_proxy_namespace: str = Field(default="envoy-gateway-system", description="the namespace Envoy "
                                             "Gateway runs the Gateway's proxy pods in: its controller's (the Helm "
                                             "chart's envoy-gateway-system), or the Gateway's own in Envoy Gateway's "
                                             "GatewayNamespace deploy mode")
    k8s_metrics_namespace: str | None = Field(default="monitoring", description="namespace whose pods may reach "
                                              "the serving pods' OpenAI port (8080, where the merged /metrics is) "
                                              "to scrape them for KEDA and dashboards; unset = none")

    batch_port: int = Field(default=8082, ge=1, le=65535,
                            description="the batch API (OpenAI's /v1/files and /v1/batches: "
                            "tasks/batch/api.py) on batch_host; clients reach it through the router")
    batch_host: IPvAnyAddress = Field(default="127.0.0.1", description="the address the batch API listens on: "
                                      "loopback locally; 0.0.0.0 in its Kubernetes pod, which a NetworkPolicy opens "
                                      "to the Gateway's proxies only (tasks/kube/batch_api.py)")
    batch_bucket: str = Field(default="modelops-batches", min_length=3, max_length=63,
                              description="S3 bucket of batch input, output and error files (made on first use)")

    @field_validator("batch_bucket")
    @classmethod
    def _a_bucket_name(cls, v: str) -> str:
        # S3's rules for a general purpose bucket's name
        # (docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html); boto's own error
        # came at the first upload, naming neither the setting nor the rule.
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*[a-z0-9]", v) or ".." in v:
            raise ValueError("not an S3 bucket name: give lowercase letters, digits, dots and hyphens, starting "
                             "and ending with a letter or digit, without two dots in a row")
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", v):
            raise ValueError("not an S3 bucket name: S3 refuses a name in the form of an IP address")
        if v.startswith(_BUCKET_PREFIXES) or v.endswith(_BUCKET_SUFFIXES):
            raise ValueError(f"not an S3 bucket name: S3 reserves the prefixes {', '.join(_BUCKET_PREFIXES)} and the "
                             f"suffixes {', '.join(_BUCKET_SUFFIXES)}")
        return v

    batch_max_requests: int = Field(default=50_000, ge=1, description="requests one batch input file may hold "
                                    "(OpenAI's limit is 50,000)")
    batch_max_concurrency: int = Field(default=16, ge=1, le=256, description="the most requests one batch "
                                       "keeps in flight; it starts there on idle engines and backs off "
                                       "(tasks/batch/pace.py)")
    batch_max_waiting: int = Field(default=0, ge=0, description="backpressure: when more requests than this wait "
                                   "in the queues of its model's instances (vLLM's num_requests_waiting, summed), a "
                                   "batch comes down to what they run plus this, and tries one more at the next read "
                                   "that sees neither signal (tasks/batch/pace.py)")
    batch_max_live: int = Field(default=0, ge=0, description="backpressure: a batch halves its concurrency when "
                                "more than this many requests of others (live traffic) are in its model's engines "
                                "(running + waiting, less the batch's own in flight), so it yields the engine to them")
    batch_quiet_s: float = Field(default=5.0, ge=1, le=3600, description="backpressure: after its first back-off, "
                                 "a batch grows only once no live traffic was seen for this many seconds (reads once "
                                 "a second), so a read between two live requests does not add a batch sequence beside "
                                 "the next one (tasks/batch/pace.py)")
    batch_stale_after_s: float = Field(default=60.0, gt=0, description="a running batch whose runner sent no "
                                       "heartbeat for this long (a killed flow run or worker) is resumed by a new "
                                       "flow run, from its last written chunk")
    batch_cache_mb: int = Field(default=256, ge=0, description="size budget of the result cache for deterministic "
                                "requests (MiB of answers; least recently used evicted first); 0 = no cache")

    @cached_property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def fsx_dir(self) -> Path:
        return (self.fsx_root or self.home_dir / "fsx").expanduser().resolve()

    @property
    def registry(self) -> str:
        return self.registry_url or f"sqlite:///{self.home_dir / 'registry.db'}"

    @property
    def run_dir(self) -> Path:
        """Pid files, sockets and generated configs of running processes."""
        return self.home_dir / "run"

    @property
    def router_internal_socket(self) -> Path:
        """The local router's Unix socket for the platform's own requests (no API key: mode 600,
        this user only): route checks, and the copies instances send to a shadow."""
        return self.run_dir / "internal.sock"

    @property
    def instance_secret_file(self) -> Path:
        """The local stack's instance secret (modelops/tenancy.py: only the router and the
        platform's checks reach the instances)."""
        return self.run_dir / "instance.secret"

    @property
    def prefect_auth_file(self) -> Path:
        """The local Prefect server's API auth string (modelops_cli/local_stack.py:
        ``prefect_auth_string``):
        the server requires it (HTTP Basic, Prefect's PREFECT_SERVER_API_AUTH_STRING; /health
        and /ready excepted), and the worker, the CLI and the UI's sign-in page send it."""
        return self.run_dir / "prefect.auth"

    @property
    def activator_socket(self) -> Path:
        """The Unix socket on which the autoscaler holds requests for versions at zero instances
        (tasks/autoscale/activator.py); the router sends them there."""
        return self.run_dir / "activator.sock"

    @property
    def regions_path(self) -> Path:
        """Where the regions file is read from (it need not exist)."""
        return (self.regions_file or self.home_dir / "regions.yaml").expanduser().resolve()

    @property
    def log_dir(self) -> Path:
        return self.home_dir / "logs"

    @property
    def runtime_dir(self) -> Path:
        """Built runtime environments, one folder per lock hash."""
        return self.runtime_root.expanduser().resolve()

    @property
    def packages_dir(self) -> Path:
        return self.home_dir / "packages"

    @property
    def s3_endpoint(self) -> str:
        return self.s3_endpoint_url or f"http://127.0.0.1:{self.s3_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def router_url(self) -> str:
        """OpenAI base URL where clients reach the router: the local HAProxy, or the Gateway's
        listener (``k8s_gateway_url``) with ``router == "gateway-api"``."""
        if self.router == "gateway-api" and self.k8s_gateway_url:
            return self.k8s_gateway_url.rstrip("/")
        return f"http://127.0.0.1:{self.router_port}/v1"


def get_settings() -> Settings:
    """Settings from the current environment (read anew on each call, cheap)."""
    return Settings()


def settings_problem(e: Exception) -> str | None:
    """One line naming each bad ``MODELOPS_*`` variable of a failed :func:`get_settings`, or None
    when ``e`` is not a settings error.

    pydantic's ``ValidationError`` carries the field and the reason; pydantic-settings'
    ``SettingsError`` is raised earlier, when a list or dict setting is not JSON.
    """
    import re

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    if isinstance(e, ValidationError):
        return "; ".join(f"MODELOPS_{'_'.join(map(str, x['loc'])).upper()}: {x['msg']} (got {x.get('input')!r})"
                         for x in e.errors())
    if isinstance(e, SettingsError):
        m = re.search(r'field "(\w+)"', str(e))
        name = f"MODELOPS_{m.group(1).upper()}" if m else "a MODELOPS_* variable"
        return f"{name}: not valid JSON; list and dict settings are JSON, e.g. {name}='[\"a.example.com\"]'"
    return None
