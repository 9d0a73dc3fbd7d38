"""Shadow traffic: a version receives a copy of a fraction of a model's live requests, and its
answers are compared with the ones clients got, without ever reaching a client.

How a copy travels (locally, on the HAProxy router):

1. The router marks a sampled fraction of the model's unpinned OpenAI requests with
   :data:`SHADOW_HEADER` (``<shadow id>/<version>``), chosen by ``rand(100)``; a client's own
   header of that name is removed first.
2. The instance that answers (the primary) answers its client as always. Only then, with the
   answer in hand, its frontend sends the same request to the router's internal socket
   (:data:`SHADOW_ROUTER_ENV`), pinned to the shadow version (``X-Model-Version``), and compares
   the two answers (runtime/frontend/shadow.py). The copy runs detached from the client's request
   with a bound on copies in flight (a full bound drops the copy and counts it), so the shadow's
   failures, slowness or death cost clients nothing.
3. The comparisons are counters and histograms in the primary instance's ``/metrics``, labelled
   by the shadow's id (:data:`METRICS`); :func:`shadow_stats` sums them over instances.

What is compared: chat and completions answered greedily (``temperature`` 0 given, the only
answers that should match) by text equality per choice, and where they differ the index of the
first token of the shadow's answer that differs (the copy asks for ``logprobs`` to learn its
tokens: sampling is unchanged by it); embeddings by the cosine of each vector pair; every
request by the two latencies (whole request, from the request's arrival to its last byte).

On Kubernetes, the Gateway API's HTTPRoute ``RequestMirror`` filter sends the copies
(tasks/traffic/gateway_api.py); a mirror's answers are discarded by the gateway, so there only
the shadow's own metrics (its latency and errors) compare.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from modelops.histograms import interpolated_quantile, parse_prometheus

__all__ = ["LATENCY_BOUNDS", "METRICS", "SHADOW_HEADER", "SHADOW_ROUTER_ENV", "ShadowPhase", "ShadowSpec", "ShadowStats",
           "answer_texts", "cosine", "first_difference", "parse_header", "shadow_stats", "shadow_tokens",
           "stream_texts"]

SHADOW_HEADER = "x-modelops-shadow"
SHADOW_ROUTER_ENV = "MODELOPS_SHADOW_ROUTER"  # where an instance sends copies: unix:<path> or http://host:port

# Histogram bounds (upper, inclusive) of what the frontend counts.
LATENCY_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FIRST_DIFF_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
COSINE_BOUNDS = (0.9, 0.99, 0.999, 0.9999, 0.99999)

METRICS = {
    "requests": "modelops_shadow_requests_total",        # {outcome}: compared | shadow_failed | dropped
    "greedy": "modelops_shadow_greedy_total",            # greedy answers compared
    "equal": "modelops_shadow_greedy_equal_total",       # ... whose texts were equal
    "first_diff": "modelops_shadow_first_diff_token",    # histogram: index of the first differing token
    "cosine": "modelops_shadow_cosine",                  # histogram: cosine of each embedding pair
    "cosine_min": "modelops_shadow_cosine_min",          # gauge: the lowest cosine seen
    "latency": "modelops_shadow_latency_seconds",        # histogram {side}: primary | shadow
}

_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ShadowPhase(BaseModel):
    """A manifest's ``shadow:``: a red-black rollout's first step, before any traffic moves (shadow
    → canary → full). The new version gets copies of ``percent`` % of the model's unpinned
    requests for ``window_s`` seconds (longer while fewer than the settings'
    ``gate_require_requests`` copies were answered, up to ``rollout_timeout_s``); then the
    comparison is judged and the copies stop. It fails, and the rollout rolls back, when the new
    version failed more copies than ``gate_max_error_ratio`` (a setting), when greedy answers
    were equal less often than ``min_greedy_equal``, or when an embedding's cosine to the served
    one fell below ``min_cosine`` (each unset: not judged). With another strategy (the I/O
    schema changed, or ``strategy: versioned``) there is no phase: ``modelops shadow start``
    runs one by hand.

    Fields:
        percent: share of the model's unpinned OpenAI requests copied, 1..100 (default 10).
        window_s: seconds the copies are watched, 1..3600 (default 30).
        min_greedy_equal: the least share of equal greedy answers, 0..1 (None: not judged).
        min_cosine: the least cosine of an embedding to the served one, -1..1 (None: not judged).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    percent: int = Field(default=10, ge=1, le=100)
    window_s: float = Field(default=30.0, ge=1, le=3600)
    min_greedy_equal: float | None = Field(default=None, ge=0, le=1)
    min_cosine: float | None = Field(default=None, ge=-1, le=1)


