"""Domain errors of the frontend, mapped to the OpenAI error shape once (in app.py).

Shape: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Errors").
"""

from __future__ import annotations

__all__ = ["APIError", "EngineUnavailable", "InvalidRequest", "ModelNotFound", "UpstreamError"]


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
