"""HAProxy as the local router (OpenAI-compatible at ``127.0.0.1:<router_port>/v1``, KServe v2
HTTP at ``127.0.0.1:<router_port>/v2/models/<model_id>/...``, KServe v2 gRPC at
``127.0.0.1:<router_grpc_port>``).

Routing: the JSON body's ``model`` field (``json_query``) picks the model's OpenAI backend; a
``/v2/models/<model_id>/`` path its KServe HTTP backend; on the gRPC listener (HTTP/2) the
``x-model-id`` metadata its KServe gRPC backend (HAProxy cannot read the model name inside the
protobuf message). The header ``X-Model-Version`` pins a version on all three. Every protocol's
servers carry the same weights and are health-checked on the instance's frontend ``/ready``
(closed while it loads or drains). Weights move through the runtime API (``set server ...
weight``) with no reload; a changed topology (a new model, version or instance) is written to
the config, checked with ``haproxy -c`` and applied by a seamless master-worker reload.
Facts: HAProxy 2.6 configuration manual (json_query, http-request return, ``proto h2``,
``check-proto``, master CLI reload); weight shifts verified here without reload
(RUNTIME_NOTES.md); gRPC's trailers-only error response (grpc/doc/PROTOCOL-HTTP2.md).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import httpx

from modelops.batch import LIVE_CACHE_HEADER, LIVE_CACHE_PATHS
from modelops.errors import TrafficError
from modelops.experiments import MAX_KEY_BYTES
from modelops.histograms import parse_prometheus
from modelops.io_contract import FRONTEND_TOKEN_HEADER
from modelops.manifest import triton_version
from modelops.shadow import SHADOW_HEADER
from modelops.registry import Registry
from modelops.routing import Routing
from modelops.settings import Settings, get_settings
from modelops.tenancy import (ALL_MODELS, CONCURRENCY_LIMIT_CODE, INSTANCE_SECRET_B64_ENV, INSTANCE_SECRET_ENV,
                              INSTANCE_SECRET_GRPC_HEADER, INSTANCE_SECRET_HEADER, KEY_CHECKED_HEADER, KEY_HEADER,
                              KEY_MAC_HEADER, MAX_LIMIT, PLATFORM_KEY, RATE_LIMIT_CODE, TOKEN_LIMIT_CODE, KeyGrant,
                              stack_secret, without_prefect_auth)
from tasks.traffic.interface import HOLD_PREFIX, ModelRoute, Router

__all__ = ["HAProxyRouter", "render_config"]

log = logging.getLogger(__name__)


def _error(status: int, code: str, message: str, cond: str = "", param: str | None = "model") -> str:
    # message is a log-format string inside a JSON string: request values go through json().
    body = ('{"error":{"message":"%s","type":"invalid_request_error","param":%s,"code":"%s"}}'
            % (message, json.dumps(param), code))
    return f"    http-request return status {status} content-type application/json lf-string '{body}'" + (
        f" if {cond}" if cond else "")


def _kserve_error(status: int, message: str, cond: str) -> str:
    # KServe v2's error shape: {"error": "<message>"} (KServe v2 protocol, HTTP/REST errors).
    return f"    http-request return status {status} content-type application/json lf-string '{{\"error\":\"{message}\"}}' if {cond}"


def _grpc_error(code: int, message: str, cond: str = "") -> str:
    # A trailers-only gRPC response: HTTP 200, grpc-status and grpc-message in the headers, no body.
    return (f"    http-request return status 200 content-type application/grpc hdr grpc-status {code} "
            f"hdr grpc-message \"{message}\"" + (f" if {cond}" if cond else ""))


# The Lua half of the router: affinity keys and the router's metrics.
LUA = Path(__file__).with_name("haproxy_router.lua")
_REWRITE_RESERVE = 16384  # bytes of a buffer kept for headers HAProxy adds (tune.maxrewrite)
_HEADER_ROOM = 49152  # bytes of a buffer for the request line and headers, beside the largest body
_MODEL = '\\"%[var(txn.model),json(utf8s)]\\"'
_KSERVE_MODEL = '\\"%[var(txn.kserve),json(utf8s)]\\"'
_VERSION = '\\"%[req.hdr(x-model-version),json(utf8s)]\\"'
# /v2/models/<model_id>/versions/<version>[/...]: KServe v2's per-version routes.
_KSERVE_VERSION_PATH = "^/v2/models/[^/]+/versions/[^/]+(/|$)"
_PATH_VERSION = '\\"%[var(txn.path_version),json(utf8s)]\\"'
# What the router passes to a model's instances: KServe v2 inference, metadata, readiness and config
# (KServe v2 protocol; Triton's generate extension), HTTP paths and gRPC methods. Statistics, trace
# and log settings, shared memory and the model repository stay the operators', on each instance.
# (`($)`: a bare `$` before a space would start an environment variable in HAProxy's config.)
_KSERVE_ROUTES = "^/v2/models/[^/]+(/versions/[^/]+)?(/(infer|generate|generate_stream|ready|config))?($)"
_KSERVE_ADMIN = ("this router serves the inference of a model (POST .../infer, .../generate, .../generate_stream), "
                 "its metadata (GET /v2/models/<model_id>), .../ready and .../config only")
_GRPC_ROUTES = ("^/inference.GRPCInferenceService/(ModelInfer|ModelStreamInfer|ModelMetadata|ModelReady|ModelConfig|"
                "ServerLive|ServerReady|ServerMetadata)($)")
_GRPC_ADMIN = ("this router serves ModelInfer, ModelStreamInfer, ModelMetadata, ModelReady, ModelConfig and the "
               "liveness, readiness and metadata of the server only")
_VERSIONS_TWICE = ("X-Model-Version names more than one version (the header twice, or values joined by a comma); "
                   "name one")
# Backend name prefixes per protocol: weighted (all routed versions) and one version (pinned).
# KServe's HTTP generate routes go to the instance's frontend, which passes them to Triton with the
# API key they count for (runtime/frontend/kserve_generate.py: Triton forwards no header there).
_PROTOCOLS = {"openai": ("m_", "mv_"), "kserve_generate": ("kg_", "kgv_"), "kserve_http": ("k_", "kv_"),
              "kserve_grpc": ("g_", "gv_")}
_AT_FRONTEND = ("openai", "kserve_generate")  # the protocols an instance's frontend (its address) serves
_GENERATE_PATH = "^/v2/models/[^/]+(/versions/[^/]+)?/generate(_stream)?($)"


def _balance(routing: Routing, protocol: str, servers) -> list[str]:
    """The balancing lines of a backend that holds one version's ``servers`` (:mod:`modelops.routing`)."""
    if routing.policy == "round-robin":
        return ["    balance roundrobin"]
    if routing.policy == "least-request" or not servers:
        return ["    balance leastconn"]
    bound = round(routing.load_bound * 100)
    # gRPC bodies are protobuf frames of a stream that stays open: only X-Session-Id keys them.
    place = f"lua.modelops_session_affinity {bound}" if protocol == "kserve_grpc" else \
        f"lua.modelops_affinity {routing.prefix_bytes} {bound}"
    # The Lua action places keyed requests (sticky, load-bounded); leastconn takes the others, and
    # a placed instance that went down (use-server is skipped for a down server).
    return ["    balance leastconn", f"    http-request {place}",
            *(f"    use-server {s.name} if {{ var(txn.modelops_server) -m str {s.name} }}" for s in servers)]


