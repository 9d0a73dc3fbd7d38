"""The OpenAI face on a real instruct model, against `vllm serve` as the oracle.

SmolLM2-135M-Instruct (tests/models/make_smollm2.py) served twice from the same runtime image with
the same engine args: one instance of ours (frontend → Triton → our vllm backend) and vLLM's own
OpenAI server. The same request goes to both; texts, token choices and shapes must agree.
"""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest
import yaml

from modelops.io_contract import STRUCTURED_OUTPUTS_CONFIG, VLLM_ENV
from tests.integration.conftest import isolated_env, runtime_python, serving, vllm_serve

pytestmark = pytest.mark.e2e

MODEL = "smollm2"
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 2048}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]
# 20 fixed chat prompts (greedy, 48 tokens): ours must equal vllm serve's text for each.
PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for writing clean code.",
    "What is photosynthesis, in one sentence?",
    "List two planets in our solar system.",
    "Who wrote Romeo and Juliet?",
    "Explain what a CPU does in simple words.",
    "Suggest a name for a pet cat.",
    "What is the boiling point of water in Celsius?",
    "Describe the color blue to someone who cannot see.",
    "What day comes after Monday?",
    "Give a synonym for 'happy'.",
    "How many legs does a spider have?",
    "What is the opposite of 'cold'?",
    "Write one sentence about autumn.",
    "What language is spoken in Brazil?",
    "Why do we need sleep?",
]


@pytest.fixture(scope="session")
def smollm2_dir():
    out = subprocess.run([str(runtime_python()), "tests/models/make_smollm2.py"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def ours(smollm2_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("smollm2")
    manifest = work / "smollm2.yaml"
    manifest.write_text(yaml.safe_dump({"model_id": MODEL, "version": "1", "source": smollm2_dir, "task": "generate",
                                        "engine_args": ENGINE_ARGS}))
    with serving(manifest, isolated_env(work / "home"), work / "serve.log", timeout=600) as inst:
        yield inst


@pytest.fixture(scope="module")
def oracle(smollm2_dir, ours, tmp_path_factory):
    """`vllm serve` on the same folder, same runtime, same engine args (the structured-outputs
    backend our packages set, and whole-prompt prefill as our backend runs it on the CPU); tool calls set up as our instance sets them up without
    a manifest tool_parser (runtime/engine/openai_engine.py)."""
    log = tmp_path_factory.mktemp("vllm-serve") / "vllm-serve.log"
    with vllm_serve(smollm2_dir, MODEL, log, "--dtype", "float32", "--max-model-len", "2048",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tool-strict-level", "parameter",
                    "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG),
                    "--no-enable-chunked-prefill", env=VLLM_ENV) as base:
        yield {"base": base}


def _post(server: dict, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server['base']}/v1/{route}", json={"model": MODEL, **body}, timeout=300)


def _both(ours, oracle, route: str, body: dict) -> tuple[dict, dict]:
    a, b = _post(ours, route, body), _post(oracle, route, body)
    assert a.status_code == 200, a.text
    assert b.status_code == 200, b.text
    return a.json(), b.json()


def _chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 48, **extra}


def test_twenty_prompts_greedy_equal_vllm_serve_and_paris(ours, oracle):
    differing = []
    for prompt in PROMPTS:
        a, b = _both(ours, oracle, "chat/completions", _chat(prompt))
        if a["choices"][0]["message"]["content"] != b["choices"][0]["message"]["content"]:
            differing.append((prompt, a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]))
        assert a["usage"] == b["usage"]
    assert not differing, differing
    first = _post(ours, "chat/completions", _chat(PROMPTS[0])).json()["choices"][0]["message"]["content"]
    assert "Paris" in first, first


def test_roles_parts_names_and_template_extensions_render_as_vllm_does(ours, oracle):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "developer", "content": "Use plain words."},
        {"role": "user", "name": "ada", "content": [{"type": "text", "text": "Hello! "},
                                                    {"type": "text", "text": "What is rain?"}]},
        {"role": "assistant", "content": "Rain is water falling from clouds."},
        {"role": "user", "content": "And snow?"},
    ]
    for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"add_generation_prompt": True}}):
        a, b = _both(ours, oracle, "chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 24,
                                                         **extra})
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], extra
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"], extra
    cont = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A fruit is the"}]
    a, b = _both(ours, oracle, "chat/completions", {"messages": cont, "temperature": 0, "max_tokens": 16,
                                                     "continue_final_message": True, "add_generation_prompt": False})
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    # A tool turn (assistant tool_calls, then the tool's answer) renders too.
    turn = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees, snow"}]
    a, b = _both(ours, oracle, "chat/completions", {"messages": turn, "temperature": 0, "max_tokens": 24})
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_chat_logprobs_same_top_tokens_as_vllm(ours, oracle):
    a, b = _both(ours, oracle, "chat/completions", _chat(PROMPTS[1], max_tokens=12, logprobs=True, top_logprobs=5))
    ca, cb = a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]
    assert len(ca) == len(cb) == a["usage"]["completion_tokens"]
    for x, y in zip(ca, cb):
        assert x["token"] == y["token"] and [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in
                                                                                          y["top_logprobs"]]
        assert len(x["top_logprobs"]) == 5 and abs(x["logprob"] - y["logprob"]) < 1e-4


