"""The batch API: OpenAI's Files and Batches endpoints, behind the router, and the live path's
opt-in result cache.

``POST/GET /v1/files``, ``GET/DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``;
``POST/GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``, as the
OpenAI API reference gives them, so the ``openai`` client's ``files`` and ``batches`` calls work
unchanged. Each batch is run by a flow run of the ``batch-inference`` deployment
(flows/batch.py); a batch whose runner went silent (a killed flow run or worker) gets a new one.

Who calls: the router checks the API key and sends its name in ``x-modelops-key``; files and
batches belong to that key, and another key neither sees nor touches them. With the stack's
instance secret (modelops/tenancy.py) only the router's requests are taken.

A live request for embeddings, scores or reranks with ``X-Modelops-Cache: use`` comes here too
(after the router checked its key, scope and limits) and is answered from the result cache, or on
a miss by the model's default version through the router's internal socket, as the caller's key's
request (its usage counts for the key; its limits are not applied twice).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import Body, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from modelops.batch import COMPLETION_WINDOWS, ENDPOINTS, LIVE_CACHE_PATHS, TERMINAL, cache_key, fresh_answer
from modelops.batch_store import BatchStore
from modelops.registry import Registry
from modelops.settings import Settings
from modelops.tenancy import INSTANCE_SECRET_HEADER, KEY_CHECKED_HEADER, KEY_HEADER
from tasks.batch.files import BatchFiles

__all__ = ["BATCH_DEPLOYMENT", "create_app", "resume_stale", "start_flow_run"]

log = logging.getLogger(__name__)

BATCH_DEPLOYMENT = "batch-inference/batch-inference"  # <flow name>/<deployment name> (prefect.yaml)
_MAX_RESUMES = 5  # flow runs started for one batch after its first, before it is failed
_NOT_FORWARDED = {"host", "content-length", "content-type", "connection", "transfer-encoding", "authorization",
                  KEY_HEADER, KEY_CHECKED_HEADER, "x-modelops-cache", "x-model-version",
                  INSTANCE_SECRET_HEADER}


class ApiError(Exception):
    """An answer in OpenAI's error shape: HTTP ``status``, ``code``, ``message``, ``param``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                   "server_error", "param": param, "code": code}}, status_code=status)


def start_flow_run(batch_id: str) -> str:
    """Start a flow run of the ``batch-inference`` deployment for ``batch_id``; returns its id.
    Needs the Prefect API (PREFECT_API_URL and its credentials in the environment)."""
    from prefect.deployments import run_deployment

    run = run_deployment(BATCH_DEPLOYMENT, parameters={"batch_id": batch_id}, flow_run_name=batch_id, timeout=0,
                         as_subflow=False, tags=["modelops", "batch"])
    return str(run.id)


