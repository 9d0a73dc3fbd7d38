"""KServe's HTTP generate routes (Triton's generate extension), passed to Triton with the API key
they count for.

``POST /v2/models/<model>[/versions/<v>]/generate`` and ``.../generate_stream`` reach Triton
through here, not through the instance's KServe port, for one reason: Triton forwards the
router's key headers (:data:`modelops.tenancy.KEY_HEADER`, :data:`modelops.tenancy.KEY_MAC_HEADER`)
to a model on ``/infer`` and gRPC calls but not on ``/generate`` (tritonserver 2.51, verified),
and over HTTP a generate model has nothing else (its ``/infer`` is a 501: it is decoupled). Here
both go into the body as top-level fields, which the generate extension hands the model as
request parameters, where the backend checks the HMAC and counts the answer for the key
(runtime/engine/api_key.py). The body is otherwise passed as the client sent it and Triton's
answer, a JSON object or server-sent events, comes back as Triton sent it, event by event.
"""

from __future__ import annotations

import json
import logging

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from modelops.tenancy import INSTANCE_SECRET_HEADER, KEY_HEADER, KEY_MAC_HEADER

__all__ = ["GENERATE_PATHS", "kserve_generate_routes"]

log = logging.getLogger("modelops.frontend")

GENERATE_PATHS = tuple(f"/v2/models/{{model}}{version}/{kind}" for version in ("", "/versions/{version}")
                       for kind in ("generate", "generate_stream"))


class _Pairs(list):
    """A JSON object's (name, value) pairs in order."""


def _kserve_error(status: int, message: str) -> JSONResponse:
    """KServe v2's error shape, as Triton answers: ``{"error": "<message>"}``."""
    return JSONResponse({"error": message}, status_code=status)


def _with_key(body: bytes, key: str, mac: str) -> bytes:
    """``body`` (a JSON object, as sent) with ``key`` and ``mac`` as its first two fields."""
    head = json.dumps({KEY_HEADER: key, KEY_MAC_HEADER: mac}, separators=(",", ":"))[:-1].encode()  # no "}"
    rest = body.lstrip()[1:].lstrip()  # after the object's "{"
    return head + (b"" if rest.startswith(b"}") else b",") + rest


def kserve_generate_routes(clients: dict, triton_http_url: str, instance_secret: str = "") -> APIRouter:
    """The four generate routes, proxied to Triton's HTTP endpoint ``triton_http_url``
    (``http://host:port``, its private port) with the router's key headers moved into the body.

    Args:
        clients: the app's clients; ``clients["http"]`` (an ``httpx.AsyncClient``) sends to Triton.
        instance_secret: the stack's secret, which Triton's restricted KServe API requires.

    A body that is not a JSON object, or one whose top-level fields name the key or its HMAC
    (the router sets them), is a 400 in KServe's shape before anything reaches Triton; Triton
    unreachable is a 502.
    """
    router = APIRouter()

    async def generate(request: Request) -> Response:
        body = await request.body()
        try:  # UTF-8 only (RFC 8259), no BOM: the key's fields are spliced into these bytes
            fields = json.loads(body.decode("utf-8"), object_pairs_hook=_Pairs)
        except UnicodeDecodeError as e:
            return _kserve_error(400, f"the request body must be UTF-8 JSON: {e}")
        except ValueError as e:
            return _kserve_error(400, f"the request body is not JSON: {e}")
        except RecursionError:
            return _kserve_error(400, "the request body nests JSON too deeply")
        if not isinstance(fields, _Pairs):
            return _kserve_error(400, "the request body must be a JSON object of the model's inputs and parameters")
        if named := next((k for k, _ in fields if k.lower() in (KEY_HEADER, KEY_MAC_HEADER)), None):
            return _kserve_error(400, f"{named}: the router sets it from the request's API key; leave it out")
        key, mac = request.headers.get(KEY_HEADER), request.headers.get(KEY_MAC_HEADER)
        if key and mac:
            body = _with_key(body, key, mac)
        headers = {"content-type": "application/json", **({INSTANCE_SECRET_HEADER: instance_secret}
                                                             if instance_secret else {})}
        path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path  # as the client encoded it
        upstream = clients["http"].build_request("POST", triton_http_url + path, content=body,
                                                 headers=headers, timeout=httpx.Timeout(600, connect=5))
        try:
            answer = await clients["http"].send(upstream, stream=True)
        except httpx.HTTPError as e:
            log.warning("KServe %s: Triton did not answer: %s", request.url.path, e)
            return _kserve_error(502, f"the model server did not answer: {e}")
        kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type", "cache-control")}

        async def relay():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:  # a client that hung up closes Triton's side too
                await answer.aclose()

        return StreamingResponse(relay(), status_code=answer.status_code, headers=kept)

    for path in GENERATE_PATHS:
        router.add_api_route(path, generate, methods=["POST"], include_in_schema=False)
    return router