def test_completion_logprobs_echo_and_prompt_lists_match_vllm(ours, oracle):
    a, b = _both(ours, oracle, "completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                "temperature": 0, "logprobs": 3})
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    assert la["tokens"] == lb["tokens"] and [sorted(t) for t in la["top_logprobs"]] == \
        [sorted(t) for t in lb["top_logprobs"]]
    # A list of 3 prompts: three choices, indexes 0-2, each what vLLM answers.
    prompts = ["Once upon a time", "The best way to learn", "In 1969,"]
    a, b = _both(ours, oracle, "completions", {"prompt": prompts, "max_tokens": 10, "temperature": 0})
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    # Token-id prompts, and echo with logprobs and max_tokens 0: the prompt's own logprobs.
    ids = [[504, 3575, 282], [1348, 314]]
    a, b = _both(ours, oracle, "completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert len(a["choices"]) == 2 and a["usage"] == b["usage"]
    for x, y in zip(a["choices"], b["choices"]):
        assert x["text"] == y["text"] and x["logprobs"]["tokens"] == y["logprobs"]["tokens"]
        for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"]):
            assert (p is None and q is None) or abs(p - q) < 1e-4


def _engine_steps(server: dict) -> float:
    """Engine steps so far: the count of vLLM's tokens-per-step histogram in the instance's /metrics."""
    text = httpx.get(f"{server['base']}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:iteration_tokens_total_count"))


def test_prefill_only_logprobs_equal_vllm_prompt_logprobs_and_take_no_decode_step(ours, oracle):
    """echo + logprobs + max_tokens 0 (the log-likelihood idiom of evaluation harnesses) gives each
    prompt's token logprobs, equal to vllm serve's own prompt_logprobs, in no more engine steps than
    a max_tokens 1 request takes (its prefill); max_tokens 8 takes at least 7 more."""
    prompts = ["The sky is blue.", "The sky is green.", "Paris is the capital of France.", "Two plus two is five."]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "temperature": 0}
    before = _engine_steps(ours)
    a = _post(ours, "completions", {**body, "max_tokens": 0}).json()
    prefill_only = _engine_steps(ours) - before
    b = _post(oracle, "completions", {"prompt": prompts, "prompt_logprobs": 1, "max_tokens": 1, "temperature": 0,
                                      "return_token_ids": True}).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    for prompt, x, y in zip(prompts, a["choices"], b["choices"]):
        assert x["text"] == prompt  # the prompt, nothing generated
        ids, theirs = y["prompt_token_ids"], y["prompt_logprobs"]
        mine = x["logprobs"]["token_logprobs"]
        assert len(mine) == len(ids) and mine[0] is None and theirs[0] is None
        for p, token, entry in zip(mine[1:], ids[1:], theirs[1:]):
            assert abs(p - entry[str(token)]["logprob"]) < 1e-4, (prompt, token)
    # "The sky is green." is less likely than "... blue." under a real model.
    assert sum(a["choices"][1]["logprobs"]["token_logprobs"][1:]) < sum(a["choices"][0]["logprobs"]["token_logprobs"][1:])
    before = _engine_steps(ours)
    _post(ours, "completions", {**body, "max_tokens": 1})
    one_token = _engine_steps(ours) - before
    before = _engine_steps(ours)
    _post(ours, "completions", {**body, "max_tokens": 8, "ignore_eos": True})
    eight_tokens = _engine_steps(ours) - before
    # A max_tokens 1 request ends with its prefill step (its one token is that step's sample).
    assert 1 <= prefill_only <= one_token and eight_tokens >= one_token + 7, (prefill_only, one_token, eight_tokens)


