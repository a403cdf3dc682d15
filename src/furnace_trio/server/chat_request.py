"""``/v1/chat/completions`` bodies validated into :class:`ChatRequest`: the messages, the
sampling fields, tools and ``tool_choice``, ``response_format`` and ``session_id``.

Tool parameter schemas and ``response_format`` schemas are checked as JSON Schemas here
(:mod:`~furnace_trio.server.schema_check`, under one size budget for the request), so that
a bad or oversized one is a 400 naming it rather than a failure while compiling its grammar.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from furnace_trio.server.chat_messages import parse_messages
from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import (
    MISSING,
    FieldBody,
    check_sequences,
    kind_of,
    parse_json_body,
    parse_stream,
)
from furnace_trio.server.sampling_options import SamplingOptions, parse_sampling
from furnace_trio.server.schema_check import DEFAULT_MAX_SCHEMA_NODES, SchemaBudget, check_schema
from furnace_trio.server.schemas import CHAT_FIELDS


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` body.

    ``messages`` are plain dicts ready for the chat template: ``role`` is one of
    :data:`CHAT_ROLES` and ``content`` is a string (text parts joined) or ``None`` for an
    assistant turn that only carries ``tool_calls``.
    """

    model: str | None
    messages: tuple[Mapping[str, Any], ...]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: ToolChoice = "none"
    tool_function: str | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    session_id: str | None = None

    @property
    def tool_schemas(self) -> dict[str, Mapping[str, Any] | None]:
        """Function name -> parameters schema (``None`` when the tool gave none)."""
        return {t["function"]["name"]: t["function"].get("parameters") for t in self.tools or ()}


ToolChoice = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``response_format``: ``json_object`` (any JSON object) or ``json_schema``."""

    kind: Literal["json_object", "json_schema"]
    schema: Mapping[str, Any] | None = None
    name: str | None = None


def parse_chat_request(
    body: bytes,
    *,
    vocab_size: int,
    max_prompt_chars: int | None = None,
    max_schema_nodes: int = DEFAULT_MAX_SCHEMA_NODES,
    max_sequences: int | None = None,
) -> ChatRequest:
    """Validate a chat completions body; raise a 400 :class:`APIError` naming the field.

    ``max_prompt_chars`` (see :func:`max_prompt_chars`) refuses message text that cannot
    fit the context before anything renders or tokenizes it; ``max_schema_nodes`` bounds
    the tools' and ``response_format``'s schemas together; ``max_sequences`` bounds ``n``
    (``FURNACE_MAX_SEQUENCES_PER_REQUEST``).
    """
    data = FieldBody(parse_json_body(body), CHAT_FIELDS)
    messages = parse_messages(data.raw("messages"), max_prompt_chars)
    logprobs = data.get("logprobs")
    top_logprobs = data.get("top_logprobs")
    if top_logprobs and not logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens, max_tokens_param = data.get("max_completion_tokens"), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = data.get("max_tokens"), "max_tokens"
    budget = SchemaBudget(max_schema_nodes)
    tools = _tools(data.raw("tools"), budget)
    tool_choice, tool_function = _tool_choice(data.raw("tool_choice"), tools)
    parallel_tool_calls = data.get("parallel_tool_calls")
    response_format = _response_format(data.raw("response_format"), budget)
    check_sequences(data.get("n"), 1, max_sequences)
    stream, include_usage = parse_stream(data)
    return ChatRequest(
        model=data.get("model") or None,
        messages=messages,
        sampling=dataclasses.replace(
            parse_sampling(
                data,
                max_tokens=max_tokens,
                logprobs=top_logprobs if logprobs else None,
                vocab_size=vocab_size,
            ),
            max_tokens_param=max_tokens_param,
        ),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        tools=tools,
        tool_choice=tool_choice,
        tool_function=tool_function,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
        session_id=data.get("session_id"),
    )


FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_json_schema(
    schema: object, where: str, budget: SchemaBudget | None = None
) -> Mapping[str, Any]:
    """``schema`` if it is a valid JSON Schema object within ``budget`` (default: one of
    ``DEFAULT_MAX_SCHEMA_NODES`` values), else a 400 naming ``where``."""
    return check_schema(schema, where, budget or SchemaBudget(DEFAULT_MAX_SCHEMA_NODES))


def _tools(value: object, budget: SchemaBudget) -> tuple[Mapping[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid_request(f"tools must be an array, not {kind_of(value)}", "tools")
    seen: set[str] = set()
    tools: list[Mapping[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"{where} must be an object, not {kind_of(tool)}", where)
        if tool.get("type") != "function":
            raise invalid_request(f"{where}.type must be 'function'", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_request(f"{where}.function must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise invalid_request(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                f"{where}.function.name",
            )
        if name in seen:
            raise invalid_request(
                f"{where}.function.name {name!r} is a duplicate", f"{where}.function.name"
            )
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_request(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        clean: dict[str, Any] = {"name": name}
        if description is not None:
            clean["description"] = description
        parameters = function.get("parameters")
        if parameters is not None:
            clean["parameters"] = check_schema(parameters, f"{where}.function.parameters", budget)
        tools.append(MappingProxyType({"type": "function", "function": clean}))
    return tuple(tools) or None


def _tool_choice(
    value: object, tools: tuple[Mapping[str, Any], ...] | None
) -> tuple[ToolChoice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise invalid_request(f"tool_choice {value!r} needs tools", "tool_choice")
        return value, None  # type: ignore[return-value]  # checked just above
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid_request(
                "tool_choice.function.name must be a string", "tool_choice.function.name"
            )
        names = {t["function"]["name"] for t in tools or ()}
        if name not in names:
            raise invalid_request(
                f"tool_choice names {name!r}, which is not one of the tools",
                "tool_choice.function.name",
            )
        return "function", name
    raise invalid_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _response_format(value: object, budget: SchemaBudget) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request(
            f"response_format must be an object, not {kind_of(value)}", "response_format"
        )
    kind = value.get("type")
    spec = value.get("json_schema", MISSING)
    if spec is not MISSING and not isinstance(spec, dict):
        raise invalid_request(
            "response_format.json_schema must be an object", "response_format.json_schema"
        )
    if isinstance(spec, dict):
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid_request(
                "response_format.json_schema.name must be a string",
                "response_format.json_schema.name",
            )
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise invalid_request(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format.json_schema.schema",
            )
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise invalid_request(
                "response_format.json_schema must be an object", "response_format.json_schema"
            )
        if schema is None:
            return ResponseFormat("json_object", name=name)
        return ResponseFormat(
            "json_schema",
            check_schema(schema, "response_format.json_schema.schema", budget),
            name,
        )
    raise invalid_request(
        "response_format.type must be 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )
