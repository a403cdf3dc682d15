"""Bounds added to the numbers a JSON schema leaves unbounded (pure data, no grammar)."""

from __future__ import annotations

from furnace_trio.tools.schema_bounds import (
    ANY_VALUE_DEFS,
    INTEGER_LIMIT,
    NUMBER_LIMIT,
    NUMBER_STEP,
    bounded_schema,
)


def test_unbounded_numbers_get_bounds_and_the_schemas_own_are_kept() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "low": {"type": "integer", "minimum": 0},
            "x": {"type": ["number", "null"], "exclusiveMaximum": 5, "multipleOf": 0.5},
            "tag": {"enum": [{"type": "integer"}]},
        },
        "$defs": {"mine": {"type": "number"}},
    }
    out = bounded_schema(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}
    assert props["low"] == {"type": "integer", "minimum": 0, "maximum": INTEGER_LIMIT}
    assert props["x"] == {
        "type": ["number", "null"],
        "exclusiveMaximum": 5,
        "multipleOf": 0.5,
        "minimum": -NUMBER_LIMIT,
    }
    assert props["tag"] == {"enum": [{"type": "integer"}]}  # data, not a schema
    assert out["$defs"]["mine"]["multipleOf"] == NUMBER_STEP
    assert out["$defs"].keys() == {"mine", *ANY_VALUE_DEFS}
    assert "minimum" not in schema["properties"]["n"]  # type: ignore[index]


def test_no_schema_is_any_object_of_bounded_values() -> None:
    out = bounded_schema(None)
    assert out["type"] == "object" and out["additionalProperties"] == {
        "$ref": "#/$defs/furnace_any_value"
    }