_ROUTER_ERRORS = (
    (408, "invalid_request_error", "request_timeout", "the request was not received within 60 s"),
    (502, "server_error", "bad_gateway", "the instance sent an invalid response"),
    (503, "server_error", "no_instance_available", "no instance of this model is available now; retry later"),
    (504, "server_error", "gateway_timeout", "the instance did not answer in time"),
)


def _too_large(max_body_mb: int, kserve: bool) -> list[str]:
    """413 for a body over ``max_body_mb`` MiB, in KServe's error shape on ``/v2/`` paths, else
    in OpenAI's."""
    message = f"the request body is larger than the router takes ({max_body_mb} MiB: MODELOPS_ROUTER_MAX_BODY_MB)"
    path = "{ path_beg /v2/ }" if kserve else "!{ path_beg /v2/ }"
    # Headers past the buffer's header room push the end of a body within the limit out of the
    # buffer: less of it arrived than its Content-Length says (req.body_size), and `model` or the
    # affinity keys could be cut off.
    cut = (f"the request headers are too large to read a {max_body_mb} MiB body beside them "
           f"(at most {_HEADER_ROOM >> 10} KiB of headers with a body at MODELOPS_ROUTER_MAX_BODY_MB): send "
           "smaller headers or a smaller body")
    out = []
    for over, why in ((f"{{ req.hdr_val(content-length) gt {max_body_mb << 20} }}", message),
                      (f"{{ req.body_len gt {max_body_mb << 20} }}", message),
                      ("{ req.body_len,sub(txn.body_size) lt 0 }", cut)):
        out.append(_kserve_error(413, why, f"{path} {over}") if kserve else
                   _error(413, "request_too_large", why, f"{path} {over}", param=None))
    return out


def _hold_lines(servers) -> list[str]:
    """What a backend with a hold server (a version at zero instances) adds: the activator learns
    the model and the version from the server's name, in a header; it answers a request it held
    past ``router_hold_s`` with 529, which no ``retry-on`` replays (a 503 would be held three more
    times), and the router turns that into the 503 clients get."""
    if not any(s.hold for s in servers):
        return []
    return ["    http-send-name-header x-modelops-server",
            f"    http-response set-status 503 if {{ status 529 }} {{ srv_name -m beg {HOLD_PREFIX} }}"]


# The maps of API keys (modelops/tenancy.py) under the router's auth directory, all keyed by
# what the router knows of a request: the key's SHA-256, then the key's name.
_KEYS_MAP, _SCOPES_MAP, _MODELS_MAP = "keys.map", "scopes.map", "models.map"
_RPM_MAP, _CONCURRENCY_MAP, _TPM_MAP = "rpm.map", "concurrency.map", "tpm.map"
_UNAUTHENTICATED = ("no valid API key: send the header Authorization: Bearer <key> with a key from "
                    "`modelops keys create`")


def _models_list(routes: list[ModelRoute], allows=lambda model_id: True) -> str:
    """``GET /v1/models``: the routed models ``allows`` admits, compact JSON (no spaces: it is a
    value in a map and in the runtime API's command line)."""
    return json.dumps({"object": "list", "data": [
        {"id": r.model_id, "object": "model", "owned_by": "modelops", "versions": sorted(r.versions)}
        for r in routes if allows(r.model_id)]}, separators=(",", ":"))


def render_auth_maps(routes: list[ModelRoute], grants: list[KeyGrant]) -> dict[str, dict[str, str]]:
    """The router's maps for ``grants`` (active keys), ``{file name: {key: value}}``: the key's
    SHA-256 → its name; ``<name>/<model>`` (or ``<name>/*``) → 1 for each model in scope; name →
    its ``/v1/models`` answer (the routed models in scope); name → rpm and max concurrency; name
    → until when (Unix seconds) a key over its tpm is refused. The platform's own requests
    (:data:`PLATFORM_KEY`) have every model and no limit."""
    return {
        _KEYS_MAP: {g.hash: g.name for g in grants},
        _SCOPES_MAP: {f"{PLATFORM_KEY}/{ALL_MODELS}": "1", **{f"{g.name}/{m}": "1" for g in grants for m in g.models}},
        _MODELS_MAP: {PLATFORM_KEY: _models_list(routes), **{g.name: _models_list(routes, g.allows) for g in grants}},
        _RPM_MAP: {g.name: str(g.rpm) for g in grants if g.rpm},
        _CONCURRENCY_MAP: {g.name: str(g.max_concurrency) for g in grants if g.max_concurrency},
        _TPM_MAP: {g.name: str(math.ceil(g.throttled_until)) for g in grants if g.throttled_until > 0},
    }


def _auth_error(status: int, *, grpc: bool, openai: tuple[str, str] | None, kserve: str | None, cond: str,
                retry_after: str | None = None) -> list[str]:
    """The answer to a request the keys refuse: gRPC's (UNAUTHENTICATED, PERMISSION_DENIED,
    RESOURCE_EXHAUSTED: grpc/doc/statuscodes.md) on the gRPC listener, else KServe's shape on
    ``/v2/`` paths (``kserve`` message) and OpenAI's elsewhere (``openai`` = (code, message));
    a 401 names the scheme (``WWW-Authenticate: Bearer``, RFC 6750), a 429 when to retry."""
    extra = (' hdr WWW-Authenticate Bearer' if status == 401 else '') + \
        (f' hdr Retry-After "{retry_after}"' if retry_after else '')
    if grpc:
        code = {401: 16, 403: 7, 429: 8}[status]
        return [f"    http-request return status 200 content-type application/grpc hdr grpc-status {code} "
                f"hdr grpc-message \"{kserve}\"{extra} if {cond}"]
    out = [f"    http-request return status {status} content-type application/json lf-string "
           f"'{{\"error\":\"{kserve}\"}}'{extra} if {{ path_beg /v2/ }} {cond}"]
    code, message = openai
    body = ('{"error":{"message":"%s","type":"%s","param":null,"code":"%s"}}'
            % (message, "requests" if status == 429 else "invalid_request_error", code))
    return out + [f"    http-request return status {status} content-type application/json lf-string '{body}'{extra} "
                  f"if !{{ path_beg /v2/ }} {cond}"]


def _auth_check_lines(auth_dir: Path, *, grpc: bool) -> list[str]:
    """Who is calling: the ``Authorization: Bearer <key>`` header (gRPC: the ``authorization``
    metadata) looked up by its SHA-256 in the keys map (the key is never compared, stored or
    logged); none or an unknown one is a 401. The name then goes to the instance as
    ``x-modelops-key`` (a client's own is dropped first)."""
    keys = auth_dir / _KEYS_MAP
    twice = "the request has the Authorization header more than once; send it once"
    return [
        # Two Authorization headers: proxies that read the first and the last would disagree.
        *([_grpc_error(3, twice, "{ req.fhdr_cnt(authorization) gt 1 }")] if grpc else
          [_kserve_error(400, twice, "{ path_beg /v2/ } { req.fhdr_cnt(authorization) gt 1 }"),
           _error(400, "invalid_authorization", twice, "{ req.fhdr_cnt(authorization) gt 1 }", param=None)]),
        f"    http-request set-var(txn.key_id) str({PLATFORM_KEY}) if {{ so_name {PLATFORM_KEY} }}",
        # The platform's request made for a key (the frontend kept the name from KEY_HEADER).
        "    http-request set-var(txn.key_id) var(txn.for_key) if { var(txn.for_key) -m found }",
        # "Bearer <key>" and nothing else (a third word makes it no key).
        f"    http-request set-var(txn.key_id) req.fhdr(authorization),word(2,' '),sha2(256),hex,lower,map({keys}) "
        f"if !{{ so_name {PLATFORM_KEY} }} {{ req.fhdr(authorization),word(1,' '),lower -m str bearer }} "
        "!{ req.fhdr(authorization),word(3,' ') -m len gt 0 }",
        *_auth_error(401, grpc=grpc, openai=("invalid_api_key", _UNAUTHENTICATED), kserve=_UNAUTHENTICATED,
                     cond="!{ var(txn.key_id) -m found }"),
    ]


