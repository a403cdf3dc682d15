"""The HTTP API reference, read out of the OpenAPI document (:mod:`furnace_trio.server.openapi`).

One walk over the document produces plain records (operations, their parameters and
responses, every component schema's fields flattened to dotted names), and two small
writers turn them into Markdown (``docs/api.md``, see
:mod:`furnace_trio.server.reference_docs`) and HTML (``GET /docs``, see
:mod:`furnace_trio.server.api_page`). Nothing here is written by hand per endpoint: a route
added to the document appears in both.

A :class:`Markup` decides how text, code and links to schemas are written, so the walk
itself never escapes anything and never emits Markdown or HTML directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

_REF = "#/components/schemas/"
#: Nested objects are flattened this many levels deep (``messages[].tool_calls[].id``).
MAX_DEPTH = 4
METHODS = ("get", "post", "put", "patch", "delete")
#: JSON Schema's constraints, as the notes spell them.
_CONSTRAINTS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
)


class Markup(Protocol):
    """How a writer spells the three kinds of inline content."""

    def text(self, value: str) -> str: ...

    def code(self, value: str) -> str: ...

    def schema_link(self, name: str) -> str: ...


@dataclass(frozen=True, slots=True)
class Field:
    """One property of a schema: ``name`` dotted through nested objects (``[]`` for array
    items); ``kind`` and ``notes`` already in the writer's markup."""

    name: str
    kind: str
    required: bool
    notes: str


@dataclass(frozen=True, slots=True)
class Response:
    status: str
    description: str
    content: tuple[tuple[str, str], ...]  # (media type, schema and its description in markup)


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    summary: str
    description: str
    parameters: tuple[Field, ...]
    request_body: str | None  # the body's schema in markup
    responses: tuple[Response, ...]


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    description: str
    fields: tuple[Field, ...]
    kind: str  # for schemas without properties (the whole schema's type)


def operations(document: Mapping[str, Any], markup: Markup) -> list[Operation]:
    """Every operation, in the document's path order."""
    found = []
    for path, item in document["paths"].items():
        shared = item.get("parameters", [])
        for method in METHODS:
            if method in item:
                found.append(_operation(method, path, item[method], shared, markup))
    return found


def schemas(document: Mapping[str, Any], markup: Markup) -> list[Schema]:
    """Every component schema, sorted by name."""
    out = []
    for name, schema in sorted(document["components"]["schemas"].items()):
        fields = tuple(_fields(schema, "", markup, 0))
        out.append(Schema(name, schema.get("description", ""), fields, type_of(schema, markup)))
    return out


def _operation(
    method: str,
    path: str,
    operation: Mapping[str, Any],
    shared: list[Mapping[str, Any]],
    markup: Markup,
) -> Operation:
    parameters = tuple(
        Field(
            p["name"],
            type_of(p.get("schema", {}), markup),
            bool(p.get("required")),
            markup.text(f"In the {p['in']}. ")
            + _notes(p.get("schema", {}), p.get("description", ""), markup),
        )
        for p in (*shared, *operation.get("parameters", []))
    )
    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
    responses = tuple(
        Response(
            status,
            answer.get("description", ""),
            tuple(
                (media, _described(content.get("schema", {}), markup))
                for media, content in answer.get("content", {}).items()
            ),
        )
        for status, answer in sorted(operation.get("responses", {}).items())
    )
    return Operation(
        method.upper(),
        path,
        operation.get("summary", ""),
        operation.get("description", ""),
        parameters,
        type_of(body["schema"], markup) if body else None,
        responses,
    )


def _described(schema: Mapping[str, Any], markup: Markup) -> str:
    """A response body's type, with the description of an inline schema (a stream's events)."""
    kind = type_of(schema, markup)
    if "$ref" in schema or not schema.get("description"):
        return kind
    return f"{kind} ({markup.text(schema['description'])})"


def _fields(schema: Mapping[str, Any], prefix: str, markup: Markup, depth: int) -> Iterator[Field]:
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        dotted = prefix + name
        yield Field(
            dotted,
            type_of(prop, markup),
            name in required,
            _notes(prop, prop.get("description", ""), markup),
        )
        if depth + 1 < MAX_DEPTH:
            for nested, suffix in _nested_objects(prop):
                yield from _fields(nested, f"{dotted}{suffix}.", markup, depth + 1)


def _nested_objects(schema: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], str]]:
    """The inline object schemas under ``schema`` (not ``$ref``s: those have their own
    section), with the suffix their fields' names get."""
    if "properties" in schema:
        yield schema, ""
    items = schema.get("items")
    if isinstance(items, Mapping) and "properties" in items:
        yield items, "[]"
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key, ()):
            yield from _nested_objects(option)


def type_of(schema: Mapping[str, Any], markup: Markup) -> str:
    """A short spelling of a schema's type: ``string | null``, ``array of Usage``."""
    if "$ref" in schema:
        return markup.schema_link(schema["$ref"].removeprefix(_REF))
    if "const" in schema:
        return markup.code(json.dumps(schema["const"]))
    if "enum" in schema:
        return markup.text(" | ").join(markup.code(json.dumps(v)) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = dict.fromkeys(type_of(option, markup) for option in schema[key])
            return markup.text(" | ").join(options)
    if "allOf" in schema:
        return markup.text(" & ").join(type_of(option, markup) for option in schema["allOf"])
    kinds = schema.get("type")
    names = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not names:
        return markup.text("any")
    spelled = []
    for kind in names:
        if kind == "array" and isinstance(schema.get("items"), Mapping):
            spelled.append(markup.text("array of ") + type_of(schema["items"], markup))
        else:
            spelled.append(markup.text(kind))
    return markup.text(" | ").join(spelled)


def _notes(schema: Mapping[str, Any], description: str, markup: Markup) -> str:
    """The description, then the constraints and the default, in the writer's markup."""
    parts = [markup.text(description)] if description else []
    limits = [template.format(schema[key]) for key, template in _CONSTRAINTS if key in schema]
    if limits:
        parts.append(markup.text(f"({', '.join(limits)})"))
    if "default" in schema:
        parts.append(markup.text("Default ") + markup.code(json.dumps(schema["default"])) + ".")
    return " ".join(parts)


def anchor(kind: str, name: str) -> str:
    """The id of an operation's or schema's section, the same in both writers."""
    cleaned = "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())
    return f"{kind}-{cleaned}" if cleaned else kind