def flow_run_waiting(flow_run_id: str) -> bool:
    """Whether that flow run is still to start or starting (Prefect's SCHEDULED, PENDING or
    RUNNING state): a batch no runner took yet is waiting for a worker, not lost. False when it
    ended (a crash, a failure, a cancel) or there is no such run."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state_type
    except (ObjectNotFound, ValueError):
        return False
    return state is not None and state.value in ("SCHEDULED", "PENDING", "RUNNING")


def resume_stale(store: BatchStore, stale_after_s: float, start: Callable[[str], str],
                 waiting: Callable[[str], bool] = flow_run_waiting, files: BatchFiles | None = None) -> list[str]:
    """Give every active batch whose runner has been silent for ``stale_after_s`` a new flow run
    (its lease released, so the new runner takes it); fail one that needed more than
    :data:`_MAX_RESUMES`. A batch no runner took yet is left to its flow run while that is
    ``waiting`` (a busy or restarting worker starts it later).

    A batch with nothing left to answer (past its window, or asked to cancel) ends here instead,
    with no worker: one no runner took, with nothing to write; one a runner began, with ``files``
    given, with the output and error files of its written lines (tasks/batch/run.py
    ``end_stale``). Returns the ids resumed."""
    resumed = []
    for b in store.stale(stale_after_s):
        if b.status == "cancelling" or time.time() > (b.expires_at or float("inf")):
            ending = "cancelled" if b.status == "cancelling" else "expired"
            if b.in_progress_at is None:
                if store.update(b.id, only_from=(b.status,), status=ending, runner="").status == ending:
                    log.warning("batch %s %s before any runner took it (flow run %s never started: is a worker up?)",
                                b.id, ending, b.flow_run_id or "none")
                continue
            if files is not None:
                from tasks.batch.run import end_stale  # the runner's code: Prefect and the pacing come with it

                if (ended := end_stale(store, files, b.id, stale_after_s)) is not None:
                    log.warning("batch %s %s by the sweep, its runner silent for %.0f s: the lines answered are in "
                                "its output and error files", b.id, ended, stale_after_s)
                continue
        if not b.heartbeat and b.flow_run_id and waiting(b.flow_run_id):
            continue
        if b.resumes >= _MAX_RESUMES:
            store.update(b.id, status="failed", runner="", errors_json='{"object":"list","data":[{"code":'
                         '"no_runner","message":"no flow run finished this batch after %d tries; see the worker and '
                         'the batch-inference flow runs in Prefect","param":null,"line":null}]}' % (_MAX_RESUMES + 1))
            continue
        # No runner and no heartbeat: the new flow run is judged by its state until its runner starts.
        store.update(b.id, runner="", heartbeat=0.0, resumes=b.resumes + 1)
        try:
            store.update(b.id, flow_run_id=start(b.id))
            log.warning("batch %s: its runner was silent for %.0f s; resumed by a new flow run", b.id, stale_after_s)
            resumed.append(b.id)
        except Exception as e:  # Prefect unreachable: the next sweep tries again
            log.warning("batch %s: could not start a flow run to resume it: %s", b.id, e)
    return resumed


def create_app(settings: Settings, store: BatchStore, files: BatchFiles,
               start: Callable[[str], str] = start_flow_run, secret: str | None = None,
               router_transport: httpx.BaseTransport | None = None) -> FastAPI:
    """The batch API as an ASGI app, with the live requests' cache route.

    Args:
        store: records of files and batches, and the result cache; files: their bytes.
        start: starts a batch's flow run and returns its id.
        secret: the stack's instance secret; when given, a request without it is a 403.
        router_transport: how the cache route reaches the router for a miss (its internal
            socket; None: ``settings.router_url`` over TCP).
    """
    app = FastAPI(title="modelops batch API", docs_url=None, redoc_url=None, openapi_url=None)
    max_bytes = settings.router_max_body_mb << 20

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.code, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if tuple(first["loc"]) == ("body",):
            return _error(400, "invalid_json", "the request body must be a JSON object (send Content-Type: "
                          "application/json)")
        field = str(first["loc"][-1])
        return _error(400, "invalid_request", f"{field}: {first['msg']}", field)

    @app.middleware("http")
    async def _from_router(request: Request, call_next):
        if secret is not None and request.url.path != "/health" and not hmac.compare_digest(
                request.headers.get(INSTANCE_SECRET_HEADER, "").encode(), secret.encode()):
            return _error(403, "not_from_router", "the batch API takes requests through the router only")
        return await call_next(request)

    def owner(request: Request) -> str:
        return request.headers.get(KEY_HEADER, "")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    # -- files -----------------------------------------------------------------------------
    @app.post("/v1/files")
    def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict:
        if purpose != "batch":
            raise ApiError(400, "invalid_purpose", f"purpose {purpose!r} is not served here; upload batch input "
                           "files with purpose \"batch\"", "purpose")
        data = file.file.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ApiError(413, "file_too_large", f"the file is over {settings.router_max_body_mb} MiB "
                           "(MODELOPS_ROUTER_MAX_BODY_MB); split it into several batches", "file")
        if not data.strip():
            raise ApiError(400, "empty_file", "the file is empty; give one JSON request per line", "file")
        file_id = store.new_file_id()
        files.put_file(file_id, data)  # the bytes first: a record never points at nothing
        return store.record_file(file_id, owner(request), file.filename or "upload.jsonl", purpose,
                                 len(data)).to_openai()

    @app.get("/v1/files")
    def list_files(request: Request, purpose: str | None = None) -> dict:
        return {"object": "list", "data": [f.to_openai() for f in store.files(owner(request), purpose)],
                "has_more": False}

    def own_file(request: Request, file_id: str):
        f = store.file(file_id, owner(request))
        if f is None:
            raise ApiError(404, "file_not_found", f"no file {file_id} (of this API key)", "file_id")
        return f

    @app.get("/v1/files/{file_id}")
    def get_file(request: Request, file_id: str) -> dict:
        return own_file(request, file_id).to_openai()

    @app.get("/v1/files/{file_id}/content")
    def file_content(request: Request, file_id: str) -> Response:
        f = own_file(request, file_id)
        return Response(files.read_file(f.id), media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{f.filename}"'})

    @app.delete("/v1/files/{file_id}")
    def delete_file(request: Request, file_id: str) -> dict:
        f = own_file(request, file_id)
        store.delete_file(f.id)  # the record first: a half-done delete leaves bytes, not a dangling record
        files.delete_file(f.id)
        return {"id": f.id, "object": "file", "deleted": True}

    # -- batches ---------------------------------------------------------------------------
    @app.post("/v1/batches")
    def create_batch(request: Request, body: dict[str, Any] = Body(...)) -> dict:
        if unknown := sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}):
            raise ApiError(400, "unknown_parameter", f"unknown field(s) {', '.join(unknown)}; a batch has "
                           "input_file_id, endpoint, completion_window and metadata", unknown[0])
        if body.get("endpoint") not in ENDPOINTS:
            raise ApiError(400, "invalid_endpoint", f"endpoint {body.get('endpoint')!r} is not one of "
                           f"{', '.join(ENDPOINTS)}", "endpoint")
        if body.get("completion_window") not in COMPLETION_WINDOWS:
            raise ApiError(400, "invalid_completion_window", f"completion_window {body.get('completion_window')!r} "
                           f"is not one of {', '.join(COMPLETION_WINDOWS)} (OpenAI's)", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
            raise ApiError(400, "invalid_metadata", "metadata is at most 16 pairs of strings (keys up to 64 "
                           "characters, values up to 512)", "metadata")
        input_file_id = body.get("input_file_id")
        f = store.file(input_file_id, owner(request)) if isinstance(input_file_id, str) else None
        if f is None:
            raise ApiError(404, "file_not_found", f"input_file_id: no file {input_file_id!r} (of this API key); upload "
                           "it first (POST /v1/files, purpose \"batch\")", "input_file_id")
        if f.purpose != "batch":
            raise ApiError(400, "invalid_input_file", f"file {f.id} has purpose {f.purpose!r}; a batch reads a "
                           "file uploaded with purpose \"batch\"", "input_file_id")
        batch = store.add_batch(owner(request), body["endpoint"], f.id, body["completion_window"], metadata)
        try:
            batch = store.update(batch.id, flow_run_id=start(batch.id))
        except Exception as e:  # Prefect unreachable: the stale sweep starts it once Prefect answers
            log.warning("batch %s: could not start its flow run yet: %s", batch.id, e)
        log.info("batch %s created by %r: %s on %s", batch.id, batch.owner or "(no key)", f.id, batch.endpoint)
        return batch.to_openai()

    def own_batch(request: Request, batch_id: str):
        b = store.batch(batch_id, owner(request))
        if b is None:
            raise ApiError(404, "batch_not_found", f"no batch {batch_id} (of this API key)", "batch_id")
        return b

    @app.get("/v1/batches")
    def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict:
        if not 1 <= limit <= 100:
            raise ApiError(400, "invalid_limit", f"limit {limit} is not within 1..100", "limit")
        all_ = store.batches(owner(request))
        ids = [b.id for b in all_]
        if after is not None and after not in ids:
            raise ApiError(404, "batch_not_found", f"after: no batch {after} (of this API key) to list after", "after")
        start = ids.index(after) + 1 if after is not None else 0
        page = all_[start:start + limit]
        return {"object": "list", "data": [b.to_openai() for b in page], "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None, "has_more": start + limit < len(all_)}

    @app.get("/v1/batches/{batch_id}")
    def get_batch(request: Request, batch_id: str) -> dict:
        return own_batch(request, batch_id).to_openai()

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(request: Request, batch_id: str) -> dict:
        b = own_batch(request, batch_id)
        if b.status in TERMINAL:
            raise ApiError(409, "batch_not_cancellable", f"batch {b.id} is already {b.status}", "batch_id")
        b = store.update(b.id, only_from=("validating", "in_progress"), status="cancelling")
        if b.status in TERMINAL:  # it ended meanwhile
            raise ApiError(409, "batch_not_cancellable", f"batch {b.id} is already {b.status}", "batch_id")
        log.info("batch %s: cancel requested (%s)", b.id, b.status)
        return b.to_openai()

    # -- the live path's opt-in cache (X-Modelops-Cache: use) ------------------------------
    router = httpx.Client(transport=router_transport, base_url=settings.router_url.removesuffix("/v1"), timeout=600)

    def live_cached(request: Request, body: dict[str, Any] = Body(...)) -> Response:
        """A live request the router sent here for its header: answered from the cache when the
        model's one default version answered it before, else by that version (pinned), whose
        200 answer is kept. ``X-Modelops-Cache`` says ``hit``, ``miss`` or ``bypass`` (no single
        default version: a red-black shift or an experiment under way; the request goes on
        unpinned, uncached)."""
        path, model = request.url.path, body.get("model")
        # An experiment chooses the version by the request's key: the cache would bypass it.
        version = store.registry.default_version(model) if isinstance(model, str) and \
            store.registry.experiment(model) is None else None
        key = cache_key(model, version, path, body) if version and settings.batch_cache_mb else None
        if key and (hit := store.cached(key)) is not None:
            return JSONResponse(fresh_answer(hit), headers={"X-Model-Version": version, "X-Modelops-Cache": "hit"})
        # The client's own headers go on (an experiment's key among them), not what the router set;
        # the miss is the caller's key's request: its usage, its limits already applied at the router.
        forwarded = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        if owner(request):
            forwarded |= {KEY_HEADER: owner(request), KEY_CHECKED_HEADER: "1"}
        try:
            r = router.post(path, json=body, headers={**forwarded, **({"X-Model-Version": version} if key else {})})
        except httpx.HTTPError as e:
            raise ApiError(502, "router_unreachable", f"the router did not answer the cache's miss: {e}") from None
        if key and r.status_code == 200 and r.headers.get("x-model-version") == version:
            store.cache(key, model, version, r.text)
            store.evict(settings.batch_cache_mb << 20)
        headers = {k: v for k, v in r.headers.items() if k.lower() in ("x-model-version", "x-request-id")}
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                        headers={**headers, "X-Modelops-Cache": "miss" if key else "bypass"})

    for path in LIVE_CACHE_PATHS:
        app.post(path)(live_cached)

    return app


def serve(settings: Settings, stopping: threading.Event) -> None:
    """Serve the batch API on ``<batch_host>:<batch_port>`` and sweep for stale batches every 5 s
    until ``stopping`` is set. Locally only the router's requests are taken (the instance
    secret); on Kubernetes (``provider`` ``kubernetes``) the pod's NetworkPolicy admits only the
    Gateway's proxies, which set ``x-modelops-key`` (tasks/kube/batch_api.py)."""
    import uvicorn

    from modelops.tenancy import stack_secret

    store, files = BatchStore(Registry(settings.registry)), BatchFiles(settings)
    secret = stack_secret(settings.instance_secret_file) if settings.provider == "local" else None
    from tasks import backends

    app = create_app(settings, store, files, secret=secret,
                     router_transport=backends.router(settings).platform_transport())
    server = uvicorn.Server(uvicorn.Config(app, host=str(settings.batch_host), port=settings.batch_port,
                                           log_level="warning"))

    def sweep() -> None:
        while not stopping.wait(5):
            try:
                resume_stale(store, settings.batch_stale_after_s, start_flow_run, files=files)
            except Exception:
                log.exception("stale batch sweep failed; trying again in 5 s")
        server.should_exit = True

    threading.Thread(target=sweep, name="batch-sweep", daemon=True).start()
    server.run()