@dataclass(frozen=True)
class ShadowSpec:
    """What the router needs of a shadow: its registry ``id``, the ``version`` that gets the
    copies and the ``percent`` (1..100) of the model's unpinned requests copied."""

    id: int
    version: str
    percent: int

    def header(self) -> str:
        """The value of :data:`SHADOW_HEADER` the router sets: ``<id>/<version>``."""
        return f"{self.id}/{self.version}"


def parse_header(value: str | None) -> tuple[str, str] | None:
    """``(shadow id, version)`` from :data:`SHADOW_HEADER`'s value, or None when it is absent
    or malformed (then nothing is copied)."""
    if not value or "/" not in value:
        return None
    sid, version = value.split("/", 1)
    return (sid, version) if sid.isdigit() and _VERSION.match(version) else None


def answer_texts(api: str, doc: dict) -> list[str]:
    """The text of each choice (by ``index``) of a chat (``api="chat"``) or completions answer."""
    out: dict[int, str] = {}
    for c in doc.get("choices") or []:
        text = (c.get("message") or {}).get("content") if api == "chat" else c.get("text")
        out[int(c.get("index", 0))] = text or ""
    return [out[i] for i in sorted(out)]


def stream_texts(api: str, events: list[str]) -> list[str]:
    """:func:`answer_texts` of a stream: its server-sent events (``data: {...}`` chunks as the
    frontend relayed them, several events per chunk possible) joined per choice."""
    out: dict[int, list[str]] = {}
    for chunk in events:
        for line in chunk.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                doc = json.loads(line[6:])
            except ValueError:
                continue
            for c in doc.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") if api == "chat" else c.get("text")
                out.setdefault(int(c.get("index", 0)), []).append(piece or "")
    return ["".join(out[i]) for i in sorted(out)]


def shadow_tokens(api: str, doc: dict) -> list[list[str]]:
    """Each choice's tokens (as text) from an answer that carries ``logprobs`` (chat:
    ``logprobs.content[].token``; completions: ``logprobs.tokens``); empty lists without them."""
    out: dict[int, list[str]] = {}
    for c in doc.get("choices") or []:
        lp = c.get("logprobs") or {}
        toks = [t.get("token", "") for t in lp.get("content") or []] if api == "chat" else list(lp.get("tokens") or [])
        out[int(c.get("index", 0))] = [t for t in toks if isinstance(t, str)]
    return [out[i] for i in sorted(out)]


