"""The component schemas of the OpenAPI document: the request bodies, generated from the
field tables in :mod:`furnace_trio.server.schemas` (the declarations the validators read
through), and the responses, written to match what :mod:`furnace_trio.server.sse` and the
handlers build.

Request objects allow additional properties on purpose: unknown fields are ignored, as
OpenAI does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from furnace_trio.server.responses_openapi import RESPONSES_SCHEMAS
from furnace_trio.server.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    TOKENIZE_FIELDS,
    FieldSpec,
)
from furnace_trio.server.status import STATUS_SCHEMA

_REF = "#/components/schemas/"


def request_schema(fields: Mapping[str, FieldSpec]) -> dict[str, Any]:
    """The JSON Schema of a request body built from its field table."""
    return {
        "type": "object",
        "required": [spec.name for spec in fields.values() if spec.required],
        "properties": {spec.name: spec.json_schema() for spec in fields.values()},
        "additionalProperties": True,
    }


def ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"anyOf": [dict(schema), {"type": "null"}]}


_FINISH = {"enum": ["stop", "length", "tool_calls", None]}


_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
    },
}


_TOKEN_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": ["array", "null"], "items": {"type": "integer"}},
    },
}


_CHAT_LOGPROBS = {
    "type": "object",
    "properties": {
        "content": {
            "type": "array",
            "items": {
                "allOf": [_TOKEN_LOGPROB],
                "properties": {"top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}},
            },
        }
    },
}


_COMPLETION_LOGPROBS = {
    "type": "object",
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}},
        "top_logprobs": {
            "type": "array",
            "items": {"type": "object", "additionalProperties": {"type": "number"}},
        },
        "text_offset": {"type": "array", "items": {"type": "integer"}},
    },
}


_TOOL_CALL_OUT = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}


_TOOL_CALL_DELTA = {
    "type": "object",
    "required": ["index"],
    "properties": {
        "index": {"type": "integer"},
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}


def _envelope(obj: str, choice: Mapping[str, Any], *, usage_nullable: bool) -> dict[str, Any]:
    usage = _nullable(ref("Usage")) if usage_nullable else ref("Usage")
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "system_fingerprint": {"type": "string"},
            "session_id": {"type": "string"},
            "choices": {"type": "array", "items": dict(choice)},
            "usage": usage,
        },
    }


SCHEMAS: dict[str, Any] = {
    "Usage": _USAGE,
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "ChatCompletion": _envelope(
        "chat.completion",
        {
            "type": "object",
            "required": ["index", "message", "finish_reason"],
            "properties": {
                "index": {"type": "integer"},
                "message": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": ["string", "null"]},
                        "tool_calls": {"type": "array", "items": _TOOL_CALL_OUT},
                    },
                },
                "logprobs": _nullable(_CHAT_LOGPROBS),
                "finish_reason": _FINISH,
            },
        },
        usage_nullable=False,
    ),
    "ChatCompletionChunk": _envelope(
        "chat.completion.chunk",
        {
            "type": "object",
            "required": ["index", "delta"],
            "properties": {
                "index": {"type": "integer"},
                "delta": {
                    "type": "object",
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": ["string", "null"]},
                        "tool_calls": {"type": "array", "items": _TOOL_CALL_DELTA},
                    },
                },
                "logprobs": _nullable(_CHAT_LOGPROBS),
                "finish_reason": _FINISH,
            },
        },
        usage_nullable=True,
    ),
    "TextCompletion": _envelope(
        "text_completion",
        {
            "type": "object",
            "required": ["index", "text", "finish_reason"],
            "properties": {
                "index": {"type": "integer"},
                "text": {"type": "string"},
                "logprobs": _nullable(_COMPLETION_LOGPROBS),
                "finish_reason": _FINISH,
            },
        },
        usage_nullable=True,
    ),
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": ref("Model")},
        },
    },
    "Session": {
        "type": "object",
        "required": ["id", "object", "turns", "messages", "cached_tokens"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "session"},
            "turns": {"type": "integer", "minimum": 0},
            "messages": {
                "type": "array",
                "items": {"type": "object"},
                "description": "Each turn's messages, and each reply as the client received "
                "it: content, and tool_calls with their ids.",
            },
            "cached_tokens": {"type": "integer", "minimum": 0},
        },
    },
    "SessionDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "session.deleted"},
            "deleted": {"const": True},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"enum": ["ok", "unavailable"]},
            "model": {"type": "string"},
            "error": {"type": "string"},
        },
    },
    "Status": STATUS_SCHEMA,
    "ChatCompletionRequest": request_schema(CHAT_FIELDS),
    "CompletionRequest": request_schema(COMPLETION_FIELDS),
    "TokenizeRequest": request_schema(TOKENIZE_FIELDS),
    "DetokenizeRequest": request_schema(DETOKENIZE_FIELDS),
    "TokenizeResponse": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": {"type": "integer", "minimum": 0},
            "max_model_len": {"type": "integer", "minimum": 1},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "token_strs": {"type": "array", "items": {"type": ["string", "null"]}},
        },
    },
    "DetokenizeResponse": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
    **RESPONSES_SCHEMAS,
    "TokenizerInfo": {
        "type": "object",
        "required": ["eos_token", "bos_token", "pad_token", "chat_template", "model_max_length"],
        "properties": {
            "tokenizer_class": {"type": "string"},
            "eos_token": {"type": ["string", "null"]},
            "bos_token": {"type": ["string", "null"]},
            "pad_token": {"type": ["string", "null"]},
            "add_bos_token": {"type": "boolean"},
            "chat_template": {"type": ["string", "null"]},
            "model_max_length": {"type": "integer", "minimum": 1},
        },
    },
}
