"""The OpenAPI 3.1 document served at ``/openapi.json``.

Request bodies are generated from the field tables in :mod:`furnace_trio.server.schemas`, the same
declarations :mod:`furnace_trio.server.protocol` validates with, so the document cannot drift from
the validator. Response schemas describe what :mod:`furnace_trio.server.sse` and the handlers build;
``tests/test_openapi.py`` checks real responses against them and the schemathesis fuzz run
(``nox -s fuzz``) does so for generated requests.

Request objects allow additional properties on purpose: unknown fields are ignored, as
OpenAI does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from furnace_trio import __version__
from furnace_trio.server.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    MAX_SESSION_ID_LENGTH,
    TOKENIZE_FIELDS,
    FieldSpec,
)

_REF = "#/components/schemas/"


def request_schema(fields: Mapping[str, FieldSpec]) -> dict[str, Any]:
    """The JSON Schema of a request body built from its field table."""
    return {
        "type": "object",
        "required": [spec.name for spec in fields.values() if spec.required],
        "properties": {spec.name: spec.json_schema() for spec in fields.values()},
        "additionalProperties": True,
    }


def _ref(name: str) -> dict[str, str]:
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
    usage = _nullable(_ref("Usage")) if usage_nullable else _ref("Usage")
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


_SCHEMAS: dict[str, Any] = {
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
            "data": {"type": "array", "items": _ref("Model")},
        },
    },
    "Session": {
        "type": "object",
        "required": ["id", "object", "turns", "messages", "cached_tokens"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "session"},
            "turns": {"type": "integer", "minimum": 0},
            "messages": {"type": "array", "items": {"type": "object"}},
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

_ERROR_STATUSES: Mapping[str, str] = {
    "400": "Invalid request: the error names the offending parameter.",
    "401": "Missing or wrong API key (when the server has one).",
    "404": "Unknown model or session.",
    "409": "Another turn of this session is running.",
    "413": "The body is larger than the server accepts.",
    "500": "The model failed on this request.",
    "503": "Busy (with Retry-After), draining, or the engine is down.",
}


def _json(schema: Mapping[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: _json(_ref("Error"), _ERROR_STATUSES[s]) for s in statuses}


_GENERATION_ERRORS = ("400", "401", "404", "413", "500", "503")
_SSE_DESCRIPTION = (
    "With stream=true: server-sent events, one `data: <{}>` per chunk, an error object as "
    '`data: {{"error": ...}}` if generation fails mid-stream, then `data: [DONE]`. The schema '
    "describes one event, as OpenAPI 3.2's `itemSchema` does for `text/event-stream`."
)


def _sse_event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream: its ``data`` is a JSON ``chunk`` or error object,
    or ``[DONE]`` last. No ``event``, ``id`` or ``retry`` field is sent (the event type is
    SSE's default, ``message``)."""
    return {
        "type": "object",
        "description": _SSE_DESCRIPTION.format(chunk),
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "contentMediaType": "application/json",
                        "contentSchema": {"oneOf": [_ref(chunk), _ref("Error")]},
                    },
                ],
            },
            "event": {"const": "message"},
        },
        "additionalProperties": False,
    }


def _generation(
    summary: str,
    op_id: str,
    request: str,
    response: str,
    chunk: str,
    *,
    session: bool = False,
) -> dict[str, Any]:
    ok = _json(_ref(response), "The whole answer (stream false or absent).")
    ok["content"]["text/event-stream"] = {"schema": _sse_event(chunk)}
    operation: dict[str, Any] = {
        "summary": summary,
        "operationId": op_id,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {"200": ok, **_errors(*_GENERATION_ERRORS)},
    }
    if session:
        operation["parameters"] = [
            {
                "name": "X-Session-Id",
                "in": "header",
                "required": False,
                "description": "Continue a server-side session (same as body session_id).",
                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_SESSION_ID_LENGTH},
            }
        ]
        operation["responses"].update(_errors("409"))
    return operation


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string"},
    }


def _tokenizer_call(summary: str, operation: str, name: str, answer: str) -> dict[str, Any]:
    """A POST of ``{name}Request`` answered by ``{name}Response``."""
    return {
        "summary": summary,
        "operationId": operation,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(f"{name}Request")}},
        },
        "responses": {"200": _json(_ref(f"{name}Response"), answer)}
        | _errors("400", "401", "404", "413", "503"),
    }


def openapi_document() -> dict[str, Any]:
    """The whole document; a fresh dict each call (callers may serialize or mutate it)."""
    paths: dict[str, Any] = {
        "/v1/chat/completions": {
            "post": _generation(
                "Chat completion",
                "createChatCompletion",
                "ChatCompletionRequest",
                "ChatCompletion",
                "ChatCompletionChunk",
                session=True,
            )
        },
        "/v1/completions": {
            "post": _generation(
                "Text completion",
                "createCompletion",
                "CompletionRequest",
                "TextCompletion",
                "TextCompletion",  # OpenAI streams text_completion objects
            )
        },
        "/v1/models": {
            "get": {
                "summary": "The model this server serves",
                "operationId": "listModels",
                "responses": {
                    "200": _json(_ref("ModelList"), "One model."),
                    **_errors("401", "503"),
                },
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model",
                "operationId": "retrieveModel",
                "parameters": [_path_param("model_id", "The model's id.")],
                "responses": {"200": _json(_ref("Model"), "The model.")}
                | _errors("401", "404", "503"),
            }
        },
        "/v1/sessions/{session_id}": {
            "parameters": [_path_param("session_id", "The session's id.")],
            "get": {
                "summary": "A session's conversation",
                "operationId": "getSession",
                "responses": {"200": _json(_ref("Session"), "The session.")}
                | _errors("401", "404", "503"),
            },
            "delete": {
                "summary": "End a session",
                "operationId": "deleteSession",
                "responses": {"200": _json(_ref("SessionDeleted"), "Deleted.")}
                | _errors("401", "404", "409", "503"),
            },
        },
        "/tokenize": {
            "post": _tokenizer_call(
                "Token ids of a prompt or a conversation (as vLLM's)",
                "tokenize",
                "Tokenize",
                "The token ids.",
            )
        },
        "/detokenize": {
            "post": _tokenizer_call(
                "Text of token ids (as vLLM's)", "detokenize", "Detokenize", "The text."
            )
        },
        "/tokenizer_info": {
            "get": {
                "summary": "The served model's special tokens and chat template (as vLLM's)",
                "operationId": "tokenizerInfo",
                "responses": {"200": _json(_ref("TokenizerInfo"), "The tokenizer.")}
                | _errors("401", "503"),
            }
        },
        "/health": {
            "get": {
                "summary": "Whether the engine serves",
                "operationId": "health",
                "responses": {
                    "200": _json(_ref("Health"), "Serving."),
                    "503": _json(_ref("Health"), "Not serving (the error says why)."),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format 0.0.4.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "operationId": "openapi",
                "responses": {
                    "200": _json({"type": "object"}, "The OpenAPI document."),
                },
            }
        },
    }
    return copy.deepcopy(
        {
            "openapi": "3.1.0",
            "info": {
                "title": "furnace-trio",
                "version": __version__,
                "description": "An OpenAI-compatible LLM inference server on Trio.",
            },
            "paths": paths,
            "components": {
                "schemas": _SCHEMAS,
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            },
        }
    )
