"""The schema checks and output checks of runtime/engine/structured_outputs/ (no engine: what the
engine's grammar does with them is tests/integration/test_structured_backend.py and the engine
tests in test_runtime.py)."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.structured_outputs import (KEYWORDS, NUMBER_BOUND, OutputCheck, SchemaRefused, locate, prepare,
                                        strict_loads)

CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


def _refused(schema, strict=True) -> SchemaRefused:
    with pytest.raises(SchemaRefused) as e:
        prepare(schema, strict)
    return e.value


def test_ref_cycles_without_a_base_case_are_refused_before_generation():
    assert _refused(CYCLE).pointer == "/$defs/a"
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
    assert _refused({"$ref": "#/$defs/n", "$defs": {"n": node}}).pointer == "/$defs/n"
    mutual = {"$ref": "#/$defs/a", "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}}
    assert "recurses with no way out" in str(_refused(mutual))
    assert _refused(CYCLE, strict=False).pointer == "/$defs/a"  # strict: false cannot make it finite


def test_recursion_with_a_way_out_is_kept():
    optional = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}}
    nullable = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["next"], "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}}
    empty_list = {"$ref": "#/$defs/t", "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}
    for schema in (optional, nullable, empty_list):
        assert prepare(schema, strict=False) == schema
        assert prepare(schema)["$ref"] == schema["$ref"]  # admitted (closed: see below)


def test_strict_objects_are_closed_as_openai_strict_mode_closes_them():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "allOf": [{"properties": {"c": {}}}]}
    out = prepare(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # allOf branches combine: left open
    assert prepare(schema, strict=False) == schema  # JSON Schema's own default
    free = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}
    assert prepare(free) == free and prepare({"type": "object"}) == {"type": "object"}
    unlisted = {"type": "object", "properties": {}, "required": ["a"]}  # "a" may be anything: left open
    assert prepare(unlisted) == unlisted


@pytest.mark.parametrize("keyword,value", [("uniqueItems", True), ("contains", {"const": 1}), ("not", {}),
                                           ("if", {}), ("dependentRequired", {"a": ["b"]}),
                                           ("propertyNames", {"maxLength": 2}), ("unevaluatedProperties", False)])
def test_keywords_the_grammar_ignores_are_refused_at_their_pointer(keyword, value):
    schema = {"type": "object", "properties": {"inner": {"type": "array", keyword: value}}}
    e = _refused(schema)
    assert e.pointer == f"/properties/inner/{keyword}" and e.droppable and "strict: false" in str(e)
    # strict: false drops just that keyword and keeps the rest
    assert prepare(schema, strict=False) == {"type": "object", "properties": {"inner": {"type": "array"}}}


def test_formats_regexes_types_and_refs_name_their_pointer():
    assert _refused({"type": "string", "format": "regex"}).pointer == "/format"
    assert prepare({"type": "string", "format": "email", "maxLength": 40})["format"] == "email"
    assert _refused({"properties": {"p": {"type": "string", "pattern": "^(?!x)"}}}).pointer == "/properties/p/pattern"
    assert _refused({"type": "string", "pattern": r"(a)\1"}).pointer == "/pattern"
    assert _refused({"items": {"type": "text"}}).pointer == "/items/type"
    remote = _refused({"$ref": "https://example.com/s.json"})
    assert remote.pointer == "/$ref" and "only local references" in str(remote)
    assert _refused({"$ref": "#/$defs/missing"}).pointer == "/$ref"
    assert _refused({"items": {"enum": [1, -2**70]}}).pointer == "/items/enum"  # beyond int64
    assert prepare({"enum": [2**63 - 1, -2**63]}) == {"enum": [2**63 - 1, -2**63]}
    assert _refused({"properties": {"a/b": {"$ref": "#/nope"}}}).pointer == "/properties/a~1b/$ref"  # RFC 6901


@pytest.mark.parametrize("schema,pointer", [
    ({"type": "string", "pattern": "^\\p{L}+$"}, "/pattern"),  # Rust-only syntax: re cannot check it
    ({"type": "string", "pattern": "^[[:alpha:]]+$"}, "/pattern"),  # read differently by the two engines
    ({"patternProperties": {"^(?=x)": {}}}, "/patternProperties/^(?=x)"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "string"}]}, "/items"),
    ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, "/exclusiveMinimum"),  # draft-04 form
    ({"type": [["string"]]}, "/type/0"),
    ({"allOf": 3}, "/allOf"),
    ({"properties": {"p": {"minLength": "x"}}}, "/properties/p/minLength"),
    ({"$schema": 3}, "/$schema"),
    ({"properties": {"p": {"oneOf": [{"type": "string"}, {"$ref": "#/nope"}]}}}, "/properties/p/oneOf/1/$ref"),
    ({"oneOf": [{"properties": {"k": {"const": "a"}}, "required": ["k"]},  # no type object: "x" matches both
                {"properties": {"k": {"const": "b"}}, "required": ["k"]}]}, "/oneOf"),
    ({"oneOf": [{"const": 1}, {"const": 1.0}]}, "/oneOf"),  # 1 and 1.0 are one value
    ({"type": "string", "nullable": True}, "/nullable"),
    ({"type": "array", "additionalItems": False}, "/additionalItems"),
])
def test_what_the_grammar_and_the_check_would_read_differently_is_refused(schema, pointer):
    assert _refused(schema).pointer == pointer


def test_deep_schemas_and_fine_corners():
    deep = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    assert "nested more than 64 levels" in str(_refused(deep))
    for fine in ({"type": "string", "pattern": "^[(?=]+$"}, {"type": "string", "pattern": "^\\\\1$"},
                 {"type": "object", "patternProperties": {"^x$": {"type": "string"}}, "required": ["x"],
                  "additionalProperties": False},
                 {"type": "string", "contentSchema": {"uniqueItems": True}}):  # contentSchema: an annotation
        assert prepare(fine) == fine
    assert prepare({"oneOf": [False, {"type": "string"}]}) == {"anyOf": [False, {"type": "string"}]}


def test_unsatisfiable_schemas_are_refused():
    for schema in ({"enum": []}, {"type": "integer", "minimum": 3, "maximum": 1}, False,
                   {"type": "object", "properties": {"a": False}, "required": ["a"]}):
        assert "no JSON value can match" in str(_refused(schema))


def test_a_max_length_below_what_pattern_or_format_need_is_unsatisfiable():
    # Found by the engine test's generated schemas: the grammar engine (llguidance) gave up with
    # "ParserTooComplex" at the first token and the request failed with a 500.
    for string in ({"type": "string", "maxLength": 0, "pattern": "^[a-z]+$"},
                   {"type": "string", "maxLength": 2, "format": "email"},
                   {"type": "string", "minLength": 0, "maxLength": 5, "pattern": "(ab){3}"}):
        assert "is below the shortest string its pattern, format and minLength admit" in str(_refused(string))
        recursive = {"type": "array", "items": {"$ref": "#/$defs/d"}, "minItems": 1, "$defs": {
            "d": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/d"}, string]}, "minItems": 2}}}
        assert _refused(recursive).pointer == "/$defs/d"
    # Named at the subschema that cannot be met, as the grammar's own check names it.
    code = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]+$", "format": "email",
                                                      "maxLength": 2}}, "required": ["code"]}
    refused = _refused(code)
    assert refused.pointer == "/properties/code" and "(3 characters)" in str(refused)
    for fine in ({"type": "string", "maxLength": 3, "pattern": "^[a-z]{2,}$"},
                 {"type": ["string", "null"], "maxLength": 0, "pattern": "a+"},  # null matches
                 {"type": "string", "maxLength": 36, "format": "uuid"},
                 {"maxLength": 0, "pattern": "a+"}):  # no type: a number matches
        prepare(fine)


def test_unbounded_integers_and_numbers_get_the_interoperable_bound_and_own_bounds_win():
    b = NUMBER_BOUND
    assert prepare({"type": "integer"}) == {"type": "integer", "minimum": -b, "maximum": b}
    assert prepare({"type": "number", "minimum": 0}) == {"type": "number", "minimum": 0, "maximum": b}
    assert prepare({"type": "integer", "exclusiveMaximum": 3}) == {"type": "integer", "exclusiveMaximum": 3,
                                                                   "minimum": -b}
    assert prepare({"type": "integer", "minimum": 2**60}) == {"type": "integer", "minimum": 2**60}  # no empty range
    assert prepare({"type": "integer", "maximum": -2**60}) == {"type": "integer", "maximum": -2**60}
    assert prepare({"type": ["integer", "null"]}, strict=False) == {"type": ["integer", "null"], "minimum": -b,
                                                                    "maximum": b}
    nested = prepare({"type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
                                                       "xs": {"type": "array", "items": {"$ref": "#/$defs/x"}}},
                      "$defs": {"x": {"type": "number"}}, "allOf": [{"properties": {"m": {"type": "integer"}}}]})
    assert nested["properties"]["n"]["anyOf"][0] == nested["$defs"]["x"] | {"type": "integer"} == \
        {"type": "integer", "minimum": -b, "maximum": b}
    assert nested["allOf"] == [{"properties": {"m": {"type": "integer", "minimum": -b, "maximum": b}}}]
    assert prepare({"type": "string"}) == {"type": "string"} and prepare({}) == {}  # untyped: not bounded
    # A schema that names a number past b / 2 anywhere is left as written: a default bound beside
    # it could leave out a value it allows, or every value (each of these compiled before).
    for big in ({"type": "integer", "enum": [2**60]}, {"type": "number", "const": 1e20},
                {"type": "object", "properties": {"id": {"$ref": "#/$defs/int", "minimum": 10**17}},
                 "required": ["id"], "additionalProperties": False, "$defs": {"int": {"type": "integer"}}},
                {"type": "integer", "anyOf": [{"minimum": 2**60}]},
                {"allOf": [{"type": "integer"}, {"minimum": 2**60}]},
                {"type": "integer", "multipleOf": 2**53, "minimum": 1},
                {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": "integer", "maximum": 2**60}},
                 "additionalProperties": False}):
        assert prepare(big) == big, big


# Small bounds, and bounds near and past the default one (the cases where it could take values away).
_BOUNDS = st.one_of(st.none(), st.integers(-100, 100),
                    st.sampled_from([s * b for s in (1, -1) for b in (NUMBER_BOUND // 2, NUMBER_BOUND // 2 + 1,
                                                                    NUMBER_BOUND, 2**54, 2**60)]))


@settings(max_examples=300, deadline=None)
@given(st.recursive(
    st.builds(lambda t, lo, hi, m: {"type": t, **({"minimum": lo} if lo is not None else {}),
                                    **({"maximum": hi} if hi is not None else {}), **({"multipleOf": m} if m else {})},
              st.sampled_from(["integer", "number", ["integer", "null"]]), _BOUNDS, _BOUNDS,
              st.one_of(st.none(), st.integers(1, 100), st.sampled_from([NUMBER_BOUND // 2 + 1, 2**54]))),
    lambda kids: st.one_of(st.builds(lambda bs, kw: {kw: bs}, st.lists(kids, min_size=1, max_size=3),
                                     st.sampled_from(["anyOf", "allOf"])),
                           st.builds(lambda k: {"type": "array", "items": k}, kids)),
    max_leaves=6), st.integers(-2**55, 2**55))
def test_the_default_bound_never_refuses_a_number_the_schema_allows(schema, value):
    import jsonschema

    try:
        out = prepare(schema, strict=False)
    except SchemaRefused:
        return
    named = _numbers(schema)
    candidates = {value, value // 3, 0, 1, -1, NUMBER_BOUND // 2, *named, *(n + 1 for n in named),
                  *(n - 1 for n in named), *(2 * n for n in named)}
    allowed = [i for v in sorted(candidates) for i in (v, [v]) if jsonschema.Draft202012Validator(schema).is_valid(i)]
    kept = [i for i in allowed if jsonschema.Draft202012Validator(out).is_valid(i)]
    # What the schema allows within the bound stays allowed, and a schema that allows a value
    # still allows one (the bound never leaves nothing).
    assert all(i in kept for i in allowed if abs(i if isinstance(i, int) else i[0]) <= NUMBER_BOUND), (out, allowed)
    assert kept or not allowed, (out, allowed)


def _numbers(value) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    return [n for v in value for n in _numbers(v)] if isinstance(value, list) else []


def test_one_of_is_any_of_when_branches_are_disjoint_else_refused():
    by_type = {"oneOf": [{"type": "boolean"}, {"type": "string"}]}
    assert prepare(by_type) == {"anyOf": [{"type": "boolean"}, {"type": "string"}]}
    tagged = {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}], "$defs": {
        "cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
        "dog": {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]}}, "required": ["kind"]}}}
    assert "anyOf" in prepare(tagged) and "oneOf" not in prepare(tagged)
    overlapping = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}
    assert _refused(overlapping).pointer == "/oneOf"
    assert prepare(overlapping, strict=False) == {"anyOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}


def test_prepare_leaves_the_callers_schema_alone():
    schema = {"oneOf": [{"type": "integer"}, {"type": "string"}], "items": {"uniqueItems": True}}
    before = copy.deepcopy(schema)
    prepare(schema, strict=False)
    assert schema == before
    assert prepare(True) == {}  # the engine wants an object at the root


def test_locate_names_the_deepest_subschema_the_grammar_refuses():
    schema = {"type": "object", "properties": {"ok": {"type": "integer"}, "code": {
        "type": "string", "pattern": "^[0-9]+$", "format": "email"}}}

    def compile_error(s):  # stands in for llguidance: strings that are digits and emails
        return "Unsatisfiable schema" if "format" in json.dumps(s) else ""

    e = locate(schema, compile_error)
    assert e.pointer == "/properties/code" and "Unsatisfiable schema" in str(e)
    assert locate({"type": "integer"}, compile_error) is None
    assert locate({"$ref": "#/$defs/a", "$defs": {"a": {"format": "x"}}}, compile_error).pointer == "/$defs/a"


def test_strict_loads_is_rfc_8259():
    assert strict_loads('{"a": "x\\u0001"}') == {"a": "x\x01"}  # escaped is fine
    for bad in ('{"a": "x\x01"}', '{"a": NaN}', "[Infinity]", '{"a": 1} trailing', '{"a": 1, "a": 2}'):
        with pytest.raises(ValueError):
            strict_loads(bad)


SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}}, "required": ["a"]}


def _chat(content, finish="stop", index=0):
    return {"index": index, "finish_reason": finish, "message": {"role": "assistant", "content": content}}


def test_output_check_of_whole_answers():
    check = OutputCheck(SCHEMA)
    assert check.check_document({"choices": [_chat('{"a":"ok"}')]}) is None
    too_long = check.check_document({"choices": [_chat('{"a":"ok"}'), _chat('{"a":"abc"}', index=1)]})
    assert (too_long.index, too_long.where, too_long.pointer) == (1, "content", "/properties/a/maxLength")
    assert "choice 1 content (schema keyword /properties/a/maxLength)" in too_long.text()
    raw = check.check_document({"choices": [{"index": 0, "finish_reason": "stop", "text": '{"a":"\n"}'}]})
    assert raw.pointer == "" and "not strict JSON" in raw.message
    assert check.check_document({"choices": [_chat('{"a":', finish="length")]}) is None  # cut: OpenAI's meaning
    assert check.check_document({"choices": [_chat(None)]}).pointer == ""  # stopped without the JSON it promised
    lenient = OutputCheck(SCHEMA, content_strict=False)
    assert lenient.check_document({"choices": [_chat('{"a":"abc"}')]}) is None
    assert lenient.check_document({"choices": [_chat("not json")]}).pointer == ""


def test_output_check_reads_numbers_and_formats_exactly():
    tenths = OutputCheck({"type": "array", "items": {"type": "number", "multipleOf": 0.1}})
    assert tenths.check_document({"choices": [_chat("[0.3,1.7,-2.2]")]}) is None  # no float rounding
    assert tenths.check_document({"choices": [_chat("[0.35]")]}).pointer == "/items/multipleOf"
    # Exponents the grammar allows: past Decimal's precision (1e100 % 0.1) and its range (19 digits)
    assert tenths.check_document({"choices": [_chat("[1e100,0e99999999999999999999,-3E+9999999999999999999]")]}) is None
    found = tenths.check_document({"choices": [_chat("[15e-99999999999999999999]")]})
    assert found.pointer == "/items/multipleOf" and "Decimal(" not in found.message
    bounded = OutputCheck({"type": "number", "maximum": 10, "minimum": -10})
    assert bounded.check_document({"choices": [_chat("1e9999999999999999999")]}).pointer == "/maximum"
    assert bounded.check_document({"choices": [_chat("-1e-9999999999999999999")]}) is None
    integers = OutputCheck({"type": "integer"})  # 2020-12: 1.0 is an integer; 5000 digits still are
    assert [integers.check_document({"choices": [_chat(t)]}) is None for t in ("1.0", "9" * 5000, "1.5", "1e400")] \
        == [True, True, False, True]
    dates = OutputCheck({"type": "string", "format": "date"})
    assert dates.check_document({"choices": [_chat('"2026-12-01"')]}) is None
    assert dates.check_document({"choices": [_chat('"2026-02-31"')]}).pointer == "/format"


def test_output_check_of_streams_and_tool_calls():
    check = OutputCheck(SCHEMA)
    assert check.feed({"choices": [{"index": 0, "delta": {"content": '{"a":"a'}}]}) is None
    found = check.feed({"choices": [{"index": 0, "delta": {"content": 'bc"}'}, "finish_reason": "stop"}]})
    assert found.pointer == "/properties/a/maxLength"
    tools = OutputCheck(tool_schemas={"f": SCHEMA}, tool_strict={"f"})
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":'}}
    assert tools.feed({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}) is None
    more = {"index": 0, "function": {"arguments": '"xyz"}'}}
    found = tools.feed({"choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]})
    assert found.where == "tool_calls[0].function.arguments" and found.pointer == "/properties/a/maxLength"
    whole = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": '{"a":"ok"}'}}]}}]}
    assert tools.check_document(whole) is None
    # vLLM's parser writes 1e999 back as Infinity: an error that says so (a string holding it is fine)
    whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"a":-Infinity}'
    assert "came back as Infinity" in tools.check_document(whole).message
    whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '{"a":"Infinity"}'
    assert tools.check_document(whole).pointer == "/properties/a/maxLength"  # JSON, just too long


# llguidance 1.7.6 inlines what it intersects (allOf; $ref or anyOf beside other keywords), so a
# recursive definition met twice at one place, or inside itself, never ends. name → (schema, the
# pointer prepare refuses at, or None when it compiles); test_structured_backend checks each
# verdict against llguidance itself.
_TREE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/t"}}}
_REF_T, _REF_A = {"$ref": "#/$defs/t"}, {"$ref": "#/$defs/a"}


def _defs(**schema):
    return {**schema, "$defs": {"t": _TREE, "a": {"type": "array", "items": _REF_A}, "n": {"type": "integer"}}}


def _inside_t(c):
    return {"$ref": "#/$defs/t", "$defs": {"t": {"type": "object", "properties": {"c": c}}}}


def _obj(**props):
    return {"type": "object", "properties": props}


RECURSIVE_INTERSECTIONS = {
    "one branch": (_defs(allOf=[_REF_T]), None),
    "tree and object": (_defs(allOf=[_REF_T, {"type": "object"}]), None),
    "tree and required": (_defs(allOf=[_REF_T, {"required": ["c"]}]), None),
    "tree beside required": (_defs(**_REF_T, required=["c"]), None),
    "tree in one part's property": (_defs(allOf=[_obj(x=_REF_T), {"required": ["x"]}]), None),
    "tree in one part, object in the other": (_defs(allOf=[_obj(x=_REF_T), _obj(x={"type": "object"})]), None),
    "tree under two different properties": (_defs(allOf=[_obj(x=_REF_T), _obj(y=_REF_T)]), None),
    "tree and a shallower object": (_defs(allOf=[_REF_T, _obj(c={"type": "object"})]), None),
    "array and array": (_defs(allOf=[_REF_A, {"type": "array"}]), None),
    "anyOf tree and object": (_defs(allOf=[{"anyOf": [_REF_T, {"type": "null"}]}, {"type": "object"}]), None),
    "not recursive": (_defs(allOf=[{"$ref": "#/$defs/n"}, {"minimum": 3}]), None),
    "inside itself, through a property": (_inside_t({"allOf": [_obj(x=_REF_T), {"required": ["x"]}]}), None),
    "inside itself, alone": (_inside_t({"allOf": [_REF_T]}), None),
    # llguidance folds left to right and stops where the types exclude each other
    "tree, boolean, tree": ({**_defs(type="array", items={"allOf": [_REF_T, {"type": "boolean"}, _REF_T]})}, None),
    "tree, tree, boolean": ({**_defs(type="array", items={"allOf": [_REF_T, _REF_T, {"type": "boolean"}]})},
                            "/items/allOf"),
    # a value that two parts both constrain, through different keywords
    "additional and listed property": (_defs(allOf=[{"type": "object", "additionalProperties": _REF_T},
                                                    _obj(x=_REF_T)]), "/allOf"),
    "items and a prefix item": (_defs(allOf=[{"type": "array", "items": _REF_T},
                                             {"type": "array", "prefixItems": [_REF_T]}]), "/allOf"),
    "pattern and listed property": (_defs(allOf=[{"type": "object", "patternProperties": {"^x$": _REF_T}},
                                                 _obj(x=_REF_T)]), "/allOf"),
    "two other patterns": (_defs(allOf=[{"type": "object", "patternProperties": {"^x": _REF_T}},
                                        {"type": "object", "patternProperties": {"^y": _REF_T}}]), None),
    "tree under one property twice": (_defs(allOf=[_obj(x=_REF_T), _obj(x=_REF_T)]), "/allOf"),
    "array twice": (_defs(allOf=[_REF_A, _REF_A]), "/allOf"),
    "items twice": (_defs(allOf=[{"type": "array", "items": _REF_T}, {"type": "array", "items": _REF_T}]), "/allOf"),
    "tree and tree one level down": (_defs(allOf=[_REF_T, _obj(c=_obj(c=_REF_T))]), "/allOf"),
    "inside itself, in allOf": (_inside_t({"allOf": [_REF_T, {"type": "object"}]}), "/$defs/t/properties/c/allOf"),
    "inside itself, in anyOf in allOf": (_inside_t({"allOf": [{"anyOf": [_REF_T, {"type": "null"}]},
                                                             {"type": "object"}]}), "/$defs/t/properties/c/allOf"),
    "inside itself, beside keywords": (_inside_t({**_REF_T, "type": "object"}), "/$defs/t/properties/c/$ref"),
    "inside itself, anyOf beside keywords": (_inside_t({"type": "object", "anyOf": [_REF_T, {"type": "null"}]}),
                                             "/$defs/t/properties/c"),
    "inside itself, one part's property met": (_inside_t({"allOf": [_obj(x=_REF_T), _obj(x={"type": "object"})]}),
                                               "/$defs/t/properties/c/allOf"),
    # A definition that is itself again at its own place: no validator can follow it (left recursion).
    "a bare self-reference combined": ({**_obj(p={"allOf": [{"$ref": "#/$defs/d"}, {"type": "number"}]}),
                                        "$defs": {"d": {"$ref": "#/$defs/d"}}}, "/$defs/d"),
}


def test_a_nested_id_over_refs_is_refused_at_the_id():
    nested = {"type": "object", "properties": {"p": {"$id": "urn:inner", "$defs": {"x": {"type": "integer"}},
                                                     "$ref": "#/$defs/x"}}}
    with pytest.raises(SchemaRefused) as e:
        prepare(nested)
    assert e.value.pointer == "/properties/p/$id" and "base" in str(e.value)
    assert prepare({"type": "object", "properties": {"p": {"$id": "urn:inner", "type": "integer"}}})  # no $ref: fine


def test_refs_into_values_that_are_no_schema_are_refused():
    """A value of enum or const, or a keyword's own map, is no schema: the grammar and the check
    would read it differently (found by a review: refused keywords could hide there)."""
    for schema, pointer in (({"$ref": "#/enum/0", "enum": [{"type": "x"}]}, "/$ref"),
                            ({"$ref": "#/properties", "properties": {"type": {"type": "string"}}}, "/$ref"),
                            ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x/const"}},
                              "$defs": {"x": {"const": {"not": {"$ref": "#"}}}}}, "/properties/a/$ref")):
        with pytest.raises(SchemaRefused) as e:
            prepare(schema)
        assert e.value.pointer == pointer and "holds no schema" in str(e.value)
    assert prepare({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"$ref": "#/prefixItems/0"}})


def test_output_check_never_raises_on_what_the_grammar_allows():
    """Numbers of any length under multipleOf, nesting past Python's recursion limit."""
    thirds = OutputCheck({"multipleOf": 3})
    assert thirds.check_document({"choices": [_chat("9" * 5000)]}) is None
    assert thirds.check_document({"choices": [_chat("9" * 4999 + "8")]}).pointer == "/multipleOf"
    tenths = OutputCheck({"multipleOf": 0.1})
    assert tenths.check_document({"choices": [_chat("1." + "0" * 5000)]}) is None
    assert tenths.check_document({"choices": [_chat("1." + "0" * 5000 + "1")]}).pointer == "/multipleOf"
    deep = OutputCheck({"type": "array"}).check_document({"choices": [_chat("[" * 5000 + "]" * 5000)]})
    assert deep.pointer == "" and "nested deeper" in deep.message
    constant = OutputCheck(tool_schemas={"f": {"type": "object"}}, tool_strict={"f"})
    calls = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": '{"a":NaN}'}}]}}]}
    assert "NaN is not JSON" in constant.check_document(calls).message  # not blamed on an overflow


