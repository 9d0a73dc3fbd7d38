"""Usage per API key across the instances, and the tpm limits that follow from it.

Each instance counts the requests and tokens it answered per key (``modelops_key_*_total`` on
its ``/metrics``: runtime/frontend/usage.py). :class:`UsageMeter` reads every live instance's
counters, adds what grew since its last read to the registry (10 s buckets: ``modelops keys
usage``), and throttles a key whose tokens over the last minute reached its ``tpm``: the router
then answers it 429 with ``Retry-After`` until enough of that minute has passed
(``throttled_until`` in the router's tpm map: tasks/traffic/haproxy.py). The autoscaler daemon
runs it every tick while any key exists.

What this cannot see: tokens of requests still running (they count when answered), and what an
instance answered after the last read before it stopped (at most one interval's worth).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC

import httpx

from modelops.registry import USAGE_BUCKET_S, Registry
from tasks.traffic.gates import parse_prometheus
from tasks.traffic.interface import Router, commit_routes

__all__ = ["TPM_WINDOW_S", "UsageMeter", "read_key_counters"]

log = logging.getLogger(__name__)

TPM_WINDOW_S = 60
_COUNTERS = ("modelops_key_requests_total", "modelops_key_prompt_tokens_total", "modelops_key_completion_tokens_total")
# Instances whose requests are counted: serving ones and those finishing their last requests.
_READ_STATES = ("running", "restarting", "draining")


def read_key_counters(text: str) -> dict[tuple[str, str], tuple[int, int, int]]:
    """``{(key, model_id): (requests, prompt tokens, completion tokens)}`` from one instance's
    Prometheus text."""
    metrics = parse_prometheus(text)
    out: dict[tuple[str, str], list[int]] = {}
    for i, name in enumerate(_COUNTERS):
        for labels, value in metrics.get(name, []):
            out.setdefault((labels.get("key", ""), labels.get("model_name", "")), [0, 0, 0])[i] += int(value)
    return {k: tuple(v) for k, v in out.items()}


class UsageMeter:
    """See the module docstring.

    Args:
        registry, router: where usage and throttles go, and the router that enforces them.
        client: the HTTP client for ``/metrics`` reads; clock: Unix seconds.
    """

    def __init__(self, registry: Registry, router: Router, client: httpx.Client,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry, self.router, self.client, self.clock = registry, router, client, clock
        self.started = clock()
        self._last: dict[str, dict[tuple[str, str], tuple[int, int, int]]] = {}

    def tick(self) -> dict[str, float]:
        """One read of every live instance, then the throttles; returns ``{key: throttled until}``
        of the keys with a tpm limit (0: not throttled). Nothing while no key exists."""
        if not self.registry.api_keys():
            return {}
        now = self.clock()
        grown: dict[tuple[str, str], list[int]] = {}
        seen = set()
        for inst in self.registry.instances():
            url = inst.endpoints.get("metrics")
            if inst.state not in _READ_STATES or not url:
                continue
            try:
                r = self.client.get(url, timeout=2.0)
                if r.status_code != 200:
                    continue
            except httpx.HTTPError:
                continue
            seen.add(inst.name)
            counters = read_key_counters(r.text)
            # An instance first read now: what it counted before is new if it started after this
            # meter (else it was read by an earlier meter, before a daemon restart: its baseline).
            before = self._last.get(inst.name)
            created = inst.created_at if inst.created_at.tzinfo else inst.created_at.replace(tzinfo=UTC)
            if before is None and created.timestamp() < self.started:
                before = counters
            for k, now_counts in counters.items():
                was = (before or {}).get(k, (0, 0, 0))
                # A counter that went down: the instance restarted (same name) and counts afresh.
                delta = now_counts if any(n < w for n, w in zip(now_counts, was)) else \
                    tuple(n - w for n, w in zip(now_counts, was))
                if any(delta):
                    acc = grown.setdefault(k, [0, 0, 0])
                    for i, d in enumerate(delta):
                        acc[i] += d
            self._last[inst.name] = counters
        for gone in set(self._last) - seen:
            del self._last[gone]
        if grown:
            self.registry.add_usage({k: tuple(v) for k, v in grown.items()}, at=now)
        return self._throttle(now)

    def _throttle(self, now: float) -> dict[str, float]:
        """Throttle each key at its tpm over the last :data:`TPM_WINDOW_S` until the oldest of
        its buckets that put it there leave the window; lift the others."""
        until: dict[str, float] = {}
        for grant in self.registry.grants():
            if not grant.tpm:
                continue
            buckets = self.registry.token_buckets(grant.name, now - TPM_WINDOW_S)
            left, until[grant.name] = sum(t for _, t in buckets), 0.0
            for bucket, tokens in buckets:
                if left < grant.tpm:
                    break
                left -= tokens
                until[grant.name] = bucket + USAGE_BUCKET_S + TPM_WINDOW_S
        if until and self.registry.set_throttled(until):
            for name, t in until.items():
                if t:
                    log.info("key %s is over its tpm: refused until %s", name, time.strftime("%H:%M:%S",
                                                                                         time.localtime(t)))
            if self.router.is_running():
                commit_routes(self.registry, self.router)
        return until
