"""``POST /v1/responses`` fields, declared once: :mod:`~furnace_trio.server.responses_request`
validates through this table and :mod:`~furnace_trio.server.openapi_schemas` publishes it.

Unlike chat completions, a Responses body with a field this table does not declare is
refused (400 naming the field): the Responses API has built-in tools, background runs,
reasoning and conversations that this server does not have, and a client that asks for one
must learn it was not honoured rather than get an answer without it. The published schema
says so with ``additionalProperties: false``. Nested objects (input items, content parts)
are left open: clients send back the output items they got, with ``id``, ``status``,
``annotations`` and the like, and those are read past.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from furnace_trio.server.schemas import (
    COMMON_FIELDS,
    MAX_MESSAGES,
    FieldSpec,
)

#: Input roles a message item may have (``developer`` is rendered as ``system``).
INPUT_ROLES = ("user", "system", "developer", "assistant")
#: Content part types read as text; images, files and audio are refused.
TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_INSTRUCTIONS_CHARS = 1 << 20
#: Most input items in one page of ``GET /v1/responses/{id}/input_items``.
MAX_LIST_LIMIT = 100

_TEXT_PART: Mapping[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["type", "refusal"],
            "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}},
        },
    ]
}
_MESSAGE_ITEM: Mapping[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": list(INPUT_ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    },
}
_FUNCTION_CALL_ITEM: Mapping[str, Any] = {
    "type": "object",
    "required": ["type", "call_id", "name", "arguments"],
    "properties": {
        "type": {"const": "function_call"},
        "call_id": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1},
        "arguments": {"type": "string"},
    },
}
_FUNCTION_CALL_OUTPUT_ITEM: Mapping[str, Any] = {
    "type": "object",
    "required": ["type", "call_id", "output"],
    "properties": {
        "type": {"const": "function_call_output"},
        "call_id": {"type": "string", "minLength": 1},
        "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    },
}
INPUT_ITEM: Mapping[str, Any] = {
    "anyOf": [_MESSAGE_ITEM, _FUNCTION_CALL_ITEM, _FUNCTION_CALL_OUTPUT_ITEM],
}
FUNCTION_TOOL: Mapping[str, Any] = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"], "description": "A JSON Schema."},
        "strict": {"type": ["boolean", "null"]},
    },
}
TOOL_CHOICE: Mapping[str, Any] = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
        },
    ]
}
TEXT_FORMAT: Mapping[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "name": {"type": "string"},
                "schema": {"type": "object"},
                "description": {"type": ["string", "null"]},
                "strict": {"type": ["boolean", "null"]},
            },
        },
    ]
}

_SAMPLING = {spec.name: spec for spec in COMMON_FIELDS}

RESPONSES_FIELDS: Mapping[str, FieldSpec] = {
    spec.name: spec
    for spec in (
        _SAMPLING["model"],
        FieldSpec(
            "input",
            "structured",
            "A user message, or a list of items: messages (roles user, system, developer, "
            "assistant; text content parts), function_call and function_call_output. With "
            "previous_response_id, only what comes after that response.",
            required=True,
            schema={
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": INPUT_ITEM},
                ]
            },
        ),
        FieldSpec(
            "instructions",
            "string",
            "A system message placed before the conversation; not carried over to a "
            "response that continues this one.",
            high=MAX_INSTRUCTIONS_CHARS,
        ),
        FieldSpec(
            "tools",
            "structured",
            "Function tools the model may call. Built-in tools (web search, file search, "
            "code interpreter, ...) are not available here.",
            schema={"type": "array", "items": FUNCTION_TOOL},
        ),
        FieldSpec(
            "tool_choice",
            "structured",
            "none, auto, required, or one function by name (which must be among the tools).",
            schema=TOOL_CHOICE,
        ),
        FieldSpec("parallel_tool_calls", "boolean", "Allow several calls in one answer.", True),
        FieldSpec(
            "text",
            "structured",
            "The output's format: plain text, any JSON object, or JSON matching a schema.",
            schema={
                "type": "object",
                "properties": {"format": TEXT_FORMAT},
                "additionalProperties": False,
            },
        ),
        _SAMPLING["temperature"],
        _SAMPLING["top_p"],
        FieldSpec(
            "max_output_tokens",
            "integer",
            "Most tokens to generate; the response is incomplete when they run out.",
            low=1,
        ),
        FieldSpec(
            "store",
            "boolean",
            "Keep the response (and its conversation's KV cache) so that it can be "
            "retrieved and continued with previous_response_id.",
            True,
        ),
        FieldSpec(
            "metadata",
            "structured",
            f"Up to {MAX_METADATA} string pairs kept with the response.",
            schema={
                "type": "object",
                "maxProperties": MAX_METADATA,
                "propertyNames": {"maxLength": MAX_METADATA_KEY},
                "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
            },
        ),
        FieldSpec(
            "previous_response_id",
            "string",
            "Continue the conversation of a stored response: its history and KV cache are "
            "reused, so only the new input is computed.",
            low=1,
            high=256,
        ),
        _SAMPLING["stream"],
        FieldSpec(
            "include",
            "structured",
            "Extra output data; none is available, so only an empty list is accepted.",
            schema={"type": "array", "maxItems": 0},
        ),
        FieldSpec(
            "background",
            "structured",
            "Background responses are not available: only false is accepted.",
            schema={"const": False},
        ),
        FieldSpec(
            "truncation",
            "structured",
            "Only disabled: an input too long for the context is an error.",
            schema={"const": "disabled"},
        ),
        FieldSpec("user", "string", "An end-user id; accepted and not used.", high=256),
    )
}
