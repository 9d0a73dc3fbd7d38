"""A crash-looping canary under chat and streamed load costs no client request.

A generative model (the tiny Llama with a chat template in its manifest) serves v1; v2 ships a
plugin wheel (built here) that ends the engine's process, Triton's Python backend stub, at the
first client request it is given: after warm-up and the health checks, before any token, so
every request it held is answered 503 before any byte and HAProxy replays it on v1. The gate
sees those refusals (``modelops_requests_refused_total``) and rolls v2 back.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import SMALL_ENGINE_ARGS, manifest_file
from tests.integration.conftest import (TINY_CHAT_TEMPLATE, RouterLoad, Stack, build_wheel, engine_crash_plugin,
                                       seeded_chat, stream_failure)

pytestmark = pytest.mark.e2e

MODEL = "tiny-chat"
SEED = 15015  # the load's requests carry it; warm-up and health checks do not
def _streamed(api: str, body: dict):
    def send(client: httpx.Client, router: str) -> str | None:
        return stream_failure(client, f"{router}/{api}", {
            "model": MODEL, "max_tokens": 4, "temperature": 0, "seed": SEED, "stream": True, **body})

    send.__name__ = f"streamed {api}"
    return send


LOAD = [seeded_chat(MODEL, SEED),
        _streamed("chat/completions", {"messages": [{"role": "user", "content": "steady stream"}]}),
        _streamed("completions", {"prompt": "steady stream"})]


def _manifest(work, version: str, weights, **fields) -> str:
    (work / "tiny.jinja").write_text(TINY_CHAT_TEMPLATE)
    return manifest_file(work, **{"model_id": MODEL, "version": version, "source": f"file://{weights}",
                                  "task": "generate", "chat_template": "tiny.jinja",
                                  "engine_args": SMALL_ENGINE_ARGS, **fields})


def _status(stack: Stack) -> dict:
    status = json.loads(stack.modelops("status", "--json").stdout)
    (model,) = [m for m in status["models"] if m["model_id"] == MODEL]
    return {v["version"]: v for v in model["versions"]}


def test_crashing_canary_under_chat_and_streams_rolls_back_and_costs_no_request(stack: Stack, tmp_path):
    from tests.models.make_tiny_llama import make

    weights = make(tmp_path / "model")
    run = stack.modelops("announce", _manifest(tmp_path, "1", weights), "--wait")
    assert run.returncode == 0, run.stdout + run.stderr
    wheel = build_wheel(tmp_path, "modelops-test-canary-crash", engine_crash_plugin(SEED))
    canary = _manifest(tmp_path, "2", weights, plugins=[{"name": "modelops-test-canary-crash", "wheel": wheel.name}])
    with RouterLoad(stack.router, LOAD, workers=3) as load:
        time.sleep(2)
        run = stack.modelops("announce", canary, "--wait")
        time.sleep(2)
    out = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 1 and "rolled back" in out, out
    versions = _status(stack)
    assert versions["2"]["state"] == "failed" and "red-black rolled back" in versions["2"]["reason"], versions["2"]
    assert (versions["1"]["state"], versions["1"]["weight"]) == ("serving", 100)
    log = next((stack.home / "logs").glob(f"{MODEL}-2-*.log")).read_text()
    assert "engine died while serving: the engine process" in log and "exit code 3" in log, log[-3000:]
    verdict = out[out.index("rolled back"):][:200]
    print(f"crashing canary under chat, streamed chat and streamed completions: {load.sent} requests, "
          f"{load.failed} failed; {verdict}")
    assert load.failed == 0 and load.sent > 50, (load.codes, load.failures[:5])
