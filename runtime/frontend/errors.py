"""Domain errors of the frontend, and how every error is answered: in the OpenAI error shape,
once, by the handlers :func:`install_error_handlers` puts on the app.

Shape: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Errors").
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from modelops.io_contract import refused_param
from runtime.frontend.disconnect import ClientGone

__all__ = ["APIError", "EngineUnavailable", "InvalidRequest", "ModelNotFound", "UpstreamError", "code_of",
           "install_error_handlers", "vllm_error"]


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    """A field is unknown, malformed or not supported: HTTP 400, never silently dropped."""

    status = 400
    type = "invalid_request_error"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"


class UpstreamError(APIError):
    """Triton or the engine failed the request: HTTP 502 (503 while not ready)."""

    status = 502
    type = "server_error"


class EngineUnavailable(UpstreamError):
    """The engine process is dead or stalled (runtime/frontend/engine_watch.py): HTTP 503 with
    code ``engine_unavailable``. Answered before any response byte, so the router retries the
    request on another instance (HAProxy ``retry-on 503``)."""

    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "engine_unavailable")


def code_of(doc: str) -> int:
    """The HTTP status an error document (vLLM's, inside a stream) carries: its ``error.code``
    when that is one (400..599), else 400."""
    try:
        code = json.loads(doc)["error"]["code"]
        return code if isinstance(code, int) and 400 <= code < 600 else 400
    except (ValueError, KeyError, TypeError):
        return 400


# Error types runtime/engine/openai_engine.py answers with → the OpenAI ``code`` clients see.
_BACKEND_CODES = {"StructuredOutputViolation": "structured_output_violation", "EngineError": "engine_error"}


def vllm_error(status: int, body: str) -> APIError:
    """vLLM's error document (``{"error": {"message", "type", "param", "code"}}``, code = the
    HTTP status) as ours: OpenAI's ``type`` names, the status kept."""
    try:
        err = json.loads(body)["error"]
        message, param, kind = str(err.get("message", body)), err.get("param"), err.get("type")
    except (ValueError, KeyError, TypeError):
        message, param, kind = body, None, None
    param = param or refused_param(message)
    if status == 404:
        return ModelNotFound(message, param, "model_not_found")
    if 400 <= status < 500:
        e = InvalidRequest(message, param)
    else:  # the backend's own faults keep a code a client can branch on
        e = UpstreamError(message, param, _BACKEND_CODES.get(kind))
    e.status = status
    return e


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the OpenAI shape: ours (:class:`APIError`), a client that
    went away, Starlette's (404, 405) and FastAPI's body validation (400 naming the field)."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls = ModelNotFound if exc.status_code == 404 else InvalidRequest
        err = cls(str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        e = errors[0]
        if e["type"] == "json_invalid":
            ctx = e.get("ctx", {}).get("error", "")
            msg = f"the request body is not valid JSON ({ctx})" if ctx else "the request body is not valid JSON"
            return JSONResponse(InvalidRequest(msg).body(), status_code=400)
        # Drop pydantic's union-branch tags ("str", "list[str]") from the location.
        loc = [str(p) for p in e["loc"] if p != "body" and not _is_type_tag(p)]
        param = ".".join(loc) or None
        if param is None and e["type"] == "value_error":  # a rule across fields; its message names them
            msg = e["msg"].removeprefix("Value error, ")
        elif param is None:
            msg = "the request body must be a JSON object (send Content-Type: application/json)"
        elif e["type"] == "extra_forbidden":
            msg = f"unsupported field {param!r}: this server does not honor it, remove it from the request"
        elif e["type"] == "missing":
            msg = f"missing required field {param!r}"
        else:
            # A union reports one error per branch; a value error (ours) is the informative one.
            e = next((x for x in errors if x["type"] == "value_error"), e)
            msg = f"invalid value for {param!r}: {e['msg'].removeprefix('Value error, ')}"
        return JSONResponse(InvalidRequest(msg, param=param).body(), status_code=400)
