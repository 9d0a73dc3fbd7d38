"""The keyword table of runtime/engine/structured_outputs/ against the grammars themselves:
llguidance and xgrammar from the runtime image, as vLLM 0.32 configures them with compact JSON
(tests/integration/structured_probe.py, one run per session, a few seconds, no engine).

The oracle is the grammar: a keyword the table calls enforced must reject a violating instance
and accept a valid one; one it calls refused must be one llguidance does not implement; every
generated schema our check lets through must compile. If an llguidance upgrade implements a
keyword, these tests say which rows of the table (and the README's) to change.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings

from modelops.io_contract import STRUCTURED_OUTPUTS_MEASURED
from runtime.engine.structured_outputs import FORMATS, KEYWORDS, REFUSED_BY_MEANING, SchemaRefused, prepare
from tests.integration.conftest import REPO
from tests.unit.test_structured_outputs import RECURSIVE_INTERSECTIONS, SCHEMAS

pytestmark = pytest.mark.e2e

# keyword → (schema, an instance it forbids, an instance it allows)
ENFORCED = {
    "type": ({"type": "integer"}, "1.5", "1"),
    "enum": ({"enum": ["a", 1]}, '"b"', "1"),
    "const": ({"const": "q"}, '"r"', '"q"'),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4", "6"),
    "maximum": ({"type": "number", "maximum": 1.5}, "1.6", "1.5"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "5", "4"),
    "minimum": ({"type": "integer", "minimum": 5}, "3", "5"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "3", "4"),
    "maxLength": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcd"', '"abc"'),
    "minLength": ({"type": "string", "format": "email", "minLength": 8}, '"a@b.co"', '"abcd@b.co"'),
    "pattern": ({"type": "string", "pattern": "^\\d+$"}, '"x"', '"12"'),
    "format": ({"type": "string", "format": "date"}, '"x"', '"2026-12-01"'),
    "maxItems": ({"type": "array", "maxItems": 1}, "[1,2]", "[1]"),
    "minItems": ({"type": "array", "minItems": 2}, "[1]", "[1,2]"),
    "items": ({"type": "array", "items": {"type": "integer"}}, '["a"]', "[1]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, '["a"]', "[1]"),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a":1,"b":2}', '{"a":1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}", '{"a":1}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}", '{"a":1}'),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":"x"}', '{"a":1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"x":"s"}',
                          '{"x":1}'),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": False}, '{"a":1,"b":2}', '{"a":1}'),
    "allOf": ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, '"maybe"', '"yes"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "true", '"s"'),
    "oneOf": (prepare({"oneOf": [{"type": "integer"}, {"type": "string"}]}), "true", "1"),
    "$ref": ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}, '"s"', "1"),
    "$defs": ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}, '"s"', "1"),
    "definitions": ({"$ref": "#/definitions/a", "definitions": {"a": {"type": "integer"}}}, '"s"', "1"),
}
REFUSED_VALUES = {"uniqueItems": True, "contains": {}, "minContains": 1, "maxContains": 1, "not": {}, "if": {},
                  "then": {}, "else": {}, "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"a": {}},
                  "dependencies": {"a": ["b"]}, "propertyNames": {}, "unevaluatedProperties": False,
                  "unevaluatedItems": False, "$dynamicRef": "#a", "$dynamicAnchor": "a", "$recursiveRef": "#",
                  "$recursiveAnchor": True, "additionalItems": False, "nullable": True}
ANNOTATED = {k: v for k, v in {"title": "t", "description": "d", "default": 1, "examples": [1], "deprecated": True,
                               "readOnly": True, "writeOnly": True, "$comment": "c", "$id": "urn:x",
                               "$schema": "https://json-schema.org/draft/2020-12/schema", "$anchor": "top",
                               "$vocabulary": {}, "contentEncoding": "base64", "contentMediaType": "text/plain",
                               "contentSchema": {}, "discriminator": {"propertyName": "k"}}.items()}
STRING = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def _generated(n: int) -> list:
    seen: list = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(SCHEMAS)
    def collect(schema):
        seen.append(schema)

    collect()
    return seen


def _refused_for_intersections(n: int) -> list:
    """Generated schemas prepare refuses only for a recursive intersection: what it would pass
    on without that one check (so llguidance can say whether the refusal was needed)."""
    from runtime.engine.structured_outputs import analysis

    found = []
    check = analysis.Intersections.check
    for schema in _generated(n):
        try:
            prepare(schema)
        except SchemaRefused as e:
            if "recursive" not in str(e) and "itself" not in str(e) or "self-reference" in str(e):
                continue  # left recursion is refused for the output check's sake, not llguidance's
            analysis.Intersections.check = lambda *a: None
            try:
                found.append(prepare(schema))
            except SchemaRefused:
                pass
            finally:
                analysis.Intersections.check = check
    return found


@pytest.fixture(scope="session")
def probe(tmp_path_factory):
    """Run the probe once over every job below; returns job → report row."""
    from tasks.image import build_runtime_image
    from tests.models.make_tiny_llama import make

    jobs = {f"enforced:{k}": (s, [bad, good]) for k, (s, bad, good) in ENFORCED.items()}
    jobs |= {f"refused:{k}": ({k: v}, []) for k, v in REFUSED_VALUES.items()}
    jobs |= {f"format:{f}": ({"type": "string", "format": f}, []) for f in [*FORMATS, "regex", "color"]}
    jobs["annotations"] = ({"type": "integer", **ANNOTATED}, ['"s"', "1"])
    jobs["nullable"] = ({"type": "string", "nullable": True}, ["null", '"s"'])
    # MEASURED's claims: control characters in strings, whitespace, pattern with maxLength
    jobs["strings"] = (STRING, ['{"a":"x\x01y"}', '{"a":"x\ny"}', '{"a":"x\\u0001y"}', '{"a":"ok"}'])
    jobs["whitespace"] = (STRING, ['{"a": "x"}', '{\n"a":"x"}', '{"a":"x"}'])
    accepted = []
    for i, schema in enumerate(_generated(150)):
        try:
            accepted.append(prepare(schema))
        except SchemaRefused:
            continue
    jobs |= {f"generated:{i}": (s, []) for i, s in enumerate(accepted)}
    jobs |= {f"intersection:{k}": (s if refused else prepare(s), [])  # admitted: what the engine would get
             for k, (s, refused) in RECURSIVE_INTERSECTIONS.items()}
    jobs |= {f"intersection-refused:{i}": (s, []) for i, s in enumerate(_refused_for_intersections(150))}
    image = build_runtime_image()
    folder = tmp_path_factory.mktemp("structured-probe")
    model = make(folder / "model")
    (folder / "jobs.json").write_text(json.dumps([{"schema": s, "instances": x} for s, x in jobs.values()]))
    proc = subprocess.run([str(image.python), str(REPO / "tests" / "integration" / "structured_probe.py"),
                           str(model), str(folder / "jobs.json"), str(folder / "report.json")],
                          env={**os.environ, **image.env()}, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(jobs, json.loads((folder / "report.json").read_text())))


def test_every_enforced_keyword_rejects_a_violation_and_keeps_a_valid_value(probe):
    assert set(ENFORCED) == {k for k, v in KEYWORDS.items() if v == "enforced"}
    wrong = {k: probe[f"enforced:{k}"]["guidance"] for k in ENFORCED
             if probe[f"enforced:{k}"]["guidance"] != {"error": "", "accepts": [False, True]}}
    assert wrong == {}


def test_every_refused_keyword_is_one_llguidance_does_not_implement(probe):
    assert set(REFUSED_VALUES) == {k for k, v in KEYWORDS.items() if v == "refused"}
    errors = {k: probe[f"refused:{k}"]["guidance"]["error"] for k in REFUSED_VALUES if k not in REFUSED_BY_MEANING}
    assert {k: e for k, e in errors.items() if f'"{k}"' not in e or "Unimplemented" not in e} == {}
    # Those llguidance reads, with a meaning of its own: nullable is not "null allowed" to it
    assert probe["nullable"]["guidance"] == {"error": "", "accepts": [False, True]}


def test_formats_and_annotations(probe):
    assert {f for f in FORMATS if probe[f"format:{f}"]["guidance"]["error"]} == set()
    assert all("Unknown format" in probe[f"format:{f}"]["guidance"]["error"] for f in ("regex", "color"))
    assert set(ANNOTATED) == {k for k, v in KEYWORDS.items() if v == "annotation"}
    assert probe["annotations"]["guidance"] == {"error": "", "accepts": [False, True]}


def test_what_the_package_records_as_measured(probe):
    """STRUCTURED_OUTPUTS_MEASURED (why every generate package has its structured_outputs_config) is true."""
    length = probe["enforced:maxLength"]
    assert length["guidance"]["accepts"] == [False, True] and length["xgrammar"]["accepts"] == [True, True]
    assert "ignores minLength/maxLength next to pattern" in STRUCTURED_OUTPUTS_MEASURED["xgrammar"]
    for backend in ("guidance", "xgrammar"):  # raw control characters: refused; escaped: fine
        assert probe["strings"][backend]["accepts"] == [False, False, True, True]
        assert probe["whitespace"][backend]["accepts"] == [False, False, True]  # compact: no whitespace at all
    # xgrammar lets these through unenforced; llguidance refuses them
    for k in ("uniqueItems", "not", "if", "dependentRequired", "contains"):
        assert probe[f"refused:{k}"]["xgrammar"]["error"] == "" and probe[f"refused:{k}"]["guidance"]["error"]


def test_every_generated_schema_the_check_admits_compiles(probe):
    """Except an empty intersection (pattern with format and lengths, say), which only the
    grammar can decide: the runtime asks it (structured_outputs.locate) and refuses with the
    subschema's pointer (test_runtime: test_structured_outputs_unsatisfiable_intersection)."""
    failed = {k: r["guidance"]["error"] for k, r in probe.items() if k.startswith("generated:") and r["guidance"]["error"]
              and not r["guidance"]["error"].startswith("Unsatisfiable schema")}
    assert sum(k.startswith("generated:") for k in probe) >= 30
    assert failed == {}


def test_the_recursive_intersections_refused_are_those_llguidance_cannot_build(probe):
    """Both ways: every case prepare refuses fails in llguidance for that reason, every case it
    admits compiles; and generated schemas refused only for this also fail there."""
    verdicts = {k: probe[f"intersection:{k}"]["guidance"]["error"] for k in RECURSIVE_INTERSECTIONS}
    wrong = {k: e for k, e in verdicts.items() if (RECURSIVE_INTERSECTIONS[k][1] is None) != (e == "")}
    assert wrong == {}
    assert all(e.startswith(("Schema intersection stack level exceeded", "circular references with sibling keys"))
               for k, e in verdicts.items() if e)
    refused = [r["guidance"]["error"] for k, r in probe.items() if k.startswith("intersection-refused:")]
    assert all(refused), refused
