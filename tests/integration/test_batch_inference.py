"""Batch inference end to end on the session stack: the ``openai`` client → router → batch API →
a ``batch-inference`` flow run on the Prefect worker → router → Triton + vLLM (MiniLM) → output
file in moto's S3 (docs/batch.md). The runner's mechanics against stand-in instances, and the
bad inputs one by one, are tests/unit/test_batch_api.py."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from modelops.batch import TERMINAL
from tests.integration.conftest import Stack

pytestmark = pytest.mark.e2e

MODEL = "all-minilm-l6-v2"


def _client(stack: Stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.router, api_key="unused", max_retries=0)


def _lines(n: int, tag: str) -> list[dict]:
    return [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": MODEL, "input": f"{tag} sentence number {i}: " + "batch inference on the same "
                      "deployments as live traffic, " * 4}} for i in range(n)]


def _upload(client, lines: list) -> str:
    data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", data), purpose="batch").id


def _wait(client, batch_id: str, until=lambda b: b.status in TERMINAL, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b.status} ({b.request_counts}) after {timeout:.0f} s")


def _output(client, batch) -> tuple[list[dict], list[dict]]:
    def read(file_id):
        return [json.loads(x) for x in client.files.content(file_id).text.splitlines()] if file_id else []

    return read(batch.output_file_id), read(batch.error_file_id)


@pytest.fixture(scope="module")
def first_batch(stack: Stack, served) -> dict:
    """A batch of 40 embedding requests and two bad lines, run to its end."""
    client = _client(stack)
    lines = _lines(40, "first") + ["{not json", {**_lines(1, "chat")[0], "url": "/v1/chat/completions"}]
    file_id = _upload(client, lines)
    started = time.monotonic()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h",
                                  metadata={"suite": "integration"})
    done = _wait(client, batch.id)
    return {"file_id": file_id, "batch": done, "lines": lines, "seconds": time.monotonic() - started}


def test_a_batch_from_the_openai_client_answers_as_the_live_api_does(stack, first_batch):
    client, done, lines = _client(stack), first_batch["batch"], first_batch["lines"]
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (42, 40, 2)
    assert done.metadata == {"suite": "integration"} and done.model_extra["modelops"]["cache_hits"] == 0
    output, errors = _output(client, done)
    assert [o["custom_id"] for o in output] == [f"first-{i}" for i in range(40)]
    assert [e["error"]["code"] for e in errors] == ["invalid_json", "mismatched_endpoint"]
    # The oracle: the same requests through the router's real-time path.
    for i in (0, 17, 39):
        live = httpx.post(f"{stack.router}/embeddings", json=lines[i]["body"], timeout=60).json()
        ours = output[i]["response"]["body"]["data"][0]["embedding"]
        np.testing.assert_allclose(ours, live["data"][0]["embedding"], rtol=0, atol=1e-5)


def test_each_batch_is_a_flow_run_with_its_progress_and_the_cli_shows_it(stack, first_batch):
    done = first_batch["batch"]
    runs = stack.prefect.post("/flow_runs/filter", json={"flow_runs": {"name": {"any_": [done.id]}}}).json()
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
    assert runs[0]["id"] == done.model_extra["modelops"]["flow_run_id"]
    key = done.id.replace("_", "-")
    artifacts = stack.prefect.post("/artifacts/latest/filter", json={"artifacts": {"key": {"any_": [key]}}}).json()
    assert [(a["type"], a["data"]) for a in artifacts] == [("progress", 100.0)]
    shown = stack.modelops("batch", "status", done.id, "--json")
    assert shown.returncode == 0, shown.stderr
    row = json.loads(shown.stdout)
    assert (row["status"], row["request_counts"]["completed"], row["owner"]) == ("completed", 40, None)


def test_a_rerun_is_answered_from_the_cache_with_the_same_answers(stack, first_batch):
    client = _client(stack)
    batch = client.batches.create(input_file_id=first_batch["file_id"], endpoint="/v1/embeddings",
                                  completion_window="24h")
    rerun = _wait(client, batch.id)
    assert rerun.status == "completed" and rerun.model_extra["modelops"]["cache_hits"] == 40
    again, first = _output(client, rerun)[0], _output(client, first_batch["batch"])[0]

    def answer(o: dict) -> dict:  # a cached answer has its own id and time
        return {k: v for k, v in o["response"]["body"].items() if k not in ("id", "created")}

    assert [answer(o) for o in again] == [answer(o) for o in first]
    assert {o["response"]["request_id"] for o in again} == {"cache"}


def _flow_run_process(flow_run_id: str) -> int:
    """The pid of the process running that flow run (Prefect's process worker gives it
    PREFECT__FLOW_RUN_ID in its environment)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"no process runs flow run {flow_run_id}")


def test_a_killed_batch_run_is_resumed_with_no_line_lost_or_answered_twice(stack, served):
    client = _client(stack)
    n = 1200
    batch = client.batches.create(input_file_id=_upload(client, _lines(n, "resume")), endpoint="/v1/embeddings",
                                  completion_window="24h")
    running = _wait(client, batch.id, until=lambda b: b.request_counts.completed >= 64 or b.status in TERMINAL)
    assert running.status == "in_progress" and running.request_counts.completed < n, running
    pid = _flow_run_process(running.model_extra["modelops"]["flow_run_id"])
    os.killpg(pid, signal.SIGKILL)  # the flow run's process dies mid-batch, as with a lost node
    killed_at = running.request_counts.completed
    done = _wait(client, batch.id, timeout=300)
    assert done.status == "completed" and done.model_extra["modelops"]["resumes"] >= 1, done
    output, errors = _output(client, done)
    assert errors == [] and [o["custom_id"] for o in output] == [f"resume-{i}" for i in range(n)]
    assert len({o["id"] for o in output}) == n and killed_at < n


def test_a_cancelled_batch_ends_with_what_it_answered(stack, served):
    client = _client(stack)
    n = 1200
    batch = client.batches.create(input_file_id=_upload(client, _lines(n, "cancel")), endpoint="/v1/embeddings",
                                  completion_window="24h")
    _wait(client, batch.id, until=lambda b: b.request_counts.completed >= 64 or b.status in TERMINAL)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = _wait(client, batch.id, timeout=120)
    assert done.status == "cancelled" and 64 <= done.request_counts.completed < n, done
    output, _ = _output(client, done)
    assert len(output) == done.request_counts.completed


def test_bad_batches_are_refused_at_the_router_in_openais_shape(stack, served, first_batch):
    import openai

    client = _client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=first_batch["file_id"], endpoint="/v1/embeddings", completion_window="1h")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-0000", endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
