"""Stop the work of a client that went away.

A streamed answer notices a gone client by itself (Starlette's StreamingResponse listens for
``http.disconnect`` and cancels the body's generator, which closes the gRPC stream). A unary
answer does not: the handler awaits the engine and nobody reads the socket, so a client that
hung up (``curl -m 3``, an ``openai`` client's timeout and retry) kept its engine slots until
the answer was done. :func:`until_disconnect` races the handler's work against the client's
``http.disconnect``, as vLLM's own server does (``vllm/entrypoints/utils.py``,
``with_cancellation``): the work is cancelled, which closes the gRPC stream to Triton; the
backend sees the cancellation (``is_cancelled()``, polled every 0.5 s) and aborts the engine
request (counted in ``vllm:request_success_total{finished_reason="abort"}``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

__all__ = ["CLIENT_CLOSED", "ClientGone", "until_disconnect"]

log = logging.getLogger("modelops.frontend")

T = TypeVar("T")

CLIENT_CLOSED = 499
"""The status an answer nobody receives is logged with (nginx's "client closed request")."""


class ClientGone(Exception):
    """The client disconnected before its answer; the work was cancelled."""

    def response(self) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # never delivered: the access log says what happened


async def _disconnected(request: Request) -> None:
    # The body was read before the handler ran (FastAPI parsed it), so the next ASGI message is
    # http.disconnect, whenever the client goes.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (and its
    cleanup awaited) and :class:`ClientGone` is raised.

    Raises: whatever ``work`` raises; ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled() and task.done():
        return task.result()
    try:
        await task  # let its cleanup (closing the gRPC stream) run before answering
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the answer has nobody to go to
        pass
    log.info("%s %s: the client disconnected before the answer; its work was cancelled", request.method,
             request.url.path)
    raise ClientGone()
