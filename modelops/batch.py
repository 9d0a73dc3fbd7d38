"""Batch inference, the core: the request lines of an input file, which requests are
deterministic (answered from the result cache), the cache key, and OpenAI's object shapes.

Facts (OpenAI API reference, "Batch" and "Files"): an input file is JSONL, one request per
line: ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}``;
a batch's ``completion_window`` is ``"24h"``; its status is one of ``validating``, ``failed``,
``in_progress``, ``finalizing``, ``completed``, ``expired``, ``cancelling``, ``cancelled``;
output lines are ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``. vLLM's batch runner adds ``/v1/score`` and ``/v1/rerank`` to OpenAI's endpoints
(vllm/entrypoints/openai/run_batch.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ENDPOINTS", "COMPLETION_WINDOWS", "LIVE_CACHE_HEADER", "LIVE_CACHE_PATHS", "TERMINAL", "BatchLine",
           "LineError", "cache_key", "deterministic", "error_line", "fresh_answer", "output_line", "parse_line",
           "request_id"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")
COMPLETION_WINDOWS = ("24h",)
TERMINAL = ("completed", "failed", "cancelled", "expired")
# Endpoints whose answer depends only on the request (no sampling): always cached.
_DETERMINISTIC_ENDPOINTS = ("/v1/embeddings", "/v1/score", "/v1/rerank")
# A live request with this header set to "use" is answered from the result cache when it can be
# (the router sends it to the batch API's cache route; docs/batch.md). Only these paths: their
# answers depend on the request alone.
LIVE_CACHE_HEADER = "x-modelops-cache"
LIVE_CACHE_PATHS = ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank")


@dataclass(frozen=True)
class BatchLine:
    """One valid request line: ``number`` (1-based line of the input file), ``custom_id``,
    ``url`` (the batch's endpoint) and ``body`` (the request, a JSON object with ``model``)."""

    number: int
    custom_id: str
    url: str
    body: dict[str, Any]

    @property
    def model(self) -> str:
        return self.body["model"]


@dataclass(frozen=True)
class LineError:
    """A line refused before it was sent: ``code`` (e.g. ``invalid_json``), ``message`` naming
    the field and the fix; ``custom_id`` when the line had a readable one."""

    number: int
    code: str
    message: str
    custom_id: str | None = None


def parse_line(raw: bytes | str, number: int, endpoint: str, seen: set[str]) -> BatchLine | LineError | None:
    """Read line ``number`` of an input file for a batch on ``endpoint``.

    ``seen`` holds the custom_ids of the lines before it and gains this one's: a repeated
    custom_id is an error (the output could not say which answer is whose).

    Returns:
        The request; a :class:`LineError` naming what is wrong; None for a blank line.
    """
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    if not text.strip():
        return None
    try:
        line = json.loads(text)
    except ValueError as e:
        return LineError(number, "invalid_json", f"line {number} is not JSON ({e}); each line is one JSON object")
    if not isinstance(line, dict):
        return LineError(number, "invalid_request", f"line {number} is a JSON {type(line).__name__}, not an object "
                         'with custom_id, method, url and body')
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, "missing_custom_id", f"line {number}: custom_id must be a non-empty string; it "
                         "names the line's answer in the output file")
    if custom_id in seen:
        return LineError(number, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} is on an earlier "
                         "line too; give each line its own", custom_id)
    seen.add(custom_id)
    if unknown := sorted(set(line) - {"custom_id", "method", "url", "body"}):
        return LineError(number, "invalid_request", f"line {number}: unknown field(s) {', '.join(unknown)}; a line "
                         "has custom_id, method, url and body", custom_id)
    if line.get("method") != "POST":
        return LineError(number, "invalid_method", f"line {number}: method must be \"POST\", not "
                         f"{line.get('method')!r}", custom_id)
    if line.get("url") != endpoint:
        return LineError(number, "mismatched_endpoint", f"line {number}: url {line.get('url')!r} is not the "
                         f"batch's endpoint {endpoint}; a batch sends every line to one endpoint", custom_id)
    body = line.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        return LineError(number, "invalid_body", f"line {number}: body must be a JSON object with a string "
                         "\"model\" (the model id)", custom_id)
    if body.get("stream"):
        return LineError(number, "invalid_body", f"line {number}: body.stream must be false or absent; a batch "
                         "writes whole answers", custom_id)
    return BatchLine(number, custom_id, endpoint, body)


def deterministic(url: str, body: dict[str, Any]) -> bool:
    """Whether the answer depends on the request alone, so a cached one is as good as a new one:
    embeddings, scores and reranks always; (chat) completions only with ``temperature`` 0
    (greedy decoding) given explicitly, as the model's own default may sample."""
    if url in _DETERMINISTIC_ENDPOINTS:
        return True
    temperature = body.get("temperature")
    return isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0


def cache_key(model_id: str, version: str, url: str, body: dict[str, Any]) -> str:
    """SHA-256 (64 hex characters) of the model version, the endpoint and the canonical request
    (JSON with sorted keys and no spaces): key order and spacing do not change it, any value
    does. ``body["model"]`` is ``model_id`` by construction; the version makes a new serving
    version miss every entry of the old one."""
    url = "/v1" + url if not url.startswith("/v1/") else url  # /score and /v1/score are one endpoint
    canonical = json.dumps({"model_id": model_id, "version": version, "url": url, "body": body},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def fresh_answer(cached: str) -> Any:
    """A cached answer (JSON text) as a new answer: its top-level ``id`` keeps its prefix with a
    new suffix (``embd-<hex>``, ``chatcmpl-<hex>``...) and ``created`` is now, as every answer
    of the OpenAI API has its own; the rest is the cached answer as it was."""
    import secrets
    import time

    body = json.loads(cached)
    if isinstance(body, dict):
        if isinstance(body.get("id"), str):
            prefix, sep, _ = body["id"].rpartition("-")
            body["id"] = f"{prefix}{sep}{secrets.token_hex(16)}" if sep else secrets.token_hex(16)
        if isinstance(body.get("created"), int):
            body["created"] = int(time.time())
    return body


def request_id(batch_id: str, number: int) -> str:
    """The output line's ``id``: the same for the same line of the same batch, however often the
    batch resumed (``batch_req_`` and 24 hex characters)."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{number}".encode()).hexdigest()[:24]


def output_line(batch_id: str, number: int, custom_id: str, status: int, body: Any, request: str = "") -> dict:
    """An output (or error) file line for a request that got an HTTP answer ``status`` with
    ``body`` (parsed JSON, or the text when it was not JSON)."""
    return {"id": request_id(batch_id, number), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request, "body": body}, "error": None}


def error_line(batch_id: str, error: LineError) -> dict:
    """An error file line for a line that was never sent, with its line number."""
    return {"id": request_id(batch_id, error.number), "custom_id": error.custom_id, "response": None,
            "error": {"code": error.code, "message": error.message, "line": error.number}}
