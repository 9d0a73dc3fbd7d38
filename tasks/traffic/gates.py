"""Metric gates between red-black steps.

A gate watches a window of traffic and compares the new version with the old one:

- error ratio of the new version: Triton's ``nv_inference_request_failure`` plus the requests
  the frontend refused with a dead or stalled engine (``modelops_requests_refused_total{code=
  "engine_unavailable"}``; the router retried them elsewhere, so clients never saw them) over
  those plus ``nv_inference_request_success`` (counter deltas over the window, from each
  instance's merged ``/metrics``), plus HTTP 5xx answered at the router for the new version's servers (HAProxy's
  ``hrsp_5xx`` per server, ``show stat``);
- p99 latency of the new version against the old one's: from the delta of vLLM's
  ``vllm:e2e_request_latency_seconds`` histogram (the bucket bound where 99% of the window's
  requests fall);
- for generative models, what streaming clients feel: time to first token p90
  (``vllm:time_to_first_token_seconds``) and inter-token latency p90
  (``vllm:inter_token_latency_seconds``) of the new version against the old one's in the same
  window, interpolated within buckets as Prometheus' ``histogram_quantile`` does (a slower
  canary shows there long before its whole-request latency moves);
- liveness: an instance that stops answering its ``/metrics`` fails the gate at once.

Thresholds come from settings (``gate_max_error_ratio``, ``gate_max_p99_ratio``,
``gate_max_ttft_p90_ratio``, ``gate_max_itl_p90_ratio``, ``gate_min_requests``). What a window with too few requests to the new version leads to
(``gate_require_requests``, ``gate_no_traffic``: probe, wait, fail or pass) is the rollout's
decision (tasks/traffic/rollout.py); the verdict's ``judged`` records it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from modelops.histograms import histogram_quantile, interpolated_quantile, parse_prometheus

__all__ = ["GateResult", "Snapshot", "evaluate", "histogram_quantile", "interpolated_quantile", "parse_prometheus",
           "snapshot"]

# vLLM's histograms a gate reads, by the Snapshot field that holds each (vLLM 0.32's v1 metrics).
_HISTOGRAMS = {"latency_buckets": "vllm:e2e_request_latency_seconds_bucket",
               "ttft_buckets": "vllm:time_to_first_token_seconds_bucket",
               "itl_buckets": "vllm:inter_token_latency_seconds_bucket"}

@dataclass
class Snapshot:
    """Counters of one instance (or a sum of instances) at one moment: Triton successes/failures,
    vLLM's e2e latency, time-to-first-token and inter-token-latency histograms, each as
    ``{upper bound (s): cumulative count}``, and vLLM's prompt and generated token counts."""

    success: float = 0.0
    failure: float = 0.0
    latency_buckets: dict[float, float] = field(default_factory=dict)
    ttft_buckets: dict[float, float] = field(default_factory=dict)
    itl_buckets: dict[float, float] = field(default_factory=dict)
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0

    def __sub__(self, other: "Snapshot") -> "Snapshot":
        # Clamped at 0: a restarted instance resets its counters, which is not negative traffic.
        def minus(mine: dict[float, float], theirs: dict[float, float]) -> dict[float, float]:
            return {le: max(0.0, c - theirs.get(le, 0.0)) for le, c in mine.items()}

        return Snapshot(**{f: max(0.0, getattr(self, f) - getattr(other, f)) for f in _COUNTS},
                        **{f: minus(getattr(self, f), getattr(other, f)) for f in _HISTOGRAMS})

    def __add__(self, other: "Snapshot") -> "Snapshot":
        def plus(mine: dict[float, float], theirs: dict[float, float]) -> dict[float, float]:
            return {le: mine.get(le, 0.0) + theirs.get(le, 0.0) for le in mine.keys() | theirs.keys()}

        return Snapshot(**{f: getattr(self, f) + getattr(other, f) for f in _COUNTS},
                        **{f: plus(getattr(self, f), getattr(other, f)) for f in _HISTOGRAMS})

    def to_json(self) -> dict:
        """JSON-able form (bucket bounds as strings: JSON keys are); :meth:`from_json` reads it."""
        return {**{f: getattr(self, f) for f in _COUNTS},
                **{f: {str(le): c for le, c in getattr(self, f).items()} for f in _HISTOGRAMS}}

    @classmethod
    def from_json(cls, doc: dict) -> "Snapshot":
        """The snapshot :meth:`to_json` wrote (fields it lacks are 0 or empty)."""
        return cls(**{f: float(doc.get(f, 0.0)) for f in _COUNTS},
                   **{f: {float(le): c for le, c in (doc.get(f) or {}).items()} for f in _HISTOGRAMS})


_COUNTS = ("success", "failure", "prompt_tokens", "generation_tokens")


