"""The API key a KServe request counts for, read inside a Triton Python-backend model (our vllm
backend, the XGBoost and python-backend templates, and a user's own ``model.py``).

The router names the caller's key and signs it (:data:`modelops.tenancy.KEY_HEADER`, its HMAC in
:data:`modelops.tenancy.KEY_MAC_HEADER`), and Triton forwards both headers to the model as
request parameters (runtime/startup.py). :func:`request_parameters` takes them out of the
request's parameters and trusts the name only when its HMAC checks out; :class:`KeyCounters`
counts the answers and tokens per key in the instance's Prometheus multiprocess folder, where
the OpenAI frontend folds them into its ``modelops_key_*_total`` families
(runtime/frontend/metrics.py). Both run in the model's process, never in the frontend's.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from collections.abc import Callable

from modelops.io_contract import ENGINE_KEY_USAGE
from modelops.tenancy import INSTANCE_SECRET_ENV, KEY_HEADER, KEY_MAC_HEADER, KEY_NAME_PATTERN, key_mac

__all__ = ["KeyCounters", "parameter_pairs", "request_parameters"]

_KEY_NAMES = (KEY_HEADER, KEY_MAC_HEADER)


class _Pairs(list):
    """A JSON object's (name, value) pairs in order, a name given twice included."""


def parameter_pairs(request) -> list[tuple[str, object]]:
    """The request's parameters as Triton hands them over (a JSON object), as (name, value)
    pairs in order, a name given twice included.

    Raises:
        ValueError: not a JSON object.
    """
    read = getattr(request, "parameters", None)
    pairs = json.loads(read() or "{}", object_pairs_hook=_Pairs) if read is not None else _Pairs()
    if not isinstance(pairs, _Pairs):  # e.g. a JSON array
        raise ValueError("parameters must be an object of names and values")
    return pairs


def request_parameters(request) -> tuple[dict, str | None]:
    """The request's ``parameters`` (KServe generate's ``parameters`` object, an ``/infer`` body's
    or a gRPC request's ``parameters`` map) and the API key the router vouched for, apart.

    Triton's parameters extension hands a model every parameter but its reserved names
    (``sequence_id``, ``priority``, ``timeout``, ``sequence_*``, ``headers``, ``triton_*``), as a
    JSON object of int, bool or string values (Triton's docs/protocol/extension_parameters.md).
    runtime/startup.py has it forward the router's key and HMAC headers too, added after the
    body's own parameters, on ``/infer`` and gRPC calls; ``/generate`` forwards no header (both
    verified with tritonserver 2.51). A client can therefore put those names among its
    parameters: the key counts only when its HMAC under the instance secret
    (``MODELOPS_INSTANCE_SECRET``) checks out (:func:`modelops.tenancy.key_mac`).

    Returns:
        (the other parameters by name, the key's name or None: no secret, or none sent).

    Raises:
        ValueError: not an object; or, on an instance with a secret, one of those names sent by
            the client (given twice, or a key without the router's HMAC): it would charge
            another key's usage. The message names ``parameters.<name>``.
    """
    pairs = parameter_pairs(request)
    sent = {name: [v for k, v in pairs if k.lower() == name] for name in _KEY_NAMES}
    parameters = {k: v for k, v in pairs if k.lower() not in _KEY_NAMES}
    secret = os.environ.get(INSTANCE_SECRET_ENV, "")
    if not secret or not any(sent.values()):
        return parameters, None  # without a secret nothing can be vouched for: nothing is counted
    (key, *more), (mac, *macs) = sent[KEY_HEADER] or [None], sent[KEY_MAC_HEADER] or [None]
    if more or macs or not isinstance(key, str) or not isinstance(mac, str) or \
            not hmac.compare_digest(mac.lower(), key_mac(secret, key)):
        # The one the client sent: given twice, else the key (a mac alone, or a key without the router's).
        named = KEY_MAC_HEADER if macs or not sent[KEY_HEADER] else KEY_HEADER
        raise ValueError(f"parameters.{named}: the router sets it from the request's API key; leave it out")
    return parameters, key if re.match(KEY_NAME_PATTERN, key) else None


class KeyCounters:
    """Per-key counters of a model's answers (:data:`modelops.io_contract.ENGINE_KEY_USAGE`:
    requests, prompt tokens, completion tokens), made on first use in the process's
    prometheus_client registry (multiprocess mode under Triton: the instance's
    PROMETHEUS_MULTIPROC_DIR).

    Args:
        warn: called with a message when a count fails (a metric never fails an answer), e.g.
            ``pb_utils.Logger.log_warn``.
    """

    def __init__(self, warn: Callable[[str], None] = print) -> None:
        self._warn, self._counters = warn, None

    def count(self, key: str | None, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count one answer for ``key`` with its tokens; nothing for None (no vouched key)."""
        if not key:
            return
        try:
            if self._counters is None:
                from prometheus_client import Counter

                self._counters = [Counter(name, "Answers of the engine for each API key", ["key"])
                                  for name in ENGINE_KEY_USAGE]
            for counter, n in zip(self._counters, (1, prompt_tokens, completion_tokens)):
                counter.labels(key).inc(n)
        except Exception as e:  # noqa: BLE001 - a metric must never fail an answer
            self._warn(f"cannot count usage of API key {key}: {e}")
