"""Tenants: API keys with per-model scopes and limits, checked by the router on every request.

A key is ``mo-`` followed by 43 URL-safe characters (256 random bits, :func:`secrets.token_urlsafe`).
Only its SHA-256 (hex) is stored: the registry, the router's maps and the logs never hold a key,
and ``modelops keys create`` shows it once. The router looks a request's key up by that hash
(HAProxy ``sha2(256)`` + ``map``), so no key is compared byte by byte at all: timing can at most
tell which hashes exist, and a SHA-256 preimage is what it would take to use one.

Limits per key, enforced at the router: ``rpm`` (requests admitted in a sliding minute),
``max_concurrency`` (requests in flight), ``tpm`` (prompt + completion tokens the instances
counted for the key in the last minute: tasks/autoscale/usage.py); each answers 429 with
``Retry-After`` when reached.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from modelops.manifest import MODEL_ID_PATTERN

__all__ = ["ALL_MODELS", "CONCURRENCY_LIMIT_CODE", "INSTANCE_SECRET_B64_ENV", "INSTANCE_SECRET_ENV",
           "INSTANCE_SECRET_GRPC_HEADER", "INSTANCE_SECRET_HEADER", "KEY_CHECKED_HEADER", "KEY_HEADER",
           "KEY_LIMIT_CODES", "KEY_MAC_HEADER", "KEY_NAME_PATTERN", "KEY_PREFIX", "MAX_LIMIT", "RATE_LIMIT_CODE",
           "TOKEN_LIMIT_CODE", "PLATFORM_KEY", "PREFECT_AUTH_VARS", "KeyGrant", "check_grant", "key_hash",
           "key_mac", "new_key", "stack_secret", "without_prefect_auth"]

KEY_PREFIX = "mo-"
KEY_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
ALL_MODELS = "*"  # a scope over every model, those announced later included
MAX_LIMIT = 2**31 - 1  # the largest limit the router compares (a 32-bit signed integer)
# The header in which the router names the caller's key to an instance (a client's own is dropped
# first); Triton forwards it to the engine as a request parameter of the same name
# (tritonserver --http-header-forward-pattern / --grpc-header-forward-pattern).
KEY_HEADER = "x-modelops-key"
# Beside it, from the router of a stack with an instance secret: HMAC-SHA256 of the key's name under
# the secret (:func:`key_mac`), so the engine, which also sees what a client put in its KServe
# ``parameters`` under the same names, trusts only a name the router vouched for.
KEY_MAC_HEADER = "x-modelops-key-mac"
# The name the router gives the platform's own requests (route checks over its internal socket).
PLATFORM_KEY = "modelops"
# Over that socket only (mode 600: the platform's user alone opens it), KEY_HEADER names the key a
# request is made for (a batch's lines: tasks/batch/run.py): the router applies that key's scope and
# limits and the instance counts its usage for it. With this header set to "1" beside it the key's
# limits were already applied where the request came in (a live request the result cache missed:
# tasks/batch/api.py), so only its scope and usage apply. On every other listener both are dropped.
KEY_CHECKED_HEADER = "x-modelops-key-checked"
# The router's 429 codes (OpenAI's error shape) for a key's own limits: max_concurrency, tpm, rpm
# (tasks/traffic/haproxy.py). A batch waits these out instead of spending a try (tasks/batch/run.py).
CONCURRENCY_LIMIT_CODE = "concurrency_limit_exceeded"
TOKEN_LIMIT_CODE = "token_limit_exceeded"
RATE_LIMIT_CODE = "rate_limit_exceeded"
KEY_LIMIT_CODES = (CONCURRENCY_LIMIT_CODE, TOKEN_LIMIT_CODE, RATE_LIMIT_CODE)


# No open doors: a local stack's instances take requests only with this header, set to the stack's
# secret (:func:`stack_secret`); the router adds it to every request it sends to an instance,
# and the platform's own health checks send it. The instance's frontend checks it on its OpenAI
# routes, and Triton on its KServe HTTP and gRPC APIs (--http-restricted-api,
# --grpc-restricted-protocol: Triton 2.51's tritonserver --help). Probes (live, ready, metrics)
# stay open.
INSTANCE_SECRET_HEADER = "x-modelops-instance-secret"
# Triton's gRPC restriction reads the metadata key with this prefix (its error says "expecting
# header 'triton-grpc-protocol-<key>'"; tritonserver 2.51, verified here).
INSTANCE_SECRET_GRPC_HEADER = "triton-grpc-protocol-" + INSTANCE_SECRET_HEADER
INSTANCE_SECRET_ENV = "MODELOPS_INSTANCE_SECRET"
# The same secret base64-encoded, as HAProxy's hmac converter takes its key (HAProxy 2.6 docs, hmac).
INSTANCE_SECRET_B64_ENV = "MODELOPS_INSTANCE_SECRET_B64"


def key_mac(secret: str, key: str) -> str:
    """:data:`KEY_MAC_HEADER`'s value for ``key``: HMAC-SHA256 of the key's name under the
    instance secret, 64 lowercase hex digits (what the router's ``hmac(sha256,...),hex,lower``
    gives: tasks/traffic/haproxy.py)."""
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def stack_secret(path: Path, prefix: str = "") -> str:
    """One of the local stack's secrets (the instance secret, the Prefect API's auth string) in
    ``path`` (mode 600), made on first use: ``prefix`` + 43 URL-safe characters. Safe when several processes ask at once: each writes its own file and the first
    to link it in place wins, so no one reads a file half written."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(prefix + secrets.token_urlsafe(32))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


