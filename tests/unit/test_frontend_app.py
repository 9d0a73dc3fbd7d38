"""The frontend app's HTTP refusals (runtime/frontend/app.py), before any call reaches Triton:
the error document names the field and says what to change. Scores and rankings themselves are
checked against `vllm serve` in tests/integration/test_score.py."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from runtime.frontend.app import create_app
from runtime.frontend.readiness import Lifecycle


def _client(task: str) -> TestClient:
    lifecycle = Lifecycle([], drain_timeout=1)
    asyncio.run(lifecycle.open())  # no warm-up here: nothing below reaches the engine
    # The lifespan (the Triton client, the warm-up) is not entered: TestClient is not used as a context.
    return TestClient(create_app(model_id="m", version="1", task=task, triton_grpc_url="127.0.0.1:1",
                                 triton_model="m", lifecycle=lifecycle))


def _error(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_rule_across_fields_is_reported_as_itself():
    err = _error(_client("generate").post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}))
    assert err["message"] == "top_logprobs needs logprobs: true"
    err = _error(_client("generate").post("/v1/chat/completions", content=b"[1]",
                                          headers={"content-type": "application/json"}))
    assert "must be a JSON object" in err["message"]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_refusals_name_the_field(path):
    client = _client("embed")
    err = _error(client.post(path, json={"model": "m", "queries": ["a", "b"], "documents": ["c"]}))
    assert err["message"] == "queries has 2 texts and documents 1: pairs are 1:1, 1:N or N:N"
    err = _error(client.post(path, content='{"model": "m", "text_1": "\\ud800", "text_2": "b"}',
                             headers={"content-type": "application/json"}))
    assert err["param"] == "text_1" and "not valid Unicode" in err["message"]
    err = _error(client.post(path, json={"model": "m", "text_1": "a", "text_2": "b", "max_tokens_per_doc": 3}))
    assert err["param"] == "max_tokens_per_doc" and "does not honor it" in err["message"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_rerank_on_a_generative_model_is_refused(path):
    err = _error(_client("generate").post(path, json={"model": "m", "query": "q", "documents": ["a"]}))
    assert err["param"] == "model" and "needs an embedding model" in err["message"]
    err = _error(_client("embed").post(path, json={"model": "m", "query": "q", "documents": ["a", ""]}))
    assert err["param"] == "documents" and "must not contain empty strings" in err["message"]


def test_embedding_input_refusals_name_the_field():
    err = _error(_client("embed").post("/v1/embeddings", json={"model": "m", "input": ["a", ""]}))
    assert err["param"] == "input" and "input must not contain empty strings (input[1] is empty)" in err["message"]
    err = _error(_client("embed").post("/v1/embeddings", content='{"model": "m", "input": "\\udc80"}',
                                       headers={"content-type": "application/json"}))
    assert err["param"] == "input" and "input is not valid Unicode" in err["message"]


def test_separate_mode_serves_no_openai_route_and_says_where_to_go():
    lifecycle = Lifecycle([], drain_timeout=1)
    asyncio.run(lifecycle.open())
    client = TestClient(create_app(model_id="fraud", version="1", task="tabular", triton_grpc_url="127.0.0.1:1",
                                   triton_model="fraud", lifecycle=lifecycle, openai=False))
    for method, path in (("post", "/v1/completions"), ("get", "/v1/models"), ("post", "/score"), ("post", "/v2/x")):
        r = getattr(client, method)(path, **({"json": {"model": "fraud"}} if method == "post" else {}))
        assert r.status_code == 404, (path, r.text)
        assert "execution_mode separate" in r.json()["error"]["message"]
        assert "/v2/models/fraud/infer" in r.json()["error"]["message"]
    assert client.get("/health").json() == {"status": "live"}


def test_a_tabular_model_embedded_refuses_openai_requests_naming_kserve():
    err = _error(_client("tabular").post("/v1/embeddings", json={"model": "m", "input": "x"}))
    assert err["param"] == "model" and "tabular (XGBoost) model" in err["message"] and "KServe v2" in err["message"]
    # Warm (the gates opened) yet not listed: no OpenAI route would take it.
    assert _client("tabular").get("/v1/models").json() == {"object": "list", "data": []}


def test_with_an_instance_secret_only_probes_are_open_without_it():
    lifecycle = Lifecycle([], drain_timeout=1)
    asyncio.run(lifecycle.open())
    client = TestClient(create_app(model_id="m", version="1", task="embed", triton_grpc_url="127.0.0.1:1",
                                   triton_model="m", lifecycle=lifecycle, instance_secret="s3cr3t"))
    for method, path in (("post", "/v1/embeddings"), ("get", "/v1/models"), ("post", "/score"), ("post", "/nowhere")):
        for headers in ({}, {"x-modelops-instance-secret": "s3cr3"}, {"x-modelops-instance-secret": "s3cr3tt"}):
            r = getattr(client, method)(path, headers=headers, **({"json": {"model": "m"}} if method == "post" else {}))
            assert r.status_code == 403 and r.json()["error"]["code"] == "not_from_router", (path, headers, r.text)
    assert client.get("/health").json() == {"status": "live"}
    # With it, the request reaches the routes (here: refused for its body, before any engine call).
    err = _error(client.post("/v1/embeddings", json={"model": "m", "input": ["a", ""]},
                             headers={"x-modelops-instance-secret": "s3cr3t"}))
    assert err["param"] == "input"
