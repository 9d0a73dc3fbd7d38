"""OpenAI-compatible HTTP API (FastAPI) for one model served by Triton.

Routes: GET /health (live), GET /ready (warmed up and not draining), GET /v1/models,
POST /v1/embeddings (task embed), POST /v1/completions and /v1/chat/completions (task generate).
Requests are parsed by protocol.py (unknown or unsupported fields → 400 naming the field),
then served by one TritonModel call.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import httpx

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.frontend.errors import APIError, InvalidRequest, ModelNotFound
from runtime.frontend.lifecycle import InflightMiddleware, Lifecycle
from runtime.frontend.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from runtime.frontend.triton import TritonModel
from runtime.metrics_proxy import CONTENT_TYPE, merged_metrics

__all__ = ["create_app"]

log = logging.getLogger("modelops.frontend")


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part)


def _chat_prompt(req: ChatCompletionRequest) -> str:
    # A plain role-tagged transcript ("user (name): text" lines, then "assistant:"); the
    # tokenizer's chat template is not applied yet (README, "One serving instance").
    lines = [f"{m.role}{f' ({m.name})' if m.name else ''}: {m.text()}" for m in req.messages]
    return "\n".join(lines) + "\nassistant:"


async def _warm_up(triton: TritonModel, task: str, lifecycle: Lifecycle) -> None:
    """Wait for Triton to report the model ready, send one real request through the engine,
    then open the gates (readiness true). Retries until it works; the provider's deadline
    decides when a model that never warms up has failed."""
    t0 = time.monotonic()
    while True:
        try:
            if await triton.ready():
                if task == "embed":
                    await triton.embed(["warm-up"])
                else:
                    await triton.generate("warm-up", {"max_tokens": 1})
                break
        except APIError as e:
            log.warning("warm-up request failed (%s); retrying", e)
        await asyncio.sleep(0.5)
    await lifecycle.open()
    log.info("warm-up answered %.1f s after the frontend started; ready", time.monotonic() - t0)


def create_app(*, model_id: str, version: str, task: str, triton_grpc_url: str, triton_model: str,
               triton_metrics_url: str = "", lifecycle: Lifecycle | None = None) -> FastAPI:
    """Build the app for one model.

    Args:
        model_id: the OpenAI ``model`` name clients send; version: reported in /v1/models.
        task: ``embed`` or ``generate`` (decides which routes answer).
        triton_grpc_url: ``host:port`` of Triton's (private) gRPC endpoint; triton_model: its name.
        triton_metrics_url: Triton's /metrics, merged into this app's /metrics with vLLM's.
        lifecycle: readiness, gates and drain (:mod:`runtime.frontend.lifecycle`); a fresh one
            without gates when None.
    """
    state: dict = {}
    lifecycle = lifecycle or Lifecycle([], drain_timeout=30)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["triton"] = TritonModel(triton_grpc_url, triton_model)
        state["http"] = httpx.AsyncClient()
        warm = asyncio.create_task(_warm_up(state["triton"], task, lifecycle))
        yield
        warm.cancel()
        await state["triton"].close()
        await state["http"].aclose()

    app = FastAPI(title=f"modelops OpenAI frontend: {model_id}", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    app.add_middleware(InflightMiddleware, lifecycle=lifecycle)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

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
        if param is None:
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

    @app.middleware("http")
    async def _version_header(request: Request, call_next):
        response = await call_next(request)
        response.headers["X-Model-Version"] = version  # which version answered, behind the router
        return response

    def _check_model(name: str, wanted_task: str) -> None:
        if name != model_id:
            raise ModelNotFound(f"model {name!r} is not served here (this instance serves {model_id!r})", "model",
                                "model_not_found")
        if task != wanted_task:
            kinds = {"embed": "an embedding model", "generate": "a generative model"}
            raise InvalidRequest(f"model {model_id!r} is {kinds[task]}; this endpoint needs {kinds[wanted_task]}",
                                 "model")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "live"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        # False until the warm-up request was answered, and again from the first SIGTERM.
        ok = lifecycle.ready and await state["triton"].ready()
        return JSONResponse({"ready": ok, "draining": lifecycle.draining, "inflight": lifecycle.inflight},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Triton's metrics and vLLM's (runtime/metrics_proxy.py) in one Prometheus scrape."""
        return Response(await merged_metrics(state["http"], triton_metrics_url), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "modelops", "version": version}]}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict:
        _check_model(req.model, "embed")
        _log_user("embeddings", req.user)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if any(not t for t in texts):
            raise InvalidRequest("input must not contain empty strings", "input")
        out = await state["triton"].embed(texts)
        dim = out.vectors.shape[1]
        if req.dimensions is not None and req.dimensions != dim:
            raise InvalidRequest(f"dimensions={req.dimensions} is not supported: this model returns {dim}", "dimensions")
        data = []
        for i, vec in enumerate(out.vectors):
            emb = base64.b64encode(vec.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" else vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = int(sum(out.prompt_tokens))
        return {"object": "list", "data": data, "model": model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _log_user(kind: str, *ids: str | None) -> None:
        for ident in ids:
            if ident:
                log.info("%s request for end user %s", kind, ident)  # the end-user id, kept for abuse tracing

    def _usage(g) -> dict:
        return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                "total_tokens": g.prompt_tokens + g.completion_tokens}

    def _sse(chunks, include_usage: bool, make_chunk, rid: str, kind: str) -> StreamingResponse:
        """Server-sent events: one ``data:`` line per delta, an optional usage chunk, ``[DONE]``.
        An error after the stream started is sent as an OpenAI error object, then ``[DONE]``."""

        async def events():
            last = None
            try:
                async for g in chunks:
                    last = g
                    yield f"data: {json.dumps(make_chunk(g))}\n\n"
                if include_usage and last is not None:
                    usage = {"id": rid, "object": kind, "created": int(time.time()), "model": model_id,
                             "choices": [], "usage": _usage(last)}
                    yield f"data: {json.dumps(usage)}\n\n"
            except APIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _first_then_rest(agen):
        # Pull the first delta before answering 200, so a refused request (bad params, too
        # long) still gets a plain HTTP 400 rather than an error inside a 200 stream.
        first = await agen.__anext__()

        async def rest():
            yield first
            async for g in agen:
                yield g

        return rest()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        _check_model(req.model, "generate")
        _log_user("completions", req.user)
        rid, created_at = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunks = await _first_then_rest(state["triton"].generate_stream(req.prompt, req.sampling_params(),
                                                                             echo=req.echo))
            return _sse(chunks, bool(req.stream_options and req.stream_options.include_usage), lambda g: {
                "id": rid, "object": "text_completion", "created": created_at, "model": model_id,
                "choices": [{"index": 0, "text": g.text, "finish_reason": g.finish_reason or None, "logprobs": None}],
            }, rid, "text_completion")
        g = await state["triton"].generate(req.prompt, req.sampling_params(), echo=req.echo)
        return {"id": rid, "object": "text_completion", "created": created_at, "model": model_id,
                "choices": [{"index": 0, "text": g.text, "finish_reason": g.finish_reason, "logprobs": None}],
                "usage": _usage(g)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        _check_model(req.model, "generate")
        _log_user("chat", req.user, req.safety_identifier)
        rid, created_at = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunks = await _first_then_rest(state["triton"].generate_stream(_chat_prompt(req), req.sampling_params()))
            sent_role = False

            def chunk(g):
                nonlocal sent_role
                delta = {"content": g.text} if sent_role else {"role": "assistant", "content": g.text}
                sent_role = True
                return {"id": rid, "object": "chat.completion.chunk", "created": created_at, "model": model_id,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": g.finish_reason or None,
                                     "logprobs": None}]}

            return _sse(chunks, bool(req.stream_options and req.stream_options.include_usage), chunk, rid,
                        "chat.completion.chunk")
        g = await state["triton"].generate(_chat_prompt(req), req.sampling_params())
        return {"id": rid, "object": "chat.completion", "created": created_at, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": g.text},
                             "finish_reason": g.finish_reason, "logprobs": None}],
                "usage": _usage(g)}

    return app
