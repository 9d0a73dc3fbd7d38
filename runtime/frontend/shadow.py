"""The primary side of shadow traffic (:mod:`modelops.shadow`): once this instance has answered a
request the router marked, send the same request to the shadow version and compare the answers.

A copy is a task of its own, started after the client's answer is complete, so nothing the
shadow does (fail, hang, die) reaches the client; at most ``max_inflight`` copies run at once and
a copy beyond that is dropped and counted. The counts are exposed with the instance's metrics
(:meth:`ShadowMirror.exposition`, merged by runtime/frontend/metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import httpx

from modelops.batch import deterministic
from modelops.shadow import (COSINE_BOUNDS, FIRST_DIFF_BOUNDS, LATENCY_BOUNDS, METRICS, answer_texts, cosine,
                             first_difference, parse_header, shadow_tokens)

__all__ = ["ShadowMirror"]

log = logging.getLogger("modelops.frontend.shadow")

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}


class _Histogram:
    """Cumulative ``le`` buckets with a count and a sum, as Prometheus exposes a histogram."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        return out + [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {total}"]


class ShadowMirror:
    """Copies of one instance's marked requests, and their comparisons.

    Args:
        target: where copies go: ``unix:<path>`` (the local router's internal socket) or an
            ``http://host:port`` base; empty: nothing is ever copied.
        model_id: the model this instance serves (the metrics' ``model_name``).
        max_inflight: copies in flight at most; one more is dropped (``outcome="dropped"``).
        timeout_s: a copy not answered by then counts as ``shadow_failed``.
    """

    def __init__(self, target: str, model_id: str, *, max_inflight: int = 8, timeout_s: float = 120.0) -> None:
        self.target, self.model_id, self.max_inflight, self.timeout_s = target, model_id, max_inflight, timeout_s
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)  # (id, version, outcome)
        self._greedy: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # compared, equal
        self._hist: dict[tuple[str, str, str], _Histogram] = {}  # (metric, id, version[,side]) → histogram
        self._cosine_min: dict[tuple[str, str], float] = {}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            if self.target.startswith("unix:"):
                self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.target[5:]),
                                                 base_url="http://router", timeout=self.timeout_s)
            else:
                self._client = httpx.AsyncClient(base_url=self.target, timeout=self.timeout_s)
        return self._client

    def offer(self, header: str | None, api: str, body: dict, primary: list, started: float) -> None:
        """Copy a request this instance answered, when the router marked it (``header``: the
        value of :data:`modelops.shadow.SHADOW_HEADER`). ``api``: ``chat``, ``completions`` or
        ``embeddings``; ``body``: the request as the client sent it; ``primary``: the answer's
        texts per choice (:func:`modelops.shadow.answer_texts`) or its embedding vectors;
        ``started``: ``time.monotonic()`` when the request arrived. Returns at once."""
        marked = parse_header(header)
        if marked is None or not self.target:
            return
        sid, version = marked
        if len(self._tasks) >= self.max_inflight:
            self._requests[(sid, version, "dropped")] += 1
            return
        self._observe("latency", sid, version, time.monotonic() - started, side="primary")
        task = asyncio.create_task(self._copy(sid, version, api, body, primary))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _copy(self, sid: str, version: str, api: str, body: dict, primary: list) -> None:
        copy = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        greedy = api != "embeddings" and deterministic(_PATHS[api], body)
        if greedy:  # the shadow's tokens, to find the first that differs (greedy decoding is unchanged by it)
            if api == "chat":
                copy["logprobs"] = True
            elif copy.get("logprobs") is None:
                copy["logprobs"] = 0
        if api == "embeddings":
            copy["encoding_format"] = "float"
        t0 = time.monotonic()
        try:
            r = await self._http().post(_PATHS[api], json=copy, headers={"X-Model-Version": version})
            ok = r.status_code == 200
            doc = r.json() if ok else None
        except (httpx.HTTPError, ValueError) as e:
            ok, doc = False, None
            log.info("shadow %s (version %s): the copy failed: %s", sid, version, e)
        self._observe("latency", sid, version, time.monotonic() - t0, side="shadow")
        if not ok:
            self._requests[(sid, version, "shadow_failed")] += 1
            return
        self._requests[(sid, version, "compared")] += 1
        try:
            self._compare(sid, version, api, greedy, primary, doc)
        except Exception:  # noqa: BLE001 - an odd answer must not end the instance's loop
            log.exception("shadow %s: comparing the answers failed", sid)

    def _compare(self, sid: str, version: str, api: str, greedy: bool, primary: list, doc: dict) -> None:
        if api == "embeddings":
            vectors = [d["embedding"] for d in sorted(doc.get("data") or [], key=lambda d: d.get("index", 0))]
            for a, b in zip(primary, vectors):
                c = cosine([float(x) for x in a], [float(x) for x in b])
                self._observe("cosine", sid, version, c)
                self._cosine_min[(sid, version)] = min(c, self._cosine_min.get((sid, version), c))
            return
        if not greedy:
            return  # sampled answers differ by design: only the latencies compare
        texts, tokens = answer_texts(api, doc), shadow_tokens(api, doc)
        counts = self._greedy[(sid, version)]
        counts[0] += 1
        if texts == list(primary):
            counts[1] += 1
            return
        for i, (mine, theirs) in enumerate(zip(primary, texts)):
            if mine != theirs and i < len(tokens) and tokens[i]:
                self._observe("first_diff", sid, version, first_difference(mine, tokens[i]))
                break

    def _observe(self, metric: str, sid: str, version: str, value: float, side: str = "") -> None:
        bounds = {"latency": LATENCY_BOUNDS, "cosine": COSINE_BOUNDS, "first_diff": FIRST_DIFF_BOUNDS}[metric]
        self._hist.setdefault((metric, sid, version, side), _Histogram(bounds)).observe(value)

    def exposition(self) -> str:
        """Prometheus text of the comparisons so far (empty before the first marked request)."""
        from runtime.frontend.metrics import label

        if not self._requests and not self._hist:
            return ""
        model = f'model_name="{label(self.model_id)}"'

        def who(sid: str, version: str) -> str:
            return f'{model},shadow="{sid}",shadow_version="{label(version)}"'

        out = [f"# TYPE {METRICS['requests']} counter"]
        out += [f'{METRICS["requests"]}{{{who(s, v)},outcome="{o}"}} {n}'
                for (s, v, o), n in sorted(self._requests.items())]
        for key, i in (("greedy", 0), ("equal", 1)):
            out += [f"# TYPE {METRICS[key]} counter"]
            out += [f"{METRICS[key]}{{{who(s, v)}}} {c[i]}" for (s, v), c in sorted(self._greedy.items())]
        out += [f"# TYPE {METRICS['cosine_min']} gauge"]
        out += [f"{METRICS['cosine_min']}{{{who(s, v)}}} {c}" for (s, v), c in sorted(self._cosine_min.items())]
        for metric in ("latency", "cosine", "first_diff"):
            out.append(f"# TYPE {METRICS[metric]} histogram")
            for (m, s, v, side), h in sorted(self._hist.items()):
                if m == metric:
                    out += h.lines(METRICS[metric], who(s, v) + (f',side="{side}"' if side else ""))
        return "\n".join(out) + "\n"

    async def close(self) -> None:
        """Cancel the copies in flight and close the client."""
        for task in list(self._tasks):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