# The Prefect API's credentials (modelops_cli/local_stack.py: prefect_env). Processes that need no
# Prefect (serving instances, and so any model.py or plugin they load; HAProxy; moto) never get them.
PREFECT_AUTH_VARS = ("PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_KEY")


def without_prefect_auth(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the Prefect API's credentials (:data:`PREFECT_AUTH_VARS`)."""
    return {k: v for k, v in env.items() if k not in PREFECT_AUTH_VARS}


def new_key() -> str:
    """A fresh API key: ``mo-`` + 43 URL-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    """The SHA-256 of ``key``'s UTF-8 bytes, 64 lowercase hex digits: what is stored and what the
    router looks up (HAProxy's ``req.fhdr(authorization),word(2,' '),sha2(256),hex,lower``)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class KeyGrant:
    """What one active key may do: ``name`` (the tenant's label, in metrics and logs),
    ``models`` (model ids, or :data:`ALL_MODELS`), ``rpm`` (requests per minute),
    ``max_concurrency`` (requests in flight), ``tpm`` (tokens per minute); a limit of None is no
    limit. ``hash`` is the key's :func:`key_hash`. ``throttled_until`` (Unix seconds; 0: not
    throttled) is when a key over its tpm may call again."""

    name: str
    hash: str
    models: tuple[str, ...]
    rpm: int | None = None
    max_concurrency: int | None = None
    tpm: int | None = None
    throttled_until: float = 0.0

    def allows(self, model_id: str) -> bool:
        """Whether the key's scope covers ``model_id``."""
        return ALL_MODELS in self.models or model_id in self.models


def check_grant(name: str, models: list[str], rpm: int | None = None, max_concurrency: int | None = None,
                tpm: int | None = None) -> tuple[str, ...]:
    """Validate what ``keys create`` was given, before anything is written; returns the models
    deduplicated in order.

    Raises:
        ValueError: naming the field and the fix: a name that is not a DNS label (it is a
            Prometheus label and a router map key), no model, a model id that cannot exist
            (``*`` means every model and stands alone), a limit under 1.
    """
    if not re.match(KEY_NAME_PATTERN, name or ""):
        raise ValueError(f"--name {name!r}: use 1-63 lowercase letters, digits and '-', starting and ending with a "
                         "letter or digit (e.g. team-a)")
    if name == PLATFORM_KEY:
        raise ValueError(f"--name {name!r} is reserved for the platform's own requests; pick another name")
    if len(models) > 1 and any(not m.strip() for m in models):
        raise ValueError(f"--models {','.join(models)!r}: an entry is empty; give model ids separated by single commas")
    models = [m.strip() for m in models if m.strip()]
    if not models:
        raise ValueError(f"--models: name the models the key may call, comma-separated (e.g. smollm2-135m-instruct), "
                         f"or {ALL_MODELS!r} for every model")
    if ALL_MODELS in models and len(models) > 1:
        raise ValueError(f"--models: {ALL_MODELS!r} already means every model; give it alone")
    bad = [m for m in models if m != ALL_MODELS and not re.match(MODEL_ID_PATTERN, m)]
    if bad:
        raise ValueError(f"--models: {', '.join(map(repr, bad))} is not a model id (1 to 63 lowercase letters, "
                         "digits and '-', starting and ending with a letter or digit)")
    for field, value in (("--rpm", rpm), ("--max-concurrency", max_concurrency), ("--tpm", tpm)):
        if value is not None and not 1 <= value <= MAX_LIMIT:
            raise ValueError(f"{field} {value}: give 1 to {MAX_LIMIT}, or leave it out for no limit")
    return tuple(dict.fromkeys(models))
