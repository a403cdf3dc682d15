"""The OpenAPI 3.1 document served at ``/openapi.json``: its paths, their operations and
error responses, around the component schemas of :mod:`furnace_trio.server.openapi_schemas`.

Request bodies are generated from the field tables in :mod:`furnace_trio.server.schemas`, the same
declarations the validators read through, so the document cannot drift from them.
``tests/server/test_openapi.py`` checks real responses against the document and the
schemathesis fuzz run (``nox -s fuzz``) does so for generated requests.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from furnace_trio import __version__
from furnace_trio.server.openapi_schemas import SCHEMAS, ref
from furnace_trio.server.reload import RELOAD_SCHEMA
from furnace_trio.server.responses_openapi import stream_event_schema
from furnace_trio.server.responses_schemas import MAX_LIST_LIMIT
from furnace_trio.server.schemas import MAX_SESSION_ID_LENGTH

_ERROR_STATUSES: Mapping[str, str] = {
    "400": "Invalid request: the error names the offending parameter.",
    "401": "Missing or wrong API key (when the server has one).",
    "404": "Unknown model, session or response.",
    "409": "Another turn of this session (or continuation of this response) is running.",
    "413": "The body is larger than the server accepts.",
    "415": "The body is not sent as application/json.",
    "429": "The API key's max_concurrent requests are in flight (with Retry-After).",
    "500": "The model failed on this request.",
    "503": "Busy (with Retry-After), draining, or the engine is down.",
}


def _json(schema: Mapping[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _html(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/html": {"schema": {"type": "string"}}}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: _json(ref("Error"), _ERROR_STATUSES[s]) for s in statuses}


_GENERATION_ERRORS = ("400", "401", "404", "413", "415", "429", "500", "503")
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
                        "contentSchema": {"oneOf": [ref(chunk), ref("Error")]},
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
    ok = _json(ref(response), "The whole answer (stream false or absent).")
    ok["content"]["text/event-stream"] = {"schema": _sse_event(chunk)}
    operation: dict[str, Any] = {
        "summary": summary,
        "operationId": op_id,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref(request)}},
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


def _query_param(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema,
    }


def _create_response() -> dict[str, Any]:
    ok = _json(ref("Response"), "The whole response (stream false or absent).")
    ok["content"]["text/event-stream"] = {"schema": stream_event_schema()}
    return {
        "summary": "Create a response (OpenAI's Responses API)",
        "operationId": "createResponse",
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref("ResponseRequest")}},
        },
        "responses": {"200": ok, **_errors(*_GENERATION_ERRORS, "409")},
    }


def _tokenizer_call(summary: str, operation: str, name: str, answer: str) -> dict[str, Any]:
    """A POST of ``{name}Request`` answered by ``{name}Response``."""
    return {
        "summary": summary,
        "operationId": operation,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref(f"{name}Request")}},
        },
        "responses": {"200": _json(ref(f"{name}Response"), answer)}
        | _errors("400", "401", "404", "413", "415", "503"),
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
        "/v1/responses": {"post": _create_response()},
        "/v1/responses/{response_id}": {
            "parameters": [_path_param("response_id", "The response's id.")],
            "get": {
                "summary": "A stored response",
                "operationId": "getResponse",
                "responses": {"200": _json(ref("Response"), "The response.")}
                | _errors("401", "404", "503"),
            },
            "delete": {
                "summary": "Delete a stored response (its conversation's KV goes with the last)",
                "operationId": "deleteResponse",
                "responses": {"200": _json(ref("ResponseDeleted"), "Deleted.")}
                | _errors("401", "404", "503"),
            },
        },
        "/v1/responses/{response_id}/input_items": {
            "get": {
                "summary": "The input items of a stored response",
                "operationId": "listResponseInputItems",
                "parameters": [
                    _path_param("response_id", "The response's id."),
                    _query_param(
                        "limit",
                        {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT, "default": 20},
                        "Most items in the page.",
                    ),
                    _query_param(
                        "order",
                        {"enum": ["asc", "desc"], "default": "desc"},
                        "asc: oldest first; desc: newest first.",
                    ),
                    _query_param("after", {"type": "string"}, "List the items after this id."),
                ],
                "responses": {"200": _json(ref("ResponseItemList"), "One page of items.")}
                | _errors("400", "401", "404", "503"),
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The model this server serves",
                "operationId": "listModels",
                "responses": {
                    "200": _json(ref("ModelList"), "One model."),
                    **_errors("401", "503"),
                },
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model",
                "operationId": "retrieveModel",
                "parameters": [_path_param("model_id", "The model's id.")],
                "responses": {"200": _json(ref("Model"), "The model.")}
                | _errors("401", "404", "503"),
            }
        },
        "/v1/sessions/{session_id}": {
            "parameters": [_path_param("session_id", "The session's id.")],
            "get": {
                "summary": "A session's conversation",
                "operationId": "getSession",
                "responses": {"200": _json(ref("Session"), "The session.")}
                | _errors("401", "404", "503"),
            },
            "delete": {
                "summary": "End a session",
                "operationId": "deleteSession",
                "responses": {"200": _json(ref("SessionDeleted"), "Deleted.")}
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
                "responses": {"200": _json(ref("TokenizerInfo"), "The tokenizer.")}
                | _errors("401", "503"),
            }
        },
        "/health": {
            "get": {
                "summary": "Whether the engine serves",
                "operationId": "health",
                "responses": {
                    "200": _json(ref("Health"), "Serving."),
                    "503": _json(ref("Health"), "Not serving (the error says why)."),
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
        "/status": {
            "get": {
                "summary": "Every request in flight and the engine's KV and step rate, now",
                "operationId": "status",
                "description": "Behind FURNACE_ADMIN_KEY when set, else the API key.",
                "responses": {"200": _json(ref("Status"), "The status.")} | _errors("401", "503"),
            }
        },
        "/admin/reload": {
            "post": {
                "summary": "Read the configuration again and apply what can change live",
                "operationId": "reloadConfig",
                "description": "Behind FURNACE_ADMIN_KEY when set, else the API keys. "
                "See docs/operations-config.md.",
                "responses": {"200": _json(RELOAD_SCHEMA, "Reloaded.")}
                | _errors("400", "401", "415"),
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
        "/docs": {
            "get": {
                "summary": "This API's reference as an HTML page, rendered from this document",
                "operationId": "apiDocs",
                "responses": {"200": _html("The page (no script, nothing from another origin).")},
            }
        },
        "/static/{name}": {
            "get": {
                "summary": "A file of the chat page (chat.js, chat.css, favicon.svg)",
                "operationId": "chatPageFile",
                "parameters": [_path_param("name", "The file's name.")],
                "responses": {
                    "200": {
                        "description": "The file.",
                        "content": {"*/*": {"schema": {"type": "string"}}},
                    },
                    **_errors("404"),
                },
            }
        },
        "/": {
            "get": {
                "summary": "The chat page (HTML; its files are under /static/)",
                "operationId": "chatPage",
                "responses": {
                    "200": _html("The page, with a Content-Security-Policy of this origin only.")
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
                "schemas": SCHEMAS,
                "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            },
        }
    )