def test_n_three_choices_seeded_as_vllm(ours, oracle):
    body = _chat(PROMPTS[2], n=3, temperature=0.9, seed=11, max_tokens=16)
    a, b = _both(ours, oracle, "chat/completions", body)
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
    assert len({c["message"]["content"] for c in a["choices"]}) >= 2  # independent samples


def test_sampling_extensions_as_vllm(ours, oracle):
    for extra in ({"min_tokens": 30, "max_tokens": 40}, {"ignore_eos": True, "max_tokens": 20},
                  {"repetition_penalty": 1.5}, {"top_k": 3, "temperature": 0.8, "seed": 1},
                  {"min_p": 0.2, "temperature": 0.8, "seed": 2}):
        a, b = _both(ours, oracle, "chat/completions", _chat(PROMPTS[6], **extra))
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], extra
        assert a["usage"] == b["usage"], extra
    a = _post(ours, "chat/completions", _chat(PROMPTS[13], min_tokens=30, max_tokens=40)).json()
    assert a["usage"]["completion_tokens"] >= 30


def test_tool_choice_required_and_named_give_valid_arguments(ours, oracle):
    import jsonschema

    schema = TOOLS[0]["function"]["parameters"]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"messages": ask, "tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 80}
        a, b = _both(ours, oracle, "chat/completions", body)
        calls = a["choices"][0]["message"]["tool_calls"]
        assert calls and calls[0]["function"]["name"] == "get_weather", a
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
        assert [c["function"] for c in calls] == [c["function"] for c in b["choices"][0]["message"]["tool_calls"]]
    # Streaming carries the tool-call deltas; joined, they are the same arguments.
    body = {"messages": ask, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 80,
            "stream": True}
    with httpx.stream("POST", f"{ours['base']}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    args = "".join(tc["function"].get("arguments") or "" for e in events for ch in e["choices"]
                   for tc in (ch["delta"].get("tool_calls") or []))
    jsonschema.validate(json.loads(args), schema)
    # tool_choice none: tools are ignored, a plain answer comes back, as from vLLM.
    a, b = _both(ours, oracle, "chat/completions", {"messages": ask, "tools": TOOLS, "tool_choice": "none",
                                                     "temperature": 0, "max_tokens": 24})
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert not a["choices"][0]["message"].get("tool_calls")


def test_structured_outputs_close_on_the_real_model(ours, oracle):
    """Enum and pattern schemas never run into max_tokens (compact JSON: no whitespace to run
    away on), parse strictly and validate; greedy answers equal vllm serve's."""
    import jsonschema

    from runtime.engine.structured_outputs import prepare, strict_loads

    enum = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"]}
    pattern = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
               "required": ["code"]}
    ends = []
    for name, schema in (("answer", enum), ("code", pattern)):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        ask = [{"role": "user", "content": f"Is Paris in France? Reply in JSON with the key {name}."}]
        for seed in range(10):
            out = _post(ours, "chat/completions", {"messages": ask, "temperature": 1.0, "seed": seed,
                                                   "max_tokens": 120, "response_format": fmt})
            assert out.status_code == 200, out.text
            choice = out.json()["choices"][0]
            ends.append(choice["finish_reason"])
            jsonschema.validate(strict_loads(choice["message"]["content"]), schema)
        # vllm serve gets the schema as our runtime hands it to the engine (objects closed)
        a = _post(ours, "chat/completions", {"messages": ask, "temperature": 0, "max_tokens": 120,
                                             "response_format": fmt}).json()
        closed = {"type": "json_schema", "json_schema": {"name": name, "schema": prepare(schema)}}
        b = _post(oracle, "chat/completions", {"messages": ask, "temperature": 0, "max_tokens": 120,
                                               "response_format": closed}).json()
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert ends == ["stop"] * 20