def first_difference(primary: str, tokens: list[str]) -> int:
    """The index of the first of the shadow's ``tokens`` (its answer, token by token) after which
    its text stops being a prefix of ``primary``; ``len(tokens)`` when the shadow's whole text is a
    prefix of the primary's (the primary goes on longer). Two equal texts have no difference: ask
    this only of texts that differ."""
    seen = 0
    for i, tok in enumerate(tokens):
        if primary[seen:seen + len(tok)] != tok:
            return i
        seen += len(tok)
    return len(tokens)


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0.0 when either is all zeros, or their lengths
    differ: then they are not the same embedding at all)."""
    if len(a) != len(b):
        return 0.0
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


@dataclass
class ShadowStats:
    """A shadow's comparison, summed over the primary instances: requests ``compared`` (both
    answered), ``shadow_failed`` (the shadow answered an error, or not at all), ``dropped``
    (not copied: the bound on copies in flight was full); ``greedy`` answers compared and how
    many were ``equal``; the first differing token's histogram; embeddings' cosines (count and
    the lowest); and each side's latency histogram ``{upper bound (s): cumulative count}``."""

    compared: int = 0
    shadow_failed: int = 0
    dropped: int = 0
    greedy: int = 0
    equal: int = 0
    first_diff: dict[float, float] = field(default_factory=dict)
    cosines: int = 0
    cosine_min: float | None = None
    cosine_buckets: dict[float, float] = field(default_factory=dict)
    latency: dict[str, dict[float, float]] = field(default_factory=dict)

    @property
    def equal_rate(self) -> float | None:
        """Equal greedy answers over greedy answers compared (None: none compared)."""
        return self.equal / self.greedy if self.greedy else None

    @property
    def failure_rate(self) -> float | None:
        """Copies the shadow failed over copies sent (None: none sent)."""
        sent = self.compared + self.shadow_failed
        return self.shadow_failed / sent if sent else None

    def latency_quantile(self, side: str, q: float) -> float | None:
        """``q``-quantile (interpolated within buckets, as Prometheus' ``histogram_quantile``) of
        ``side``'s latency in seconds; None without data."""
        return interpolated_quantile(q, self.latency.get(side, {}))

    def as_dict(self) -> dict:
        """JSON-able summary: counts, rates, the lowest cosine, latency p50/p90 per side."""
        return {"compared": self.compared, "shadow_failed": self.shadow_failed, "dropped": self.dropped,
                "greedy": self.greedy, "equal": self.equal, "equal_rate": self.equal_rate,
                "failure_rate": self.failure_rate, "cosines": self.cosines, "cosine_min": self.cosine_min,
                "latency_s": {side: {"p50": self.latency_quantile(side, 0.5), "p90": self.latency_quantile(side, 0.9)}
                              for side in ("primary", "shadow")}}


def shadow_stats(metrics_texts: list[str], shadow_id: int) -> ShadowStats:
    """Sum one shadow's comparisons (the series labelled ``shadow="<shadow_id>"``) over the
    ``/metrics`` texts of the instances that answered its model's requests."""
    out, sid = ShadowStats(), str(shadow_id)

    def add(buckets: dict[float, float], labels: dict, value: float) -> None:
        le = float(labels["le"])
        buckets[le] = buckets.get(le, 0.0) + value

    for text in metrics_texts:
        parsed = parse_prometheus(text)
        for labels, value in parsed.get(METRICS["requests"], []):
            if labels.get("shadow") == sid:
                outcome = labels.get("outcome", "")
                if outcome in ("compared", "shadow_failed", "dropped"):
                    setattr(out, outcome, getattr(out, outcome) + int(value))
        for key in ("greedy", "equal"):
            setattr(out, key, getattr(out, key) + sum(int(v) for lb, v in parsed.get(METRICS[key], [])
                                                      if lb.get("shadow") == sid))
        for labels, value in parsed.get(METRICS["first_diff"] + "_bucket", []):
            if labels.get("shadow") == sid:
                add(out.first_diff, labels, value)
        for labels, value in parsed.get(METRICS["cosine"] + "_bucket", []):
            if labels.get("shadow") == sid:
                add(out.cosine_buckets, labels, value)
        out.cosines += sum(int(v) for lb, v in parsed.get(METRICS["cosine"] + "_count", []) if lb.get("shadow") == sid)
        for labels, value in parsed.get(METRICS["cosine_min"], []):
            if labels.get("shadow") == sid:
                out.cosine_min = value if out.cosine_min is None else min(out.cosine_min, value)
        for labels, value in parsed.get(METRICS["latency"] + "_bucket", []):
            if labels.get("shadow") == sid:
                add(out.latency.setdefault(labels.get("side", ""), {}), labels, value)
    return out
