"""modelops/batch.py: request lines of a batch input file, determinism and the cache key."""

import json

from hypothesis import given
from hypothesis import strategies as st

from modelops.batch import BatchLine, LineError, cache_key, deterministic, error_line, output_line, parse_line, \
    request_id

CHAT = "/v1/chat/completions"


def _line(**fields) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, **fields})


def test_a_valid_line_is_a_request():
    got = parse_line(_line().encode(), 3, CHAT, set())
    assert got == BatchLine(3, "a", CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert got.model == "m"


def test_blank_lines_are_skipped():
    assert parse_line(b"  \t", 1, CHAT, set()) is None


def test_each_bad_line_names_its_fault_and_line():
    cases = {
        "{not json": "invalid_json",
        "[1, 2]": "invalid_request",
        _line(custom_id=""): "missing_custom_id",
        _line(custom_id=7): "missing_custom_id",
        _line(method="GET"): "invalid_method",
        _line(url="/v1/embeddings"): "mismatched_endpoint",
        _line(body={"messages": []}): "invalid_body",
        _line(body=[1]): "invalid_body",
        _line(body={"model": "m", "stream": True}): "invalid_body",
        _line(extra=1): "invalid_request",
    }
    for raw, code in cases.items():
        got = parse_line(raw, 9, CHAT, set())
        assert isinstance(got, LineError) and got.code == code and got.number == 9, (raw, got)
        assert "line 9" in got.message


def test_a_repeated_custom_id_is_an_error_on_the_second_line_only():
    seen: set[str] = set()
    assert isinstance(parse_line(_line(), 1, CHAT, seen), BatchLine)
    second = parse_line(_line(), 2, CHAT, seen)
    assert isinstance(second, LineError) and second.code == "duplicate_custom_id" and second.custom_id == "a"


def test_deterministic_means_no_sampling():
    assert deterministic("/v1/embeddings", {"model": "m", "input": "x"})
    assert deterministic("/v1/score", {}) and deterministic("/v1/rerank", {})
    assert deterministic(CHAT, {"temperature": 0}) and deterministic(CHAT, {"temperature": 0.0})
    # The model's own default temperature may sample; True is not a number here.
    assert not deterministic(CHAT, {}) and not deterministic(CHAT, {"temperature": 0.7})
    assert not deterministic(CHAT, {"temperature": False}) and not deterministic(CHAT, {"temperature": "0"})


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)


@given(st.dictionaries(st.text(max_size=6), _json, min_size=1, max_size=6))
def test_the_cache_key_ignores_key_order_and_sees_every_value(body):
    reordered = dict(reversed(list(body.items())))
    key = cache_key("m", "1", CHAT, body)
    assert key == cache_key("m", "1", CHAT, reordered) and len(key) == 64
    assert key != cache_key("m", "2", CHAT, body)  # a new version misses
    assert key != cache_key("m", "1", "/v1/completions", body)
    assert key != cache_key("m", "1", CHAT, {**body, "\x00extra": 1})


def test_output_and_error_lines_have_openais_shape_and_stable_ids():
    out = output_line("batch_x", 4, "a", 200, {"ok": 1}, "req-1")
    assert out == {"id": request_id("batch_x", 4), "custom_id": "a",
                   "response": {"status_code": 200, "request_id": "req-1", "body": {"ok": 1}}, "error": None}
    assert request_id("batch_x", 4) == request_id("batch_x", 4) != request_id("batch_x", 5)
    assert request_id("batch_x", 4).startswith("batch_req_")
    err = error_line("batch_x", LineError(2, "invalid_json", "line 2 is not JSON"))
    assert err["response"] is None and err["error"] == {"code": "invalid_json", "message": "line 2 is not JSON",
                                                        "line": 2}


def test_a_cached_answer_gets_its_own_id_and_time_and_keeps_the_rest():
    from modelops.batch import fresh_answer

    cached = json.dumps({"id": "embd-0123abcd", "created": 1, "object": "list", "data": [{"embedding": [0.5]}]})
    a, b = fresh_answer(cached), fresh_answer(cached)
    assert a["id"].startswith("embd-") and a["id"] != b["id"] != "embd-0123abcd" and a["created"] > 1
    assert {k: v for k, v in a.items() if k not in ("id", "created")} == {"object": "list", "data": [{"embedding": [0.5]}]}
    assert fresh_answer('{"data": [1]}') == {"data": [1]} and fresh_answer("[1, 2]") == [1, 2]
