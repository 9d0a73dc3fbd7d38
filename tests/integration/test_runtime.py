"""The serving runtime on one real instance (tiny random-weight Llama → vLLM → Triton → the
OpenAI frontend): streaming, structured outputs, the request-field audit, KServe streaming.

The tiny model's tokenizer has no chat template; its manifest ships one (``chat_template``),
which is how chat works here. Text quality and prompt rendering: test_chat_real.py."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import statistics
import threading
import time
import typing

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from runtime.startup import TRITON_EXIT_TIMEOUT_S
from tests.integration.conftest import isolated_env, serving, vllm_serve
from tests.integration.engine_load import engine_load, grpc_stream, http_request, wait_for

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
CONTEXT, SLOTS, BUDGET = 4096, 8, 6000  # max_model_len, max_num_seqs, limits.max_request_tokens
# The manifest's chat_template for the tiny model (its tokenizer has none).
TRANSCRIPT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.models.make_tiny_llama import make

    work = tmp_path_factory.mktemp("runtime")
    weights = make(work / "model", context=CONTEXT)
    (work / "tiny.jinja").write_text(TRANSCRIPT_TEMPLATE)
    manifest = work / "tiny.yaml"
    manifest.write_text(yaml.safe_dump({
        "model_id": MODEL, "version": "1", "source": str(weights), "task": "generate", "chat_template": "tiny.jinja",
        # A long context, so one request can hold the engine for seconds (abort tests); 8 slots,
        # so a few requests fill it; a token budget below two full contexts (limits tests).
        "engine_args": {"dtype": "float32", "max_model_len": CONTEXT, "max_num_seqs": SLOTS},
        "limits": {"max_request_tokens": BUDGET}}))
    with serving(manifest, isolated_env(work / "home"), work / "serve.log") as inst:
        yield inst


# Every finish_reason of every 200 answer these tests read (the OpenAI client's and _complete's).
SEEN_FINISH: list = []


def _record_finish(response: httpx.Response) -> None:
    """An httpx response hook: reads the body (a JSON answer or server-sent events) and keeps
    its finish_reason values, so the last test can check that none is one OpenAI never sends."""
    if response.status_code != 200 or response.request.url.path.rsplit("/", 1)[-1] not in ("completions",):
        return
    response.read()
    text = response.text
    docs = [line[6:] for line in text.splitlines() if line.startswith("data: {")] if text.startswith("data:") \
        else [text]
    for doc in docs:
        SEEN_FINISH.extend(c.get("finish_reason") for c in json.loads(doc).get("choices") or [])


@pytest.fixture(scope="module")
def client(llama):
    from openai import OpenAI

    return OpenAI(base_url=f"{llama['base']}/v1", api_key="unused", max_retries=0,
                  http_client=httpx.Client(event_hooks={"response": [_record_finish]}, timeout=120))


def test_streamed_text_equals_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt="The model serves", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The model serves", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2, "expected several server-sent events"
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"
    flat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chat) == flat.choices[0].message.content


def test_usage_per_key_is_the_sum_of_the_answers_usage(llama):
    """The router names the caller's key in x-modelops-key; the instance counts each answer's
    usage for it, streams without stream_options.include_usage too (the engine counts their
    tokens; the client's events stay as they were, with no usage chunk)."""
    base, expected = llama["base"], {"prompt": 0, "completion": 0, "requests": 0}

    def post(path: str, body: dict, key: str | None = "team-a") -> dict:
        r = httpx.post(f"{base}/v1/{path}", json={"model": MODEL, "max_tokens": 5, "temperature": 0, **body},
                       headers={"x-modelops-key": key} if key else {}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def add(usage: dict) -> None:
        expected["prompt"] += usage["prompt_tokens"]
        expected["completion"] += usage["completion_tokens"]
        expected["requests"] += 1

    add(post("completions", {"prompt": ["one prompt", "and a second, longer prompt"], "n": 2, "temperature": 1,
                             "seed": 3}))
    add(post("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}))
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={"model": MODEL, "max_tokens": 5, "temperature": 0,
                      **chat}, headers={"x-modelops-key": "team-a"}, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"usage"' in e for e in events)  # as the client asked: no usage
    add(post("chat/completions", {**chat, "stream": False}, key=None))  # its twin (greedy): the same tokens
    with httpx.stream("POST", f"{base}/v1/completions", headers={"x-modelops-key": "team-a"}, timeout=120,
                      json={"model": MODEL, "prompt": "Once", "max_tokens": 7, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        last = json.loads([line[6:] for line in r.iter_lines() if line.startswith("data: {")][-1])
    add(last["usage"])
    other = post("completions", {"prompt": "another tenant"}, key="team-b")

    metrics = httpx.get(f"{base}/metrics", timeout=30).text

    def counter(name: str, key: str) -> int:
        line = f'{name}{{model_name="{MODEL}",key="{key}"}} '
        return int(next(x for x in metrics.splitlines() if x.startswith(line)).split()[-1])

    assert counter("modelops_key_requests_total", "team-a") == expected["requests"] == 4
    assert counter("modelops_key_prompt_tokens_total", "team-a") == expected["prompt"]
    assert counter("modelops_key_completion_tokens_total", "team-a") == expected["completion"]
    assert counter("modelops_key_prompt_tokens_total", "team-b") == other["prompt_tokens"]
    assert counter("modelops_key_completion_tokens_total", "team-b") == other["completion_tokens"]


def test_a_refused_stream_is_a_plain_400(llama):
    r = httpx.post(f"{llama['base']}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "word " * (CONTEXT + 100), "max_tokens": 4, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "invalid_request_error"


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


def test_response_format_json_schema_20_of_20(client):
    import jsonschema

    valid = 0
    for seed in range(20):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give me a color ({seed})"}], max_tokens=64,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
        doc = json.loads(out.choices[0].message.content)
        jsonschema.validate(doc, SCHEMA)
        valid += 1
    assert valid == 20


def test_response_format_on_completions_needs_no_chat_template(llama):
    # vLLM's extension: structured outputs on /v1/completions (what the health check uses).
    import jsonschema

    for seed in range(5):
        out = _complete(llama, prompt=f"pick ({seed})", max_tokens=64, temperature=1.0, seed=seed,
                        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}})
        jsonschema.validate(json.loads(out["choices"][0]["text"]), SCHEMA)


def test_response_format_json_object_is_enforced(client):
    # json_object constrains to "some JSON object": a random-weight model writes endless strings
    # inside it, so outputs that hit max_tokens are cut mid-object. Those that stop must parse;
    # every one must open an object, which the unconstrained model does not do.
    stopped = 0
    for seed in range(20):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"JSON please ({seed})"}], max_tokens=200,
            temperature=1.0, seed=seed, response_format={"type": "json_object"})
        text = out.choices[0].message.content
        assert text.lstrip().startswith("{"), text
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            stopped += 1
    free = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"JSON please ({s})"}],
                                           max_tokens=8, temperature=1.0, seed=s).choices[0].message.content
            for s in range(5)]
    assert sum(t.lstrip().startswith("{") for t in free) < 5
    print(f"json_object: {stopped}/20 finished inside max_tokens and parsed")


