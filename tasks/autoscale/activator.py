"""The activator: where the router holds requests for a version at zero instances (``scaling.min:
0``) while the autoscaler starts one, as Knative's activator does for KServe.

The router (:mod:`tasks.traffic.haproxy`) sends such a version's share of traffic to a hold
server, this HTTP server on the Unix socket ``<home>/run/activator.sock``, with the model in
its hold server's name (:func:`~tasks.traffic.interface.hold_server`) in ``x-modelops-server``. It runs inside the
autoscaler daemon, so a held request wakes the autoscaler at once (no wait for its next tick):

- each held request counts as demand for its version (:meth:`Activator.demand`), which makes the
  autoscaler start an instance;
- once the registry has a running instance of the version, the request goes to it as it came
  (OpenAI paths and KServe's HTTP generate routes to its frontend, other ``/v2/`` paths to its
  KServe HTTP endpoint) and the answer, streams included, comes back as it is sent, with
  ``x-modelops-held-s``: the seconds it was held (the first request's is the version's cold start
  as a client sees it);
- past ``router_hold_s`` (120 s), or at once while the version's last start failed and the
  autoscaler is backing off, the client gets 503 with ``Retry-After``, in the OpenAI error shape
  (KServe's ``{"error": ...}`` on ``/v2/`` paths). The server answers 529 for it, which the router
  rewrites to 503 (see :func:`tasks.traffic.haproxy._hold_lines`);
- a request whose version stops being served while it waits (a rollout moved the weight off a
  version at zero) goes back to the router, which routes it as it routes a new one;
- a client that hangs up stops being held.

Only a version's first requests pay this path: once its instance is routed the router sends to it
directly. Facts: Knative Serving's router sends a revision at zero to its activator, which
buffers the requests, reports them to the autoscaler and forwards them once a pod is ready
(knative.dev/docs/serving/request-flow, "Scale From Zero").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from modelops.registry import Registry
from tasks.traffic.interface import held_version

__all__ = ["Activator", "GIVE_UP_STATUS"]

log = logging.getLogger(__name__)

GIVE_UP_STATUS = 529  # the router turns it into 503 (no retry-on replays it)
RETRY_AFTER_S = 10  # what a client that was held too long is told to wait
MAX_HELD = 1024  # held requests at once, all versions together; past it a request gets 503 at once
POLL_S = 0.25  # how often the held requests of a version look for a running instance (one read for all)
# Not forwarded either way: hop-by-hop headers (RFC 9110 7.6.1), the router's two, and the length
# and host the relay sets again.
_DROP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host",
         "content-length", "x-modelops-server"}


class Activator:
    """The hold server (see the module docstring), on its own thread and event loop.

    Args:
        registry: where running instances are found.
        router_url: the router's base URL (``http://127.0.0.1:<router_port>``), for a request
            whose version stopped being served while it was held.
        socket_path: the Unix socket to listen on (``Settings.activator_socket``).
        hold_s: the longest a request is held (``router_hold_s``), seconds.
        wake: called with ``(model_id, version)`` when a request is held, from the server's thread.
        backoff: ``(model_id, version)`` → ``(seconds left, why)`` while the version's last start
            failed and the autoscaler waits before trying again, else None.
    """

    def __init__(self, registry: Registry, router_url: str, socket_path: Path, hold_s: float,
                 wake: Callable[[str, str], None] = lambda m, v: None,
                 backoff: Callable[[str, str], tuple[float, str] | None] = lambda m, v: None) -> None:
        self.registry, self.router_url, self.socket_path, self.hold_s = registry, router_url, socket_path, hold_s
        self.wake, self.backoff = wake, backoff
        self._held: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None
        self._lookups: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}  # the server's loop only
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=methods)], lifespan=self._lifespan)
        self._server = uvicorn.Server(uvicorn.Config(app, uds=str(socket_path), log_level="warning", access_log=False,
                                                     timeout_keep_alive=10, timeout_graceful_shutdown=5,
                                                     server_header=False,
                                                     lifespan="on"))
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        """Listen on the socket (a stale one is replaced); returns once it accepts.

        Raises:
            RuntimeError: it did not start within ``timeout`` seconds.
        """
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._server.run, name="activator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the activator did not start on {self.socket_path}")
            time.sleep(0.02)
        log.info("activator listening on %s (requests held up to %.0f s)", self.socket_path, self.hold_s)

    def stop(self) -> None:
        """Stop listening; requests still held end with the server."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self.socket_path.unlink(missing_ok=True)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        # One client on the server's loop; a stream may take minutes, a connect may not.
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0)) as self._client:
            yield

    # -- demand --------------------------------------------------------------------------------
    def demand(self, model_id: str, version: str) -> int:
        """Requests held now for ``version`` of ``model_id``."""
        with self._lock:
            return self._held[(model_id, version)]

    def _running(self, model_id: str, version: str):
        """A running instance of the version (the least recently started), or None; and whether
        the version is still served."""
        row = self.registry.get_version(model_id, version)
        if row is None or row.state != "serving":
            return None, False
        running = [i for i in self.registry.instances(model_id, version) if i.state == "running" and i.endpoints]
        return (running[0] if running else None), True

    async def _lookup(self, model_id: str, version: str):
        """:meth:`_running`'s answer, read from the registry at most once per :data:`POLL_S` per
        version however many of its requests are held."""
        at, future = self._lookups.get((model_id, version), (0.0, None))
        if future is None or time.monotonic() - at > POLL_S:
            future = asyncio.ensure_future(asyncio.to_thread(self._running, model_id, version))
            self._lookups[(model_id, version)] = (time.monotonic(), future)
        return await asyncio.shield(future)

    # -- serving -------------------------------------------------------------------------------
    async def _handle(self, request: Request) -> Response:
        kserve = request.url.path.startswith("/v2/")
        held = held_version(request.headers.get("x-modelops-server", ""))
        if held is None:
            return _error(400, "not a held request: the router names the hold server in x-modelops-server", kserve,
                          retry=False)
        (model_id, version), key, t0 = held, held, time.monotonic()
        body = await request.body()
        if not kserve:  # KServe bodies may be binary tensors; OpenAI's are JSON
            try:
                json.loads(body)
            except ValueError as e:  # no engine needed to say so: answered now, nothing started
                return _error(400, f"the request body is not valid JSON: {e}", kserve, retry=False)
        with self._lock:
            if sum(self._held.values()) >= MAX_HELD:
                return _error(503, f"model {model_id} version {version} has no instance yet and {MAX_HELD} requests "
                              "are already held; retry later", kserve)
            self._held[key] += 1
        try:
            self.wake(model_id, version)
            log.info("holding a request for %s %s until an instance is up", model_id, version)
            while True:
                try:
                    instance, served = await self._lookup(model_id, version)
                except Exception as e:  # noqa: BLE001 - a registry hiccup: look again, within the bound
                    log.warning("%s %s: could not read the registry (%s); looking again", model_id, version, e)
                    instance, served = None, True
                if instance is not None:
                    break
                if not served:  # its hold server is gone with it: the router cannot send it back here
                    log.info("%s %s is no longer served; a request held %.1f s goes back to the router", model_id,
                             version, time.monotonic() - t0)
                    return await self._relay(request, body, self.router_url, "the router", time.monotonic() - t0)
                if (failing := self.backoff(model_id, version)) is not None:
                    wait, why = failing
                    return _error(GIVE_UP_STATUS, f"model {model_id} version {version} has no instance: its last "
                                  f"start failed ({why}); the next try is in {wait:.0f} s", kserve,
                                  retry_after=max(1, math.ceil(wait)))
                if time.monotonic() - t0 > self.hold_s:
                    log.warning("%s %s: a request held %.0f s found no instance up; answered 503", model_id,
                                version, self.hold_s)
                    return _error(GIVE_UP_STATUS, f"model {model_id} version {version} has no instance up after "
                                  f"{self.hold_s:.0f} s (MODELOPS_ROUTER_HOLD_S); one is starting, retry later",
                                  kserve, retry_after=RETRY_AFTER_S)
                if await request.is_disconnected():
                    log.info("%s %s: a held request's client hung up after %.1f s", model_id, version,
                             time.monotonic() - t0)
                    return Response(status_code=499)
                await asyncio.sleep(POLL_S)
        finally:
            with self._lock:
                self._held[key] -= 1
        # As the router sends them: KServe's HTTP generate routes to the frontend too
        # (runtime/frontend/kserve_generate.py).
        at_triton = kserve and not request.url.path.endswith(("/generate", "/generate_stream"))
        base = instance.endpoints["kserve_http"] if at_triton else instance.endpoints["openai"].removesuffix("/v1")
        return await self._relay(request, body, base, instance.name, time.monotonic() - t0)

    async def _relay(self, request: Request, body: bytes, base: str, name: str, held_s: float) -> Response:
        """Send the held request to ``base`` (an instance's endpoint, or the router; ``name`` says
        which in logs and errors) and stream its answer back as it comes."""
        kserve = request.url.path.startswith("/v2/")
        url = base + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP]
        assert self._client is not None
        try:
            upstream = await self._client.send(self._client.build_request(request.method, url, headers=headers,
                                                                          content=body), stream=True)
        except httpx.HTTPError as e:
            log.warning("%s: a held request could not reach it after %.1f s: %s", name, held_s, e)
            return _error(503, f"{name} did not take the held request ({e}); retry", kserve, retry_after=1)
        log.info("%s: a request held %.1f s went to it (%s %d)", name, held_s, request.url.path, upstream.status_code)
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP - {"content-length"}}
        out["x-modelops-held-s"] = f"{held_s:.2f}"
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out,
                                 background=BackgroundTask(upstream.aclose))


def _error(status: int, message: str, kserve: bool, retry: bool = True, retry_after: int = RETRY_AFTER_S) -> Response:
    """An error in the protocol's shape: KServe v2's ``{"error": message}`` or OpenAI's."""
    body = {"error": message} if kserve else {"error": {
        "message": message, "type": "server_error" if retry else "invalid_request_error", "param": None,
        "code": "no_instance_available" if retry else "invalid_body"}}
    return JSONResponse(body, status_code=status, headers={"retry-after": str(retry_after)} if retry else None)
