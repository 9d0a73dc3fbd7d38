"""Places in a JSON Schema: JSON pointers (RFC 6901), ``$ref`` resolution, and walks over a
schema's subschemas; :class:`SchemaRefused` names the pointer of what is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["Resolver", "SchemaRefused", "deref", "esc", "has_ref", "own_subschemas", "ref_nodes", "structural",
           "subschemas", "unesc"]


class SchemaRefused(ValueError):
    """A schema the engine would not enforce as written: ``pointer`` is the JSON pointer of the
    keyword (``""`` for the whole schema), ``reason`` why and what to do instead; ``str(e)`` both,
    plus the OpenAI routes' way out (``strict: false``) when the keyword can be dropped."""

    def __init__(self, pointer: str, message: str, droppable: bool = False) -> None:
        hint = "; or send strict: false to have it dropped (not enforced)" if droppable else ""
        super().__init__(f"{pointer or ' (the root)'}: {message}{hint}")
        self.pointer, self.droppable, self.reason = pointer, droppable, message


def esc(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def unesc(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def subschemas(schema: dict, ptr: str) -> Iterator[tuple[str, Any]]:
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
            yield from ((f"{ptr}/{key}/{esc(k)}", s) for k, s in schema[key].items())


class Resolver:
    """Local ``$ref`` targets of one schema: JSON pointers (``#/...``) and ``$anchor`` names."""

    def __init__(self, root: Any) -> None:
        self.root, self.anchors = root, {}
        self._index(root, "")

    def _index(self, schema: Any, ptr: str) -> None:
        if not isinstance(schema, dict):
            return
        if isinstance(schema.get("$anchor"), str):
            self.anchors[schema["$anchor"]] = ptr
        for sub_ptr, sub in subschemas(schema, ptr):
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
            part = unesc(part)
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
    parts = [unesc(p) for p in ptr.split("/")[1:]]
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


def ref_nodes(schema: Any, ptr: str = "", defs: bool = True) -> Iterator[tuple[str, dict]]:
    """(pointer, node) of every subschema at or below ``schema`` that has ``$ref`` (a keyword,
    not a property name), without following them; ``defs=False`` skips $defs/definitions."""
    todo = [(ptr, schema)]
    while todo:
        at, node = todo.pop()
        if isinstance(node, dict):
            if "$ref" in node:
                yield at, node
            todo.extend(subschemas(node, at) if defs else structural(node, at))


def has_ref(schema: Any) -> bool:
    return next(ref_nodes(schema), None) is not None


def deref(schema: Any, resolver: Resolver, ptr: str) -> Any:
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and len(schema) == 1 and seen < 32:
        schema, seen = resolver.get(resolver.target(schema["$ref"], f"{ptr}/$ref")), seen + 1
        ptr = ""
    return schema


def structural(schema: dict, ptr: str) -> Iterator[tuple[str, Any]]:
    """Subschemas below ``schema``, without $defs/definitions (reached through $ref only)."""
    for sub_ptr, sub in subschemas(schema, ptr):
        if not sub_ptr[len(ptr):].startswith(("/$defs/", "/definitions/")):
            yield sub_ptr, sub


def own_subschemas(schema: dict) -> Iterator[Any]:
    """The subschemas of ``schema`` that constrain a value on their own: not ``allOf``'s, which
    combine (a keyword added to one branch would constrain the others' values too)."""
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            yield from value.values()
        elif key in ("anyOf", "oneOf", "prefixItems") and isinstance(value, list):
            yield from value
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            yield value