# -- structured outputs: strictly valid, fully enforced, or refused ----------------------------------

def _json_schema(schema, strict=None, name="out"):
    spec = {"name": name, "schema": schema, **({"strict": strict} if strict is not None else {})}
    return {"type": "json_schema", "json_schema": spec}


def _structured(llama, schema, seed=0, strict=None, max_tokens=64, route="chat/completions"):
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "response_format": _json_schema(schema, strict)}
    body.update({"messages": [{"role": "user", "content": f"JSON ({seed})"}]} if route == "chat/completions"
                else {"prompt": f"JSON ({seed})"})
    r = httpx.post(f"{llama['base']}/v1/{route}", json=body, timeout=120)
    _record_finish(r)
    return r


def _content(r: httpx.Response) -> tuple[str, str]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["message"]["content"] if "message" in choice else choice["text"]), choice["finish_reason"]


def test_free_text_strings_parse_strictly_20_of_20(llama):
    import jsonschema

    from runtime.engine.structured_outputs import strict_loads

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    for seed in range(20):
        text, finish = _content(_structured(llama, schema, seed=seed, max_tokens=96))
        assert finish == "stop", text
        jsonschema.validate(strict_loads(text), schema)  # no raw control characters, no NaN


def test_pattern_with_max_length_is_enforced(llama):
    # additionalProperties false: else JSON Schema allows more properties, which a random model
    # keeps adding until max_tokens
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
              "required": ["w"], "additionalProperties": False}
    words = []
    for seed in range(20):
        text, finish = _content(_structured(llama, schema, seed=seed))
        assert finish == "stop", text
        words.append(json.loads(text)["w"])
    assert all(1 <= len(w) <= 3 and w.isalpha() and w.islower() for w in words), words


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_ref_cycle_is_a_400_before_generation(llama, route):
    r = _structured(llama, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, route=route)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and err["type"] == "invalid_request_error"
    assert err["message"].startswith("response_format.json_schema.schema/$defs/a: ") and "no way out" in err["message"]


