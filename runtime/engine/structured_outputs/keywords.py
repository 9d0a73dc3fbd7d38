"""What the engine's grammar (llguidance 1.7.6) does with each JSON Schema keyword and format,
and the bounds the checks hold schemas to: the capability tables of structured outputs."""

from __future__ import annotations

import re

__all__ = ["FORMATS", "FORMAT_MIN_LENGTH", "KEYWORDS", "MAX_DEPTH", "NUMBER_BOUND", "REFUSED", "REFUSED_BY_MEANING",
           "RUST_ONLY", "TYPES"]


FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
"""``format`` values llguidance 1.7.6 enforces; any other format is refused."""

_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
                "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
                "discriminator")
_ENFORCED = ("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
             "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "items", "prefixItems",
             "maxProperties", "minProperties", "required", "properties", "patternProperties",
             "additionalProperties", "allOf", "anyOf", "oneOf", "$ref", "$defs", "definitions")
REFUSED = {
    "uniqueItems": "the grammar cannot compare items", "contains": "", "minContains": "", "maxContains": "",
    "not": "", "if": "", "then": "", "else": "", "dependentRequired": "", "dependentSchemas": "",
    "dependencies": "", "propertyNames": "", "unevaluatedProperties": "use additionalProperties",
    "unevaluatedItems": "use items", "$dynamicRef": "", "$dynamicAnchor": "", "$recursiveRef": "",
    "$recursiveAnchor": "",
    # Refused by us although llguidance reads them: its meaning and JSON Schema 2020-12's differ.
    "additionalItems": "2020-12 has no additionalItems: use prefixItems with items",
    "nullable": "OpenAPI, not JSON Schema: the grammar would never produce null; use \"type\": [..., \"null\"]",
}
REFUSED_BY_MEANING = frozenset({"additionalItems", "nullable"})
"""Refused keywords llguidance does implement, with a meaning other than JSON Schema 2020-12's."""
KEYWORDS: dict[str, str] = {**{k: "annotation" for k in _ANNOTATIONS}, **{k: "enforced" for k in _ENFORCED},
                            **{k: "refused" for k in REFUSED}}
"""JSON Schema keyword → ``enforced`` (by the grammar), ``annotation`` (no constraint) or
``refused`` (a 400). Keywords not listed are unknown to JSON Schema and carry no constraint."""

TYPES = {"string", "number", "integer", "boolean", "null", "array", "object"}
NUMBER_BOUND = 2**53 - 1
"""An integer or number with no bound of its own is held within ±``NUMBER_BOUND`` in the
engine's schema (:func:`_bound_numbers` says when not), so a model cannot run away on digits (an
unbounded integer ran to max_tokens with 80 digits in 2 of 10 tries on SmolLM2). The bound is
RFC 8259 §6's interoperable range (what every JSON parser reads exactly), not int64's:
llguidance 1.7.6 reads bounds as doubles and fails past ±2^62 ("Failed to generate regex for
integer range"). Within it the grammar also holds the integer part of a number to 16 digits and
allows no exponent; a fraction's digits are not bounded, nor is a value with no ``type``."""
# Regex features llguidance's regex engine (Rust regex syntax) does not have.
# Rust-regex syntax Python's re reads differently (POSIX classes, class intersection).
RUST_ONLY = re.compile(r"\[\[:|&&")
MAX_DEPTH = 64


# A lower bound on the strings each enforced format admits (date "2024-01-01", time "00:00:00",
# date-time both around a "T", even without an offset; "a@b"; "P1D"; "0.0.0.0"; "::"; "a:b"; a UUID).
FORMAT_MIN_LENGTH = {"date": 10, "time": 8, "date-time": 19, "email": 3, "duration": 3, "hostname": 1,
                      "ipv4": 7, "ipv6": 2, "uri": 3, "uuid": 36}
