"""The autoscaler's signals, read from each instance's merged ``/metrics`` (vLLM's own names).

Facts: vLLM's Prometheus metrics ``vllm:num_requests_waiting``, ``vllm:num_requests_running``
(gauges), ``vllm:request_success`` (counter, exposed as ``_total``), ``vllm:kv_cache_usage_perc``
(gauge, 0..1) and ``vllm:time_to_first_token_seconds`` (histogram), labelled ``model_name`` and
``engine`` (vllm/v1/metrics/loggers.py); the runtime serves them with Triton's on the frontend's
``/metrics`` (runtime/frontend/metrics.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import httpx

from tasks.traffic.gates import histogram_quantile, parse_prometheus

__all__ = ["InstanceSample", "TtftWindow", "read_instance"]

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
FINISHED = "vllm:request_success_total"
KV_CACHE = "vllm:kv_cache_usage_perc"
TTFT = "vllm:time_to_first_token_seconds_bucket"


@dataclass(frozen=True)
class InstanceSample:
    """One read of one instance: ``waiting`` requests, ``kv_cache`` fraction in use (0..1),
    the TTFT histogram ``ttft`` as ``{upper bound s: cumulative count}``, ``running`` requests
    and ``finished``, the requests it finished so far (a counter)."""

    waiting: float
    kv_cache: float
    ttft: dict[float, float] = field(default_factory=dict)
    running: float = 0.0
    finished: float = 0.0


def read_instance(metrics_url: str, client: httpx.Client, timeout: float = 2.0) -> InstanceSample | None:
    """Read one instance's signals; None when its ``/metrics`` does not answer 200 or lacks
    vLLM's gauges (an engine still loading, a dead process): missing data, never zeros."""
    try:
        r = client.get(metrics_url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    metrics = parse_prometheus(r.text)
    if WAITING not in metrics or KV_CACHE not in metrics:
        return None
    ttft: dict[float, float] = {}
    for labels, value in metrics.get(TTFT, []):
        le = float(labels.get("le", "inf"))
        ttft[le] = ttft.get(le, 0.0) + value
    return InstanceSample(waiting=sum(v for _, v in metrics[WAITING]),
                          kv_cache=max(v for _, v in metrics[KV_CACHE]), ttft=ttft,
                          running=sum(v for _, v in metrics.get(RUNNING, [])),
                          finished=sum(v for _, v in metrics.get(FINISHED, [])))


class TtftWindow:
    """TTFT p90 of one version over the last ``window_s`` seconds, from each instance's
    cumulative histogram: the counts added since the oldest read within the window, summed over
    the instances. A counter that fell (the instance restarted) counts from zero.

    Args:
        window_s: seconds of requests measured.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._reads: dict[str, deque[tuple[float, dict[float, float]]]] = {}

    def add(self, t: float, samples: dict[str, InstanceSample]) -> None:
        """Record each instance's histogram read at ``t``; instances not in ``samples`` are forgotten."""
        for name in set(self._reads) - set(samples):
            del self._reads[name]
        for name, s in samples.items():
            reads = self._reads.setdefault(name, deque())
            reads.append((t, s.ttft))
            while len(reads) > 1 and reads[1][0] <= t - self.window_s:
                reads.popleft()

    def p90(self) -> float:
        """Seconds (the upper bound of the bucket holding the 90th percentile, or the largest
        finite bound when it lies past them); 0.0 when no request arrived in the window."""
        added: dict[float, float] = {}
        for reads in self._reads.values():
            (_, first), (_, last) = reads[0], reads[-1]
            restarted = any(last.get(le, 0.0) < c for le, c in first.items())
            for le, c in last.items():
                added[le] = added.get(le, 0.0) + c - (0.0 if restarted else first.get(le, 0.0))
        q = histogram_quantile(0.9, added)
        if q is None:
            return 0.0
        return max((le for le in added if not math.isinf(le)), default=0.0) if math.isinf(q) else q