def test_unenforceable_keywords_are_refused_unless_strict_false(llama):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "uniqueItems": True, "maxItems": 3}}, "required": ["tags"]}
    r = _structured(llama, schema)
    assert r.status_code == 400 and "/properties/tags/uniqueItems" in r.json()["error"]["message"], r.text
    assert "strict: false" in r.json()["error"]["message"]
    text, finish = _content(_structured(llama, schema, strict=False))
    assert finish == "stop" and set(json.loads(text)["tags"]) <= {"a", "b", "c"}  # the rest still enforced
    overlap = _structured(llama, {"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert overlap.status_code == 400 and "/oneOf" in overlap.json()["error"]["message"]


def test_an_empty_intersection_is_refused_at_its_subschema(llama):
    """Only the grammar can tell that digits can never be an email: it is asked before admission."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]+$", "format": "email",
                                                        "maxLength": 2}}, "required": ["code"]}
    r = _structured(llama, schema)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("response_format.json_schema.schema/properties/code: ")


def test_a_violation_the_grammar_lets_through_is_an_error_and_counted(llama):
    """The grammar's date format allows February 29th in any year; RFC 3339 does not (2026 is no
    leap year). The pattern forces that date, so the answer must come back as a
    structured_output_violation, never as a 200."""
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date", "pattern": "^2026-02-29$"}},
              "required": ["d"], "additionalProperties": False}
    whole = _structured(llama, schema)
    assert whole.status_code == 500, whole.text
    err = whole.json()["error"]
    assert err["code"] == "structured_output_violation" and "/properties/d/format" in err["message"], err
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "response_format": _json_schema(schema),
            "messages": [{"role": "user", "content": "date"}]}
    with httpx.stream("POST", f"{llama['base']}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200  # the stream had started: the error is its last event
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "structured_output_violation"
    assert not any(c.get("finish_reason") for e in events[:-2] for c in json.loads(e).get("choices", []))
    metrics = httpx.get(f"{llama['base']}/metrics", timeout=30).text
    counted = [line for line in metrics.splitlines() if line.startswith("modelops_structured_output_violations_total{")]
    assert counted and sum(float(line.split()[-1]) for line in counted) >= 2, counted
    assert 'model_id="tiny-llama"' in counted[0]


def test_generated_schemas_are_refused_with_a_pointer_or_answered_validly(llama):
    """Hypothesis schemas (tests/unit/test_structured_outputs.py's SCHEMAS) on the random model,
    which explores far more of a grammar than a real one."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings

    from runtime.engine.structured_outputs import strict_loads
    from tests.unit.test_structured_outputs import SCHEMAS

    outcomes = {"refused": 0, "stop": 0, "length": 0}

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(SCHEMAS)
    def one(schema):
        r = _structured(llama, schema, seed=len(json.dumps(schema)), max_tokens=48)
        if r.status_code == 400:
            message = r.json()["error"]["message"]
            assert message.startswith(("response_format.json_schema.schema/",  # a JSON pointer
                                       "response_format.json_schema.schema (the root)")), message
            outcomes["refused"] += 1
            return
        text, finish = _content(r)
        assert finish in ("stop", "length"), finish
        outcomes[finish] += 1
        if finish == "stop":
            jsonschema.validate(strict_loads(text), schema)

    one()
    print(f"generated schemas: {outcomes}")
    assert outcomes["refused"] and outcomes["stop"]


def test_generated_tool_parameters_are_refused_with_a_pointer_or_called_validly(llama):
    """The same schemas as one tool's parameter, under tool_choice required and named: every
    call that finishes has arguments that parse strictly and validate."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from runtime.engine.structured_outputs import strict_loads
    from tests.unit.test_structured_outputs import SCHEMAS

    outcomes = {"refused": 0, "called": 0, "length": 0, "overflow": 0}

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(SCHEMAS, st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]))
    def one(schema, choice):
        body = {k: v for k, v in schema.items() if k != "$defs"}
        params = {"type": "object", "properties": {"arg": body}, "required": ["arg"], "additionalProperties": False,
                  "$defs": schema["$defs"]}
        seed = len(json.dumps(schema))
        r = httpx.post(f"{llama['base']}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 64, "temperature": 1.0, "seed": seed, "tool_choice": choice,
            "messages": [{"role": "user", "content": f"call ({seed})"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]})
        _record_finish(r)
        if r.status_code == 400:
            message = r.json()["error"]["message"]
            assert message.startswith(("tools[0].function.parameters/", "tools[0].function.parameters (the root)")), \
                message
            outcomes["refused"] += 1
            return
        if r.status_code == 500 and "came back as Infinity" in r.text:
            # vLLM re-serializes parsed arguments: a number past double range (the grammar allows
            # any exponent) becomes Infinity; the check answers an error instead of bad JSON.
            assert r.json()["error"]["code"] == "structured_output_violation", r.text
            outcomes["overflow"] += 1
            return
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]
        if answer["finish_reason"] == "length":
            outcomes["length"] += 1
            return
        assert answer["finish_reason"] in ("stop", "tool_calls"), answer
        calls = answer["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "f" for c in calls), answer
        for call in calls:
            jsonschema.validate(strict_loads(call["function"]["arguments"]), params)
        outcomes["called"] += 1

    one()
    print(f"generated tool parameters: {outcomes}")
    assert outcomes["refused"] and outcomes["called"]


# -- the field audit: every request field of the openai client's types is honored or refused ---------

def _fields(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def _openai_fields():
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    return (_fields(completions.CompletionCreateParamsStreaming) | _fields(completions.CompletionCreateParamsNonStreaming),
            _fields(chat.CompletionCreateParamsStreaming) | _fields(chat.CompletionCreateParamsNonStreaming))


# Honored: by vLLM's serving classes in the backend (test_chat_real.py compares them with
# `vllm serve`); the tests below check the ones the tiny model can show.
HONORED_COMPLETIONS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                       "presence_penalty", "frequency_penalty", "logit_bias", "echo", "stream", "stream_options",
                       "user", "logprobs"}
HONORED_CHAT = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
                "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stream", "stream_options", "user",
                "response_format", "safety_identifier", "logprobs", "top_logprobs", "tools", "tool_choice",
                "parallel_tool_calls"}
# vLLM's extensions we honor beside the OpenAI fields (vLLM 0.32's request types).
VLLM_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "vllm_xargs"}
VLLM_CHAT_EXTENSIONS = {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
VLLM_COMPLETION_EXTENSIONS = {"response_format"}
# What an LLM router in front adds (vllm-router): taken at their default value only, never forwarded
# (runtime/frontend/protocol.py ROUTER_DEFAULTS; tests/unit/test_frontend_protocol.py).
ROUTER_ADDED = {"no_stop_trim", "skip_special_tokens", "separate_reasoning", "stream_reasoning", "include_reasoning",
                "return_hidden_states"}
# Refused with HTTP 400 naming the field, with a valid OpenAI value for it.
REFUSED_COMPLETIONS = {"best_of": 2, "suffix": "end"}
REFUSED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "metadata": {"k": "v"},
    "modalities": ["text"], "moderation": {"model": "omni-moderation-latest"},
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "auto"}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "service_tier": "auto", "store": True, "verbosity": "low", "web_search_options": {},
}


def test_every_openai_request_field_is_classified():
    from runtime.frontend.protocol import ChatCompletionRequest, CompletionRequest

    completions, chat = _openai_fields()
    assert completions == HONORED_COMPLETIONS | set(REFUSED_COMPLETIONS), \
        f"unclassified: {completions ^ (HONORED_COMPLETIONS | set(REFUSED_COMPLETIONS))}"
    assert chat == HONORED_CHAT | set(REFUSED_CHAT), f"unclassified: {chat ^ (HONORED_CHAT | set(REFUSED_CHAT))}"
    # What the frontend declares is exactly the honored set: nothing refused slips through.
    assert set(CompletionRequest.model_fields) == \
        HONORED_COMPLETIONS | VLLM_EXTENSIONS | VLLM_COMPLETION_EXTENSIONS | ROUTER_ADDED
    assert set(ChatCompletionRequest.model_fields) == HONORED_CHAT | VLLM_EXTENSIONS | VLLM_CHAT_EXTENSIONS | ROUTER_ADDED


@pytest.mark.parametrize("route, field, value", [
    *(("completions", f, v) for f, v in REFUSED_COMPLETIONS.items()),
    *(("chat/completions", f, v) for f, v in REFUSED_CHAT.items()),
])
def test_refused_fields_are_400_naming_the_field(llama, route, field, value):
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(f"{llama['base']}/v1/{route}", json={**body, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"


def _complete(llama, **fields):
    r = httpx.post(f"{llama['base']}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "The model serves", "max_tokens": 8, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    _record_finish(r)
    return r.json()


def test_honored_completion_fields_change_the_output(llama, client):
    from openai import OpenAI

    base = _complete(llama)
    assert base["usage"]["completion_tokens"] == 8 and base["choices"][0]["finish_reason"] == "length"
    # max_tokens
    assert _complete(llama, max_tokens=3)["usage"]["completion_tokens"] == 3
    # echo: the prompt comes back in front of the same completion
    assert _complete(llama, echo=True)["choices"][0]["text"] == "The model serves" + base["choices"][0]["text"]
    # logit_bias: +100 on one token makes greedy decoding pick it every time
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(str(llama["log"].parent / "model"))
    token = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" fox")[0])
    biased = _complete(llama, logit_bias={str(token): 100})
    assert tokenizer(biased["choices"][0]["text"], add_special_tokens=False)["input_ids"] == [token] * 8
    # stop: generation ends before the stop string, with finish_reason "stop"
    text = base["choices"][0]["text"]
    stop = text[2:5] if len(text) > 5 and text[2:5].strip() else None
    if stop:
        stopped = _complete(llama, stop=[stop])
        assert stop not in stopped["choices"][0]["text"] and stopped["choices"][0]["finish_reason"] == "stop"
    # seed: sampling at temperature 1 repeats with the same seed and differs across seeds
    a = _complete(llama, temperature=1.0, seed=7, max_tokens=16)["choices"][0]["text"]
    assert _complete(llama, temperature=1.0, seed=7, max_tokens=16)["choices"][0]["text"] == a
    assert any(_complete(llama, temperature=1.0, seed=s, max_tokens=16)["choices"][0]["text"] != a for s in (8, 9))
    # top_p tiny → greedy; penalties change a repetitive greedy continuation
    assert _complete(llama, temperature=1.0, top_p=1e-6, seed=3)["choices"][0]["text"] == text
    assert _complete(llama, presence_penalty=2.0, max_tokens=32)["choices"][0]["text"] != \
        _complete(llama, max_tokens=32)["choices"][0]["text"]
    assert _complete(llama, frequency_penalty=2.0, max_tokens=32)["choices"][0]["text"] != \
        _complete(llama, max_tokens=32)["choices"][0]["text"]
    # user / safety_identifier: logged for abuse tracing
    _complete(llama, user="user-4711")
    OpenAI(base_url=f"{llama['base']}/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=2, safety_identifier="sid-42")
    log = llama["log"].read_text()
    assert "end user user-4711" in log and "end user sid-42" in log
    # n: independent choices (n=1 is the plain answer); max_completion_tokens wins for chat
    assert _complete(llama, n=1)["choices"][0]["text"] == text
    three = _complete(llama, n=3, temperature=1.0, seed=5, max_tokens=12)["choices"]
    assert [c["index"] for c in three] == [0, 1, 2] and len({c["text"] for c in three}) >= 2
    # ignore_eos: a sampled (default temperature 1) random-weight model may end at its first token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=4, max_tokens=9, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4
    # vLLM's extensions: ignore_eos/min_tokens hold generation to max_tokens; top_k 1 is greedy
    assert _complete(llama, ignore_eos=True, max_tokens=20)["usage"]["completion_tokens"] == 20
    assert _complete(llama, temperature=1.0, top_k=1, seed=3)["choices"][0]["text"] == text
    assert _complete(llama, temperature=1.0, min_p=1.0, seed=3)["choices"][0]["text"] == text
    assert _complete(llama, repetition_penalty=1.8, max_tokens=32)["choices"][0]["text"] != \
        _complete(llama, max_tokens=32)["choices"][0]["text"]


def test_a_constraint_in_vllm_xargs_is_obeyed(llama):
    # vllm_xargs → SamplingParams.extra_args → the native constraint processor (issue 8's plugin,
    # loaded through its vllm.logits_processors entry point inside Triton's stub).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama["log"].parent / "model"))
    words = [" quick brown fox", " lazy dog", " zero downtime"]
    items = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in words]
    spec = json.dumps({"type": "catalog", "items": items})
    seen = set()
    for seed in range(8):
        out = _complete(llama, temperature=1.0, seed=seed, max_tokens=20, vllm_xargs={"constraint": spec})
        text = out["choices"][0]["text"]
        assert text in words, text  # exactly one catalog item, then EOS
        assert out["choices"][0]["finish_reason"] == "stop"
        seen.add(text)
    assert len(seen) >= 2  # sampling still chooses among the items
    free = _complete(llama, temperature=1.0, seed=0, max_tokens=20)["choices"][0]["text"]
    assert free not in words


def test_constraint_token_ids_beyond_the_vocabulary_are_a_400(llama):
    for spec, field in (({"type": "literal", "tokens": [5, 100000]}, "extra_args.constraint.tokens[1]"),
                        ({"type": "sequence", "parts": [{"type": "catalog", "items": [[5], [7, 99999]]}]},
                         "extra_args.constraint.parts[0].items[1][1]")):
        r = httpx.post(f"{llama['base']}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "x", "max_tokens": 4, "vllm_xargs": {"constraint": json.dumps(spec)}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "vllm_xargs" and err["message"].startswith(field) and "outside the vocabulary" in \
            err["message"], err


def test_every_stop_id_ends_a_constrained_answer(llama):
    """Twelve stop ids (more than the engine once gated): the constraint holds them back until
    its literal is complete, then the most likely of them (biased: the largest id) ends it."""
    stops = list(range(300, 312))
    spec = json.dumps({"type": "literal", "tokens": [40, 41]})
    out = _complete(llama, max_tokens=8, stop_token_ids=stops, logit_bias={str(stops[-1]): 60, str(stops[0]): 50},
                    vllm_xargs={"constraint": spec})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stops[-1], choice
    assert out["usage"]["completion_tokens"] == 3  # the literal's two tokens, then the stop id


def test_a_malformed_constraint_is_a_400_naming_it(llama):
    bad = json.dumps({"type": "repeat", "min": 0, "max": 2, "item": {"type": "catalog", "items": [[5]]}})
    r = httpx.post(f"{llama['base']}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, "vllm_xargs": {"constraint": bad}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "vllm_xargs" and "extra_args.constraint" in err["message"]
    r = httpx.post(f"{llama['base']}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2, "vllm_xargs": "not a mapping"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs"


def test_kserve_grpc_streaming_on_the_same_instance(llama):
    client = grpcclient.InferenceServerClient(llama["grpc"])
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL, as_json=True)
    assert {i["name"] for i in meta["inputs"]} >= {"text_input", "sampling_parameters", "stream"}
    config = client.get_model_config(MODEL, as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    responses = []
    client.start_stream(callback=lambda result, error: responses.append((result, error)))
    inputs = []
    for name, value, dtype in (("text_input", b"The model serves", "BYTES"),
                               ("sampling_parameters", json.dumps({"max_tokens": 5, "temperature": 0}).encode(),
                                "BYTES"),
                               ("stream", True, "BOOL")):
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(np.asarray([value], dtype=np.object_ if dtype == "BYTES" else bool))
        inputs.append(t)
    client.async_stream_infer(MODEL, inputs, request_id="k1")
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            r is not None and r.as_numpy("finish_reason")[0] for r, _ in responses):
        time.sleep(0.05)
    client.stop_stream()
    assert all(e is None for _, e in responses)
    assert len(responses) >= 2  # one response per decode step
    assert responses[-1][0].as_numpy("finish_reason")[0] == b"length"
    assert int(responses[-1][0].as_numpy("num_output_tokens")[0]) == 5
    r = httpx.post(f"{llama['http']}/v2/models/{MODEL}/generate", timeout=30,
                   json={"text_input": "The model serves", "sampling_parameters": json.dumps({"max_tokens": 3})})
    assert r.status_code == 200 and r.json()["finish_reason"] == "length"


def test_kserve_parameters_are_honoured_or_refused_by_name(llama):
    """KServe generate's ``parameters`` (and a gRPC request's) are sampling parameters, as
    ``sampling_parameters`` is: never ignored. (Over HTTP, Triton's generate endpoint turns a
    parameter named like an input, e.g. ``stream``, into that input itself.)"""
    url = f"{llama['http']}/v2/models/{MODEL}/generate"
    r = httpx.post(url, timeout=60, json={"text_input": "The model serves", "parameters": {"max_tokens": 3,
                                                                                          "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["finish_reason"] == "length", r.text
    assert r.json()["num_output_tokens"] == 3
    # Both places agree, or the request is refused; each refusal names the field where it was sent.
    both = httpx.post(url, timeout=60, json={"text_input": "hi", "parameters": {"max_tokens": 2},
                                             "sampling_parameters": json.dumps({"max_tokens": 2, "ignore_eos": True})})
    assert both.status_code == 200 and both.json()["num_output_tokens"] == 2, both.text
    for parameters, extra, says in (
            ({"max_token": 3}, {}, "parameters.max_token: not a sampling parameter"),
            ({"structured_outputs": "{}"}, {}, "parameters.structured_outputs: send it in sampling_parameters"),
            ({"max_tokens": 3}, {"sampling_parameters": json.dumps({"max_tokens": 4})},
             "parameters.max_tokens: 3 disagrees with sampling_parameters.max_tokens (4)"),
            ({"max_tokens": CONTEXT}, {}, "parameters.max_tokens"),
            ({"n": 2}, {}, "parameters.n: 2 is not served over KServe")):
        bad = httpx.post(url, timeout=60, json={"text_input": "hi", "parameters": parameters, **extra})
        assert bad.status_code == 400 and says in bad.text, (parameters, bad.text)
    # gRPC: the request's parameters map.
    client = grpcclient.InferenceServerClient(llama["grpc"])
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.asarray([b"The model serves"], dtype=np.object_))
    got = []
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    try:
        client.async_stream_infer(MODEL, [text], parameters={"max_tokens": 4, "ignore_eos": True})
        client.async_stream_infer(MODEL, [text], parameters={"max_tokns": 4})
        client.async_stream_infer(MODEL, [text], parameters={"stream": True})  # an input, not a parameter
        deadline = time.monotonic() + 60
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.stop_stream()
    answers = [r for r, e in got if e is None]
    errors = [str(e) for _, e in got if e is not None]
    assert len(answers) == 1 and int(answers[0].as_numpy("num_output_tokens")[0]) == 4, got
    assert len(errors) == 2 and "parameters.max_tokns: not a sampling parameter" in errors[0], errors
    assert "parameters.stream: stream is an input of the generate request" in errors[1], errors


# -- one client cannot hurt the others: abort on disconnect, request limits ----------------------

LONG = {"max_tokens": CONTEXT - 96, "ignore_eos": True}  # seconds of decoding on 2 cores
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **LONG}


def _hang_up(llama, kind: str):
    """A client that sends one long request of ``kind`` and hangs up when the block ends."""
    kserve = json.dumps(LONG)
    return {
        "openai-chat": lambda: http_request(llama["base"], "/v1/chat/completions", CHAT),
        "openai-completions-n2": lambda: http_request(llama["base"], "/v1/completions",
                                                      {"model": MODEL, "prompt": "hi", "n": 2, **LONG,
                                                       "max_tokens": (BUDGET - 100) // 2}),
        "openai-stream": lambda: http_request(llama["base"], "/v1/chat/completions", {**CHAT, "stream": True}),
        "kserve-http-stream": lambda: http_request(llama["http"], f"/v2/models/{MODEL}/generate_stream",
                                                   {"text_input": "hi", "stream": True, "sampling_parameters": kserve}),
        "kserve-grpc-stream": lambda: grpc_stream(llama["grpc"], MODEL, "hi", LONG),
    }[kind]()


@pytest.mark.parametrize("kind", ["openai-chat", "openai-completions-n2", "openai-stream", "kserve-http-stream",
                                  "kserve-grpc-stream"])
def test_a_client_that_hangs_up_frees_the_engine_within_a_second(llama, kind):
    """Mid-decode: the engine holds the request's sequences; the client goes; within 1 s they
    are gone and the cancellation is counted. (KServe HTTP unary generate cannot be cancelled:
    Triton 2.51 sees cancellation over gRPC only; its work is bounded by the request limits.)"""
    wait_for(llama["base"], lambda load: not load["running"] and not load["waiting"], 60)
    before = engine_load(llama["base"])["cancelled"]
    with _hang_up(llama, kind):
        held, _ = wait_for(llama["base"], lambda load: load["running"] >= 1, 30)
    _, freed_s = wait_for(llama["base"], lambda load: not load["running"], 5)
    assert freed_s <= 1.0, f"{kind}: {held['running']:.0f} sequence(s) freed {freed_s:.2f} s after the hang-up"
    assert engine_load(llama["base"])["cancelled"] == before + 1


def test_a_queued_request_whose_client_hangs_up_never_runs(llama):
    """Every slot taken by other clients; one more request waits in the engine's queue; its
    client hangs up: it leaves the queue (never runs), and the others run on."""
    wait_for(llama["base"], lambda load: not load["running"] and not load["waiting"], 60)
    before = engine_load(llama["base"])["cancelled"]
    with contextlib.ExitStack() as others:
        for _ in range(SLOTS):
            others.enter_context(http_request(llama["base"], "/v1/chat/completions", CHAT))
        wait_for(llama["base"], lambda load: load["running"] == SLOTS, 30)
        with http_request(llama["base"], "/v1/chat/completions", CHAT):
            wait_for(llama["base"], lambda load: load["waiting"] == 1, 10)
        load, gone_s = wait_for(llama["base"], lambda load: not load["waiting"], 5)
        assert gone_s <= 1.0 and load["running"] == SLOTS, (gone_s, load)
    wait_for(llama["base"], lambda load: not load["running"], 5)
    assert engine_load(llama["base"])["cancelled"] == before + SLOTS + 1


def test_a_request_at_the_token_budget_is_served_and_one_token_over_is_refused(llama):
    ids = list(range(5, 15))  # a prompt of token ids: 10 tokens exactly
    at = {"model": MODEL, "prompt": ids, "n": 2, "max_tokens": (BUDGET - len(ids)) // 2, "ignore_eos": True}
    assert len(ids) + at["n"] * at["max_tokens"] == BUDGET
    with httpx.stream("POST", f"{llama['base']}/v1/completions", json={**at, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and next(r.iter_lines()).startswith("data: {")  # served; hang up
    over = httpx.post(f"{llama['base']}/v1/completions", json={**at, "prompt": ids + [5]}, timeout=60)
    assert over.status_code == 400, over.text
    err = over.json()["error"]
    assert err["param"] == "max_tokens" and f"{BUDGET + 1} tokens" in err["message"] and str(BUDGET) in err["message"]
    # A list counts every prompt; KServe generate gets the same bound.
    three = httpx.post(f"{llama['base']}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": BUDGET // 3})
    assert three.status_code == 400 and "over 3 prompts" in three.json()["error"]["message"], three.text
    # KServe generate (one prompt, n = 1): its context, n and max_tokens are checked before the engine.
    for params, says in (({"max_tokens": CONTEXT}, f"maximum context length is {CONTEXT} tokens"),
                         ({"max_tokens": 4, "n": 2}, "sampling_parameters.n: 2 is not served over KServe"),
                         ({"max_tokens": "10"}, "sampling_parameters.max_tokens: '10' is not a whole number")):
        kserve = httpx.post(f"{llama['http']}/v2/models/{MODEL}/generate", timeout=60, json={
            "text_input": "hi", "sampling_parameters": json.dumps(params)})
        assert kserve.status_code == 400 and says in kserve.text, kserve.text


def test_kserve_structured_outputs_pass_the_schema_checks_of_the_openai_routes(llama):
    """One way in (runtime/engine/openai_engine.py: kserve_structured): KServe generate's
    ``structured_outputs.json`` is refused with the JSON pointer the OpenAI routes name for the same
    schema, and a schema they admit is prepared the same way and enforced."""
    from runtime.engine.structured_outputs import strict_loads

    def generate(structured: dict, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(f"{llama['http']}/v2/models/{MODEL}/generate", timeout=60, json={
            "text_input": "JSON", "sampling_parameters": json.dumps(
                {"max_tokens": max_tokens, "temperature": 0, "structured_outputs": structured})})

    refused = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    openai = _structured(llama, refused)
    assert openai.status_code == 400, openai.text
    assert openai.json()["error"]["message"].startswith("response_format.json_schema.schema/properties/tags/uniqueItems: ")
    for structured in ({"json": refused}, {"json": json.dumps(refused)}):
        r = generate(structured)
        assert r.status_code == 400, r.text
        assert "sampling_parameters.structured_outputs.json/properties/tags/uniqueItems: uniqueItems is not " \
               "enforced" in r.text and "strict: false" not in r.text, r.text  # strict is the OpenAI routes' field
    admitted = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                "additionalProperties": False}
    r = generate({"json": admitted}, max_tokens=32)
    assert r.status_code == 200, r.text
    assert strict_loads(r.json()["text_output"])["a"] in ("x", "y")


def test_a_kserve_answer_that_breaks_its_schema_is_an_error_and_counted(llama):
    """The same check as the OpenAI routes' on KServe generate's answers: the grammar's date format
    lets February 29th of 2026 through, RFC 3339 does not (test above), so the answer comes back
    as an engine error naming the keyword, never as a 200."""
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date", "pattern": "^2026-02-29$"}},
              "required": ["d"], "additionalProperties": False}
    r = httpx.post(f"{llama['http']}/v2/models/{MODEL}/generate", timeout=60, json={
        "text_input": "date", "sampling_parameters": json.dumps({"max_tokens": 64, "temperature": 0,
                                                                 "structured_outputs": {"json": schema}})})
    # Not a 200; Triton 2.51's HTTP generate answers every error of a model 400, whatever its code
    # (an INTERNAL code was tried: still 400), so the message says whose fault it is.
    assert r.status_code == 400, r.text
    assert "engine error: the engine produced a structured output that breaks its schema" in r.text
    assert "/properties/d/format" in r.text, r.text
    metrics = httpx.get(f"{llama['base']}/metrics", timeout=30).text
    assert any(line.startswith("modelops_structured_output_violations_total{") and 'api="kserve"' in line
               for line in metrics.splitlines()), metrics[-2000:]


def test_one_request_holds_at_most_its_share_of_the_sequence_slots(llama):
    share = SLOTS // 2  # limits.max_request_share 0.5 (the default)
    for route, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": CHAT["messages"]})):
        r = httpx.post(f"{llama['base']}/v1/{route}", json={"model": MODEL, "n": share + 1, "max_tokens": 2, **body},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert f"at most {share}" in r.json()["error"]["message"]
    # A list of prompts takes turns within the request's share: 3 prompts × n=2 never hold 6.
    wait_for(llama["base"], lambda load: not load["running"] and not load["waiting"], 60)
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(engine_load(llama["base"])["running"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = httpx.post(f"{llama['base']}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 600, "ignore_eos": True})
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text
    assert max(seen) == share, seen


def test_a_short_request_keeps_its_first_token_beside_the_largest_allowed_one(llama):
    """Measured in one run: a short request's TTFT p50 while another client's request holds
    its whole share (n = slots/2, the whole token budget) stays within 2x of its p50 alone."""
    def ttft() -> float:
        t0 = time.monotonic()
        with httpx.stream("POST", f"{llama['base']}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "The model serves", "max_tokens": 4, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):  # a completions stream's first event is its first token
                    return time.monotonic() - t0
        raise AssertionError("no token")

    wait_for(llama["base"], lambda load: not load["running"] and not load["waiting"], 60)
    for _ in range(3):
        ttft()
    alone = statistics.median(ttft() for _ in range(15))
    ids, n = list(range(5, 25)), SLOTS // 2
    largest = {"model": MODEL, "prompt": ids, "n": n, "max_tokens": (BUDGET - len(ids)) // n, "ignore_eos": True}
    with http_request(llama["base"], "/v1/completions", largest):
        wait_for(llama["base"], lambda load: load["running"] == n, 30)
        beside = [ttft() for _ in range(15)]
        assert engine_load(llama["base"])["running"] >= n  # still decoding through every sample
    ratio = statistics.median(beside) / alone
    assert ratio <= 2.0, f"TTFT p50 {statistics.median(beside) * 1000:.1f} ms beside, {alone * 1000:.1f} ms alone"


@contextlib.contextmanager
def _keyed_router(home, address: str, keys: dict[str, dict]):
    """Our HAProxy router (its own home) over the instance at ``address``, with ``keys`` (name →
    limits) scoped to MODEL; yields ``(router URL, {name: key})`` once it answers a keyed request."""
    from modelops.registry import Registry
    from modelops.settings import Settings
    from modelops.tenancy import key_hash, new_key
    from tasks.traffic.haproxy import HAProxyRouter
    from tasks.traffic.interface import ModelRoute, Server
    from tests.conftest import free_port

    settings = Settings(home=home, router_port=free_port(), router_grpc_port=free_port())
    registry, made = Registry(settings.registry), {}
    for name, limits in keys.items():
        made[name] = new_key()
        registry.create_key(name, key_hash(made[name]), (MODEL,), **limits)
    router = HAProxyRouter(settings)
    router.apply([ModelRoute(MODEL, {"1": (Server(f"{MODEL}-1-1", address, 100),)})])
    url, probe = f"http://127.0.0.1:{settings.router_port}", {"Authorization": f"Bearer {next(iter(made.values()))}"}
    try:
        deadline = time.monotonic() + 30
        while httpx.post(f"{url}/v1/completions", headers=probe, timeout=30,
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code != 200:
            assert time.monotonic() < deadline, "the keyed router never reached the instance"
            time.sleep(0.1)
        yield url, made
    finally:
        router.stop()


def test_a_key_that_floods_holds_its_max_concurrency_in_the_engine_and_the_other_key_is_served(llama, tmp_path):
    """Fair sharing (docs/tenants.md): key A keeps 6 long streams coming through the router at
    ``max_concurrency`` 2; the engine never runs more than A's 2 and B's 1, A is told 429
    ``concurrency_limit_exceeded`` for the rest, and every one of B's streams is answered while
    A floods. B's TTFT beside the flood is a benchmark (bench/results/tenants.json)."""
    address = llama["base"].removeprefix("http://")
    wait_for(llama["base"], lambda load: not load["running"] and not load["waiting"], 60)
    with _keyed_router(tmp_path / "router", address, {"a": {"max_concurrency": 2}, "b": {}}) as (url, keys):
        stop, codes, seen = threading.Event(), [], []
        flood = {"model": MODEL, "prompt": "Count", "max_tokens": 2000, "ignore_eos": True, "stream": True}

        def a_stream():
            with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {keys['a']}"}) as client:
                while not stop.is_set():
                    with client.stream("POST", f"{url}/v1/completions", json=flood) as r:
                        if r.status_code == 429:
                            codes.append(json.loads(r.read())["error"]["code"])
                            time.sleep(0.05)
                            continue
                        codes.append(r.status_code)
                        for _ in r.iter_lines():
                            if stop.is_set():
                                break  # and hang up: the engine aborts it

        def watch():
            while not stop.is_set():
                seen.append(engine_load(llama["base"])["running"])
                time.sleep(0.05)

        threads = [threading.Thread(target=a_stream) for _ in range(6)] + [threading.Thread(target=watch)]
        for t in threads:
            t.start()
        try:
            wait_for(llama["base"], lambda load: load["running"] == 2, 30)
            b = []
            for _ in range(10):
                with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {keys['b']}"},
                                  json={"model": MODEL, "prompt": "The model serves", "max_tokens": 4,
                                        "ignore_eos": True, "stream": True}) as r:
                    b.append((r.status_code, sum(line.startswith("data: {") for line in r.iter_lines())))
            assert engine_load(llama["base"])["running"] >= 2  # A still flooding through all of B's
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert len(b) == 10 and all(status == 200 and events >= 1 for status, events in b), b
    assert max(seen) <= 3, max(seen)  # A's 2 and B's 1
    assert codes.count(200) >= 2 and "concurrency_limit_exceeded" in codes, codes[:20]
    assert set(codes) <= {200, "concurrency_limit_exceeded"}, set(codes)
    wait_for(llama["base"], lambda load: not load["running"], 30)