def test_seeded_long_prompts_at_once_keep_the_engine_up(ours):
    """Three seeded ~1,400-token prompts at once exceed one step's token budget: with chunked
    prefill on, vLLM 0.32's CPU engine dies rewinding a seeded generator after a partial
    prefill. Our backend prefills whole prompts on the CPU, so all are answered, reproducibly."""
    import concurrent.futures

    long_prompt = "Summarize: " + "The quick brown fox jumps over the lazy dog near the river bank. " * 100
    body = lambda s: {"prompt": long_prompt, "temperature": 1.0, "seed": s, "max_tokens": 4}  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda s: _post(ours, "completions", body(s)), range(3)))
    assert [o.status_code for o in outs] == [200, 200, 200], [o.text[:300] for o in outs]
    assert outs[0].json()["usage"]["prompt_tokens"] > 1300
    again = _post(ours, "completions", body(1))
    assert again.json()["choices"][0]["text"] == outs[1].json()["choices"][0]["text"]
    assert "enable_chunked_prefill=False" in ours["log"].read_text()


def test_tool_choice_auto_without_a_parser_is_a_400_naming_the_manifest_field(ours):
    r = _post(ours, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and "tool_parser" in err["message"] and err["type"] == "invalid_request_error"


def test_streamed_chat_with_logprobs_and_usage_equals_the_whole(ours):
    body = _chat(PROMPTS[3], logprobs=True, top_logprobs=2)
    whole = _post(ours, "chat/completions", body).json()
    with httpx.stream("POST", f"{ours['base']}/v1/chat/completions", timeout=120,
                      json={"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(ch["delta"].get("content") or "" for e in events for ch in e["choices"])
    tokens = [t["token"] for e in events for ch in e["choices"] if ch.get("logprobs")
              for t in ch["logprobs"]["content"]]
    assert text == whole["choices"][0]["message"]["content"]
    assert tokens == [t["token"] for t in whole["choices"][0]["logprobs"]["content"]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert events[-1]["choices"] == [] and [events[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in
                                                                                        counts]


def test_context_length_refusals_name_the_numbers(ours):
    r = _post(ours, "chat/completions", _chat("Hi", max_tokens=2040))
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    prompt_tokens = _post(ours, "chat/completions", _chat("Hi", max_tokens=1)).json()["usage"]["prompt_tokens"]
    assert all(str(n) in msg for n in (2048, 2040, prompt_tokens)), msg
    assert r.json()["error"]["param"] in ("max_tokens", "messages", "max_completion_tokens", None)
    long = _post(ours, "completions", {"prompt": "word " * 2100, "max_tokens": 1})
    assert long.status_code == 400 and "2048" in long.json()["error"]["message"], long.text
    stream = httpx.post(f"{ours['base']}/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": "word " * 2100, "max_tokens": 1, "stream": True})
    assert stream.status_code == 400 and stream.headers["content-type"].startswith("application/json")
    # Without max_tokens, the default is what is left of the context: a chat answer may run long.
    free = _post(ours, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                                            "max_tokens": 64, "ignore_eos": True})
    assert free.status_code == 200 and free.json()["usage"]["completion_tokens"] == 64
    unbounded = _post(ours, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0})
    assert unbounded.status_code == 200 and unbounded.json()["choices"][0]["finish_reason"] == "stop"


def test_engine_side_refusals_are_400(ours):
    for route, body, param in [
        ("completions", {"prompt": [[10 ** 7]], "max_tokens": 2}, None),  # out-of-vocabulary token id
        ("chat/completions", _chat("x", n=2), None),  # n > 1 with greedy sampling
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
         "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, None),
    ]:
        r = _post(ours, route, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        if param:
            assert r.json()["error"]["param"] == param


def test_metrics_label_the_model_id_not_the_path(ours):
    text = httpx.get(f"{ours['base']}/metrics", timeout=10).text
    names = {line.split('model_name="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("vllm:") and 'model_name="' in line}
    assert names == {MODEL}, names
    assert f'modelops_model_info{{model_name="{MODEL}",version="1"}} 1' in text
