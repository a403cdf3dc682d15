"""JSON schemas whose grammar ends: bounds on the numbers a schema leaves unbounded.

A grammar built from ``{"type": "integer"}`` accepts ``1111...`` for ever, and a small
model will write it until ``max_tokens``. :func:`bounded_schema` returns a copy of a schema
in which every integer and number the schema does not bound itself has bounds, so that the
number, and the grammar, end:

- integers: the 64-bit range, as far as llguidance can express it (it reads bounds as
  doubles and cannot build the full signed range): ``±INTEGER_LIMIT``, the largest doubles
  inside it;
- numbers: ``±NUMBER_LIMIT`` and a multiple of ``NUMBER_STEP`` (at most six decimals, no
  exponent), unless the schema gives its own bounds or ``multipleOf``.

Whitespace needs no bound: the grammars are compact (no whitespace between tokens). A value
the schema leaves free (``json_object``, a property without a schema) is :data:`ANY_VALUE`,
any JSON value with the same bounds. Strings stay unbounded unless the schema sets
``maxLength``. Pure functions over plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "ANY_VALUE",
    "ANY_VALUE_DEFS",
    "INTEGER_LIMIT",
    "NUMBER_LIMIT",
    "NUMBER_STEP",
    "bounded_schema",
    "bounded_subschema",
]

INTEGER_LIMIT = 2**63 - 1024
NUMBER_LIMIT = 1e15
NUMBER_STEP = 1e-6

_INTEGER = {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}
_NUMBER = {
    "type": "number",
    "minimum": -NUMBER_LIMIT,
    "maximum": NUMBER_LIMIT,
    "multipleOf": NUMBER_STEP,
}
_REF = {"$ref": "#/$defs/furnace_any_value"}
#: Any JSON value, numbers bounded; ``$ref`` resolves against the root's ``$defs``.
ANY_VALUE: dict[str, Any] = {
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        {"type": "string"},
        _INTEGER,
        _NUMBER,
        {"type": "array", "items": _REF},
        {"type": "object", "additionalProperties": _REF},
    ]
}
#: The root ``$defs`` entries that a bounded schema refers to.
ANY_VALUE_DEFS: dict[str, Any] = {"furnace_any_value": ANY_VALUE}
#: Keys whose values are JSON data, not schemas: never rewritten.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "required"})


def bounded_schema(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """``schema`` with its unbounded numbers bounded (``None``: any JSON object), as a
    whole document (it carries the ``$defs`` entry of :data:`ANY_VALUE`)."""
    root = bounded_subschema(schema)
    return {**root, "$defs": {**(root.get("$defs") or {}), **ANY_VALUE_DEFS}}


def bounded_subschema(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The same for a schema embedded in a document whose root holds :data:`ANY_VALUE_DEFS`."""
    if schema is None:
        return {"type": "object", "additionalProperties": _REF}
    return _bound(schema)


def _bound(schema: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif isinstance(value, Mapping):
            out[key] = _bound(value)
        elif isinstance(value, list):
            out[key] = [_bound(v) if isinstance(v, Mapping) else v for v in value]
        else:
            out[key] = value
    types = out.get("type")
    kinds = set(types) if isinstance(types, list) else {types}
    if "number" in kinds:
        if "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
        _default_bounds(out, NUMBER_LIMIT)
    elif "integer" in kinds:
        _default_bounds(out, INTEGER_LIMIT)
    return out


def _default_bounds(schema: dict[str, Any], limit: float) -> None:
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = limit
