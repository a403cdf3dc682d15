"""``POST /v1/responses`` bodies validated into :class:`ResponsesRequest`.

The request is checked against :data:`~furnace_trio.server.responses_schemas.RESPONSES_FIELDS`
(any other field is a 400 naming it), its input items become chat messages
(:mod:`~furnace_trio.server.responses_input`), and :meth:`ResponsesRequest.chat_request`
turns it into the :class:`~furnace_trio.server.chat_request.ChatRequest` the chat path
renders, constrains and generates: the Responses API is a different wire format over the
same generation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from furnace_trio.server.chat_request import (
    FUNCTION_NAME,
    ChatRequest,
    ResponseFormat,
    ToolChoice,
    check_json_schema,
)
from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import FieldBody, kind_of, parse_json_body, too_long
from furnace_trio.server.responses_input import InputItems, parse_input
from furnace_trio.server.responses_schemas import (
    MAX_METADATA,
    MAX_METADATA_KEY,
    MAX_METADATA_VALUE,
    RESPONSES_FIELDS,
)
from furnace_trio.server.sampling_options import SamplingOptions


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` body.

    ``input`` holds the items as the response's ``input_items`` list them and the chat
    messages they render as; ``tools`` are in the chat shape
    (``{"type": "function", "function": {...}}``) and ``published_tools`` in the Responses
    shape the response object echoes.
    """

    model: str | None
    input: InputItems
    instructions: str | None
    sampling: SamplingOptions
    stream: bool
    store: bool
    tools: tuple[Mapping[str, Any], ...] | None
    published_tools: tuple[Mapping[str, Any], ...]
    tool_choice: ToolChoice
    tool_function: str | None
    parallel_tool_calls: bool
    text_format: ResponseFormat | None
    published_format: Mapping[str, Any]
    metadata: Mapping[str, str]
    previous_response_id: str | None

    def chat_request(self, history: tuple[Mapping[str, Any], ...]) -> ChatRequest:
        """The chat request this response generates as: the instructions as a system
        message, then ``history`` (an earlier conversation, or the session turn's), which
        ends with this request's input."""
        messages = history
        if self.instructions is not None:
            system = MappingProxyType({"role": "system", "content": self.instructions})
            messages = (system, *history)
        return ChatRequest(
            model=self.model,
            messages=messages,
            sampling=self.sampling,
            stream=self.stream,
            tools=self.tools,
            tool_choice=self.tool_choice,
            tool_function=self.tool_function,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.text_format,
        )

    def published_tool_choice(self) -> str | dict[str, str]:
        if self.tool_choice == "function" and self.tool_function is not None:
            return {"type": "function", "name": self.tool_function}
        return self.tool_choice


def parse_responses_request(
    body: bytes, *, vocab_size: int, max_prompt_chars: int | None = None
) -> ResponsesRequest:
    """Validate a Responses body; raise a 400 :class:`APIError` naming the field.

    ``max_prompt_chars`` refuses input and instructions that cannot fit the context before
    anything renders them. ``vocab_size`` is unused (no field here names token ids); it is
    part of every generation parser's signature.
    """
    del vocab_size
    raw = parse_json_body(body)
    for name in raw:
        if name not in RESPONSES_FIELDS:
            raise invalid_request(
                f"{name} is not supported by this server's Responses API", name, "unsupported"
            )
    data = FieldBody(raw, RESPONSES_FIELDS)
    items = parse_input(data.raw("input"))
    instructions = data.get("instructions")
    if max_prompt_chars is not None:
        chars = items.chars + len(instructions or "")
        if chars > max_prompt_chars:
            raise too_long("input", chars, max_prompt_chars)
    tools, published_tools = _tools(data.raw("tools"))
    tool_choice, tool_function = _tool_choice(data.raw("tool_choice"), tools)
    text_format, published_format = _text_format(data.raw("text"))
    # background, include and truncation only accept the value that changes nothing; the
    # generic check of their published schema is all there is to do.
    _only(data, "background", False, "background responses are not supported")
    _only(data, "truncation", "disabled", "only truncation 'disabled' is supported")
    data.get("user")  # checked (a string of at most 256 characters), not used
    include = data.raw("include")
    if include is not None and include != []:
        raise invalid_request("include is not supported: no extra output data exists", "include")
    return ResponsesRequest(
        model=data.get("model") or None,
        input=items,
        instructions=instructions,
        sampling=SamplingOptions(
            max_tokens=data.get("max_output_tokens"),
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
            max_tokens_param="max_output_tokens",
        ),
        stream=data.get("stream"),
        store=data.get("store"),
        tools=tools,
        published_tools=published_tools,
        tool_choice=tool_choice,
        tool_function=tool_function,
        parallel_tool_calls=data.get("parallel_tool_calls"),
        text_format=text_format,
        published_format=published_format,
        metadata=_metadata(data.raw("metadata")),
        previous_response_id=data.get("previous_response_id"),
    )


