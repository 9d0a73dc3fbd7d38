"""Checks of finished answers: a strict RFC 8259 parse (no NaN/Infinity, no raw control
characters, no duplicate keys) and validation against the schema with ``jsonschema``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from runtime.engine.structured_outputs.pointers import esc

__all__ = ["OutputCheck", "Violation", "strict_loads"]


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
        pointer = "".join(f"/{esc(str(p))}" for p in error.schema_path)
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