def _auth_limit_lines(auth_dir: Path, targets: tuple[str, ...], *, grpc: bool, signed: bool = False) -> list[str]:
    """Once the model (the first of the samples ``targets`` found) is known: a model outside the
    key's scope is a 403; then the key's limits, counted in the ``key_usage`` stick table that
    every listener shares: more requests in flight than ``max_concurrency``, a key throttled for
    its ``tpm`` (the tpm map), or more admitted in the last 60 s than ``rpm``, is a 429 (refused
    requests do not count against the rate). ``signed``: the key's name goes with its HMAC under
    the instance secret (the router has one: ``instance_secret``)."""
    scopes = auth_dir / _SCOPES_MAP
    scope_msg = ('this API key may not call model \\"%[var(txn.target),json(utf8s)]\\" '
                 '(`modelops keys ls` shows its scope)')
    return [
        f"    acl key_scoped var(txn.key_id),concat(/,txn.target,),map({scopes}) -m found",
        f"    acl key_scoped var(txn.key_id),concat(/*),map({scopes}) -m found",
        *(f"    http-request set-var(txn.target) {t} if !{{ var(txn.target) -m found }}" for t in targets),
        *_auth_error(403, grpc=grpc, openai=("model_not_allowed", scope_msg), kserve=scope_msg,
                     cond="{ var(txn.target) -m found } !key_scoped"),
        # Untracked, a request without limits passes the concurrency and rpm rules below (their
        # sc0 samples are absent) and counts in neither: its limits were applied where it came in
        # (a live request the result cache missed), or it is no inference (the Files and Batches API).
        "    http-request track-sc0 var(txn.key_id) table key_usage if !{ var(txn.no_limits) -m found }",
        f"    http-request set-var(txn.key_concurrency) var(txn.key_id),map({auth_dir / _CONCURRENCY_MAP},{MAX_LIMIT})",
        f"    http-request set-var(txn.key_rpm) var(txn.key_id),map({auth_dir / _RPM_MAP},{MAX_LIMIT})",
        *_auth_error(429, grpc=grpc, openai=(CONCURRENCY_LIMIT_CODE, "this API key has "
                     "%[var(txn.key_concurrency)] request(s) in flight, its max_concurrency; retry when one ends"),
                     kserve="this API key has %[var(txn.key_concurrency)] request(s) in flight, its max_concurrency",
                     cond="{ sc0_conn_cur,sub(txn.key_concurrency) gt 0 }", retry_after="1"),
        "    http-request set-var(txn.now) date",
        f"    http-request set-var(txn.key_wait) var(txn.key_id),map({auth_dir / _TPM_MAP},0),sub(txn.now)",
        *_auth_error(429, grpc=grpc, openai=(TOKEN_LIMIT_CODE, "this API key used its tpm limit (tokens in "
                     "the last minute); retry in %[var(txn.key_wait)] s"),
                     kserve="this API key used its tpm limit (tokens in the last minute)",
                     cond="{ var(txn.key_wait) -m int gt 0 } !{ var(txn.no_limits) -m found }",
                     retry_after="%[var(txn.key_wait)]"),
        # Over the rpm: refused until the counter's minute has rolled over, at most 60 s after the
        # first refusal of this run of them (gpt0 keeps when that was): Retry-After counts down to it.
        "    http-request set-var(txn.key_over) sc0_gpc0_rate,sub(txn.key_rpm)",
        "    http-request sc-set-gpt0(0) date if { var(txn.key_over) -m int ge 0 } { sc0_get_gpt0 eq 0 }",
        "    http-request set-var(txn.key_retry) sc0_get_gpt0,add(60),sub(txn.now)",
        "    http-request set-var(txn.key_retry) int(1) if { var(txn.key_retry) -m int lt 1 }",
        *_auth_error(429, grpc=grpc, openai=(RATE_LIMIT_CODE, "this API key made %[var(txn.key_rpm)] "
                     "request(s) in the last minute, its rpm limit"),
                     kserve="this API key made %[var(txn.key_rpm)] request(s) in the last minute, its rpm limit",
                     cond="{ var(txn.key_over) -m int ge 0 }", retry_after="%[var(txn.key_retry)]"),
        "    http-request sc-set-gpt0(0) 0",
        "    http-request sc-inc-gpc0(0)",
        f"    http-request set-header {KEY_HEADER} %[var(txn.key_id)]",
        # With an instance secret: the name's HMAC under it, which the engine checks before it counts
        # a KServe answer for the name (modelops.tenancy.key_mac).
        *([f"    http-request set-header {KEY_MAC_HEADER} "
           f'%[var(txn.key_id),hmac(sha256,"${{{INSTANCE_SECRET_B64_ENV}}}"),hex,lower]'] if signed else []),
    ]


def _experiment_key_rules(r: ModelRoute) -> list[str]:
    """The frontend rules that give a request for ``r``'s model under an experiment its bucket
    (``txn.exp_bucket``, 0..99: ``crc32`` of the key, as :func:`modelops.experiments.bucket_of`)
    and how its arm was chosen (``txn.exp_assigned``: key or default, counted by the Lua)."""
    spec, model = r.experiment, f"{{ var(txn.model) -m str {r.model_id} }}"
    unpinned = "!{ req.hdr(x-model-version) -m found }"
    if spec.header:
        h = spec.header
        # fhdr: the whole value of the header's last line (hdr would split it at commas).
        source = [f"    http-request set-var(txn.exp_key) req.fhdr({h}) if {model} {unpinned} "
                  f"{{ req.fhdr({h}) -m len gt 0 }} {{ req.fhdr({h}) -m len le {MAX_KEY_BYTES} }}"]
    else:  # the body's `user`, which the Lua found (at most MAX_KEY_BYTES, quotes included)
        source = [f"    http-request set-var(txn.exp_key) var(txn.user_key) if {model} {unpinned} "
                  "{ var(txn.user_key) -m found }"]
    return [*source,
            f"    http-request set-var(txn.exp_bucket) var(txn.exp_key),crc32,mod(100) if {model} "
            "{ var(txn.exp_key) -m found }",
            f"    http-request set-var(txn.exp_assigned) str(key) if {model} {{ var(txn.exp_key) -m found }}",
            f"    http-request set-var(txn.exp_assigned) str(default) if {model} {unpinned} "
            "!{ var(txn.exp_key) -m found }"]


def _experiment_arms(r: ModelRoute) -> list[str]:
    """``r``'s unpinned OpenAI requests to the arm whose slice holds their bucket, else (no key)
    to the default arm; empty without an experiment, or when its default arm has no route (an
    arm without one yields its slice to the default)."""
    spec = r.experiment
    if spec is None or spec.default not in r.versions:
        return []
    when = f"{{ var(txn.model) -m str {r.model_id} }} !{{ req.hdr(x-model-version) -m found }}"
    rules = [f"    use_backend mv_{r.model_id}__{v} if {when} {{ var(txn.exp_bucket) -m int ge {lo} }} "
             f"{{ var(txn.exp_bucket) -m int lt {hi} }}" for v, lo, hi in spec.slices() if v in r.versions]
    return [*rules, f"    use_backend mv_{r.model_id}__{spec.default} if {when}"]