def _only(data: FieldBody, name: str, allowed: object, message: str) -> None:
    value = data.raw(name)
    if value is not None and (value != allowed or type(value) is not type(allowed)):
        raise invalid_request(f"{message}; got {name} {value!r}", name, "unsupported")


def _tools(
    value: object,
) -> tuple[tuple[Mapping[str, Any], ...] | None, tuple[Mapping[str, Any], ...]]:
    """(tools in the chat shape or None, tools as the response echoes them)."""
    if value is None:
        return None, ()
    if not isinstance(value, list):
        raise invalid_request(f"tools must be an array, not {kind_of(value)}", "tools")
    chat: list[Mapping[str, Any]] = []
    published: list[Mapping[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"{where} must be an object, not {kind_of(tool)}", where)
        kind = tool.get("type")
        if kind != "function":
            raise invalid_request(
                f"{where}.type {kind!r} is not supported: this server offers function tools "
                "only (no built-in tools such as web_search or file_search)",
                f"{where}.type",
                "unsupported",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise invalid_request(
                f"{where}.name must be 1-64 letters, digits, '_' or '-'", f"{where}.name"
            )
        if name in seen:
            raise invalid_request(f"{where}.name {name!r} is a duplicate", f"{where}.name")
        seen.add(name)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_request(f"{where}.description must be a string", f"{where}.description")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_request(f"{where}.strict must be a boolean", f"{where}.strict")
        parameters = tool.get("parameters")
        if parameters is not None:
            parameters = check_json_schema(parameters, f"{where}.parameters")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        if parameters is not None:
            function["parameters"] = parameters
        chat.append(MappingProxyType({"type": "function", "function": function}))
        published.append(
            MappingProxyType(
                {
                    "type": "function",
                    "name": name,
                    "description": description,
                    "parameters": parameters,
                    "strict": True if strict is None else strict,
                }
            )
        )
    return tuple(chat) or None, tuple(published)


def _tool_choice(
    value: object, tools: tuple[Mapping[str, Any], ...] | None
) -> tuple[ToolChoice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise invalid_request("tool_choice 'required' needs tools", "tool_choice")
        return (value if tools else "none"), None  # type: ignore[return-value]  # checked
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise invalid_request("tool_choice.name must be a string", "tool_choice.name")
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise invalid_request(
                f"tool_choice names {name!r}, which is not one of the tools", "tool_choice.name"
            )
        return "function", name
    if isinstance(value, dict):
        raise invalid_request(
            f"tool_choice type {value.get('type')!r} is not supported: only function tools are",
            "tool_choice.type",
            "unsupported",
        )
    raise invalid_request(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
        "tool_choice",
    )


def _text_format(value: object) -> tuple[ResponseFormat | None, Mapping[str, Any]]:
    """(the grammar's format or None for plain text, the format as the response echoes it)."""
    plain: Mapping[str, Any] = MappingProxyType({"type": "text"})
    if value is None:
        return None, plain
    if not isinstance(value, dict):
        raise invalid_request(f"text must be an object, not {kind_of(value)}", "text")
    for key in value:
        if key != "format":
            raise invalid_request(f"text.{key} is not supported", f"text.{key}", "unsupported")
    if "format" not in value:
        return None, plain
    spec = value["format"]
    if not isinstance(spec, dict):
        raise invalid_request(f"text.format must be an object, not {kind_of(spec)}", "text.format")
    kind = spec.get("type")
    if kind == "text":
        return None, plain
    if kind == "json_object":
        return ResponseFormat("json_object"), MappingProxyType({"type": "json_object"})
    if kind != "json_schema":
        raise invalid_request(
            "text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type"
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid_request("text.format.name must be a string", "text.format.name")
    for key in ("description",):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise invalid_request(f"text.format.{key} must be a string", f"text.format.{key}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request("text.format.strict must be a boolean", "text.format.strict")
    if "schema" not in spec:
        raise invalid_request("text.format.schema is required for json_schema", "text.format")
    schema = check_json_schema(spec["schema"], "text.format.schema")
    published: dict[str, Any] = {
        "type": "json_schema",
        "name": name or "response",
        "schema": schema,
    }
    if spec.get("description") is not None:
        published["description"] = spec["description"]
    published["strict"] = bool(strict)
    return ResponseFormat("json_schema", schema, name), MappingProxyType(published)


def _metadata(value: object) -> Mapping[str, str]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, dict):
        raise invalid_request(f"metadata must be an object, not {kind_of(value)}", "metadata")
    if len(value) > MAX_METADATA:
        raise invalid_request(f"metadata may hold at most {MAX_METADATA} pairs", "metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid_request(
                f"metadata keys may have at most {MAX_METADATA_KEY} characters", "metadata"
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise invalid_request(
                f"metadata values must be strings of at most {MAX_METADATA_VALUE} characters",
                "metadata",
            )
    return MappingProxyType(dict(value))