def snapshot(metrics_url: str, client: httpx.Client) -> Snapshot:
    """Read one instance's merged ``/metrics``.

    Raises:
        httpx.HTTPError: the instance did not answer (the caller fails the gate).
    """
    r = client.get(metrics_url, timeout=5)
    r.raise_for_status()
    m = parse_prometheus(r.text)
    histograms: dict[str, dict[float, float]] = {}
    for name, metric in _HISTOGRAMS.items():
        buckets: dict[float, float] = defaultdict(float)
        for labels, value in m.get(metric, []):
            buckets[float(labels["le"])] += value
        histograms[name] = dict(buckets)
    # Requests the frontend refused because its engine was dead or stalled never reached Triton.
    refused = sum(v for labels, v in m.get("modelops_requests_refused_total", [])
                  if labels.get("code") == "engine_unavailable")
    return Snapshot(sum(v for _, v in m.get("nv_inference_request_success", [])),
                    sum(v for _, v in m.get("nv_inference_request_failure", [])) + refused, **histograms,
                    prompt_tokens=sum(v for _, v in m.get("vllm:prompt_tokens_total", [])),
                    generation_tokens=sum(v for _, v in m.get("vllm:generation_tokens_total", [])))


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict: ``passed``, ``reason`` (empty when passed) and what was measured."""

    passed: bool
    reason: str
    requests_new: int
    errors_new: int
    error_ratio: float
    p99_new_s: float | None
    p99_old_s: float | None
    router_5xx_counted: bool = True  # False: the router keeps no 5xx counters (Gateway API)
    ttft_p90_new_s: float | None = None
    ttft_p90_old_s: float | None = None
    itl_p90_new_s: float | None = None
    itl_p90_old_s: float | None = None
    # What the verdict rests on: "traffic" (clients'), "probe: N requests of its own", "traffic
    # after waiting N s", or "nothing to judge, gate_no_traffic=pass" (a blind pass, asked for).
    judged: str = "traffic"

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def evaluate(new: Snapshot, old: Snapshot, router_5xx_new: int | None, *, max_error_ratio: float,
             max_p99_ratio: float, min_requests: int, require_requests: int = 0, judged: str = "traffic",
             max_ttft_p90_ratio: float | None = None, max_itl_p90_ratio: float | None = None) -> GateResult:
    """Judge one window from counter deltas (``new`` / ``old``: after − before).

    ``router_5xx_new``: 5xx the router answered for the new version's servers in the window;
    None when the router does not count them (judged from the instances' metrics alone).

    The latency comparisons need at least ``min_requests`` in the window on both sides (for TTFT
    and inter-token latency: that many requests' first tokens); with fewer, only errors are
    judged. ``max_ttft_p90_ratio`` / ``max_itl_p90_ratio``: None judges neither. Fewer than
    ``require_requests`` requests to the new version fail the gate. ``judged`` is recorded in the
    result (what the window's requests were).
    """
    # A backend failure is also answered as a 5xx at the router: count the router's only for
    # what the instance never saw (connection errors, timeouts).
    extra = max(0, (router_5xx_new or 0) - int(new.failure))
    requests = int(new.success + new.failure) + extra
    errors = int(new.failure) + extra
    ratio = errors / requests if requests else 0.0
    p99_new = histogram_quantile(0.99, new.latency_buckets)
    p99_old = histogram_quantile(0.99, old.latency_buckets)
    reason = ""
    if ratio > max_error_ratio:  # errors first: 3 of 3 failed is a failure, not "too little traffic"
        reason = f"error ratio {ratio:.3f} > {max_error_ratio} ({errors} of {requests} requests failed)"
    elif requests < require_requests:
        reason = (f"{requests} requests reached the new version in the window, fewer than the "
                  f"{require_requests} gate_require_requests asks for: nothing to judge")
    elif (p99_new is not None and p99_old is not None and requests >= min_requests
          and old.success >= min_requests and p99_new > p99_old * max_p99_ratio):
        reason = f"p99 latency {p99_new:.3f} s > {max_p99_ratio} × the old version's {p99_old:.3f} s"
    p90 = {}
    for what, name, limit in (("ttft", "time to first token", max_ttft_p90_ratio),
                              ("itl", "inter-token latency", max_itl_p90_ratio)):
        mine, theirs = getattr(new, f"{what}_buckets"), getattr(old, f"{what}_buckets")
        p90[what] = (interpolated_quantile(0.9, mine), interpolated_quantile(0.9, theirs))
        # Requests on each side: TTFT is observed once per request (inter-token latency once per token).
        judged_here = (limit is not None and None not in p90[what] and p90[what][1] > 0
                       and max(new.ttft_buckets.values(), default=0) >= min_requests
                       and max(old.ttft_buckets.values(), default=0) >= min_requests)
        if not reason and judged_here and p90[what][0] > p90[what][1] * limit:
            reason = (f"{name} p90 {p90[what][0]:.3f} s > {limit} × the old version's {p90[what][1]:.3f} s in the "
                      "same window")
    rounded = {k: tuple(None if x is None else round(x, 4) for x in v) for k, v in p90.items()}
    return GateResult(not reason, reason, requests, errors, round(ratio, 4), p99_new, p99_old,
                      router_5xx_new is not None, *rounded["ttft"], *rounded["itl"], judged)
