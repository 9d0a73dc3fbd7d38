"""Static analysis of one schema before admission: its keywords against the capability tables,
its regexes, its form, whether it can be satisfied at all, and whether its ``allOf`` parts
intersect to something the grammar can hold."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from typing import Any

from runtime.engine.structured_outputs.keywords import (FORMATS, FORMAT_MIN_LENGTH, KEYWORDS, MAX_DEPTH, REFUSED,
                                                        RUST_ONLY, TYPES)
from runtime.engine.structured_outputs.pointers import (Resolver, SchemaRefused, deref, esc, has_ref, ref_nodes,
                                                        structural, subschemas)

__all__ = ["Intersections", "check_form", "check_keywords", "check_satisfiable"]


def check_keywords(schema: Any, ptr: str, resolver: Resolver, unenforced: list[tuple[str, str]]) -> None:
    """Walk every subschema: refused keywords go to ``unenforced`` (pointer, why); malformed or
    unresolvable ones raise SchemaRefused at once."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaRefused(ptr, f"a schema must be an object or a boolean, got {type(schema).__name__}")
    for key in schema:
        if KEYWORDS.get(key) == "refused":
            hint = REFUSED[key]
            unenforced.append((f"{ptr}/{esc(key)}", f"{key} is not enforced by the structured-outputs grammar"
                                                     f"{' (' + hint + ')' if hint else ''}"))
    types = schema.get("type")
    for t in [types] if isinstance(types, str) else types if isinstance(types, list) else []:
        if t not in TYPES:
            raise SchemaRefused(f"{ptr}/type", f"{t!r} is not a JSON Schema type; use one of {sorted(TYPES)}")
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
            _check_regex(key, f"{ptr}/patternProperties/{esc(key)}")
    if isinstance(schema.get("items"), list):
        raise SchemaRefused(f"{ptr}/items", "items as a list is the draft-04 tuple form, which 2020-12 reads "
                                            "otherwise: use prefixItems (and items: false to allow no more)")
    for key in ("enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        if key in schema and _too_big(schema[key]):
            raise SchemaRefused(f"{ptr}/{key}", "integers beyond 64 bits cannot be enforced by the grammar; "
                                                "use a string with a pattern for such numbers")
    if ptr and "$id" in schema and has_ref(schema):
        raise SchemaRefused(f"{ptr}/$id", "a nested $id moves the base that the $refs below it resolve against; "
                                          "references resolve from the root here: remove this $id and point "
                                          "the $refs at the root's #/$defs/...")
    if "$ref" in schema:
        resolver.target(schema["$ref"], f"{ptr}/$ref")
    if isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1 \
            and not _disjoint([deref(s, resolver, f"{ptr}/oneOf/{i}") for i, s in enumerate(schema["oneOf"])]):
        unenforced.append((f"{ptr}/oneOf", "oneOf branches that can match the same value cannot be enforced "
                                           "(the grammar cannot exclude a second match): use anyOf, or make "
                                           "the branches distinct by type or by a required property's const"))
    for sub_ptr, sub in subschemas(schema, ptr):
        check_keywords(sub, sub_ptr, resolver, unenforced)


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
    if RUST_ONLY.search(pattern):
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


def check_form(schema: Any) -> None:
    """The schema is well formed (its draft's metaschema; nesting at most 64 deep) before
    anything reads it. Raises SchemaRefused at the offending keyword."""
    stack = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaRefused("", f"nested more than {MAX_DEPTH} levels deep; flatten it with $defs")
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
        pointer = "".join(f"/{esc(str(p))}" for p in error.absolute_path)
        raise SchemaRefused(pointer, f"not a valid JSON Schema: {error.message[:200]}")


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


def _productive(schema: Any, resolver: Resolver, known: dict[str, bool]) -> bool:
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
    return max(shortest, FORMAT_MIN_LENGTH.get(schema.get("format"), 0))


def check_satisfiable(root: Any, resolver: Resolver) -> None:
    refs = {resolver.target(n["$ref"], f"{at}/$ref") for at, n in ref_nodes(root)}
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


def _unproductive_at(schema: Any, ptr: str, resolver: Resolver, known: dict[str, bool]) -> tuple[str, Any]:
    """The deepest place under an unproductive ``schema`` that is itself unproductive, following
    what :func:`_productive` requires (allOf parts, required properties, the first items)."""
    if not isinstance(schema, dict):
        return ptr, schema
    children: list[tuple[str, Any]] = [(f"{ptr}/allOf/{i}", sub) for i, sub in enumerate(schema.get("allOf") or [])
                                       if isinstance(schema.get("allOf"), list)]
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list):
        children += [(f"{ptr}/properties/{esc(name)}", props[name]) for name in schema["required"] if name in props]
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


class Intersections:
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

    def __init__(self, root: Any, resolver: Resolver) -> None:
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
        return {self.resolver.target(n["$ref"], f"{at}/$ref") for at, n in ref_nodes(schema, defs=False)}

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
        if len(stack) > MAX_DEPTH:
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
            todo.extend((sub, sub_ptr) for sub_ptr, sub in structural(node, at))
            if "$ref" in node:
                t = self.resolver.target(node["$ref"], f"{at}/$ref")
                todo.append((self.resolver.get(t), t))


def _searches(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # conservative: it may match
