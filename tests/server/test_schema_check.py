"""Client JSON schemas checked before compiling: the size budget, known drafts, the
meta-schema (jsonschema-rs) and Python regexes. Plain functions, no server."""

from __future__ import annotations

from typing import Any

import pytest

from furnace_trio.server.errors import APIError
from furnace_trio.server.schema_check import SchemaBudget, check_schema

WHERE = "tools[0].function.parameters"


def refused(schema: Any, budget: int = 1000) -> APIError:
    with pytest.raises(APIError) as info:
        check_schema(schema, WHERE, SchemaBudget(budget))
    assert info.value.status == 400
    return info.value


def test_valid_schemas_pass_and_use_the_budget() -> None:
    budget = SchemaBudget(10)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}  # 5 values
    assert check_schema(schema, WHERE, budget) is schema
    assert budget.used == 5
    check_schema(schema, WHERE, budget)
    error = refused(schema, 0)
    assert error.param == WHERE and "FURNACE_MAX_SCHEMA_NODES" in error.message
    with pytest.raises(APIError, match="past 10 values"):
        check_schema({"type": "string"}, "response_format.json_schema.schema", budget)


def test_a_huge_schema_is_refused_by_the_budget() -> None:
    # counting stops one value past the budget, so this costs microseconds
    huge: dict[str, Any] = {"anyOf": [{"type": "string"}] * 1_000_000}
    refused(huge, 100)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "strin"}, "not valid under any of the schemas"),
        ({"properties": {"a": {"minimum": "x"}}}, "properties/a/minimum"),
        ("string", "must be a JSON schema object"),
    ],
)
def test_invalid_schemas_name_what_is_wrong(schema: Any, words: str) -> None:
    error = refused(schema)
    assert error.param == WHERE and words in error.message


@pytest.mark.parametrize(
    "draft",
    [
        "http://json-schema.org/draft-04/schema#",
        "http://json-schema.org/draft-07/schema",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_known_drafts_are_checked_against_their_meta_schema(draft: str) -> None:
    check_schema({"$schema": draft, "type": "string"}, WHERE, SchemaBudget(100))
    assert "not valid" in refused({"$schema": draft, "type": 7}).message


@pytest.mark.parametrize(
    "draft", ["http://127.0.0.1:9/meta", "http://json-schema.org/draft-03/schema#", 5]
)
def test_other_meta_schemas_are_refused_without_being_fetched(draft: object) -> None:
    error = refused({"$schema": draft, "type": "string"})
    assert error.param == f"{WHERE}.$schema"


def test_patterns_must_compile_as_python_regexes() -> None:
    assert "regular expression" in refused({"type": "string", "pattern": "[a-"}).message
    bad_key = {"type": "object", "patternProperties": {"(?<": {"type": "string"}}}
    assert "regular expression" in refused(bad_key).message
    # a "pattern" inside data is not a regex
    check_schema({"const": {"pattern": "[a-"}}, WHERE, SchemaBudget(100))
    check_schema({"properties": {"pattern": {"type": "string"}}}, WHERE, SchemaBudget(100))
