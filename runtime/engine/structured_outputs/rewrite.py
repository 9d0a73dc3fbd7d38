"""The schema the engine gets: :func:`prepare` checks a client's schema (analysis.py) and returns
the copy with numbers bounded and objects closed as the grammar needs; :func:`locate` names the
place of what the grammar itself refused."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from runtime.engine.structured_outputs.keywords import NUMBER_BOUND
from runtime.engine.structured_outputs.pointers import Resolver, SchemaRefused, own_subschemas, subschemas, unesc
from runtime.engine.structured_outputs.analysis import Intersections, check_form, check_keywords, check_satisfiable

__all__ = ["locate", "prepare"]


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
    check_form(schema)
    if schema is True:
        schema = {}  # llguidance wants an object at the root; {} admits the same values
    resolver = Resolver(schema)
    unenforced: list[tuple[str, str]] = []
    check_keywords(schema, "", resolver, unenforced)
    if unenforced and strict is not False:
        raise SchemaRefused(*unenforced[0], droppable=True)
    out = copy.deepcopy(schema)
    copied = Resolver(out)
    for ptr, _ in sorted(unenforced, key=lambda u: -u[0].count("/")):  # deepest first
        parent_ptr, _, key = ptr.rpartition("/")
        if key == "oneOf":
            continue  # kept as anyOf below: "at least one" is the closest the grammar enforces
        parent = copied.get(parent_ptr)
        if isinstance(parent, dict):
            parent.pop(unesc(key), None)
    if strict is not False:
        _close_objects(out)
    check_satisfiable(out, Resolver(out))
    try:
        Intersections(out, Resolver(out)).check()
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
    for sub in [*own_subschemas(schema), *branches]:
        _bound_all_numbers(sub)


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
    for sub in own_subschemas(schema):
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
            for sub_ptr, sub in subschemas(node, ptr):
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
        for _, sub in subschemas(schema, ""):
            _one_of_to_any_of(sub)