def test_a_property_named_ref_is_no_reference():
    assert prepare({"type": "object", "properties": {"p": {"$id": "urn:x", "enum": ["$ref"]}}})
    assert prepare({"type": "object", "properties": {"p": {"$id": "urn:x", "type": "object",
                                                           "properties": {"$ref": {"type": "string"}}}}})


def test_left_recursion_is_refused_at_its_definition():
    """d = anyOf[d, integer] compiles in llguidance, but jsonschema (the output check) recurses
    without end on it (seen in test_runtime's generated schemas as a 500)."""
    for body in ({"anyOf": [{"$ref": "#/$defs/d"}, {"type": "integer"}]}, {"anyOf": [{"type": "null"}, {"allOf": [{"$ref": "#/$defs/d"}]}]},
                 {"oneOf": [{"type": "null"}, {"anyOf": [{"$ref": "#/$defs/d"}]}]}):
        with pytest.raises(SchemaRefused) as e:
            prepare({"$ref": "#/$defs/d", "$defs": {"d": body}}, strict=False)
        assert e.value.pointer == "/$defs/d" and "self-reference" in str(e.value)
    # through a property it consumes a level of the value: fine
    assert prepare({"$ref": "#/$defs/d", "$defs": {"d": {"anyOf": [_obj(x={"$ref": "#/$defs/d"}), {"type": "null"}]}}})


