"""The generative model's OpenAI routes, ``/v1/completions`` and ``/v1/chat/completions``: the
audited body is handed to vLLM's own serving classes in the engine (runtime/engine/openai_engine.py)
and their answer relayed, one JSON document or a stream of server-sent events."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from modelops.shadow import SHADOW_HEADER, answer_texts, stream_texts
from runtime.frontend.disconnect import until_disconnect
from runtime.frontend.errors import APIError, code_of, vllm_error
from runtime.frontend.protocol import ChatCompletionRequest, CompletionRequest
from runtime.frontend.served import Served
from runtime.frontend.usage import KEY_HEADER

__all__ = ["generate_routes"]


def generate_routes(served: Served) -> APIRouter:
    """The routes of :mod:`this module <runtime.frontend.generate>` for ``served``'s model (a
    model of another task answers them with a 400 naming ``model``)."""
    router = APIRouter()

    async def _relay(api: str, req, stream: bool, request: Request):
        """Hand the audited body to vLLM's serving classes in the backend and answer with what
        they answer: one JSON document, or a stream of server-sent events. The first reply is
        awaited before answering, so a refused stream is a plain HTTP error, not a 200 stream.
        The answer's usage is counted for the request's key; a request the router marked for a
        shadow is copied once its answer is complete (a stream: its last event sent)."""
        started, body, key = time.monotonic(), req.body(), request.headers.get(KEY_HEADER)
        marked = request.headers.get(SHADOW_HEADER)
        replies = served.triton.openai(api, body, key=key)  # its usage: counted by the engine for the key
        # Closing the iterator closes the gRPC stream: the backend then aborts the engine request.
        first = await replies.__anext__()
        if first.status != 200 or not stream:
            await replies.aclose()
            if first.status != 200:
                raise vllm_error(first.status, first.body)
            if marked:
                served.mirror.offer(marked, api, body, answer_texts(api, json.loads(first.body)), started)
            return Response(first.body, media_type="application/json")
        if first.body.startswith("data: {\"error\"") and not first.final:
            # vLLM reports an error raised before the first token inside the stream (HTTP 200);
            # here it is the plain HTTP error it is.
            await replies.aclose()
            doc = first.body.removeprefix("data: ")
            raise vllm_error(code_of(doc), doc)

        async def events():
            reply, sent = first, []
            try:
                while True:
                    if reply.status != 200:  # refused after the stream started: an error event
                        yield f"data: {json.dumps(vllm_error(reply.status, reply.body).body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if reply.body:  # a final reply may carry nothing (the engine's stream ended without [DONE])
                        yield reply.body
                        if marked:
                            sent.append(reply.body)
                    if reply.final:
                        if marked:
                            served.mirror.offer(marked, api, body, stream_texts(api, sent), started)
                        return
                    try:
                        reply = await replies.__anext__()
                    except APIError as e:
                        yield f"data: {json.dumps(e.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
            finally:  # also when the client went away mid-stream
                await replies.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        served.check_model(req.model, "generate")
        served.log_user("completions", req.user)
        # Until the answer (or a stream's first event): a stream's body notices a gone client itself.
        return await until_disconnect(request, _relay("completions", req, req.stream, request))

    @router.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        served.check_model(req.model, "generate")
        served.log_user("chat", req.user, req.safety_identifier)
        return await until_disconnect(request, _relay("chat", req, req.stream, request))

    return router
