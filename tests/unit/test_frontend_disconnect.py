"""runtime.frontend.disconnect: a unary handler's work is cancelled when its client goes, and
runtime.frontend.access_log: probes and scrapes stay out of the instance log."""

from __future__ import annotations

import asyncio
import logging

import pytest

from runtime.frontend.access_log import quiet_probes
from runtime.frontend.disconnect import CLIENT_CLOSED, ClientGone, until_disconnect


class _Request:
    """The ASGI side of a request whose body was read: ``http.disconnect`` after ``gone_s``."""

    method, url = "POST", type("U", (), {"path": "/v1/chat/completions"})()

    def __init__(self, gone_s: float | None) -> None:
        self.gone_s = gone_s

    async def receive(self) -> dict:
        if self.gone_s is None:
            await asyncio.Event().wait()  # never
        await asyncio.sleep(self.gone_s)
        return {"type": "http.disconnect"}


def test_the_work_of_a_client_that_went_away_is_cancelled_and_cleaned_up():
    cleaned = []

    async def work() -> str:
        try:
            await asyncio.sleep(10)
            return "answer"
        finally:
            cleaned.append(True)  # where the gRPC stream to Triton is closed

    async def run():
        return await until_disconnect(_Request(0.05), work())

    with pytest.raises(ClientGone) as e:
        asyncio.run(asyncio.wait_for(run(), 2))
    assert cleaned == [True] and e.value.response().status_code == CLIENT_CLOSED


def test_an_answer_before_any_disconnect_is_returned_and_errors_pass_through():
    async def answer() -> str:
        await asyncio.sleep(0.01)
        return "answer"

    async def refuse() -> str:
        raise ValueError("bad field")

    assert asyncio.run(until_disconnect(_Request(None), answer())) == "answer"
    with pytest.raises(ValueError, match="bad field"):
        asyncio.run(until_disconnect(_Request(None), refuse()))


def test_probes_and_scrapes_are_not_logged_but_requests_are(caplog):
    quiet_probes()
    access = logging.getLogger("uvicorn.access")
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        for method, path, status in (("GET", "/ready", 503), ("GET", "/health", 200), ("GET", "/metrics", 200),
                                     ("GET", "/ready?x=1", 200), ("POST", "/v1/completions", 200),
                                     ("GET", "/v1/models", 200)):
            access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", method, path, "1.1", status)
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ['127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200',
                      '127.0.0.1:5 - "GET /v1/models HTTP/1.1" 200'], logged
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
