"""Structured outputs that never lie: every JSON Schema keyword is enforced by the engine's
grammar or refused before admission, and every finished answer is checked against its schema.

The engine's structured-outputs backend is llguidance (vLLM's ``guidance`` backend) with compact
JSON (``disable_any_whitespace``): :data:`modelops.io_contract.STRUCTURED_OUTPUTS_CONFIG`, written into every generate
package's ``model.json`` as ``structured_outputs_config``; why is
``STRUCTURED_OUTPUTS_MEASURED``.

:func:`prepare` checks one schema (``response_format.json_schema.schema``, a tool's
``parameters``) against :data:`KEYWORDS` and returns the copy the engine gets; it raises
:class:`SchemaRefused` naming the JSON pointer (RFC 6901) of the offending keyword. What
llguidance supports was read off llguidance 1.7.6 itself (its "Unimplemented keys" and "Unknown
format" errors, and violating instances it does or does not accept).

:class:`OutputCheck` validates finished answers with ``jsonschema`` (Draft 2020-12 unless the
schema's ``$schema`` says otherwise) after a strict RFC 8259 parse (no NaN/Infinity, no raw
control characters).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["FORMATS", "KEYWORDS", "NUMBER_BOUND", "REFUSED_BY_MEANING", "OutputCheck", "SchemaRefused", "Violation",
           "locate", "prepare", "strict_loads"]

FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
"""``format`` values llguidance 1.7.6 enforces; any other format is refused."""

_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
                "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
                "discriminator")
_ENFORCED = ("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
             "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "items", "prefixItems",
             "maxProperties", "minProperties", "required", "properties", "patternProperties",
             "additionalProperties", "allOf", "anyOf", "oneOf", "$ref", "$defs", "definitions")
_REFUSED = {
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
                            **{k: "refused" for k in _REFUSED}}
"""JSON Schema keyword → ``enforced`` (by the grammar), ``annotation`` (no constraint) or
``refused`` (a 400). Keywords not listed are unknown to JSON Schema and carry no constraint."""

_TYPES = {"string", "number", "integer", "boolean", "null", "array", "object"}
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
_RUST_ONLY = re.compile(r"\[\[:|&&")
_MAX_DEPTH = 64


class SchemaRefused(ValueError):
    """A schema the engine would not enforce as written: ``pointer`` is the JSON pointer of the
    keyword (``""`` for the whole schema), ``reason`` why and what to do instead; ``str(e)`` both,
    plus the OpenAI routes' way out (``strict: false``) when the keyword can be dropped."""

    def __init__(self, pointer: str, message: str, droppable: bool = False) -> None:
        hint = "; or send strict: false to have it dropped (not enforced)" if droppable else ""
        super().__init__(f"{pointer or ' (the root)'}: {message}{hint}")
        self.pointer, self.droppable, self.reason = pointer, droppable, message