def test_the_instance_log_tells_requests_not_probes(llama):
    """The readiness polls and /metrics scrapes of every test above are not in the log; the
    requests, the warm-up and the hang-ups are."""
    for _ in range(5):
        httpx.get(f"{llama['base']}/ready", timeout=10)
        httpx.get(f"{llama['base']}/metrics", timeout=10)
    text = llama["log"].read_text()
    probes = [line for line in text.splitlines() if re.search(r'"GET /(ready|health|metrics)', line)
              or "HTTP Request: GET" in line]
    assert not probes, probes[:5]
    assert '"POST /v1/completions HTTP/1.1" 200' in text and "ready" in text
    assert "the client disconnected before the answer" in text


# -- startup gating, one merged /metrics, drain on SIGTERM (last: it stops the instance) ------------

def test_no_answer_carried_a_finish_reason_openai_never_sends():
    """Across every 200 answer the tests above read (engine aborts and errors are HTTP errors)."""
    assert len(SEEN_FINISH) >= 100, len(SEEN_FINISH)
    assert set(SEEN_FINISH) <= {None, "stop", "length", "tool_calls"}, set(SEEN_FINISH)


def test_grpc_port_stayed_closed_until_the_engine_answered(llama):
    gate = llama["gate"]
    assert gate["live_polls"] >= 5, gate  # the frontend was live (and /ready 503) while the engine loaded
    assert gate["grpc_connects_before_ready"] == 0, gate
    # The OpenAI routes said so: 503 in the OpenAI shape with Retry-After (a 404 for the unknown
    # model is the instance serving already); /v1/models listed nothing until then.
    loading = [a for a in gate["openai_while_loading"] if a[0] != 404]
    assert len(loading) >= 5 and set(loading) == {(503, "5", "loading")}, gate["openai_while_loading"]
    assert len(gate["models_while_loading"]) >= 5 and set(gate["models_while_loading"]) == {0}, gate
    assert [m["id"] for m in httpx.get(f"{llama['base']}/v1/models", timeout=10).json()["data"]] == [MODEL]
    timeline = json.loads(next((llama["log"].parent / "home").rglob("startup-timeline.json")).read_text())
    stages = {s["stage"]: s["seconds"] for s in timeline["stages"]}
    assert list(stages)[-1] == "load_and_warm_up" and stages["load_and_warm_up"] > 5


