"""I/O-free parsing and validation of OpenAI request bodies.

Input is the raw body bytes; output is a frozen request record or an
:class:`~furnace_trio.errors.APIError` (400, naming the parameter). Nothing here touches a
socket, the tokenizer or the engine, so every rule is testable in microseconds.

Rules that keep the server safe from surprising input:

- JSON is decoded from bytes by us (invalid UTF-8 and invalid JSON are 400s, whatever the
  content type says); the body must be an object.
- ``bool`` is never accepted where a number is expected (``True`` is an ``int`` in Python).
- Unknown fields are ignored, as OpenAI does; known fields are checked strictly, and
  ``null`` means "not given".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import jsonschema

from .errors import APIError, invalid_request
from .params import SamplingParams

MAX_N = 16
MAX_STOP_SEQUENCES = 16
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_SEED_LIMIT = 2**63

_MISSING: Any = object()


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a request body as a JSON object, or raise a 400 :class:`APIError`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"request body is not valid UTF-8: {exc.reason}") from None
    if not text.strip():
        raise invalid_request("request body is empty; expected a JSON object")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise invalid_request(f"request body must be a JSON object, not {_kind(value)}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Sampling fields common to both endpoints; ``max_tokens`` is resolved later.

    ``max_tokens is None`` means the client gave none: the handler picks a default once
    the prompt length is known (the rest of the context for chat, 16 for completions).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def to_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters with ``max_tokens`` resolved."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            logprobs=self.logprobs,
            n=self.n,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
        )


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


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body: ``prompt`` is text or token ids, never empty."""

    model: str | None
    prompt: str | tuple[int, ...]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None


def parse_chat_request(body: bytes, *, vocab_size: int) -> ChatRequest:
    """Validate a chat completions body; raise a 400 :class:`APIError` naming the field."""
    data = parse_json_body(body)
    messages = _messages(data.get("messages", _MISSING))
    logprobs = _bool(data, "logprobs", False)
    top_logprobs = _int(data, "top_logprobs", 0, low=0, high=MAX_CHAT_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = _int(data, "max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = _int(data, "max_tokens", None, low=1)
    tools = _tools(data.get("tools"))
    tool_choice, tool_function = _tool_choice(data.get("tool_choice"), tools)
    parallel_tool_calls = _bool(data, "parallel_tool_calls", True)
    response_format = _response_format(data.get("response_format"))
    stream, include_usage = _stream(data)
    return ChatRequest(
        model=_model(data),
        messages=messages,
        sampling=_sampling(
            data,
            max_tokens=max_tokens,
            logprobs=top_logprobs if logprobs else None,
            vocab_size=vocab_size,
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
    )


def parse_completion_request(body: bytes, *, vocab_size: int) -> CompletionRequest:
    """Validate a (legacy) completions body; raise a 400 :class:`APIError` naming the field."""
    data = parse_json_body(body)
    prompt = _prompt(data.get("prompt", _MISSING), vocab_size)
    logprobs = _int(data, "logprobs", None, low=0, high=MAX_COMPLETION_LOGPROBS)
    if _bool(data, "echo", False):
        raise invalid_request("echo is not supported", "echo")
    best_of = _int(data, "best_of", None, low=1)
    if best_of is not None and best_of != _int(data, "n", 1, low=1):
        raise invalid_request("best_of is not supported (it must equal n)", "best_of")
    if data.get("suffix") not in (None, ""):
        raise invalid_request("suffix is not supported", "suffix")
    stream, include_usage = _stream(data)
    return CompletionRequest(
        model=_model(data),
        prompt=prompt,
        sampling=_sampling(
            data,
            max_tokens=_int(data, "max_tokens", None, low=1),
            logprobs=logprobs,
            vocab_size=vocab_size,
        ),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
    )


def resolve_max_tokens(
    requested: int | None, *, prompt_tokens: int, max_context: int, default: int | None
) -> int:
    """Check the prompt fits the context and choose ``max_tokens``.

    A prompt that leaves no room for one generated token is a 400
    (``context_length_exceeded``). A ``max_tokens`` beyond the context is clamped to what is
    left, so generation ends with ``finish_reason == "length"`` at the context limit rather
    than failing a request that asked for "a lot". ``default is None`` means "as much as
    the context allows".
    """
    room = max_context - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens; the prompt has "
            f"{prompt_tokens} tokens, leaving no room to generate. Shorten the prompt.",
            param="messages" if default is None else "prompt",
            code="context_length_exceeded",
        )
    wanted = requested if requested is not None else default
    return room if wanted is None else min(wanted, room)


# --- field helpers -------------------------------------------------------------------------


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _model(data: Mapping[str, Any]) -> str | None:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_request(f"model must be a string, not {_kind(model)}", "model")
    return model or None


def _bool(data: Mapping[str, Any], name: str, default: bool) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"{name} must be a boolean, not {_kind(value)}", name)
    return value


def _int(
    data: Mapping[str, Any],
    name: str,
    default: Any,
    *,
    low: int | None = None,
    high: int | None = None,
) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"{name} must be an integer, not {_kind(value)}", name)
    _check_range(name, value, low, high)
    return value