def _esc(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unesc(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def _subschemas(schema: dict, ptr: str) -> Iterator[tuple[str, Any]]:
    """(pointer, subschema) of every keyword whose value is a schema or holds schemas."""
    for key in ("additionalProperties", "additionalItems"):
        if isinstance(schema.get(key), (dict, bool)):
            yield f"{ptr}/{key}", schema[key]
    items = schema.get("items")
    if isinstance(items, (dict, bool)):
        yield f"{ptr}/items", items
    elif isinstance(items, list):
        yield from ((f"{ptr}/items/{i}", s) for i, s in enumerate(items))
    for key in ("prefixItems", "allOf", "anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            yield from ((f"{ptr}/{key}/{i}", s) for i, s in enumerate(schema[key]))
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            yield from ((f"{ptr}/{key}/{_esc(k)}", s) for k, s in schema[key].items())


class _Resolver:
    """Local ``$ref`` targets of one schema: JSON pointers (``#/...``) and ``$anchor`` names."""

    def __init__(self, root: Any) -> None:
        self.root, self.anchors = root, {}
        self._index(root, "")

    def _index(self, schema: Any, ptr: str) -> None:
        if not isinstance(schema, dict):
            return
        if isinstance(schema.get("$anchor"), str):
            self.anchors[schema["$anchor"]] = ptr
        for sub_ptr, sub in _subschemas(schema, ptr):
            self._index(sub, sub_ptr)

    def target(self, ref: Any, at: str) -> str:
        """The pointer ``ref`` names. Raises SchemaRefused for a remote or dangling ref."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaRefused(at, f"$ref {ref!r} is not in this schema: only local references (#/$defs/...) "
                                    "are resolved; inline the referenced schema under $defs")
        frag = ref[1:]
        ptr = frag if frag == "" or frag.startswith("/") else self.anchors.get(frag)
        if ptr is None or self.get(ptr) is _MISSING:
            raise SchemaRefused(at, f"$ref {ref!r} points at nothing in this schema")
        if (bad := _not_a_schema_place(ptr)) is not None:
            raise SchemaRefused(at, f"$ref {ref!r} points into {bad!r}, which holds no schema (a value of enum, "
                                    "const, a keyword's own value...); point it at a subschema, e.g. #/$defs/...")
        return ptr

    def get(self, ptr: str) -> Any:
        node = self.root
        for part in ptr.split("/")[1:]:
            part = _unesc(part)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return _MISSING
        return node


_MISSING = object()
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name → schema
_LISTED = ("allOf", "anyOf", "oneOf", "prefixItems")  # index → schema
_SINGLE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")


def _not_a_schema_place(ptr: str) -> str | None:
    """The first part of JSON pointer ``ptr`` that leaves the schema keywords (into an enum
    value, say), or None when it names a subschema."""
    parts = [_unesc(p) for p in ptr.split("/")[1:]]
    i = 0
    while i < len(parts):
        key = parts[i]
        if key in _NAMED or key in _LISTED:
            if i + 1 == len(parts):
                return key  # the map or list itself, not one schema of it
            i += 2
        elif key in _SINGLE:
            i += 1
        else:
            return key
    return None


def _check_keywords(schema: Any, ptr: str, resolver: _Resolver, unenforced: list[tuple[str, str]]) -> None:
    """Walk every subschema: refused keywords go to ``unenforced`` (pointer, why); malformed or
    unresolvable ones raise SchemaRefused at once."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaRefused(ptr, f"a schema must be an object or a boolean, got {type(schema).__name__}")
    for key in schema:
        if KEYWORDS.get(key) == "refused":
            hint = _REFUSED[key]
            unenforced.append((f"{ptr}/{_esc(key)}", f"{key} is not enforced by the structured-outputs grammar"
                                                     f"{' (' + hint + ')' if hint else ''}"))
    types = schema.get("type")
    for t in [types] if isinstance(types, str) else types if isinstance(types, list) else []:
        if t not in _TYPES:
            raise SchemaRefused(f"{ptr}/type", f"{t!r} is not a JSON Schema type; use one of {sorted(_TYPES)}")
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        unenforced.append((f"{ptr}/format", f"format {fmt!r} is not enforced; enforced formats: {sorted(FORMATS)} "
                                            "(or use pattern)"))
    pattern = schema.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise SchemaRefused(f"{ptr}/pattern", "pattern must be a string (a regular expression)")
        _check_regex(pattern, f"{ptr}/pattern")
    if isinstance(schema.get("patternProperties"), dict):
        for key in schema["patternProperties"]:
            _check_regex(key, f"{ptr}/patternProperties/{_esc(key)}")
    if isinstance(schema.get("items"), list):
        raise SchemaRefused(f"{ptr}/items", "items as a list is the draft-04 tuple form, which 2020-12 reads "
                                            "otherwise: use prefixItems (and items: false to allow no more)")
    for key in ("enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if key in schema and _too_big(schema[key]):
            raise SchemaRefused(f"{ptr}/{key}", "integers beyond 64 bits cannot be enforced by the grammar; "
                                                "use a string with a pattern for such numbers")
    if ptr and "$id" in schema and _has_ref(schema):
        raise SchemaRefused(f"{ptr}/$id", "a nested $id moves the base that the $refs below it resolve against; "
                                          "references resolve from the root here: remove this $id and point "
                                          "the $refs at the root's #/$defs/...")
    if "$ref" in schema:
        resolver.target(schema["$ref"], f"{ptr}/$ref")
    if isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1 \
            and not _disjoint([_deref(s, resolver, f"{ptr}/oneOf/{i}") for i, s in enumerate(schema["oneOf"])]):
        unenforced.append((f"{ptr}/oneOf", "oneOf branches that can match the same value cannot be enforced "
                                           "(the grammar cannot exclude a second match): use anyOf, or make "
                                           "the branches distinct by type or by a required property's const"))
    for sub_ptr, sub in _subschemas(schema, ptr):
        _check_keywords(sub, sub_ptr, resolver, unenforced)


def _ref_nodes(schema: Any, ptr: str = "", defs: bool = True) -> Iterator[tuple[str, dict]]:
    """(pointer, node) of every subschema at or below ``schema`` that has ``$ref`` (a keyword,
    not a property name), without following them; ``defs=False`` skips $defs/definitions."""
    todo = [(ptr, schema)]
    while todo:
        at, node = todo.pop()
        if isinstance(node, dict):
            if "$ref" in node:
                yield at, node
            todo.extend(_subschemas(node, at) if defs else _structural(node, at))


def _has_ref(schema: Any) -> bool:
    return next(_ref_nodes(schema), None) is not None


def _too_big(value: Any) -> bool:
    """Whether a JSON value holds an integer outside int64 (llguidance: "not JSON serializable")."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -2**63 <= value < 2**63
    if isinstance(value, list):
        return any(_too_big(v) for v in value)
    if isinstance(value, dict):
        return any(_too_big(v) for v in value.values())
    return False


def _check_regex(pattern: str, ptr: str) -> None:
    """The grammar (Rust regex) and the output check (Python re) must read a pattern alike, and
    the grammar has no look-around or back-references."""
    import re._parser as sre  # the parser re.compile uses: exact where a regex over regexes is not

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "possible nested set": refused below anyway
            parsed = sre.parse(pattern)
    except re.error as e:
        raise SchemaRefused(ptr, f"not a regular expression both engines read ({e}): use plain ECMA-262/Python "
                                 "syntax (no \\p{...}, \\z, \\x{...}, (?<name>...))") from None
    if _RUST_ONLY.search(pattern):
        raise SchemaRefused(ptr, "POSIX classes ([[:alpha:]]) and class intersection (&&) mean different things "
                                 "to the grammar and to JSON Schema; spell the characters out")

    def ops(items):
        for op, arg in items:
            yield op
            for sub in (arg if isinstance(arg, (list, tuple)) else [arg]):
                if isinstance(sub, sre.SubPattern):
                    yield from ops(sub.data)
                elif isinstance(sub, (list, tuple)):
                    for x in sub:
                        if isinstance(x, sre.SubPattern):
                            yield from ops(x.data)

    found = {str(op) for op in ops(parsed.data)}
    if found & {"ASSERT", "ASSERT_NOT", "GROUPREF", "GROUPREF_EXISTS"}:
        raise SchemaRefused(ptr, "look-around and back-references cannot be enforced by the grammar; rewrite the "
                                 "pattern without them")


def _check_form(schema: Any) -> None:
    """The schema is well formed (its draft's metaschema; nesting at most 64 deep) before
    anything reads it. Raises SchemaRefused at the offending keyword."""
    stack = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise SchemaRefused("", f"nested more than {_MAX_DEPTH} levels deep; flatten it with $defs")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children)
    if not isinstance(schema, (dict, bool)):
        raise SchemaRefused("", f"a schema must be an object or a boolean, got {type(schema).__name__}")
    import jsonschema

    if isinstance(schema, dict) and "$schema" in schema and not isinstance(schema["$schema"], str):
        raise SchemaRefused("/$schema", "must be a string naming a JSON Schema draft")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        pointer = "".join(f"/{_esc(str(p))}" for p in error.absolute_path)
        raise SchemaRefused(pointer, f"not a valid JSON Schema: {error.message[:200]}")


def _deref(schema: Any, resolver: _Resolver, ptr: str) -> Any:
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and len(schema) == 1 and seen < 32:
        schema, seen = resolver.get(resolver.target(schema["$ref"], f"{ptr}/$ref")), seen + 1
        ptr = ""
    return schema


def _kinds(schema: Any) -> set[str] | None:
    """The JSON types a branch can take, or None when unknown (no type, enum or const)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_json_type(v) for v in schema["enum"]}
    t = schema.get("type")
    kinds = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if kinds and "number" in kinds:
        kinds.add("integer")  # every integer is a number
    return kinds


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"  # 1.0 is the integer 1 in JSON Schema
    return {float: "number", str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _values(schema: Any) -> set[str] | None:
    """The values a const/enum branch allows (canonical JSON), else None."""
    if isinstance(schema, dict) and "const" in schema:
        return {_canonical(schema["const"])}
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return {_canonical(v) for v in schema["enum"]}
    return None


def _tags(schema: Any) -> dict[str, set[str]]:
    """Required properties whose value is pinned (const or enum): property → JSON-encoded values."""
    if not isinstance(schema, dict) or _kinds(schema) != {"object"}:
        return {}  # without type object, a non-object value matches both branches
    out = {}
    for name in schema.get("required", []) if isinstance(schema.get("required"), list) else []:
        prop = schema.get("properties", {}).get(name) if isinstance(schema.get("properties"), dict) else None
        if isinstance(prop, dict) and "const" in prop:
            out[name] = {_canonical(prop["const"])}
        elif isinstance(prop, dict) and isinstance(prop.get("enum"), list):
            out[name] = {_canonical(v) for v in prop["enum"]}
    return out


def _canonical(value: Any) -> str:
    """JSON text equal for values JSON Schema calls equal (1 and 1.0)."""
    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v
    return json.dumps(norm(value), sort_keys=True)


def _disjoint(branches: list[Any]) -> bool:
    """True when no value can match two branches: their types differ, or a required property
    pinned in both takes different values (a discriminated union)."""
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            if a is False or b is False:
                continue  # false matches nothing
            ka, kb = _kinds(a), _kinds(b)
            if ka is not None and kb is not None and not (ka & kb):
                continue
            va, vb = _values(a), _values(b)
            if va is not None and vb is not None and not (va & vb):
                continue
            ta, tb = _tags(a), _tags(b)
            if any(not (ta[p] & tb[p]) for p in ta.keys() & tb.keys()):
                continue
            return False
    return True


def _productive(schema: Any, resolver: _Resolver, known: dict[str, bool]) -> bool:
    """Whether ``schema`` admits some finite JSON value, given ``known`` for ``$ref`` targets (a
    least fixpoint over the reference graph; conjunctions of satisfiable parts count as
    satisfiable, which only errs towards admitting)."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        return False
    if "$ref" in schema and not known.get(resolver.target(schema["$ref"], ""), False):
        return False
    if isinstance(schema.get("enum"), list) and not schema["enum"]:
        return False
    if any(not _productive(s, resolver, known) for s in schema.get("allOf", []) or []):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and not any(_productive(s, resolver, known) for s in schema[key]):
            return False
    types = _kinds({"type": schema["type"]}) if "type" in schema else None
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
                      ("minProperties", "maxProperties")):
        lo, hi = schema.get(low), schema.get(high)
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
            return False
    if isinstance(schema.get("maxLength"), int) and types == {"string"} and \
            _shortest_string(schema) > schema["maxLength"]:
        return False
    objects = types is None or types == {"object"}
    if objects and isinstance(schema.get("required"), list):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        for name in schema["required"]:
            matching = [sub for key, sub in patterns.items() if re.search(key, name)]
            sub = props[name] if name in props else {"allOf": matching} if matching else \
                schema.get("additionalProperties", True)
            if not _productive(sub, resolver, known):
                return False
    arrays = types is None or types == {"array"}
    if arrays and isinstance(schema.get("minItems"), int) and schema["minItems"] > 0:
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        needed = prefix[:schema["minItems"]]
        if len(needed) < schema["minItems"]:
            needed.append(schema.get("items", True) if not isinstance(schema.get("items"), list) else True)
        if any(not _productive(s, resolver, known) for s in needed):
            return False
    return True


# A lower bound on the strings each enforced format admits (date "2024-01-01", time "00:00:00",
# date-time both around a "T", even without an offset; "a@b"; "P1D"; "0.0.0.0"; "::"; "a:b"; a UUID).
_FORMAT_MIN_LENGTH = {"date": 10, "time": 8, "date-time": 19, "email": 3, "duration": 3, "hostname": 1,
                      "ipv4": 7, "ipv6": 2, "uri": 3, "uuid": 36}


def _shortest_string(schema: dict) -> int:
    """A lower bound on the length of any string ``schema`` admits: ``minLength``, the shortest
    match of ``pattern`` (a regex search: at least its shortest match) and of ``format``."""
    import re._parser as sre_parse  # the stdlib regex parser: getwidth() is (min, max) match length

    shortest = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
    if isinstance(schema.get("pattern"), str):
        try:
            shortest = max(shortest, sre_parse.parse(schema["pattern"]).getwidth()[0])
        except (re.error, OverflowError, RecursionError):  # not Python's dialect: no bound from it
            pass
    return max(shortest, _FORMAT_MIN_LENGTH.get(schema.get("format"), 0))


def _check_satisfiable(root: Any, resolver: _Resolver) -> None:
    refs = {resolver.target(n["$ref"], f"{at}/$ref") for at, n in _ref_nodes(root)}
    known = {r: False for r in refs}
    changed = True
    while changed:  # least fixpoint: a target is productive once its body is, given the others
        changed = False
        for r in refs:
            if not known[r] and _productive(resolver.get(r), resolver, known):
                known[r] = changed = True
    if not _productive(root, resolver, known):
        loops = sorted(r for r, ok in known.items() if not ok)
        if loops:
            raise SchemaRefused(loops[0], f"$ref {'#' + loops[0]!r} recurses with no way out: every value of it must "
                                "contain another one, so no finite JSON matches; make the recursive property "
                                "optional or add a base case (anyOf with null)")
        where, node = _unproductive_at(root, "", resolver, known)
        if isinstance(node, dict) and isinstance(node.get("maxLength"), int) and \
                _shortest_string(node) > node["maxLength"]:
            raise SchemaRefused(where, f"maxLength {node['maxLength']} is below the shortest string its pattern, "
                                f"format and minLength admit ({_shortest_string(node)} characters)")
        raise SchemaRefused(where, "no JSON value can match this schema (an empty enum, false, or a minimum above "
                                   "its maximum)")


def _unproductive_at(schema: Any, ptr: str, resolver: _Resolver, known: dict[str, bool]) -> tuple[str, Any]:
    """The deepest place under an unproductive ``schema`` that is itself unproductive, following
    what :func:`_productive` requires (allOf parts, required properties, the first items)."""
    if not isinstance(schema, dict):
        return ptr, schema
    children: list[tuple[str, Any]] = [(f"{ptr}/allOf/{i}", sub) for i, sub in enumerate(schema.get("allOf") or [])
                                       if isinstance(schema.get("allOf"), list)]
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list):
        children += [(f"{ptr}/properties/{_esc(name)}", props[name]) for name in schema["required"] if name in props]
    if isinstance(schema.get("minItems"), int) and schema["minItems"] > 0:
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        children += [(f"{ptr}/prefixItems/{i}", sub) for i, sub in enumerate(prefix[:schema["minItems"]])]
        if len(prefix) < schema["minItems"] and isinstance(schema.get("items"), (dict, bool)):
            children.append((f"{ptr}/items", schema["items"]))
    for where, sub in children:
        if not _productive(sub, resolver, known):
            return _unproductive_at(sub, where, resolver, known)
    return ptr, schema


_COMBINED = ("allOf", "anyOf", "oneOf")
_MAX_EXPANSIONS = 20000


def _structural(schema: dict, ptr: str) -> Iterator[tuple[str, Any]]:
    """Subschemas below ``schema``, without $defs/definitions (reached through $ref only)."""
    for sub_ptr, sub in _subschemas(schema, ptr):
        if not sub_ptr[len(ptr):].startswith(("/$defs/", "/definitions/")):
            yield sub_ptr, sub


class _Intersections:
    """Where llguidance 1.7.6 would have to intersect a recursive ``$ref`` with itself, which it
    cannot: intersection (``allOf``, or ``$ref``/``anyOf`` beside other keywords) inlines the
    schemas it combines, and a recursive definition never ends. It fails on two shapes (measured
    with its grammar_from_json_schema; tests/integration/test_structured_backend.py keeps the
    rule honest against it): one recursive definition reached by two of the combined parts at the
    same place ("Schema intersection stack level exceeded"), and an intersection inside a recursive
    definition whose part is that definition again ("circular references with sibling keys are
    not supported"). A part reaches a definition *at the same place* through ``$ref`` and
    ``allOf``/``anyOf``/``oneOf``; a property, pattern property, additional property, prefix
    item or item is one level deeper, where the parts that have something for that value meet.
    Conservative: where it cannot tell, it refuses. Each node is visited once (by identity), so
    the work grows with the schema's size, not with its number of paths."""

    def __init__(self, root: Any, resolver: _Resolver) -> None:
        self.resolver, self.root, self.budget = resolver, root, _MAX_EXPANSIONS
        # Memos by identity, each holding its schema so that the id stays its own.
        self._expansion: dict[int, tuple[dict, list[dict]]] = {}
        self._kind_memo: dict[int, tuple[dict, set[str] | None]] = {}
        graph: dict[str, set[str]] = {}
        todo = list(self._refs(root))
        while todo:
            t = todo.pop()
            if t not in graph:
                graph[t] = self._refs(resolver.get(t))
                todo.extend(graph[t])
        self.recursive = {t for t in graph if t in self._reach(graph, t)}
        # A definition that is itself again at its own place ({"$ref": "#/$defs/d"} as d's body,
        # or d = anyOf[d, ...]): inlining it never ends, and a validator follows it forever.
        self.looping = {t for t in self.recursive if t in self._shallow(resolver.get(t))}

    def _spend(self, ptr: str) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise SchemaRefused(ptr, "too many subschemas and intersections to check; flatten the schema")

    def _refs(self, schema: Any) -> set[str]:
        """$ref targets anywhere below ``schema`` (not following them)."""
        return {self.resolver.target(n["$ref"], f"{at}/$ref") for at, n in _ref_nodes(schema, defs=False)}

    @staticmethod
    def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            t = todo.pop()
            if t not in seen:
                seen.add(t)
                todo.extend(graph.get(t, ()))
        return seen

    def expansion(self, schema: Any) -> list[dict]:
        """The schemas that constrain a value at this place: ``schema``, its allOf/anyOf/oneOf
        branches and the bodies of its $refs, transitively (each once)."""
        if not isinstance(schema, dict):
            return []
        if id(schema) in self._expansion:
            return self._expansion[id(schema)][1]
        out, seen, todo = [], set(), [schema]
        while todo:
            node = todo.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            out.append(node)
            for key in _COMBINED:
                if isinstance(node.get(key), list):
                    todo.extend(node[key])
            if "$ref" in node:
                todo.append(self.resolver.get(self.resolver.target(node["$ref"], "")))
        self._expansion[id(schema)] = (schema, out)  # the schema kept alive: its id is not reused
        return out

    def _shallow(self, schema: Any) -> set[str]:
        """Definitions a schema is, at its own place: through $ref and allOf/anyOf/oneOf."""
        return {self.resolver.target(n["$ref"], "") for n in self.expansion(schema) if "$ref" in n}

    def _kinds(self, schema: Any) -> set[str] | None:
        """The JSON types a part can take, through $ref and anyOf/oneOf; None when unknown."""
        if not isinstance(schema, dict):
            return None
        key = id(schema)
        if key in self._kind_memo:
            return self._kind_memo[key][1]
        self._kind_memo[key] = (schema, None)  # a cycle: unknown
        kinds = _kinds(schema)
        if kinds is None and "$ref" in schema and len(schema) == 1:
            kinds = self._kinds(self.resolver.get(self.resolver.target(schema["$ref"], "")))
        for k in ("anyOf", "oneOf"):
            if kinds is None and isinstance(schema.get(k), list):
                branches = [self._kinds(b) for b in schema[k]]
                kinds = None if any(b is None for b in branches) else set().union(*branches)
        self._kind_memo[key] = (schema, kinds)
        return kinds

    def _children(self, schema: Any) -> dict[str, Any]:
        """What a part puts below the value: properties/patternProperties (name → schemas),
        additionalProperties and items (schemas), prefixItems (index → schemas)."""
        out: dict[str, Any] = {"properties": {}, "patternProperties": {}, "additionalProperties": [],
                               "prefixItems": {}, "items": []}
        for node in self.expansion(schema):
            for key in ("properties", "patternProperties"):
                if isinstance(node.get(key), dict):
                    for name, sub in node[key].items():
                        out[key].setdefault(name, []).append(sub)
            for key in ("additionalProperties", "items"):
                if isinstance(node.get(key), dict):
                    out[key].append(node[key])
            if isinstance(node.get("prefixItems"), list):
                for i, sub in enumerate(node["prefixItems"]):
                    out["prefixItems"].setdefault(i, []).append(sub)
        return out

    @staticmethod
    def _value_schemas(child: dict[str, Any], place: tuple[str, Any]) -> list[Any]:
        """The schemas one part gives the value at ``place`` (what llguidance intersects there)."""
        kind, name = place
        if kind == "properties":
            if name in child["properties"]:
                return child["properties"][name]
            matching = [s for k, subs in child["patternProperties"].items() if _searches(k, name) for s in subs]
            return matching or child["additionalProperties"]
        if kind == "patternProperties":
            return child["patternProperties"].get(name) or child["additionalProperties"]
        if kind == "prefixItems":
            return child["prefixItems"].get(name) or child["items"]
        return child[kind]

    @staticmethod
    def parts(schema: Any) -> list[Any]:
        """What llguidance intersects at this schema: [] when it intersects nothing."""
        if not isinstance(schema, dict):
            return []
        own = {k: v for k, v in schema.items() if KEYWORDS.get(k, "enforced") == "enforced"
               and k not in ("$defs", "definitions")}
        parts = list(own.pop("allOf", None) or [])
        if "$ref" in own:
            parts.append({"$ref": own.pop("$ref")})
        for key in ("anyOf", "oneOf"):
            if key in own and (parts or len(own) > 1):
                parts.append({key: own.pop(key)})
        if own:
            parts.append(own)
        return parts if len(parts) > 1 else []

    def intersect(self, parts: list[Any], inside: set[str], ptr: str, stack: tuple = ()) -> None:
        """Raises SchemaRefused at ``ptr`` where intersecting ``parts`` would not end."""
        self._spend(ptr)
        if len(stack) > _MAX_DEPTH:
            raise SchemaRefused(ptr, "intersections nest too deep to check; flatten the schema")
        # llguidance folds the parts left to right and stops at the first whose types exclude
        # the rest so far (the result is empty; the grammar reports it, locate names it).
        kinds: set[str] | None = None
        reached: set[str] = set()
        for i, part in enumerate(parts):
            shallow = self._shallow(part) & self.recursive
            if shallow & inside:  # resolved before its types are compared
                r = min(shallow & inside)
                raise SchemaRefused(ptr, f"the recursive definition {'#' + r!r} is combined with other keywords "
                                         "inside itself, which the grammar cannot build; reference it alone "
                                         "(move the other keywords into the definition)")
            these = self._kinds(part)
            if kinds is not None and these is not None and not kinds & these:
                parts = parts[:i]
                break
            kinds = these if kinds is None else kinds & these if these is not None else kinds
            if shallow & reached:
                r = min(shallow & reached)
                raise SchemaRefused(ptr, f"two combined parts both reach the recursive definition {'#' + r!r}: "
                                         "the grammar would intersect it with itself without end; reference it "
                                         "from one part only, or merge the parts into one schema")
            reached |= shallow
        key = tuple(sorted(_canonical(p) for p in parts))
        if key in stack:
            raise SchemaRefused(ptr, "these combined parts intersect themselves again below: the grammar would "
                                     "not end; merge them into one schema")
        children = [self._children(p) for p in parts]
        places = sorted({(k, name) for c in children for k in ("properties", "patternProperties", "prefixItems")
                         for name in c[k]} | {(k, None) for k in ("additionalProperties", "items")}, key=repr)
        for place in places:
            below = [subs[0] if len(subs) == 1 else {"anyOf": subs}
                     for c in children if (subs := self._value_schemas(c, place))]
            if len(below) > 1:
                self.intersect(below, inside, ptr, (*stack, key))

    def check(self) -> None:
        """Every intersection reachable from the root, each node once."""
        if self.looping:
            raise SchemaRefused(min(self.looping), "this definition is itself again with no value in between "
                                "(through $ref and anyOf/allOf/oneOf), which a validator can only follow forever; "
                                "remove that self-reference (a recursion must go through properties or items)")
        # Recursive definitions each node lies inside: the nodes reachable from their bodies.
        within: dict[int, set[str]] = {}
        for r in sorted(self.recursive):
            for node, _ in self._reachable(self.resolver.get(r), r):
                within.setdefault(id(node), set()).add(r)
        for node, ptr in self._reachable(self.root, ""):
            if parts := self.parts(node):
                where = f"{ptr}/allOf" if "allOf" in node else f"{ptr}/$ref" if "$ref" in node else ptr
                self.intersect(parts, within.get(id(node), set()), where)

    def _reachable(self, schema: Any, ptr: str) -> Iterator[tuple[dict, str]]:
        seen, todo = set(), [(schema, ptr)]
        while todo:
            node, at = todo.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            self._spend(at)
            yield node, at
            todo.extend((sub, sub_ptr) for sub_ptr, sub in _structural(node, at))
            if "$ref" in node:
                t = self.resolver.target(node["$ref"], f"{at}/$ref")
                todo.append((self.resolver.get(t), t))


def _searches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # conservative: it may match


def prepare(schema: Any, strict: bool | None = True) -> dict | bool:
    """Check ``schema`` and return the schema the engine gets.

    Args:
        schema: a JSON Schema (object or boolean). strict: OpenAI's ``strict``. True or None (the
            default): a keyword the grammar would not enforce is refused. False: such keywords
            are dropped from the engine's copy (best effort, as OpenAI's ``strict: false`` promises
            no adherence) and :class:`OutputCheck` does not turn their violations into errors.

    Returns: a copy; objects listing ``properties`` get ``additionalProperties: false`` unless
    the schema says otherwise (strict only, as OpenAI's strict mode); ``oneOf`` becomes ``anyOf``: the same values when its branches are disjoint
    (checked here; otherwise refused when strict), "at least one" when ``strict`` is False;
    integers and numbers without bounds get ±:data:`NUMBER_BOUND` (whatever ``strict`` says).

    Raises: SchemaRefused naming the JSON pointer: a refused keyword (when strict), an unknown
    ``type``, an unsupported regex, a remote or dangling ``$ref``, or a schema no finite value
    matches (a ``$ref`` cycle without a base case) — whatever ``strict`` says.
    """
    _check_form(schema)
    if schema is True:
        schema = {}  # llguidance wants an object at the root; {} admits the same values
    resolver = _Resolver(schema)
    unenforced: list[tuple[str, str]] = []
    _check_keywords(schema, "", resolver, unenforced)
    if unenforced and strict is not False:
        raise SchemaRefused(*unenforced[0], droppable=True)
    out = copy.deepcopy(schema)
    copied = _Resolver(out)
    for ptr, _ in sorted(unenforced, key=lambda u: -u[0].count("/")):  # deepest first
        parent_ptr, _, key = ptr.rpartition("/")
        if key == "oneOf":
            continue  # kept as anyOf below: "at least one" is the closest the grammar enforces
        parent = copied.get(parent_ptr)
        if isinstance(parent, dict):
            parent.pop(_unesc(key), None)
    if strict is not False:
        _close_objects(out)
    _check_satisfiable(out, _Resolver(out))
    try:
        _Intersections(out, _Resolver(out)).check()
    except RecursionError:
        raise SchemaRefused("", "$refs and combinators nest too deep to check; flatten the schema") from None
    _bound_numbers(out)
    _one_of_to_any_of(out)
    return out


def _number_bound(schema: dict, keys: tuple[str, str]) -> float | None:
    values = [schema[k] for k in keys if isinstance(schema.get(k), (int, float)) and not isinstance(schema[k], bool)]
    return values[0] if values else None


def _bound_numbers(schema: Any) -> None:
    """±:data:`NUMBER_BOUND` on every integer or number schema, ``allOf`` branches included, on
    each side it leaves open; a side stays open when the schema's own bound on the other side
    lies beyond it. Nothing is bounded when the schema names a number past ±NUMBER_BOUND / 2
    anywhere (a bound, ``multipleOf``, an ``enum`` or ``const`` value, even an example): its
    author deals in such numbers, and a default bound beside them could leave out a value it
    allows (an ``enum`` of 2^60, a ``minimum`` of 10^17 beside a ``$ref``). Within that, every
    range the schema combines with the default bound still holds a value (a bound and a
    ``multipleOf`` of at most NUMBER_BOUND / 2 leave a multiple within NUMBER_BOUND)."""
    if not _names_big_number(schema):
        _bound_all_numbers(schema)


def _names_big_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return abs(value) > NUMBER_BOUND // 2
    if isinstance(value, dict):
        return any(_names_big_number(v) for v in value.values())
    return isinstance(value, list) and any(_names_big_number(v) for v in value)


def _bound_all_numbers(schema: Any) -> None:
    if not isinstance(schema, dict):
        return
    t = schema.get("type")
    kinds = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    if kinds & {"integer", "number"}:
        low = _number_bound(schema, ("minimum", "exclusiveMinimum"))
        high = _number_bound(schema, ("maximum", "exclusiveMaximum"))
        if not {"minimum", "exclusiveMinimum"} & set(schema) and (high is None or high > -NUMBER_BOUND):
            schema["minimum"] = -NUMBER_BOUND
        if not {"maximum", "exclusiveMaximum"} & set(schema) and (low is None or low < NUMBER_BOUND):
            schema["maximum"] = NUMBER_BOUND
    branches = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
    for sub in [*_own_subschemas(schema), *branches]:
        _bound_all_numbers(sub)


def _own_subschemas(schema: dict) -> Iterator[Any]:
    """The subschemas of ``schema`` that constrain a value on their own: not ``allOf``'s, which
    combine (a keyword added to one branch would constrain the others' values too)."""
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            yield from value.values()
        elif key in ("anyOf", "oneOf", "prefixItems") and isinstance(value, list):
            yield from value
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            yield value


def _close_objects(schema: Any) -> None:
    """``additionalProperties: false`` on every object schema that lists ``properties`` and says
    nothing of others (OpenAI's strict mode requires it; JSON Schema's default lets a model add
    property after property until max_tokens). Not inside ``allOf``, whose branches combine."""
    if not isinstance(schema, dict):
        return
    listed = schema.get("properties")
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if isinstance(listed, dict) and not {"additionalProperties", "patternProperties"} & set(schema) \
            and all(name in listed for name in required):  # a required name not listed stays allowed
        schema["additionalProperties"] = False
    for sub in _own_subschemas(schema):
        _close_objects(sub)


def locate(schema: Any, compile_error: Callable[[Any], str]) -> SchemaRefused | None:
    """Where the grammar refuses a prepared schema, for what :func:`prepare` cannot decide (an
    empty intersection of pattern, format and lengths, say).

    Args:
        schema: :func:`prepare`'s result. compile_error: the backend's verdict on a schema, ""
            when it compiles (runtime/engine/openai_engine.py passes llguidance's validate_grammar).

    Returns: None when it compiles; else SchemaRefused at the deepest subschema (one without
    ``$ref``, which compiles on its own) that fails alone, or at the root.
    """
    error = compile_error(schema)
    if not error:
        return None
    found: list[tuple[str, Any]] = []

    def walk(node: Any, ptr: str) -> None:
        if isinstance(node, dict):
            for sub_ptr, sub in _subschemas(node, ptr):
                walk(sub, sub_ptr)
            if ptr and "$ref" not in json.dumps(node):
                found.append((ptr, node))

    walk(schema, "")
    for ptr, node in found:  # children before their parents
        if sub_error := compile_error(node):
            return SchemaRefused(ptr, f"the grammar cannot be built: {sub_error[:300]}")
    return SchemaRefused("", f"the grammar cannot be built: {error[:300]}")


def _one_of_to_any_of(schema: Any) -> None:
    if isinstance(schema, dict):
        if "oneOf" in schema and "anyOf" not in schema:
            schema["anyOf"] = schema.pop("oneOf")
        for _, sub in _subschemas(schema, ""):
            _one_of_to_any_of(sub)


class _NotJSONConstant(ValueError):
    """NaN, Infinity or -Infinity where JSON has a number."""


def _refuse_constant(name: str) -> float:
    raise _NotJSONConstant(f"{name} is not JSON (RFC 8259)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        dupes = sorted({k for k, _ in pairs if [p[0] for p in pairs].count(k) > 1})
        raise ValueError(f"duplicate object keys {dupes} (RFC 8259: names SHOULD be unique; parsers disagree)")
    return out


def _integer(text: str) -> int | Decimal:
    # Python refuses int() of over 4300 digits (a DoS guard); the value is still a JSON integer.
    return int(text) if len(text) <= 4000 else Decimal(text)


_NUMBER = re.compile(r"(-?)(\d+)(?:\.(\d+))?[eE]([+-]?)(\d+)")


def _number(text: str) -> Decimal:
    """A JSON number, exactly. An exponent past Decimal's (|e| ≥ 10^18, which the grammar allows)
    is clamped to ±10^17: beside any schema's bounds, enums and divisors the verdict is the same."""
    try:
        return Decimal(text)
    except InvalidOperation:
        sign, whole, frac, e_sign, e_digits = _NUMBER.fullmatch(text).groups()
        exponent = 10 ** 17 if len(e_digits) > 17 else int(e_digits)
        return Decimal(f"{sign}{whole}{frac or ''}E{e_sign}{exponent}")


def _is_integer(checker: Any, value: Any) -> bool:
    """JSON Schema's integer: any number with no fractional part (2020-12, §6.1.1), 1.0 included."""
    if isinstance(value, Decimal):
        return value.is_finite() and value == value.to_integral_value()
    return not isinstance(value, bool) and (isinstance(value, int) or isinstance(value, float) and value.is_integer())


def _mod_digits(digits: tuple[int, ...], m: int) -> int:
    """``int(digits) % m`` without building the integer (Python refuses str→int past 4300 digits)."""
    r = 0
    for d in digits:
        r = (r * 10 + d) % m
    return r


def _multiple_of(value: Decimal, divisor: Decimal) -> bool:
    """Whether ``value / divisor`` is an integer, exactly, for any exponent and any number of
    digits (``1e100 % 0.1`` is past Decimal's precision; ``Fraction(1e999999)`` has a million
    digits). A zero divisor (which the metaschema forbids) divides nothing."""
    if divisor == 0:
        return False
    if value == 0:
        return True
    _, v_digits, v_exp = value.as_tuple()
    _, d_digits, d_exp = divisor.as_tuple()
    m2, k = int("".join(map(str, d_digits))), v_exp - d_exp  # a divisor is a short literal in a schema
    if k < 0:  # m2·10^-k must divide m1: its last -k digits are zeros, and m2 divides the rest
        shift = -k
        if shift > len(v_digits) or any(v_digits[len(v_digits) - shift:]):
            return False
        return _mod_digits(v_digits[:len(v_digits) - shift], m2) == 0
    twos = fives = 0
    rest = m2
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if k >= max(twos, fives):  # 10^k covers m2's factors 2 and 5; the rest must divide m1
        return _mod_digits(v_digits, rest) == 0
    return (_mod_digits(v_digits, m2) * pow(10, k, m2)) % m2 == 0


def _multiple_of_keyword(validator: Any, divisor: Any, value: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(value, "number") and isinstance(divisor, (int, Decimal)) and not isinstance(divisor, bool):
        if not _multiple_of(Decimal(value), Decimal(divisor)):
            yield ValidationError(f"{value} is not a multiple of {divisor}")


def strict_loads(text: str) -> Any:
    """``json.loads`` as RFC 8259 reads it: raw control characters inside strings (the default
    ``strict=True``), NaN/Infinity and duplicate object keys are refused. Raises ``ValueError``.
    Integers of over 4000 digits come back as ``Decimal`` (Python's int() refuses them)."""
    return json.loads(text, parse_constant=_refuse_constant, parse_int=_integer, object_pairs_hook=_unique_keys)


@dataclass(frozen=True)
class Violation:
    """A finished answer that is not what its schema promised: ``where`` (``content`` or
    ``tool_calls[i].function.arguments`` of choice ``index``), ``pointer`` of the schema keyword
    it broke (``""`` when it is not JSON at all), ``message``."""

    index: int
    where: str
    pointer: str
    message: str

    def text(self) -> str:
        at = f" (schema keyword {self.pointer})" if self.pointer else ""
        return (f"the engine produced a structured output that breaks its schema in choice {self.index} "
                f"{self.where}{at}: {self.message}; it was not returned")


class OutputCheck:
    """Checks the answers of one request against the schemas it asked for.

    Args:
        content_schema: the schema ``content`` (chat) or ``text`` (completions) must match, or
            None; ``{"type": "object"}`` for ``json_object``. content_strict: False when the
            client sent ``strict: false`` (then only the JSON parse is checked).
        tool_schemas: function name → its ``parameters`` schema, for requests whose
            ``tool_choice`` lets tools be called; tool_strict: names whose ``strict`` is not False.
    """

    def __init__(self, content_schema: Any = None, content_strict: bool = True,
                 tool_schemas: dict[str, Any] | None = None, tool_strict: set[str] | None = None) -> None:
        self.content = self._validator(content_schema) if content_schema is not None and content_strict else None
        self.content_json = content_schema is not None
        self.tools = {n: self._validator(s) for n, s in (tool_schemas or {}).items() if n in (tool_strict or set())}
        self.tool_names = set(tool_schemas or {})
        self._content: dict[int, list[str]] = {}
        self._calls: dict[tuple[int, int], dict[str, Any]] = {}

    @staticmethod
    def _validator(schema: Any):
        import jsonschema

        # Decimals on both sides: float division would call 0.3 no multiple of 0.1.
        schema = json.loads(json.dumps(schema), parse_float=Decimal)
        base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls = jsonschema.validators.extend(base, validators={"multipleOf": _multiple_of_keyword},
                                           type_checker=base.TYPE_CHECKER.redefine("integer", _is_integer))
        return cls(schema, format_checker=base.FORMAT_CHECKER)

    @property
    def active(self) -> bool:
        return self.content_json or bool(self.tool_names)

    def _check(self, validator, text: str, index: int, where: str, must_be_json: bool) -> Violation | None:
        if not must_be_json:
            return None
        try:
            strict_loads(text)
        except _NotJSONConstant as e:
            if where.startswith("tool_calls") and "Infinity" in str(e):
                # The grammar allows any exponent; vLLM 0.32 parses tool-call arguments with
                # json.loads and writes them again with json.dumps, so 1e999 comes out as Infinity.
                return Violation(index, where, "", "a number beyond the double range (such as 1e999) came back "
                                 "as Infinity from vLLM's tool-call parser, which JSON cannot carry; bound the "
                                 "number with minimum/maximum in the tool's parameters")
            return Violation(index, where, "", f"not strict JSON ({e})")
        except ValueError as e:
            return Violation(index, where, "", f"not strict JSON ({e})")
        except RecursionError:
            return Violation(index, where, "", "nested deeper than the output check can read (about 1000 levels)")
        if validator is None:
            return None
        value = json.loads(text, parse_float=_number, parse_int=_integer, object_pairs_hook=dict)
        from jsonschema.exceptions import best_match

        try:
            error = best_match(validator.iter_errors(value))
        except RecursionError:
            return Violation(index, where, "", "nested deeper than the output check can read (about 1000 levels)")
        if error is None:
            return None
        pointer = "".join(f"/{_esc(str(p))}" for p in error.schema_path)
        return Violation(index, where, pointer, re.sub(r"Decimal\('([^']*)'\)", r"\1", error.message)[:300])

    def check_choice(self, choice: dict) -> Violation | None:
        """One finished choice of a whole answer (chat ``message`` or completions ``text``)."""
        if choice.get("finish_reason") not in ("stop", "tool_calls"):
            return None
        index = choice.get("index", 0)
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else choice.get("text")
        calls = (message or {}).get("tool_calls") or [] if isinstance(message, dict) else []
        if not calls:
            found = self._check(self.content, content if isinstance(content, str) else "", index, "content",
                                self.content_json)
            if found:
                return found
        for i, call in enumerate(calls):
            fn = call.get("function") or {}
            if self.tool_names:  # a name not declared still must carry JSON arguments
                found = self._check(self.tools.get(fn.get("name")), fn.get("arguments") or "", index,
                                    f"tool_calls[{i}].function.arguments", True)
                if found:
                    return found
        return None

    def check_document(self, doc: dict) -> Violation | None:
        """A non-streamed answer: the first violation among its choices, or None."""
        for choice in doc.get("choices") or []:
            found = self.check_choice(choice)
            if found:
                return found
        return None

    def feed(self, chunk: dict) -> Violation | None:
        """One streamed chunk: deltas are gathered per choice; a choice's finish is checked."""
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("content"):
                    self._content.setdefault(index, []).append(delta["content"])
                for call in delta.get("tool_calls") or []:
                    slot = self._calls.setdefault((index, call.get("index", 0)), {"name": None, "arguments": []})
                    fn = call.get("function") or {}
                    slot["name"] = fn.get("name") or slot["name"]
                    if fn.get("arguments"):
                        slot["arguments"].append(fn["arguments"])
            elif choice.get("text"):
                self._content.setdefault(index, []).append(choice["text"])
            if choice.get("finish_reason"):
                calls = [{"function": {"name": s["name"], "arguments": "".join(s["arguments"])}}
                         for (i, _), s in sorted(self._calls.items()) if i == index]
                whole = {"index": index, "finish_reason": choice["finish_reason"]}
                if isinstance(delta, dict) or calls:
                    whole["message"] = {"content": "".join(self._content.get(index, [])) if not calls else None,
                                        "tool_calls": calls}
                else:
                    whole["text"] = "".join(self._content.get(index, []))
                found = self.check_choice(whole)
                if found:
                    return found
        return None