def _families(text: str, prefix: str) -> set[str]:
    # `*_created` gauges are prometheus_client's creation timestamps of counters and histograms
    # (single-process mode only), not metrics of vLLM's; RUNTIME_NOTES.md counts without them.
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ") and
            line.split()[2].startswith(prefix) and not line.split()[2].endswith("_created")}


@pytest.fixture(scope="module")
def vllm_serve_families(llama):
    """The vllm: metric families of vLLM's own OpenAI server on the same model, same runtime,
    after the same kind of traffic."""
    folder = llama["log"].parent
    with vllm_serve(str(folder / "model"), MODEL, folder / "vllm-serve.log", "--dtype", "float32",
                    "--max-model-len", "256", timeout=300) as base:
        for _ in range(3):
            httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "The model serves", "max_tokens": 8}).raise_for_status()
        return _families(httpx.get(f"{base}/metrics", timeout=10).text, "vllm:")


def test_metrics_merge_triton_and_every_vllm_family(llama, vllm_serve_families):
    for _ in range(3):
        _complete(llama)
    text = httpx.get(f"{llama['base']}/metrics", timeout=10).text
    ours = _families(text, "vllm:")
    assert len(vllm_serve_families) >= 30
    assert ours == vllm_serve_families, f"missing {vllm_serve_families - ours}, extra {ours - vllm_serve_families}"
    assert "nv_inference_request_success" in _families(text, "nv_")
    assert "modelops_triton_metrics_up 1" in text
    success = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    assert sum(float(line.split()[-1]) for line in success) >= 3