def _float(
    data: Mapping[str, Any],
    name: str,
    default: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_request(f"{name} must be a number, not {_kind(value)}", name)
    number = float(value)
    if not math.isfinite(number):
        raise invalid_request(f"{name} must be finite", name)
    if low_open and low is not None and number <= low:
        raise invalid_request(f"{name} must be greater than {low}, got {number}", name)
    _check_range(name, number, None if low_open else low, high)
    return number


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            bounds = f"between {low} and {high}"
        elif low is not None:
            bounds = f"at least {low}"
        else:
            bounds = f"at most {high}"
        raise invalid_request(f"{name} must be {bounds}, got {value}", name)


def _stream(data: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _bool(data, "stream", False)
    options = data.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid_request(
            f"stream_options must be an object, not {_kind(options)}", "stream_options"
        )
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid_request(
            "stream_options.include_usage must be a boolean", "stream_options.include_usage"
        )
    return stream, bool(include_usage) and stream


def _sampling(
    data: Mapping[str, Any], *, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingOptions:
    top_k = _int(data, "top_k", None)
    if top_k is not None and top_k < -1:
        raise invalid_request(f"top_k must be -1 (disabled) or at least 1, got {top_k}", "top_k")
    seed = _int(data, "seed", None, low=-_SEED_LIMIT, high=_SEED_LIMIT - 1)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=_float(data, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_float(data, "top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=top_k if top_k is not None and top_k > 0 else None,
        min_p=_float(data, "min_p", 0.0, low=0.0, high=1.0),
        presence_penalty=_float(data, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=_float(data, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=_float(
            data, "repetition_penalty", 1.0, low=0.0, high=2.0, low_open=True
        ),
        logit_bias=_logit_bias(data.get("logit_bias"), vocab_size),
        seed=seed,
        logprobs=logprobs,
        n=_int(data, "n", 1, low=1, high=MAX_N),
        stop=_stop(data.get("stop")),
        ignore_eos=_bool(data, "ignore_eos", False),
    )


def _logit_bias(value: object, vocab_size: int) -> Mapping[int, float]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, dict):
        raise invalid_request(f"logit_bias must be an object, not {_kind(value)}", "logit_bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid_request(
                f"logit_bias keys must be token ids as strings, got {key!r}", "logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                "logit_bias",
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise invalid_request(
                f"logit_bias values must be numbers, not {_kind(amount)}", "logit_bias"
            )
        if not -100 <= amount <= 100:
            raise invalid_request(
                f"logit_bias values must be between -100 and 100, got {amount}", "logit_bias"
            )
        bias[token_id] = float(amount)
    return MappingProxyType(bias)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise invalid_request(
            f"stop must be a string or a list of strings, not {_kind(value)}", "stop"
        )
    if len(value) > MAX_STOP_SEQUENCES:
        raise invalid_request(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences", "stop")
    stops: list[str] = []
    for item in value:
        if not isinstance(item, str):
            raise invalid_request(f"stop sequences must be strings, not {_kind(item)}", "stop")
        if item and item not in stops:
            stops.append(item)
    return tuple(stops)


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _check_schema(schema: object, where: str) -> Mapping[str, Any]:
    if not isinstance(schema, dict):
        raise invalid_request(f"{where} must be a JSON schema object, not {_kind(schema)}", where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise invalid_request(f"{where} is not a valid JSON schema: {exc.message}", where) from None
    return schema


def _tools(value: object) -> tuple[Mapping[str, Any], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid_request(f"tools must be an array, not {_kind(value)}", "tools")
    seen: set[str] = set()
    tools: list[Mapping[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"{where} must be an object, not {_kind(tool)}", where)
        if tool.get("type") != "function":
            raise invalid_request(f"{where}.type must be 'function'", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_request(f"{where}.function must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
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
            clean["parameters"] = _check_schema(parameters, f"{where}.function.parameters")
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


def _response_format(value: object) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_request(
            f"response_format must be an object, not {_kind(value)}", "response_format"
        )
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid_request(
                "response_format.json_schema must be an object", "response_format.json_schema"
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid_request(
                "response_format.json_schema.name must be a string",
                "response_format.json_schema.name",
            )
        schema = spec.get("schema")
        if schema is None:
            return ResponseFormat("json_object", name=name)
        return ResponseFormat(
            "json_schema",
            _check_schema(schema, "response_format.json_schema.schema"),
            name,
        )
    raise invalid_request(
        "response_format.type must be 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_request(f"{where} must be an array", where)
    calls: list[dict[str, Any]] = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise invalid_request(f"{at} must be an object", at)
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid_request(f"{at} must be a function call with a function object", at)
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise invalid_request(f"{at}.function.name must be a string", f"{at}.function.name")
        if not isinstance(arguments, str):
            raise invalid_request(
                f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments"
            )
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid_request(f"{at}.id must be a string", f"{at}.id")
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return calls


def _messages(value: object) -> tuple[Mapping[str, Any], ...]:
    if value is _MISSING or value is None:
        raise invalid_request("messages is required", "messages")
    if not isinstance(value, list):
        raise invalid_request(f"messages must be an array, not {_kind(value)}", "messages")
    if not value:
        raise invalid_request("messages must not be empty", "messages")
    return tuple(_message(item, f"messages[{i}]") for i, item in enumerate(value))


def _message(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise invalid_request(f"{where} must be an object, not {_kind(value)}", where)
    role = value.get("role")
    if not isinstance(role, str):
        raise invalid_request(f"{where}.role is required and must be a string", f"{where}.role")
    if role not in CHAT_ROLES:
        raise invalid_request(
            f"{where}.role {role!r} is not one of {', '.join(sorted(CHAT_ROLES))}",
            f"{where}.role",
        )
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    tool_calls = value.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid_request(
                f"{where}.tool_calls must be a list on an assistant message", f"{where}.tool_calls"
            )
        message["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
    content = value.get("content", _MISSING)
    if content is _MISSING or content is None:
        if tool_calls is None:
            raise invalid_request(f"{where}.content is required", f"{where}.content")
        message["content"] = None
    else:
        message["content"] = _content(content, f"{where}.content")
    for key in ("name", "tool_call_id"):
        extra = value.get(key)
        if extra is not None:
            if not isinstance(extra, str):
                raise invalid_request(f"{where}.{key} must be a string", f"{where}.{key}")
            message[key] = extra
    if role == "tool" and "tool_call_id" not in message:
        raise invalid_request(f"{where}.tool_call_id is required on a tool message", where)
    return MappingProxyType(message)


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid_request(
            f"{where} must be a string or a list of content parts, not {_kind(value)}", where
        )
    texts: list[str] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise invalid_request(f"{where}[{i}] must be an object", f"{where}[{i}]")
        kind = part.get("type")
        if kind != "text":
            raise invalid_request(
                f"{where}[{i}].type {kind!r} is not supported; only text parts are",
                f"{where}[{i}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_request(f"{where}[{i}].text must be a string", f"{where}[{i}].text")
        texts.append(text)
    return "".join(texts)


def _prompt(value: object, vocab_size: int) -> str | tuple[int, ...]:
    if value is _MISSING or value is None:
        raise invalid_request("prompt is required", "prompt")
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise invalid_request(
            "prompt must be a string, a list of one string, or a non-empty list of token ids",
            "prompt",
        )
    if len(value) == 1 and isinstance(value[0], str | list):
        return _prompt(value[0], vocab_size)
    if all(isinstance(item, str) for item in value):
        raise invalid_request("only one prompt per request is supported", "prompt")
    if all(isinstance(item, list) for item in value):
        raise invalid_request("only one prompt per request is supported", "prompt")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise invalid_request(f"prompt token ids must be integers, not {_kind(item)}", "prompt")
        if not 0 <= item < vocab_size:
            raise invalid_request(
                f"prompt token id {item} is outside the vocabulary (0..{vocab_size - 1})",
                "prompt",
            )
    return tuple(value)
