"""The Responses API's part of the OpenAPI document: its request body (from
:data:`~furnace_trio.server.responses_schemas.RESPONSES_FIELDS`, closed to other fields as
the validator is), the response object, its stream events and item lists, written to
match what :mod:`~furnace_trio.server.responses_object` and
:mod:`~furnace_trio.server.responses_events` build.
"""

from __future__ import annotations

from typing import Any

from furnace_trio.server.responses_schemas import FUNCTION_TOOL, RESPONSES_FIELDS, TOOL_CHOICE
from furnace_trio.server.schemas import FieldSpec

_REF = "#/components/schemas/"

#: Every stream event type, in the order a stream can send them.
STREAM_EVENTS = (
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "error",
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _request(fields: dict[str, FieldSpec]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": [spec.name for spec in fields.values() if spec.required],
        "properties": {spec.name: spec.json_schema() for spec in fields.values()},
        "additionalProperties": False,
    }


_ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_OUTPUT_TEXT = {
    "type": "object",
    "required": ["type", "text", "annotations"],
    "properties": {
        "type": {"const": "output_text"},
        "text": {"type": "string"},
        "annotations": {"type": "array", "maxItems": 0},
        "logprobs": {"type": "array", "maxItems": 0},
    },
}
_INPUT_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "input_text"}, "text": {"type": "string"}},
}
_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "status", "content"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "status": _ITEM_STATUS,
        "content": {"type": "array", "items": _OUTPUT_TEXT},
    },
}
_FUNCTION_CALL = {
    "type": "object",
    "required": ["id", "type", "status", "call_id", "name", "arguments"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function_call"},
        "status": _ITEM_STATUS,
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
    },
}
_INPUT_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "status", "content"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"enum": ["user", "system", "developer", "assistant"]},
        "status": _ITEM_STATUS,
        "content": {"type": "array", "items": {"anyOf": [_INPUT_TEXT, _OUTPUT_TEXT]}},
    },
}
_FUNCTION_CALL_OUTPUT = {
    "type": "object",
    "required": ["id", "type", "status", "call_id", "output"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function_call_output"},
        "status": _ITEM_STATUS,
        "call_id": {"type": "string"},
        "output": {"type": "string"},
    },
}
_COUNT = {"type": "integer", "minimum": 0}
_NULLABLE_NUMBER = {"type": ["number", "null"]}

RESPONSES_SCHEMAS: dict[str, Any] = {
    "ResponseRequest": _request(dict(RESPONSES_FIELDS)),
    "ResponseOutputItem": {"oneOf": [_MESSAGE, _FUNCTION_CALL]},
    "ResponseUsage": {
        "type": "object",
        "required": ["input_tokens", "input_tokens_details", "output_tokens", "total_tokens"],
        "properties": {
            "input_tokens": _COUNT,
            "input_tokens_details": {
                "type": "object",
                "required": ["cached_tokens"],
                "properties": {"cached_tokens": _COUNT, "cache_write_tokens": _COUNT},
            },
            "output_tokens": _COUNT,
            "output_tokens_details": {
                "type": "object",
                "properties": {"reasoning_tokens": _COUNT},
            },
            "total_tokens": _COUNT,
        },
    },
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "tools"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "completed_at": {"type": ["integer", "null"]},
            "status": {"enum": ["in_progress", "completed", "incomplete", "failed"]},
            "error": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["code", "message"],
                        "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                    },
                ]
            },
            "incomplete_details": {
                "anyOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["reason"],
                        "properties": {"reason": {"const": "max_output_tokens"}},
                    },
                ]
            },
            "instructions": {"type": ["string", "null"]},
            "max_output_tokens": {"type": ["integer", "null"]},
            "model": {"type": "string"},
            "output": {"type": "array", "items": _ref("ResponseOutputItem")},
            "parallel_tool_calls": {"type": "boolean"},
            "previous_response_id": {"type": ["string", "null"]},
            "temperature": _NULLABLE_NUMBER,
            "top_p": _NULLABLE_NUMBER,
            "text": {"type": "object", "properties": {"format": {"type": "object"}}},
            "tool_choice": TOOL_CHOICE,
            "tools": {"type": "array", "items": FUNCTION_TOOL},
            "truncation": {"const": "disabled"},
            "store": {"type": "boolean"},
            "background": {"const": False},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "usage": {"anyOf": [{"type": "null"}, _ref("ResponseUsage")]},
        },
    },
    "ResponseStreamEvent": {
        "type": "object",
        "required": ["type", "sequence_number"],
        "properties": {
            "type": {"enum": list(STREAM_EVENTS)},
            "sequence_number": _COUNT,
            "response": _ref("Response"),
            "output_index": _COUNT,
            "content_index": _COUNT,
            "item_id": {"type": "string"},
            "item": _ref("ResponseOutputItem"),
            "part": _OUTPUT_TEXT,
            "delta": {"type": "string"},
            "text": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string"},
            "logprobs": {"type": "array", "maxItems": 0},
            "code": {"type": ["string", "null"]},
            "message": {"type": "string"},
            "param": {"type": ["string", "null"]},
        },
    },
    "ResponseDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response.deleted"},
            "deleted": {"const": True},
        },
    },
    "ResponseItemList": {
        "type": "object",
        "required": ["object", "data", "first_id", "last_id", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {"oneOf": [_INPUT_MESSAGE, _FUNCTION_CALL, _FUNCTION_CALL_OUTPUT]},
            },
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
            "has_more": {"type": "boolean"},
        },
    },
}


def stream_event_schema() -> dict[str, Any]:
    """One server-sent event of a Responses stream: named by its type, its data a JSON
    stream event (OpenAPI 3.2's ``itemSchema`` for ``text/event-stream``, as an object)."""
    return {
        "type": "object",
        "description": "With stream=true: server-sent events, `event: <type>` and "
        "`data: <ResponseStreamEvent>`; no `[DONE]`, the last event is response.completed, "
        "response.incomplete, response.failed or error.",
        "required": ["data", "event"],
        "properties": {
            "event": {"enum": list(STREAM_EVENTS)},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _ref("ResponseStreamEvent"),
            },
        },
        "additionalProperties": False,
    }