_EXPERIMENT_COUNTER = "modelops_router_experiment_requests_total"  # haproxy_router.lua


def _shadow_rule(r: ModelRoute) -> str:
    """The rule that marks ``r.shadow.percent`` % of the model's unpinned OpenAI requests, drawn
    by ``rand(100)`` (0..99), for a copy to the shadow version (:mod:`modelops.shadow`): the
    instance that answers sends it after answering its client."""
    return (f"    http-request set-header {SHADOW_HEADER} {r.shadow.header()} "
            f"if {{ var(txn.model) -m str {r.model_id} }} !{{ req.hdr(x-model-version) -m found }} "
            f"{{ rand(100) -m int lt {r.shadow.percent} }}")


def render_config(routes: list[ModelRoute], *, port: int, stats_socket: Path, grpc_port: int | None = None,
                  max_body_mb: int = 4, hold_socket: Path | None = None, auth_dir: Path | None = None,
                  internal_socket: Path | None = None, instance_secret: bool = False,
                  batch_api: str | None = None) -> str:
    """The full haproxy.cfg for ``routes``.

    Backends per protocol (see :data:`_PROTOCOLS`): ``m_<model>`` (OpenAI), ``k_<model>``
    (KServe HTTP), ``kg_<model>`` (KServe HTTP's generate routes, at the instance's frontend) and
    ``g_<model>`` (KServe gRPC, on ``grpc_port``; none when None) weigh the servers of every
    routed version; ``mv_``/``kv_``/``kgv_``/``gv_<model>__<version>`` hold one version,
    for ``X-Model-Version``. Unknown model or version: 404 in the OpenAI error shape, in
    KServe's on ``/v2/`` paths, gRPC status NOT_FOUND (5) on the gRPC listener. A backend that
    holds one version balances by that version's ``routing`` policy; one that weighs several
    (a red-black shift) round-robin, which keeps each version's share exact. A body over
    ``max_body_mb`` MiB is a 413. ``GET /metrics`` answers the router's own metrics
    (``haproxy_router.lua``), ``GET /metrics/haproxy`` HAProxy's Prometheus exporter. A hold
    server (a version at zero instances) is the activator on ``hold_socket``, over HTTP (OpenAI
    and KServe HTTP); gRPC has no hold: a gRPC call for a version at zero gets UNAVAILABLE.
    With ``auth_dir`` (the maps of :func:`render_auth_maps` are there) every listener takes only
    requests with an API key: 401 without a known one, 403 for a model outside its scope, 429
    past its limits; ``GET /v1/models`` lists the key's models; ``/metrics`` stays open.
    ``internal_socket`` (a Unix socket, mode 600: only the platform's user opens it) takes the
    platform's own requests, the route checks, as the reserved key ``modelops``: every model, no
    limit, no key sent; or, with ``x-modelops-key: <name>``, as that key's (its scope, limits and
    usage: a batch's lines), its limits skipped with ``x-modelops-key-checked: 1``
    (:data:`modelops.tenancy.KEY_CHECKED_HEADER`). With ``instance_secret`` every request to an
    instance carries the stack's secret (``x-modelops-instance-secret``; gRPC:
    ``triton-grpc-protocol-x-modelops-instance-secret``, the key Triton reads), from HAProxy's
    environment, never in this file: the instances take requests from the router only
    (modelops/tenancy.py). ``batch_api`` (``host:port``) serves
    OpenAI's ``/v1/files`` and ``/v1/batches`` (tasks/batch/api.py), behind the same keys and
    limits, the key's name in ``x-modelops-key``, and an unpinned request with
    ``X-Modelops-Cache: use`` on a path of :data:`modelops.batch.LIVE_CACHE_PATHS` (its cache
    route); without it those paths are not routed and the header does nothing.
    A route's ``shadow`` marks its share of the model's unpinned OpenAI requests with
    :data:`modelops.shadow.SHADOW_HEADER` (a client's own header of that name is removed).

    Raises:
        ValueError: a route has a hold server and ``hold_socket`` is None.
    """
    if hold_socket is None and any(s.hold for r in routes for ss in r.versions.values() for s in ss):
        raise ValueError("a version at zero instances needs the activator's socket (hold_socket)")
    max_body = max_body_mb << 20
    lines = [
        "global",
        f"    stats socket {stats_socket} mode 600 level admin expose-fd listeners",
        # The whole body fits the buffer with the request's headers, so json_query finds `model`
        # and Lua the affinity key wherever they are in it; the rewrite reserve keeps room for the
        # headers HAProxy adds.
        f"    tune.bufsize {max_body + _HEADER_ROOM + _REWRITE_RESERVE}",
        f"    tune.maxrewrite {_REWRITE_RESERVE}",
        f"    lua-load {LUA}",
        "",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        "    timeout client 600s",
        "    timeout server 600s",
        "    timeout http-request 60s",
        "    option http-buffer-request",
        # What HAProxy answers itself (a timeout, no instance up) in the OpenAI error shape, instead of
        # its HTML pages. (A request it cannot parse, e.g. over 101 headers, still gets the HTML 400:
        # 2.6 answers those before any http-error applies.)
        *(f"    http-error status {code} content-type application/json string "
          f"'{{\"error\":{{\"message\":\"{message}\",\"type\":\"{kind}\",\"param\":null,\"code\":\"{name}\"}}}}'"
          for code, kind, name, message in _ROUTER_ERRORS),
        # Send each server-sent event or gRPC message on at once: by default HAProxy holds a
        # partial response it knows more of (MSG_MORE) for up to 200 ms, which is how a stream
        # through the router gained ~200 ms on its first token and lost its token pacing.
        "    option http-no-delay",
        # A client that hangs up (curl -m 3, an openai client's timeout before its retry) closes
        # the instance's connection too, so the instance cancels the engine request; by default
        # HAProxy keeps the server side open until the answer is complete (an HTTP half-close),
        # and a unary request ran to its end for nobody.
        "    option abortonclose",
        # A reload's old worker answers the next request on each idle keep-alive connection (then
        # closes it) instead of closing it at once: a client that sent a request just as the close
        # arrived got "Server disconnected" (1 in 14,624 requests of a red-black rollout in CI).
        # The old worker's routes serve such a request, so its idle connections live 10 s, not the
        # 60 s of `timeout http-request`; 10 s outlasts httpx's (the openai SDK's) 5 s idle expiry.
        "    option idle-close-on-response",
        "    timeout http-keep-alive 10s",
        # A request an instance fails before any response byte (connection refused, empty reply,
        # 503: draining, loading, engine dead or stalled, all answered before the request reached
        # the engine or as the engine vanished) is retried on another server of the backend
        # (redispatch on every retry; the body is buffered above): a dying or draining instance
        # costs no request. Other 5xx are not replayed: a 502 (Triton failed the request) or 500
        # (the answer failed its checks) may be the request's own doing, and one poison request
        # must not visit every instance. A stream that broke after its first byte cannot be.
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response 503",
        "",
        "frontend openai",
        f"    bind 127.0.0.1:{port}",
        *([f"    bind unix@{internal_socket} mode 600 name {PLATFORM_KEY}"] if internal_socket else []),
        *([r"    acl batch_api path_reg ^/v1/(files|batches)(/|$)",
           f"    acl live_cache req.hdr({LIVE_CACHE_HEADER}) -i -m str use",
           f"    acl live_cache_path path {' '.join(LIVE_CACHE_PATHS)}",
           # Managing files and batches is no inference: the key's limits do not count or refuse it.
           "    http-request set-var(txn.no_limits) bool(1) if batch_api"] if batch_api else []),
        "    http-request lua.modelops_start",
        "    http-response lua.modelops_observe",
        "    http-request use-service lua.modelops_metrics if { method GET } { path /metrics }",
        "    http-request use-service prometheus-exporter if { method GET } { path /metrics/haproxy }",
        # Only the router says which key called (usage per key is counted by the instances), and
        # which requests are copied to a shadow; over the internal socket the platform names the
        # key it makes a request for (modelops.tenancy.KEY_CHECKED_HEADER).
        *([f"    http-request set-var(txn.for_key) req.fhdr({KEY_HEADER}) if {{ so_name {PLATFORM_KEY} }} "
           f"{{ req.fhdr({KEY_HEADER}) -m len gt 0 }}",
           f"    http-request set-var(txn.no_limits) bool(1) if {{ so_name {PLATFORM_KEY} }} "
           f"{{ req.fhdr({KEY_CHECKED_HEADER}) -m str 1 }}"] if internal_socket and auth_dir else []),
        f"    http-request del-header {KEY_CHECKED_HEADER}",
        f"    http-request del-header {KEY_HEADER}",
        f"    http-request del-header {KEY_MAC_HEADER}",
        f"    http-request del-header {FRONTEND_TOKEN_HEADER}",
        f"    http-request del-header {SHADOW_HEADER}",
        *(_auth_check_lines(auth_dir, grpc=False) if auth_dir else []),
        # Over the limit by its Content-Length, or, sent chunked, by what filled the buffer.
        "    http-request set-var(txn.body_size) req.body_size",
        *(rule for kserve in (True, False) for rule in _too_large(max_body_mb, kserve)),
        "    http-request set-var(txn.kserve) path,field(4,/) if { path_beg /v2/models/ }",
        # A model's inference, metadata, readiness and config only: its statistics and trace
        # settings are the operators', on the instance (which takes them with the stack's secret).
        _kserve_error(404, _KSERVE_ADMIN, f"{{ path_beg /v2/models/ }} !{{ path_reg {_KSERVE_ROUTES} }}"),
        # One version or none: a use_backend rule matches any of a header's values.
        _kserve_error(400, _VERSIONS_TWICE, "{ path_beg /v2/ } { req.hdr_cnt(x-model-version) gt 1 }"),
        _error(400, "invalid_header", _VERSIONS_TWICE, "{ req.hdr_cnt(x-model-version) gt 1 }", param=None),
        # A KServe path that names a version pins it as X-Model-Version does: each instance's
        # Triton serves its own version only (modelops.manifest.triton_version).
        f"    acl kserve_versioned path_reg {_KSERVE_VERSION_PATH}",
        "    http-request set-var(txn.path_version) path,field(6,/) if kserve_versioned",
        _kserve_error(400, f"the path names version {_PATH_VERSION} and X-Model-Version names {_VERSION}; "
                      "name one version, or leave one out",
                      "kserve_versioned { req.hdr(x-model-version) -m found } "
                      "!{ req.hdr(x-model-version),strcmp(txn.path_version) eq 0 }"),
        "    http-request set-header x-model-version %[var(txn.path_version)] if kserve_versioned "
        "!{ req.hdr(x-model-version) -m found }",
        "    http-request lua.modelops_model if { method POST } !{ path_reg ^/v2(/|$) }" +
        (" !batch_api" if batch_api else ""),
        (f"    http-request return status 200 content-type application/json lf-string "
         f"'%[var(txn.key_id),map({auth_dir / _MODELS_MAP})]' if {{ method GET }} {{ path /v1/models }}"
         if auth_dir else
         f"    http-request return status 200 content-type application/json string '{_models_list(routes)}' "
         "if { method GET } { path /v1/models }"),
        _error(405, "method_not_allowed", "use POST with a JSON body; GET is served for /v1/models, /metrics and "
               "/metrics/haproxy only",
               "!{ method POST } !{ path_reg ^/v2(/|$) }" + (" !batch_api" if batch_api else ""), param=None),
        _kserve_error(404, "this router serves KServe v2 per model: /v2/models/<model_id>/...; server-level "
                      "routes are answered by each instance", "{ path_reg ^/v2(/|$) } !{ var(txn.kserve) -m found }"),
        *(_auth_limit_lines(auth_dir, ("var(txn.kserve)", "var(txn.model)"), grpc=False, signed=instance_secret)
          if auth_dir else []),
    ]

    def serves(protocol: str, r: ModelRoute) -> bool:  # every instance of the model has that endpoint
        needs = "kserve_http" if protocol == "kserve_generate" else protocol
        return protocol == "openai" or all(getattr(s, needs) for ss in r.versions.values() for s in ss if not s.hold)

    def use(protocol: str, var: str, when: str = "") -> list[str]:
        prefixes, out = _PROTOCOLS[protocol], []
        for r in (r for r in routes if serves(protocol, r)):
            m = r.model_id
            for v in sorted(r.versions):
                out.append(f"    use_backend {prefixes[1]}{m}__{v} if {{ {var} -m str {m} }} "
                           f"{{ req.hdr(x-model-version) -m str {v} }}{when}")
            if protocol == "openai" and (arms := _experiment_arms(r)):
                out += arms
                continue
            out.append(f"    use_backend {prefixes[0]}{m} if {{ {var} -m str {m} }} "
                       f"!{{ req.hdr(x-model-version) -m found }}{when}")
        return out

    lines += [rule for r in routes if _experiment_arms(r) for rule in _experiment_key_rules(r)]
    lines += [_shadow_rule(r) for r in routes if r.shadow is not None]
    lines += ["    use_backend batch_api if batch_api"] if batch_api else []
    # A request that asks for the result cache, unpinned, for a model served here (else the 404).
    lines += [f"    use_backend batch_api if live_cache live_cache_path {{ var(txn.model) -m str {r.model_id} }} "
              "!{ req.hdr(x-model-version) -m found }" for r in routes] if batch_api else []
    lines += use("kserve_generate", "var(txn.kserve)", f" {{ path_reg {_GENERATE_PATH} }}")
    lines += use("kserve_http", "var(txn.kserve)") + use("openai", "var(txn.model)")
    lines += [
        "    default_backend no_route",
        "",
        *(["backend batch_api", "    option httpchk GET /health",
           *([f'    http-request set-header {INSTANCE_SECRET_HEADER} "${{{INSTANCE_SECRET_ENV}}}"'] if instance_secret
             else []),
           f"    server batch {batch_api} check inter 2s fall 2 rise 1", ""] if batch_api else []),
        *(["backend key_usage",  # per API key: requests in flight, admitted in the last minute
            "    stick-table type string len 63 size 100k expire 2m store conn_cur,gpc0,gpc0_rate(60s),gpt0", ""]
          if auth_dir else []),
        "backend no_route",
        _kserve_error(404, f"version {_VERSION} of model {_KSERVE_MODEL} is not served by this router",
                      "{ var(txn.kserve) -m found } { req.hdr(x-model-version) -m found }"),
        _kserve_error(404, f"model {_KSERVE_MODEL} is not served by this router", "{ var(txn.kserve) -m found }"),
        _error(400, "invalid_body", 'the request body has the \\"model\\" field more than once; send it once',
               "{ var(txn.model_problem) -m str duplicate }", param="model"),
        _error(400, "invalid_body", 'the \\"model\\" field of the request body must be a string (the model id)',
               "{ var(txn.model_problem) -m str type }", param="model"),
        _error(400, "invalid_body", 'the request body must be a JSON object with a string \\"model\\" field',
               "!{ var(txn.model) -m found }"),
        _error(404, "model_not_found", f"version {_VERSION} of model {_MODEL} is not served by this router",
               "{ req.hdr(x-model-version) -m found }"),
        _error(404, "model_not_found", f"model {_MODEL} is not served by this router"),
        "",
    ]

    if grpc_port is not None:
        # No request buffering here: a gRPC stream's request body stays open for the stream's life,
        # so a buffering proxy would never forward it (unary calls only lose the retry on 503).
        lines += ["frontend kserve_grpc", f"    bind 127.0.0.1:{grpc_port} proto h2", "    no option http-buffer-request",
                  "    http-request lua.modelops_start", "    http-response lua.modelops_observe",
                  f"    http-request del-header {KEY_HEADER}", f"    http-request del-header {KEY_MAC_HEADER}",
                  f"    http-request del-header {FRONTEND_TOKEN_HEADER}",
                  _grpc_error(3, _VERSIONS_TWICE, "{ req.hdr_cnt(x-model-version) gt 1 }"),
                  _grpc_error(12, _GRPC_ADMIN, f"!{{ path_reg {_GRPC_ROUTES} }}"),
                  *(_auth_check_lines(auth_dir, grpc=True) + _auth_limit_lines(
                      auth_dir, ("req.hdr(x-model-id)",), grpc=True, signed=instance_secret) if auth_dir else []),
                  *use("kserve_grpc", "req.hdr(x-model-id)"), "    default_backend grpc_no_route", "",
                  "backend grpc_no_route",
                  _grpc_error(5, "no model of that x-model-id (and x-model-version) is served by this router",
                              "{ req.hdr(x-model-id) -m found }"),
                  _grpc_error(3, "name the model in the x-model-id metadata of the call"), ""]

    def server_lines(protocol: str, servers, weight_of) -> list[str]:
        out = []
        for s in servers:
            if s.hold:  # the activator: no health check, it is there as long as the autoscaler runs
                out.append(f"    server {s.name} unix@{hold_socket} weight {weight_of(s)}")
                continue
            address = s.address if protocol in _AT_FRONTEND else getattr(s, protocol)
            # Readiness is the frontend's /ready whatever the protocol: it alone knows warm-up,
            # engine stalls and drain (Triton's own readiness knows none of them).
            check = "check inter 1s fall 2 rise 1" if protocol in _AT_FRONTEND else \
                f"check addr {s.address.rsplit(':', 1)[0]} port {s.address.rsplit(':', 1)[1]} inter 1s fall 2 rise 1"
            proto = " proto h2 check-proto h1" if protocol == "kserve_grpc" else ""
            out.append(f"    server {s.name} {address} weight {weight_of(s)}{proto} {check}")
        return out

    def at_zero(r: ModelRoute, protocol: str, versions: dict) -> list[str]:
        # gRPC has no hold (the activator speaks HTTP/1.1): a call that finds no server says why.
        if protocol != "kserve_grpc" or not any(s.hold for v in versions for s in r.versions[v]):
            return []
        zero = ", ".join(v for v in sorted(versions) if any(s.hold for s in r.versions[v]))
        return [_grpc_error(14, f"model {r.model_id} version {zero} is at zero instances (scaling.min 0) and gRPC "
                            "calls are not held: an HTTP request starts an instance; retry once it serves",
                            "{ nbsrv lt 1 }")]

    for protocol, (weighted, pinned) in _PROTOCOLS.items():
        if protocol == "kserve_grpc" and grpc_port is None:
            continue
        for r in (r for r in routes if serves(protocol, r)):  # else that protocol's requests get the 404
            versions = {v: tuple(s for s in ss if not s.hold) if protocol == "kserve_grpc" else ss
                        for v, ss in r.versions.items()}
            all_servers = [s for v in sorted(versions) for s in versions[v]]
            secret_header = INSTANCE_SECRET_GRPC_HEADER if protocol == "kserve_grpc" else INSTANCE_SECRET_HEADER
            options = ["    option httpchk GET /ready",
                       *(["    no option http-buffer-request"] if protocol == "kserve_grpc" else []),
                       *([f'    http-request set-header {secret_header} "${{{INSTANCE_SECRET_ENV}}}"']
                         if instance_secret else [])]
            weighted_balance = ["    balance roundrobin"] if len(r.versions) > 1 else \
                _balance(r.routing_of(next(iter(r.versions))), protocol, all_servers)
            # The OpenAI frontend names the version that answered; for KServe (Triton answers) the router does.
            answered = [] if protocol == "openai" else \
                [f"    http-response set-header X-Model-Version {v} if {{ srv_name -m str {s.name} }}"
                 for v in sorted(versions) for s in versions[v]]
            lines += [f"backend {weighted}{r.model_id}", *weighted_balance, *options, *answered,
                      *_hold_lines(all_servers), *at_zero(r, protocol, versions),
                      *server_lines(protocol, all_servers, lambda s: s.weight), ""]
            for v in sorted(versions):
                # A label is served as another Triton version number: its version path says that one.
                relabel = [f"    http-request set-path %[path,'regsub(\"^(/v2/models/[^/]+)/versions/[^/]+\","
                           f"\"\\1/versions/{triton_version(v)}\")']"] \
                    if protocol in ("kserve_http", "kserve_generate") and triton_version(v) != v else []
                lines += [f"backend {pinned}{r.model_id}__{v}", *_balance(r.routing_of(v), protocol, versions[v]), *options,
                          *relabel, *([f"    http-response set-header X-Model-Version {v}"] if answered else []),
                          *_hold_lines(versions[v]), *at_zero(r, protocol, {v: versions[v]}),
                          *server_lines(protocol, versions[v], lambda s: 100), ""]
    return "\n".join(lines) + "\n"


