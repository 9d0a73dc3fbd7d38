"""The frontend's request audit (runtime/frontend/protocol.py): what passes goes as it came to
vLLM's serving classes; what it refuses names the field. The instance-level behaviour is in
tests/integration/test_runtime.py and test_chat_real.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from runtime.frontend.protocol import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RerankRequest,
                                      ScoreRequest)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def _error_loc(exc: ValidationError) -> tuple[set[str], str]:
    return {".".join(str(p) for p in e["loc"]) for e in exc.errors()}, str(exc)


def test_body_is_what_the_client_set_minus_frontend_only_fields():
    req = _chat(safety_identifier="sid", n=2, temperature=0.5, tools=[TOOL], tool_choice="required",
                chat_template_kwargs={"enable_thinking": False})
    assert req.body() == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0.5,
                          "tools": [TOOL], "tool_choice": "required",
                          "chat_template_kwargs": {"enable_thinking": False}}
    cmpl = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True,
                                             "logprobs": 2})
    assert cmpl.body() == {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 2}


@pytest.mark.parametrize("fields, loc, words", [
    ({"messages": [{"role": "tool", "content": "3 degrees"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", "content is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0",
     "belong to assistant"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls.0.type", "required"),
    ({"top_logprobs": 3}, "", "top_logprobs needs logprobs"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "",
     "'other', which is not in tools"),
    ({"tool_choice": "required"}, "", "needs tools"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "", "cannot both be true"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"best_of": 2}, "best_of", "Extra inputs are not permitted"),
])
def test_chat_refusals_name_the_field(fields, loc, words):
    with pytest.raises(ValidationError) as e:
        _chat(**fields)
    locs, text = _error_loc(e.value)
    assert any(x.startswith(loc) for x in locs), locs
    assert words in text


def test_completion_prompt_shapes():
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1], [2, 3]]):
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    for prompt in ([], [[1], []]):
        with pytest.raises(ValidationError, match="must not be an empty list"):
            CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    with pytest.raises(ValidationError, match="less than or equal to 20"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 21})


@pytest.mark.parametrize("fields, first, second", [
    ({"text_1": "a", "text_2": ["b", "c"]}, ["a"], ["b", "c"]),
    ({"queries": ["a", "b"], "documents": ["c", "d"]}, ["a", "b"], ["c", "d"]),
    ({"queries": "a", "items": "b"}, ["a"], ["b"]),
    ({"data_1": ["a"], "data_2": ["b", "c", "d"]}, ["a"], ["b", "c", "d"]),
])
def test_score_takes_each_pair_name_of_vllm(fields, first, second):
    req = ScoreRequest.model_validate({"model": "m", **fields})
    assert req.sides() == (first, second)
    assert req.pair == tuple(fields)


@pytest.mark.parametrize("fields, words", [
    ({"text_1": "a"}, "text_1 needs text_2; give exactly one pair"),
    ({"queries": ["a"]}, "queries needs documents or items"),
    ({"text_1": "a", "text_2": ["b", "\ud800"]}, "text_2[1] is not valid Unicode"),
    ({"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}, "exactly one pair"),
    ({"text_1": "a", "documents": "b"}, "exactly one pair"),
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts and text_2 3"),
    ({"text_1": [], "text_2": "b"}, "text_1 must not be an empty list"),
    ({"queries": "a", "items": ["b", ""]}, "items must not contain empty strings (items[1] is empty)"),
    ({"text_1": "a", "text_2": ["b"] * 2048}, "at most 2048"),
    ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 8}, "Extra inputs are not permitted"),
    ({"text_1": {"content": [{"type": "text", "text": "a"}]}, "text_2": "b"}, "text_1"),
])
def test_score_refusals_say_what_to_change(fields, words):
    with pytest.raises(ValidationError) as e:
        ScoreRequest.model_validate({"model": "m", **fields})
    assert words in str(e.value)


def test_embedding_input_must_be_unicode():
    with pytest.raises(ValidationError, match=r"input\[1\] is not valid Unicode"):
        EmbeddingRequest.model_validate({"model": "m", "input": ["ok", "\udc80"]})


def test_rerank_fields():
    req = RerankRequest.model_validate({"model": "m", "query": "q", "documents": ["a", "b"], "top_n": 1})
    assert (req.top_n, req.return_documents) == (1, True)
    for fields, words in (({"documents": []}, "must not be an empty list"), ({"top_n": -1}, "greater than or equal"),
                          ({"documents": ["\ud800"]}, r"documents\[0\] is not valid Unicode"),
                          ({"query": ""}, "at least 1 character"), ({"max_tokens_per_doc": 4}, "Extra inputs")):
        with pytest.raises(ValidationError, match=words):
            RerankRequest.model_validate({"model": "m", "query": "q", "documents": ["a"], **fields})


# What vllm-router 0.1.17 adds to every request it forwards (captured here from its requests).
VLLM_ROUTER_CHAT = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                    "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                    "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
VLLM_ROUTER_COMPLETION = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                          "skip_special_tokens": True, "return_hidden_states": False}


def test_fields_a_router_adds_at_their_default_are_honoured_by_doing_nothing():
    from runtime.frontend.protocol import ROUTER_DEFAULTS

    chat = _chat(max_tokens=3, **VLLM_ROUTER_CHAT)
    assert not set(ROUTER_DEFAULTS) & set(chat.body())  # not forwarded: vLLM's defaults already do it
    assert chat.body()["continue_final_message"] is False  # our own fields pass as before
    cmpl = CompletionRequest.model_validate({"model": "m", "prompt": "x", **VLLM_ROUTER_COMPLETION})
    assert not set(ROUTER_DEFAULTS) & set(cmpl.body())


@pytest.mark.parametrize("field", sorted(__import__("runtime.frontend.protocol", fromlist=["x"]).ROUTER_DEFAULTS))
def test_a_router_field_set_otherwise_is_refused_naming_it(field):
    from runtime.frontend.protocol import ROUTER_DEFAULTS

    for other in (not ROUTER_DEFAULTS[field], 0 if ROUTER_DEFAULTS[field] is False else 1, "true"):
        with pytest.raises(ValidationError) as e:
            _chat(**{field: other})
        assert field in _error_loc(e.value)[0]


def test_stream_null_is_not_streamed_and_stream_options_still_need_stream_true():
    """OpenAI's schema has ``stream: boolean | null`` and vLLM's server takes null; it was a 400."""
    for cls, fields in ((CompletionRequest, {"prompt": "hi"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        req = cls.model_validate({"model": "m", "stream": None, **fields})
        assert not req.stream and req.body()["stream"] is None
        with pytest.raises(ValidationError, match="stream_options is only allowed with stream: true"):
            cls.model_validate({"model": "m", "stream": None, "stream_options": {"include_usage": True}, **fields})
