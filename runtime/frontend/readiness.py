"""An instance's serving lifecycle: closed until warm, open, draining.

- :class:`Gate`: a public loopback port that forwards TCP connections to a private one. Triton
  listens on private ports from its start; the public KServe HTTP and gRPC ports stay closed
  (connection refused) until the engine has loaded and answered a warm-up request, so a
  client or load balancer never reaches a Triton that is still loading.
- :class:`Lifecycle`: readiness (false until warm, while the engine is dead or stalled, and again
  from the first SIGTERM), the count of in-flight OpenAI requests (:class:`InflightMiddleware`,
  counted until the last byte of a streamed body), and the drain: refuse new requests with 503, close the gates to new
  connections, wait for in-flight requests up to the drain timeout, then stop the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

__all__ = ["Gate", "InflightMiddleware", "Lifecycle"]

log = logging.getLogger("modelops.frontend")


PRIVATE_HOST = "127.0.0.1"  # Triton's own HTTP/gRPC listeners, behind the gates


class Gate:
    """Forward ``host:public_port`` → ``127.0.0.1:private_port`` once :meth:`open` is called.

    Byte-for-byte, so HTTP/1.1 and HTTP/2 (gRPC, including bidirectional streams) pass through.
    The private side is loopback only: nothing outside the instance reaches Triton around the gate.
    """

    def __init__(self, name: str, host: str, public_port: int, private_port: int) -> None:
        self.name, self.host, self.public_port, self.private_port = name, host, public_port, private_port
        self._server: asyncio.AbstractServer | None = None

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.public_port)
        log.info("gate %s open: %s:%d → %d", self.name, self.host, self.public_port, self.private_port)

    async def close(self) -> None:
        """Stop accepting connections; connections already forwarded run on."""
        if self._server is not None:
            self._server.close()
            self._server = None
            log.info("gate %s closed to new connections", self.name)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(PRIVATE_HOST, self.private_port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()  # half-close: the other direction may still be answering
            except (ConnectionError, OSError, RuntimeError):  # RuntimeError: the other side's transport closed
                pass

        # Both directions as tasks this handler owns: when it ends (or is cancelled) neither is left
        # pending for the collector ("Task was destroyed but it is pending!" in the instance log).
        pipes = [asyncio.ensure_future(pipe(reader, up_writer)), asyncio.ensure_future(pipe(up_reader, writer))]
        try:
            await asyncio.gather(*pipes)
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (up_writer, writer):
                try:
                    w.close()
                except RuntimeError:
                    pass


class Lifecycle:
    """Readiness, in-flight requests and the drain of one instance.

    Args:
        gates: opened after warm-up, closed on drain; drain_timeout: seconds in-flight requests
        get after SIGTERM before the server stops anyway.
    """

    def __init__(self, gates: list[Gate], drain_timeout: float) -> None:
        self.gates, self.drain_timeout = gates, drain_timeout
        self.warm = False
        self.draining = False
        self.inflight = 0
        self.stop_server = None  # set by the server: a callable that makes it exit
        self.on_ready = None  # called once, when the instance turns ready
        self.engine = None  # an EngineWatch (runtime/frontend/engine_watch.py): its state gates readiness
        self.on_engine_dead = None  # called once with the EngineState when the engine died
        self.refused = {"loading": 0, "engine_unavailable": 0, "draining": 0}  # 503s answered, by code
        self._idle = asyncio.Event()

    @property
    def engine_problem(self) -> str:
        """Why the engine cannot serve now (dead or stalled), or "" when it can."""
        state = self.engine.state if self.engine is not None else None
        return "" if state is None or state.serving else state.cause

    @property
    def ready(self) -> bool:
        return self.warm and not self.draining and not self.engine_problem

    async def open(self) -> None:
        for gate in self.gates:
            await gate.open()
        self.warm = True
        if self.on_ready is not None:
            self.on_ready()

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def drain(self) -> None:
        """Readiness false, gates closed, wait for in-flight requests (bounded), then stop."""
        if self.draining:
            return
        self.draining = True
        t0 = time.monotonic()
        log.info("draining: readiness false, %d request(s) in flight, up to %.0f s", self.inflight,
                 self.drain_timeout)
        for gate in self.gates:
            await gate.close()
        if self.inflight:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=self.drain_timeout)
            except asyncio.TimeoutError:
                log.warning("drain timeout: %d request(s) still in flight after %.0f s", self.inflight,
                            self.drain_timeout)
        log.info("drained in %.2f s; stopping", time.monotonic() - t0)
        if self.stop_server is not None:
            self.stop_server()


LOADING_RETRY_AFTER_S = 5  # a load takes tens of seconds; a client need not ask every 100 ms


async def _unavailable(send, code: str, message: str, retry_after: int, kserve: bool = False) -> None:
    body = json.dumps({"error": message} if kserve else {"error": {
        "message": message, "type": "service_unavailable", "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", str(retry_after).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class InflightMiddleware:
    """ASGI middleware: counts OpenAI API requests (and the KServe generate requests the frontend
    passes to Triton: runtime/frontend/kserve_generate.py) until their response body is
    complete, and answers 503 (OpenAI's error shape, KServe's on ``/v2/``; ``Retry-After``) to
    new ones while the engine loads (code ``loading``), while it is dead or stalled
    (``engine_unavailable``) and once the instance drains (``draining``). ``/v1/models``
    always answers: it lists the model only while the instance can serve (app.py)."""

    def __init__(self, app, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(("/v1/", "/v2/")) or scope["path"] == "/v1/models":
            return await self.app(scope, receive, send)
        kserve = scope["path"].startswith("/v2/")
        if self.lifecycle.draining:
            self.lifecycle.refused["draining"] += 1
            return await _unavailable(send, "draining", "this instance is draining (shutting down); retry on another",
                                      1, kserve)
        if not self.lifecycle.warm:
            self.lifecycle.refused["loading"] += 1
            return await _unavailable(send, "loading", "the model is still loading on this instance (engine not "
                                      "warmed up yet); retry after the Retry-After seconds", LOADING_RETRY_AFTER_S,
                                      kserve)
        if problem := self.lifecycle.engine_problem:
            self.lifecycle.refused["engine_unavailable"] += 1
            return await _unavailable(send, "engine_unavailable", f"the engine cannot serve: {problem}; retry on "
                                      "another instance", 1, kserve)
        self.lifecycle.enter()
        done = False

        async def counted_send(message):
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.lifecycle.leave()

        try:
            await self.app(scope, receive, counted_send)
        finally:
            if not done:
                done = True
                self.lifecycle.leave()