@pytest.mark.parametrize("name", RECURSIVE_INTERSECTIONS)
def test_recursive_definitions_the_grammar_would_intersect_forever_are_refused(name):
    schema, pointer = RECURSIVE_INTERSECTIONS[name]
    if pointer is None:
        assert prepare(schema) is not None
        return
    with pytest.raises(SchemaRefused) as e:
        prepare(schema, strict=False)  # not a keyword to drop: refused whatever strict says
    assert e.value.pointer == pointer and ("recursive" in str(e.value) or "itself" in str(e.value))


# -- generated schemas -------------------------------------------------------------------------
_leaf = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "pattern": st.sampled_from(["^[a-z]+$", "^\\d{2,4}$", "(?=x)"]), "maxLength": st.integers(0, 5),
        "minLength": st.integers(0, 5), "format": st.sampled_from(["email", "date", "regex", "color"])}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=3)}),
    st.builds(lambda: {"$ref": "#/$defs/d"}),
)


def _node(children):
    props = st.dictionaries(st.sampled_from(["a", "b", "c/d", "e~f"]), children, max_size=3)
    return st.one_of(
        st.builds(lambda p, req, extra: {"type": "object", "properties": p, "required": req,
                                         **({"additionalProperties": False} if extra else {})},
                  props, st.lists(st.sampled_from(["a", "b"]), unique=True, max_size=2), st.booleans()),
        st.builds(lambda i, lo, u: {"type": "array", "items": i, "minItems": lo, **({"uniqueItems": True} if u else {})},
                  children, st.integers(0, 2), st.booleans()),
        st.builds(lambda bs, kw: {kw: bs}, st.lists(children, min_size=1, max_size=3),
                  st.sampled_from(["anyOf", "oneOf", "allOf"])),
    )