def _topology(cfg: str) -> str:
    return re.sub(r" weight \d+", "", cfg)


def _weighted_servers(cfg: str) -> list[tuple[str, str, int]]:
    """``(backend, server, weight)`` of every server of the weighted backends (``m_``, ``k_``,
    ``kg_``, ``g_``) in a rendered config: the runtime API then sets exactly what a reload would load
    (a backend without some server, as gRPC's without a hold server, is never asked about it)."""
    out, backend = [], None
    prefixes = tuple(weighted for weighted, _ in _PROTOCOLS.values())
    for line in cfg.splitlines():
        if line.startswith("backend "):
            name = line.split()[1]
            backend = name if name.startswith(prefixes) else None
        elif backend and (m := re.match(r"\s+server (\S+) \S+ weight (\d+)", line)):
            out.append((backend, m[1], int(m[2])))
    return out


def _connected(path: Path, timeout: float, retry_for: float) -> socket.socket:
    """A socket connected to the Unix socket ``path`` (I/O ``timeout`` in seconds), the connect
    retried for up to ``retry_for`` seconds while it is refused: HAProxy 2.6's master can refuse
    its CLI socket for a moment after start (seen in CI). Raises the last ``OSError`` after that."""
    deadline = time.monotonic() + retry_for
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(str(path))
            return s
        except (ConnectionRefusedError, FileNotFoundError):
            s.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class HAProxyRouter(Router):
    """HAProxy in master-worker mode with files under ``<home>/run``."""

    experiments = True

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        run = self.settings.run_dir
        self.cfg = run / "haproxy.cfg"
        # What the running worker loaded (written once a start or reload is confirmed): the
        # file above can be ahead of it when a control plane died between writing and reloading.
        self.loaded = run / "haproxy.cfg.loaded"
        self.pidfile = run / "haproxy.pid"
        self.master_socket = run / "haproxy-master.sock"
        self.stats_socket = run / "haproxy.sock"
        self.auth_dir = run / "auth"
        self.internal_socket = self.settings.router_internal_socket
        self.experiment_counts = run / "experiment-counts.json"
        self._registry: Registry | None = None  # the keys' registry, opened at the first render
        self.binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
        # Locally the instances take requests from this router only: it sends them the stack's
        # secret, which its config reads from its environment (modelops/tenancy.py).
        self._secured = self.settings.provider == "local"

    # -- process -----------------------------------------------------------------------------
    def is_running(self) -> bool:
        """Whether the HAProxy process of the pid file is alive."""
        return self.pid() is not None

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().split()[0])
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError, IndexError):
            return None

    def ensure_running(self, routes: list[ModelRoute]) -> None:
        if self.pid():
            return
        if not Path(self.binary).exists():
            raise TrafficError("haproxy is not installed: apt-get install haproxy (2.6+)")
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        cfg, maps = self._render(routes)
        self._write_maps(maps)
        self._write_checked(cfg)
        self.master_socket.unlink(missing_ok=True)
        # -dMglobal: freed buffers go to a pool shared by the threads instead of back to the
        # system (2.6 keeps none beyond a small per-thread cache), so a request does not map and
        # fault in fresh buffers of tune.bufsize: 8.3 → 2.8 ms to the response headers with
        # 8 MiB buffers, measured here.
        proc = subprocess.run([self.binary, "-W", "-D", "-dMglobal", "-S", str(self.master_socket), "-f", str(self.cfg),
                               "-p", str(self.pidfile)], capture_output=True, text=True, env=self._env())
        if proc.returncode != 0:
            raise TrafficError(f"haproxy failed to start: {proc.stderr.strip()[-1000:]}")
        self._wait_socket()
        self.loaded.write_text(cfg)
        log.info("haproxy started (pid %s) on 127.0.0.1:%d", self.pid(), self.settings.router_port)

    def stop(self) -> None:
        pid = self.pid()
        if pid:
            os.kill(pid, 15)
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        self.pidfile.unlink(missing_ok=True)

    # -- configuration -----------------------------------------------------------------------
    def _render(self, routes: list[ModelRoute]) -> tuple[str, dict[str, dict[str, str]]]:
        """The config for ``routes`` and the API-key maps (empty while keys are off: no key was
        ever made and ``router_auth`` is ``auto``)."""
        if self._registry is None:  # opened once: the router is asked again at every weight step
            self._registry = Registry(self.settings.registry)
        on = self.settings.router_auth == "on" or bool(self._registry.api_keys())
        cfg = render_config(routes, port=self.settings.router_port, stats_socket=self.stats_socket,
                            grpc_port=self.settings.router_grpc_port, max_body_mb=self.settings.router_max_body_mb,
                            hold_socket=self.settings.activator_socket, auth_dir=self.auth_dir if on else None,
                            internal_socket=self.internal_socket, instance_secret=self._secured,
                            batch_api=f"127.0.0.1:{self.settings.batch_port}")
        return cfg, render_auth_maps(routes, self._registry.grants()) if on else {}

    def _write_maps(self, maps: dict[str, dict[str, str]]) -> None:
        """The maps as files, which the config loads at each start and reload."""
        self.auth_dir.mkdir(parents=True, exist_ok=True)
        for name, entries in maps.items():
            tmp = self.auth_dir / f"{name}.new"
            tmp.write_text("".join(f"{k} {v}\n" for k, v in entries.items()))
            tmp.chmod(0o600)
            os.replace(tmp, self.auth_dir / name)

    def _load_maps(self, maps: dict[str, dict[str, str]]) -> None:
        """Replace each changed map in the running router at once, through the runtime API
        (``prepare map`` / ``add map @<version>`` / ``commit map``: requests see the old map or
        the new one whole, never half of it; none in flight is touched), then on disk."""
        for name, entries in maps.items():
            path = self.auth_dir / name
            if path.exists() and path.read_text() == "".join(f"{k} {v}\n" for k, v in entries.items()):
                continue
            prepared = self._command(f"prepare map {path}")
            version = re.search(r"New version created: (\d+)", prepared)
            if not version:
                raise TrafficError(f"haproxy refused 'prepare map {path}': {prepared.strip()}")
            for key, value in entries.items():
                self._checked(f"add map @{version[1]} {path} {key} {value}")
            self._checked(f"commit map @{version[1]} {path}")
        self._write_maps(maps)

    def _env(self) -> dict[str, str]:
        """HAProxy's environment: the instance secret its config reads, when it sends one; never
        the Prefect API's credentials."""
        env = without_prefect_auth(dict(os.environ))
        if not self._secured:
            return env
        secret = stack_secret(self.settings.instance_secret_file)
        return {**env, INSTANCE_SECRET_ENV: secret, INSTANCE_SECRET_B64_ENV: base64.b64encode(secret.encode()).decode()}

    def _write_checked(self, cfg: str) -> None:
        tmp = self.cfg.with_suffix(".new")
        tmp.write_text(cfg)
        check = subprocess.run([self.binary, "-c", "-q", "-f", str(tmp)], capture_output=True, text=True,
                               env=self._env())
        if check.returncode != 0:
            raise TrafficError(f"haproxy rejected the generated config ({tmp}): {check.stderr.strip()[-1000:]}")
        os.replace(tmp, self.cfg)

    def apply(self, routes: list[ModelRoute]) -> None:
        self.ensure_running(routes)
        new, maps = self._render(routes)
        # Compared with what the running worker has, not with the config file: a run killed
        # between writing the file and reloading left the file ahead of the worker.
        old = self.loaded.read_text() if self.loaded.exists() else ""
        if _topology(new) == _topology(old):
            self._load_maps(maps)  # keys created, revoked or rotated, or the models they list
            if new == old:
                return
            for backend, server, weight in _weighted_servers(new):
                self._command(f"set server {backend}/{server} weight {weight}")
            self._write_checked(new)  # so a later reload keeps these weights
            self.loaded.write_text(new)
            log.info("router weights set without reload")
            return
        self._write_maps(maps)
        self._write_checked(new)
        self._reload(routes)
        self.loaded.write_text(new)

    def _worker_pid(self) -> int | None:
        """The pid of the worker answering the stats socket (``show info``), None if none answers."""
        try:
            found = re.search(r"^Pid: (\d+)", self._command("show info"), re.M)
        except OSError:
            return None
        return int(found[1]) if found else None

    def _reload(self, routes: list[ModelRoute]) -> None:
        old_worker = self._worker_pid()
        self._carry_experiment_counts()
        with _connected(self.master_socket, timeout=10, retry_for=10) as s:
            s.sendall(b"reload\n")
            try:
                s.recv(4096)
            except TimeoutError:
                pass
        # Done when a new worker answers the stats socket with exactly the new servers and weights:
        # right after "reload" the old worker may still answer with the old ones (and a change of
        # keys alone leaves the servers as they were).
        want = {(r.model_id, s.name): s.weight for r in routes for servers in r.versions.values() for s in servers}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self._worker_pid() not in (None, old_worker) and self.weights() == want:
                    log.info("router reloaded: %d model route(s)", len(routes))
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TrafficError(f"haproxy reload did not bring up the new routes within 10 s (want {want})")

    # -- runtime API -------------------------------------------------------------------------
    def _wait_socket(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                self._command("show info")
                return
            except OSError:
                time.sleep(0.05)
        raise TrafficError(f"haproxy stats socket {self.stats_socket} did not come up")

    def _command(self, command: str) -> str:
        with _connected(self.stats_socket, timeout=5, retry_for=0.5) as s:
            s.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        out = b"".join(chunks).decode()
        if command.startswith("set ") and out.strip():
            raise TrafficError(f"haproxy refused {command!r}: {out.strip()}")
        return out

    def _checked(self, command: str) -> None:
        """Run a runtime-API command that answers nothing (or a blank line) when it succeeds."""
        out = self._command(command)
        if out.strip():
            raise TrafficError(f"haproxy refused {command.split(' ', 3)[:3]}: {out.strip()}")

    def _server_stat(self, column: str, backend) -> dict[str, int]:
        """``column`` of ``show stat`` summed per server over the backends ``backend(name)`` accepts."""
        lines = self._command("show stat").splitlines()
        if not lines or not lines[0].startswith("# "):
            return {}
        header = lines[0][2:].split(",")
        px, sv, col = header.index("pxname"), header.index("svname"), header.index(column)
        out: dict[str, int] = {}
        for line in lines[1:]:
            parts = line.split(",")
            if len(parts) > col and backend(parts[px]) and parts[sv] not in ("FRONTEND", "BACKEND"):
                out[parts[sv]] = out.get(parts[sv], 0) + int(parts[col] or 0)
        return out

    def server_errors(self, model_id: str) -> dict[str, int]:
        """HTTP 5xx answered per server of the model's weighted OpenAI and KServe HTTP backends
        so far (``hrsp_5xx``; a gRPC error is an HTTP 200 with its grpc-status, not counted)."""
        return self._server_stat("hrsp_5xx", lambda px: px in (f"m_{model_id}", f"k_{model_id}", f"kg_{model_id}"))

    def server_requests(self, model_id: str) -> dict[str, int]:
        """Requests (sessions, ``stot``) each server of the model took so far over every
        protocol, default and version-pinned backends together; counters restart with a reload."""
        return self._server_stat("stot", lambda px: any(
            px == f"{weighted}{model_id}" or px.startswith(f"{pinned}{model_id}__") for weighted, pinned in
            _PROTOCOLS.values()))

    def instance_traffic(self) -> dict[str, dict]:
        """Per instance, from the router's ``GET /metrics`` (``haproxy_router.lua``); empty when
        HAProxy is not running. See :meth:`Router.instance_traffic`."""
        from tasks.traffic.gates import histogram_quantile, parse_prometheus

        if not self.pid():
            return {}
        try:
            text = httpx.get(f"http://127.0.0.1:{self.settings.router_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        metrics = parse_prometheus(text)
        out: dict[str, dict] = {}

        def entry(name: str) -> dict:
            return out.setdefault(name, {"requests": 0, "errors_5xx": 0, "retries": 0, "redispatches": 0,
                                         "buckets": defaultdict(float)})

        for labels, value in metrics.get("modelops_router_requests_total", []):
            e = entry(labels["instance"])
            e["requests"] += int(value)
            e["errors_5xx"] += int(value) if labels.get("code", "").startswith("5") else 0
        for counter in ("retries", "redispatches"):
            for labels, value in metrics.get(f"modelops_router_{counter}_total", []):
                entry(labels["instance"])[counter] += int(value)
        for labels, value in metrics.get("modelops_router_ttfb_seconds_bucket", []):
            entry(labels["instance"])["buckets"][float(labels["le"])] += value
        for e in out.values():
            buckets = e.pop("buckets")
            for q, key in ((0.5, "ttfb_p50_s"), (0.99, "ttfb_p99_s")):
                bound = histogram_quantile(q, buckets)
                e[key] = None if bound is None or math.isinf(bound) else bound  # JSON has no Infinity
        return out

    def _carry_experiment_counts(self) -> None:
        """A reload ends the worker whose Lua counts each running experiment's requests; its
        counts go to :attr:`experiment_counts` first, under the experiment's id, so an
        experiment's figures count from its start whatever reloads come between."""
        running = {e.model_id: str(e.id) for e in (self._registry or Registry(self.settings.registry)).experiments()}
        if not running:
            return
        try:
            text = httpx.get(f"http://127.0.0.1:{self.settings.router_port}/metrics", timeout=2).text
        except httpx.HTTPError as e:
            log.warning("experiment counts before the reload could not be read (they start again): %s", e)
            return
        import fcntl

        with open(self.experiment_counts.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            carried = json.loads(self.experiment_counts.read_text()) if self.experiment_counts.exists() else {}
            carried = {eid: v for eid, v in carried.items() if eid in running.values()}  # ended ones go
            for labels, value in parse_prometheus(text).get(_EXPERIMENT_COUNTER, []):
                if (eid := running.get(labels.get("model", ""))) is not None:
                    key = f"{labels['model']}|{labels.get('version', '')}|{labels.get('assigned', '')}"
                    carried.setdefault(eid, {})[key] = carried.get(eid, {}).get(key, 0) + value
            self.experiment_counts.write_text(json.dumps(carried))

    def experiment_metrics(self) -> str:
        """The Lua's live counts (``GET /metrics``) plus what earlier workers counted for the
        running experiments before each reload (:meth:`_carry_experiment_counts`): a series may
        stand twice, its values add up. Empty when the router does not answer."""
        try:
            live = httpx.get(f"http://127.0.0.1:{self.settings.router_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return ""
        lines = [line for line in live.splitlines() if line.startswith(_EXPERIMENT_COUNTER)]
        if self.experiment_counts.exists():
            running = {str(e.id) for e in (self._registry or Registry(self.settings.registry)).experiments()}
            for eid, counts in json.loads(self.experiment_counts.read_text()).items():
                for key, value in counts.items() if eid in running else ():
                    model, version, assigned = key.split("|")
                    lines.append(f'{_EXPERIMENT_COUNTER}{{model="{model}",version="{version}",'
                                 f'assigned="{assigned}"}} {value}')
        return "\n".join(lines) + ("\n" if lines else "")

    def key_headers(self, key_name: str) -> dict[str, str]:
        """``{x-modelops-key: key_name}``, which the router honours on its internal socket only
        (:func:`render_config`)."""
        return {KEY_HEADER: key_name}

    def platform_transport(self) -> httpx.HTTPTransport:
        """The router's internal Unix socket (:func:`render_config`'s ``internal_socket``): the
        platform's requests need no API key there."""
        return httpx.HTTPTransport(uds=str(self.internal_socket))

    def weights(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for line in self._command("show servers state").splitlines():
            parts = line.split()
            if len(parts) > 8 and parts[1].startswith("m_") and parts[0].isdigit():
                out[(parts[1][2:], parts[3])] = int(parts[7])
        return out
