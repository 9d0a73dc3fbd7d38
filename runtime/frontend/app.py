"""OpenAI-compatible HTTP API (FastAPI) for one model served by Triton.

Routes: GET /health (live), GET /ready (warmed up, engine alive, not draining), GET /v1/models,
POST /v1/embeddings, /score, /v1/score, /rerank and /v1/rerank (task embed), POST /v1/completions
and /v1/chat/completions (task generate). Requests are parsed by protocol.py (unknown or
unsupported fields → 400 naming the field); embeddings, scores and reranking are TritonModel
embed calls (scores: cosine similarity, as vLLM scores with an embedding model), completions and
chat are handed as they came to vLLM's own OpenAI serving classes in the backend
(runtime/engine/openai_engine.py), whose answer is relayed.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import httpx
import numpy as np

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from modelops.io_contract import refused_param
from modelops.shadow import SHADOW_HEADER, answer_texts, stream_texts
from modelops.tenancy import INSTANCE_SECRET_HEADER
from runtime.frontend.disconnect import ClientGone, until_disconnect
from runtime.frontend.errors import APIError, InvalidRequest, ModelNotFound, UpstreamError
from runtime.frontend.readiness import InflightMiddleware, Lifecycle
from runtime.frontend.shadow import ShadowMirror
from runtime.frontend.protocol import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RerankRequest,
                                      ScoreRequest)
from runtime.frontend.triton import TritonModel
from runtime.frontend.usage import KEY_HEADER, KeyUsage
from runtime.frontend.metrics import CONTENT_TYPE, merged_metrics

__all__ = ["create_app"]

log = logging.getLogger("modelops.frontend")


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part)


async def _warm_up(triton: TritonModel, task: str, model_id: str, lifecycle: Lifecycle) -> None:
    """Wait for Triton to report the model ready, send one real request through the engine,
    then open the gates (readiness true). Retries until it works; the provider's deadline
    decides when a model that never warms up has failed."""
    t0 = time.monotonic()
    while True:
        try:
            if await triton.ready():
                if task == "tabular":
                    await triton.predict_zeros()
                    break
                if task == "embed":
                    await triton.embed(["warm-up"])
                    break
                # Through vLLM's serving layer, as every OpenAI request goes (model name: ours).
                replies = [r async for r in triton.openai("completions", {"model": model_id, "prompt": "warm-up",
                                                                          "max_tokens": 1})]
                if replies[-1].status == 200:
                    break
                log.warning("warm-up request answered %d: %s; retrying", replies[-1].status, replies[-1].body[:300])
        except APIError as e:
            log.warning("warm-up request failed (%s); retrying", e)
        await asyncio.sleep(0.5)
    await lifecycle.open()
    log.info("warm-up answered %.1f s after the frontend started; ready", time.monotonic() - t0)


async def _watch_engine(lifecycle: Lifecycle, triton: TritonModel) -> None:
    """Poll the engine's liveness (runtime/frontend/engine_watch.py) every POLL_S seconds: log
    each change; once dead (or stalled longer than ENGINE_WEDGED_EXIT_S: then its supervisor's
    restart is the way back), fail what waits on the engine and hand over to
    ``lifecycle.on_engine_dead`` (runtime/startup.py stops the instance)."""
    from runtime.frontend.engine_watch import ENGINE_WEDGED_EXIT_S, POLL_S, EngineState

    watch, last, stalled_since = lifecycle.engine, "starting", None
    while True:
        watch.beating = lifecycle.warm  # loading is not a stall: the engine loop beats once it serves
        try:
            state = watch.check()
        except Exception:  # noqa: BLE001 - a /proc read that went wrong must not end the watching
            log.exception("engine watch: check failed; trying again")
            await asyncio.sleep(POLL_S)
            continue
        if state.kind == "stalled":
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > ENGINE_WEDGED_EXIT_S:  # it will not come back by itself
                state = EngineState("dead", f"{state.cause}; stalled {ENGINE_WEDGED_EXIT_S:.0f} s (wedged)",
                                    transient=True)
        else:
            stalled_since = None
        if state.kind != last:
            if state.kind == "stalled":
                log.warning("engine stalled: %s; readiness false until it moves again", state.cause)
            elif state.kind == "alive" and last == "stalled":
                log.info("engine serves again; readiness restored")
            last = state.kind
        if state.kind == "dead":
            phase = "while serving" if lifecycle.warm else "during warm-up"
            triton.engine_died(state.cause)
            if lifecycle.on_engine_dead is not None:
                lifecycle.on_engine_dead(state, phase)
            return
        await asyncio.sleep(POLL_S)


def _code_of(doc: str) -> int:
    try:
        code = json.loads(doc)["error"]["code"]
        return code if isinstance(code, int) and 400 <= code < 600 else 400
    except (ValueError, KeyError, TypeError):
        return 400


# What anyone on the instance's host may ask: liveness, readiness and metrics (the router's and
# the provider's probes, the autoscaler's reads).
_PROBES = frozenset({"/health", "/ready", "/metrics"})

# Error types runtime/engine/openai_engine.py answers with → the OpenAI ``code`` clients see.
_BACKEND_CODES = {"StructuredOutputViolation": "structured_output_violation", "EngineError": "engine_error"}


def _vllm_error(status: int, body: str) -> APIError:
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


def create_app(*, model_id: str, version: str, task: str, triton_grpc_url: str, triton_model: str,
               triton_metrics_url: str = "", lifecycle: Lifecycle | None = None, openai: bool = True,
               instance_secret: str = "", shadow_router: str = "") -> FastAPI:
    """Build the app for one model.

    Args:
        model_id: the OpenAI ``model`` name clients send; version: reported in /v1/models.
        task: ``embed``, ``generate`` or ``tabular`` (decides which routes answer; a tabular model
            answers none of the OpenAI ones, it is served over KServe v2).
        triton_grpc_url: ``host:port`` of Triton's (private) gRPC endpoint; triton_model: its name.
        triton_metrics_url: Triton's /metrics, merged into this app's /metrics with vLLM's.
        lifecycle: readiness, gates and drain (:mod:`runtime.frontend.readiness`); a fresh one
            without gates when None.
        openai: False for ``execution_mode: separate``: only the instance's own routes (/health,
            /ready, /metrics) are served, every ``/v1`` path is a 404 that points at KServe v2.
        instance_secret: when set, every route but /health, /ready and /metrics answers 403
            unless the request carries it in ``x-modelops-instance-secret`` (the router adds it:
            modelops/tenancy.py); the calls to Triton carry it too.
        shadow_router: where the copies of requests the router marks for a shadow go
            (:class:`runtime.frontend.shadow.ShadowMirror`'s ``target``); empty: none are copied.
    """
    state: dict = {}
    lifecycle = lifecycle or Lifecycle([], drain_timeout=30)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["triton"] = TritonModel(triton_grpc_url, triton_model, secret=instance_secret)
        state["http"] = httpx.AsyncClient()
        warm = asyncio.create_task(_warm_up(state["triton"], task, model_id, lifecycle))
        watch = asyncio.create_task(_watch_engine(lifecycle, state["triton"])) if lifecycle.engine else None
        yield
        warm.cancel()
        if watch is not None:
            watch.cancel()
        await state["triton"].close()
        await state["http"].aclose()
        await mirror.close()

    app = FastAPI(title=f"modelops OpenAI frontend: {model_id}", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    app.add_middleware(InflightMiddleware, lifecycle=lifecycle)
    created = int(time.time())
    usage = KeyUsage()
    mirror = ShadowMirror(shadow_router, model_id)

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

    if instance_secret:
        @app.middleware("http")
        async def _from_the_router_only(request: Request, call_next):
            if request.url.path not in _PROBES and not hmac.compare_digest(
                    request.headers.get(INSTANCE_SECRET_HEADER, "").encode(), instance_secret.encode()):
                err = InvalidRequest("this instance takes requests from its router only: send them to the router "
                                     "(`modelops up` prints its address)", None, "not_from_router")
                return JSONResponse(err.body(), status_code=403)
            return await call_next(request)

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
            if task == "tabular":
                raise InvalidRequest(f"model {model_id!r} is a tabular (XGBoost) model: it is served over KServe v2 "
                                     f"(POST /v2/models/{model_id}/infer, or gRPC ModelInfer), not the OpenAI API",
                                     "model")
            kinds = {"embed": "an embedding model", "generate": "a generative model"}
            raise InvalidRequest(f"model {model_id!r} is {kinds[task]}; this endpoint needs {kinds[wanted_task]}",
                                 "model")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "live"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        # False until the warm-up request was answered, while the engine is dead or stalled, and
        # again from the first SIGTERM.
        ok = lifecycle.ready and await state["triton"].ready()
        body = {"ready": ok, "draining": lifecycle.draining, "inflight": lifecycle.inflight}
        if problem := lifecycle.engine_problem:
            body["engine"] = problem
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Triton's metrics and vLLM's (runtime/frontend/metrics.py) in one Prometheus scrape."""
        return Response(await merged_metrics(state["http"], triton_metrics_url, model_id, version,
                                             lifecycle.refused, not lifecycle.engine_problem, usage, mirror),
                        media_type=CONTENT_TYPE)

    if not openai:
        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def kserve_only(path: str) -> None:
            raise ModelNotFound(f"/{path}: model {model_id!r} runs in execution_mode separate and has no OpenAI API; "
                                f"it is served over KServe v2 (POST /v2/models/{model_id}/infer, or gRPC ModelInfer)",
                                None, "not_found")

        return app

    @app.get("/v1/models")
    async def models() -> dict:
        # Listed only while it can serve: not while the engine loads, nor once draining; never a
        # tabular model (embedded, it answers KServe only: every OpenAI route refuses it).
        listed = task != "tabular" and lifecycle.ready and await state["triton"].ready()
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "modelops", "version": version}
        ] if listed else []}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> dict:
        started = time.monotonic()
        _check_model(req.model, "embed")
        _log_user("embeddings", req.user)
        texts = [req.input] if isinstance(req.input, str) else req.input  # non-empty texts (protocol.py)
        out = await until_disconnect(request, state["triton"].embed(texts))
        dim = out.vectors.shape[1]
        if req.dimensions is not None and req.dimensions != dim:
            raise InvalidRequest(f"dimensions={req.dimensions} is not supported: this model returns {dim}", "dimensions")
        data = []
        for i, vec in enumerate(out.vectors):
            emb = base64.b64encode(vec.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" else vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = int(sum(out.prompt_tokens))
        usage.record(request.headers.get(KEY_HEADER), tokens)
        if request.headers.get(SHADOW_HEADER):
            mirror.offer(request.headers[SHADOW_HEADER], "embeddings",
                         req.model_dump(exclude_unset=True, by_alias=True, mode="json"), out.vectors.tolist(), started)
        return {"object": "list", "data": data, "model": model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(first: list[str], second: list[str], params: tuple[str, str]) -> tuple[list[float], int]:
        """The cosine similarity of each pair (one first text against every second one, or
        index by index) and the prompt tokens of all texts, each embedded once: what vLLM 0.32
        computes for an embedding model (vllm/entrypoints/pooling/scoring/io_processor.py,
        BiEncoderIOProcessor: torch cosine_similarity of the pooled embeddings). The sides go
        as two concurrent calls (Triton batches them together), so a refusal (a text over the
        context) names its side's field, ``params``."""
        one, two = await asyncio.gather(state["triton"].embed(first, param=params[0]),
                                        state["triton"].embed(second, param=params[1]))
        a, b = one.vectors.astype(np.float64), two.vectors.astype(np.float64)
        if len(a) == 1:
            a = np.repeat(a, len(b), axis=0)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        return ((a * b).sum(axis=1) / np.maximum(norms, 1e-8)).tolist(), int(sum(one.prompt_tokens + two.prompt_tokens))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest, request: Request) -> dict:
        _check_model(req.model, "embed")
        _log_user("score", req.user)
        first, second = req.sides()
        scores, tokens = await until_disconnect(request, _scores(first, second, req.pair))
        usage.record(request.headers.get(KEY_HEADER), tokens)
        # vLLM's ScoreResponse with its UsageInfo, every key as vLLM dumps it.
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_id,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None, "completion_tokens_details": None}}

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def rerank(req: RerankRequest, request: Request) -> dict:
        _check_model(req.model, "embed")
        _log_user("rerank", req.user)
        documents = [req.documents] if isinstance(req.documents, str) else req.documents
        scores, tokens = await until_disconnect(request, _scores([req.query], documents, ("query", "documents")))
        usage.record(request.headers.get(KEY_HEADER), tokens)
        results = [{"index": i, **({"document": {"text": d, "multi_modal": None}} if req.return_documents else {}),
                    "relevance_score": s} for i, (d, s) in enumerate(zip(documents, scores))]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: ties keep input order, as vLLM's
        return {"id": f"score-{uuid.uuid4().hex}", "model": model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results[:req.top_n] if req.top_n else results}

    def _log_user(kind: str, *ids: str | None) -> None:
        for ident in ids:
            if ident:
                log.info("%s request for end user %s", kind, ident)  # the end-user id, kept for abuse tracing

    async def _relay(api: str, req, stream: bool, request: Request):
        """Hand the audited body to vLLM's serving classes in the backend and answer with what
        they answer: one JSON document, or a stream of server-sent events. The first reply is
        awaited before answering, so a refused stream is a plain HTTP error, not a 200 stream.
        The answer's usage is counted for the request's key; a request the router marked for a
        shadow is copied once its answer is complete (a stream: its last event sent)."""
        started, body, key = time.monotonic(), req.body(), request.headers.get(KEY_HEADER)
        marked = request.headers.get(SHADOW_HEADER)
        replies = state["triton"].openai(api, body, on_usage=lambda p, c: usage.record(key, p, c))
        # Closing the iterator closes the gRPC stream: the backend then aborts the engine request.
        first = await replies.__anext__()
        if first.status != 200 or not stream:
            await replies.aclose()
            if first.status != 200:
                raise _vllm_error(first.status, first.body)
            if marked:
                mirror.offer(marked, api, body, answer_texts(api, json.loads(first.body)), started)
            return Response(first.body, media_type="application/json")
        if first.body.startswith("data: {\"error\"") and not first.final:
            # vLLM reports an error raised before the first token inside the stream (HTTP 200);
            # here it is the plain HTTP error it is.
            await replies.aclose()
            doc = first.body.removeprefix("data: ")
            raise _vllm_error(_code_of(doc), doc)

        async def events():
            reply, sent = first, []
            try:
                while True:
                    if reply.status != 200:  # refused after the stream started: an error event
                        yield f"data: {json.dumps(_vllm_error(reply.status, reply.body).body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    yield reply.body
                    if marked:
                        sent.append(reply.body)
                    if reply.final:
                        if marked:
                            mirror.offer(marked, api, body, stream_texts(api, sent), started)
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

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(req.model, "generate")
        _log_user("completions", req.user)
        # Until the answer (or a stream's first event): a stream's body notices a gone client itself.
        return await until_disconnect(request, _relay("completions", req, req.stream, request))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        _check_model(req.model, "generate")
        _log_user("chat", req.user, req.safety_identifier)
        return await until_disconnect(request, _relay("chat", req, req.stream, request))

    return app