SCHEMAS = st.builds(lambda body, d: {**body, "$defs": {"d": d}}, st.recursive(_leaf, _node, max_leaves=8),
                    st.recursive(_leaf, _node, max_leaves=4))


@settings(max_examples=300, deadline=None)
@given(SCHEMAS, st.sampled_from([True, None, False]))
def test_every_refusal_names_a_keyword_that_is_there(schema, strict):
    try:
        out = prepare(schema, strict)
    except SchemaRefused as e:
        node = schema
        for part in e.pointer.split("/")[1:]:
            node = node[int(part)] if isinstance(node, list) else node[part.replace("~1", "/").replace("~0", "~")]
        assert e.pointer == "" or node is not None
        return
    assert "oneOf" not in _keywords(out)  # the grammar gets anyOf
    if strict is not False:  # nothing dropped: every keyword left is enforced or an annotation
        assert not any(KEYWORDS.get(k) == "refused" for k in _keywords(out))
        closed = {"additionalProperties", "minimum", "maximum"}  # added: closed objects, bounded numbers
        assert _keywords(out) - closed == \
            _keywords(schema) - {"oneOf"} - closed | ({"anyOf"} if "oneOf" in _keywords(schema) else set())


def _keywords(schema) -> set:
    """Every keyword used anywhere in ``schema`` (property names are not keywords)."""
    if not isinstance(schema, dict):
        return set()
    out = set(schema)
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs") and isinstance(value, dict):
            out |= {k for sub in value.values() for k in _keywords(sub)}
        elif isinstance(value, list):
            out |= {k for sub in value for k in _keywords(sub)}
        elif isinstance(value, dict):
            out |= _keywords(value)
    return out