def test_sigterm_drains_in_flight_requests_then_exits(llama):
    import os
    import signal
    import threading
    import time

    streams, started = 8, threading.Semaphore(0)
    results: list[dict] = []

    def long_stream():
        out = {"events": []}
        results.append(out)
        with httpx.stream("POST", f"{llama['base']}/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": "The model serves", "max_tokens": 230, "temperature": 0,
                                "stream": True}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not out["events"]:
                        started.release()
                    out["events"].append(line)

    threads = [threading.Thread(target=long_stream) for _ in range(streams)]
    for t in threads:
        t.start()
    for _ in range(streams):
        assert started.acquire(timeout=60)  # every stream has its first event: all are in flight
    t0 = time.monotonic()
    os.kill(llama["pid"], signal.SIGTERM)
    ready = httpx.get(f"{llama['base']}/ready", timeout=5)
    refused = httpx.post(f"{llama['base']}/v1/completions", timeout=5,
                         json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    with socket.socket() as probe:  # the KServe gRPC gate is closed to new connections
        grpc_closed = probe.connect_ex(("127.0.0.1", int(llama["grpc"].split(":")[1]))) != 0
    for t in threads:
        t.join(timeout=120)
    llama["proc"].wait(timeout=60)
    exited = time.monotonic() - t0
    assert ready.status_code == 503 and ready.json()["draining"] is True
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert grpc_closed
    for out in results:  # every in-flight request ran to its end
        assert out["status"] == 200 and out["events"][-1] == "data: [DONE]"
        last = json.loads(out["events"][-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length"
    log = llama["log"].read_text()
    assert "draining: readiness false" in log and "drained in" in log
    drained = float(re.search(r"drained in ([0-9.]+) s", log).group(1))
    unloaded = float(re.search(r"tritonserver stopped ([0-9.]+) s after the drain", log).group(1))
    # Triton's unload is bounded (runtime/startup.py: TRITON_EXIT_TIMEOUT_S). Its finalize now and
    # then never begins (seen here and in CI; cause unknown): then the bound is what ends it.
    finalized = "vllm backend: finalized in" in log
    assert unloaded <= TRITON_EXIT_TIMEOUT_S + 2.5 and exited <= drained + TRITON_EXIT_TIMEOUT_S + 5, (drained, exited)
    assert llama["proc"].returncode == 0
    print(f"{streams} in-flight streams finished; drained in {drained:.1f} s, Triton stopped {unloaded:.1f} s "
          f"later (finalize {'ran' if finalized else 'never began'}), exited {exited:.1f} s after SIGTERM")
