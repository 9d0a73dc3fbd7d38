"""OpenAI-compatible HTTP API (FastAPI) for one model served by Triton: the app, put together.

Here: the instance's own routes (GET /health: live; GET /ready: warmed up, engine alive, not
draining; GET /metrics; GET /v1/models), its warm-up and engine watch, and the guards every
request passes (the router's secret, the version header). The model's routes live in
embeddings.py (POST /v1/embeddings, /score, /rerank) and generate.py (POST /v1/completions,
/v1/chat/completions); requests are parsed by protocol.py (unknown or unsupported fields → 400
naming the field) and every error is answered by errors.py's handlers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from modelops.tenancy import INSTANCE_SECRET_HEADER
from runtime.frontend.embeddings import embedding_routes
from runtime.frontend.errors import APIError, InvalidRequest, ModelNotFound, install_error_handlers
from runtime.frontend.generate import generate_routes
from runtime.frontend.kserve_generate import kserve_generate_routes
from runtime.frontend.metrics import CONTENT_TYPE, merged_metrics
from runtime.frontend.readiness import InflightMiddleware, Lifecycle
from runtime.frontend.served import Served
from runtime.frontend.shadow import ShadowMirror
from runtime.frontend.triton import TritonModel

__all__ = ["create_app"]

log = logging.getLogger("modelops.frontend")


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


# What anyone on the instance's host may ask: liveness, readiness and metrics (the router's and
# the provider's probes, the autoscaler's reads).
_PROBES = frozenset({"/health", "/ready", "/metrics"})

def create_app(*, model_id: str, version: str, task: str, triton_grpc_url: str, triton_model: str,
               triton_metrics_url: str = "", lifecycle: Lifecycle | None = None, openai: bool = True,
               instance_secret: str = "", shadow_router: str = "", triton_http_url: str = "",
               frontend_token: str = "") -> FastAPI:
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
        triton_http_url: ``http://host:port`` of Triton's (private) HTTP endpoint; for a generate
            model KServe's HTTP generate routes are passed there from here (whatever the task:
            Triton answers for the model), with the API key they count for
            (runtime/frontend/kserve_generate.py); empty: not served here.
        frontend_token: sent with each ``openai_request`` (:data:`modelops.io_contract.FRONTEND_TOKEN_HEADER`);
            the backend takes that input only with the token Triton's environment has.
    """
    lifecycle = lifecycle or Lifecycle([], drain_timeout=30)
    served = Served(model_id, version, task, mirror=ShadowMirror(shadow_router, model_id))
    clients = served.clients

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        clients["triton"] = TritonModel(triton_grpc_url, triton_model, secret=instance_secret,
                                        frontend_token=frontend_token)
        clients["http"] = httpx.AsyncClient()
        warm = asyncio.create_task(_warm_up(served.triton, task, model_id, lifecycle))
        watch = asyncio.create_task(_watch_engine(lifecycle, served.triton)) if lifecycle.engine else None
        yield
        warm.cancel()
        if watch is not None:
            watch.cancel()
        await served.triton.close()
        await clients["http"].aclose()
        await served.mirror.close()

    app = FastAPI(title=f"modelops OpenAI frontend: {model_id}", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    app.add_middleware(InflightMiddleware, lifecycle=lifecycle)
    install_error_handlers(app)
    created = int(time.time())

    if instance_secret:
        @app.middleware("http")
        async def _from_the_router_only(request: Request, call_next):
            if request.url.path not in _PROBES and not hmac.compare_digest(
                    request.headers.get(INSTANCE_SECRET_HEADER, "").encode(), instance_secret.encode()):
                err = InvalidRequest("this instance takes requests from its router only: send them to the router "
                                     "(`modelops up` prints its address)", None, "not_from_router")
                kserve = request.url.path.startswith("/v2/")  # KServe's shape there
                return JSONResponse({"error": err.message} if kserve else err.body(), status_code=403)
            return await call_next(request)

    @app.middleware("http")
    async def _version_header(request: Request, call_next):
        response = await call_next(request)
        response.headers["X-Model-Version"] = version  # which version answered, behind the router
        return response

    @app.get("/health")
    async def health() -> dict:
        return {"status": "live"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        # False until the warm-up request was answered, while the engine is dead or stalled, and
        # again from the first SIGTERM.
        ok = lifecycle.ready and await served.triton.ready()
        body = {"ready": ok, "draining": lifecycle.draining, "inflight": lifecycle.inflight}
        if problem := lifecycle.engine_problem:
            body["engine"] = problem
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Triton's metrics and vLLM's (runtime/frontend/metrics.py) in one Prometheus scrape."""
        return Response(await merged_metrics(clients["http"], triton_metrics_url, model_id, version,
                                             lifecycle.refused, not lifecycle.engine_problem, served.usage,
                                             served.mirror),
                        media_type=CONTENT_TYPE)

    if triton_http_url:
        app.include_router(kserve_generate_routes(clients, triton_http_url, instance_secret))

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
        listed = task != "tabular" and lifecycle.ready and await served.triton.ready()
        return {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "modelops", "version": version}
        ] if listed else []}

    # Every OpenAI route on every model: one of another task answers 400 naming `model`.
    app.include_router(embedding_routes(served))
    app.include_router(generate_routes(served))
    return app
