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

One concern per module: ``keywords`` (what the grammar does with each keyword and format),
``pointers`` (JSON pointers, ``$ref`` and walks over subschemas), ``analysis`` (the static checks
of one schema), ``rewrite`` (:func:`prepare` and :func:`locate`: the engine's copy) and ``output``
(:class:`OutputCheck` of finished answers).
"""

from runtime.engine.structured_outputs.keywords import FORMATS, KEYWORDS, NUMBER_BOUND, REFUSED_BY_MEANING
from runtime.engine.structured_outputs.output import OutputCheck, Violation, strict_loads
from runtime.engine.structured_outputs.pointers import SchemaRefused
from runtime.engine.structured_outputs.rewrite import locate, prepare

__all__ = ["FORMATS", "KEYWORDS", "NUMBER_BOUND", "REFUSED_BY_MEANING", "OutputCheck", "SchemaRefused", "Violation",
           "locate", "prepare", "strict_loads"]
