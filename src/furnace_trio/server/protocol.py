"""I/O-free parsing and validation of OpenAI request bodies.

Input is the raw body bytes; output is a frozen request record or an
:class:`~furnace_trio.server.errors.APIError` (400, naming the parameter). Nothing here touches a
socket, the tokenizer or the engine, so every rule is testable in microseconds.

Rules that keep the server safe from surprising input:

- JSON is decoded from bytes by us (invalid UTF-8 and invalid JSON are 400s, whatever the
  content type says); the body must be an object.
- ``bool`` is never accepted where a number is expected (``True`` is an ``int`` in Python).
- Unknown fields are ignored, as OpenAI does; known fields are checked strictly, and
  ``null`` means "not given".
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import jsonschema

from furnace_trio.core.params import SamplingParams
from furnace_trio.server.errors import APIError, invalid_request
from furnace_trio.server.schemas import (
    CHAT_FIELDS,
    CHAT_ROLES,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    MAX_CHARS_PER_TOKEN,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    TOKENIZE_FIELDS,
    FieldSpec,
)

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "ResponseFormat",
    "SamplingOptions",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_body",
    "resolve_max_tokens",
]

_MISSING: Any = object()
_TOKEN_ID_KEY = re.compile(r"^[0-9]{1,10}$")


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a request body as a JSON object, or raise a 400 :class:`APIError`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"request body is not valid UTF-8: {exc.reason}") from None
    if not text.strip():
        raise invalid_request("request body is empty; expected a JSON object")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise invalid_request(f"request body must be a JSON object, not {_kind(value)}")
    if _depth(value) > MAX_JSON_DEPTH:
        raise invalid_request(
            f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        )
    return value


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and neither do we.
    raise invalid_request(f"request body is not valid JSON: {name} is not a JSON value")


def _depth(value: object) -> int:
    """Nesting depth of decoded JSON, iteratively (a recursive walk could itself overflow)."""
    deepest = 0
    pending: list[tuple[object, int]] = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        pending.extend((child, level + 1) for child in items)
    return deepest


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
    #: The field ``max_tokens`` came from, named by a ``context_length_exceeded`` error.
    max_tokens_param: str = "max_tokens"

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


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body: ``prompts`` holds one or more prompts (up to
    ``MAX_PROMPTS``), each text or token ids, never an empty list of ids."""

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingOptions
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False


class _Body:
    """A decoded body read only through its field table.

    Reading a field that the table does not declare is a ``KeyError`` (a bug here, not a bad
    request): so every field the validator looks at is one the OpenAPI document publishes.
    Scalar fields are checked generically from their :class:`FieldSpec`.
    """

    __slots__ = ("data", "fields")

    def __init__(self, data: Mapping[str, Any], fields: Mapping[str, FieldSpec]) -> None:
        self.data = data
        self.fields = fields

    def raw(self, name: str) -> Any:
        """The value as sent (``None`` when absent or ``null``), for structured fields."""
        if name not in self.fields:
            raise KeyError(f"{name} is not a declared request field")
        return self.data.get(name)

    def get(self, name: str) -> Any:
        """A scalar field, type- and range-checked, or its default when absent/``null``."""
        spec = self.fields[name]
        value = self.raw(name)
        if value is None:
            return spec.default
        if spec.type == "boolean":
            return _check_bool(name, value)
        if spec.type == "integer":
            return _check_int(name, value, spec.low, spec.high)
        if spec.type == "number":
            return _check_float(name, value, spec.low, spec.high, spec.low_open)
        if spec.type == "string":
            return _check_str(name, value, spec.low, spec.high)
        raise KeyError(f"{name} is structured; read it with raw()")


def parse_chat_request(
    body: bytes, *, vocab_size: int, max_prompt_chars: int | None = None
) -> ChatRequest:
    """Validate a chat completions body; raise a 400 :class:`APIError` naming the field.

    ``max_prompt_chars`` (see :func:`max_prompt_chars`) refuses message text that cannot
    fit the context before anything renders or tokenizes it.
    """
    data = _Body(parse_json_body(body), CHAT_FIELDS)
    messages = _messages(data.raw("messages"), max_prompt_chars)
    logprobs = data.get("logprobs")
    top_logprobs = data.get("top_logprobs")
    if top_logprobs and not logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens, max_tokens_param = data.get("max_completion_tokens"), "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = data.get("max_tokens"), "max_tokens"
    tools = _tools(data.raw("tools"))
    tool_choice, tool_function = _tool_choice(data.raw("tool_choice"), tools)
    parallel_tool_calls = data.get("parallel_tool_calls")
    response_format = _response_format(data.raw("response_format"))
    stream, include_usage = _stream(data)
    return ChatRequest(
        model=data.get("model") or None,
        messages=messages,
        sampling=dataclasses.replace(
            _sampling(
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


def parse_completion_request(
    body: bytes, *, vocab_size: int, max_prompt_chars: int | None = None
) -> CompletionRequest:
    """Validate a (legacy) completions body; raise a 400 :class:`APIError` naming the field."""
    data = _Body(parse_json_body(body), COMPLETION_FIELDS)
    prompts = _prompts(data.raw("prompt"), vocab_size)
    for prompt in prompts:
        if (
            isinstance(prompt, str)
            and max_prompt_chars is not None
            and len(prompt) > max_prompt_chars
        ):
            raise _too_long("prompt", len(prompt), max_prompt_chars)
    logprobs = data.get("logprobs")
    echo = data.get("echo")
    if data.get("max_tokens") == 0 and not echo:
        raise invalid_request(
            "max_tokens 0 generates nothing: it is for echo, which returns the prompt alone",
            "max_tokens",
        )
    best_of = data.get("best_of")
    if best_of is not None and best_of != data.get("n"):
        raise invalid_request("best_of is not supported (it must equal n)", "best_of")
    if data.raw("suffix") not in (None, ""):
        raise invalid_request("suffix is not supported", "suffix")
    stream, include_usage = _stream(data)
    return CompletionRequest(
        model=data.get("model") or None,
        prompts=prompts,
        sampling=_sampling(
            data,
            max_tokens=data.get("max_tokens"),
            logprobs=logprobs,
            vocab_size=vocab_size,
        ),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
    )


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    model: str | None
    prompt: str | None
    messages: tuple[Mapping[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize_request(body: bytes, *, max_prompt_chars: int | None = None) -> TokenizeRequest:
    """Validate a ``/tokenize`` body (vLLM's: a prompt, or chat messages)."""
    data = _Body(parse_json_body(body), TOKENIZE_FIELDS)
    prompt = data.get("prompt")
    raw_messages = data.raw("messages")
    if (prompt is None) == (raw_messages is None):
        raise invalid_request("give exactly one of prompt and messages", "prompt")
    messages = None
    if raw_messages is not None:
        messages = _messages(raw_messages, max_prompt_chars)
    elif max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        raise _too_long("prompt", len(prompt), max_prompt_chars)
    add_special_tokens = data.get("add_special_tokens")
    return TokenizeRequest(
        model=data.get("model") or None,
        prompt=prompt,
        messages=messages,
        add_special_tokens=messages is None if add_special_tokens is None else add_special_tokens,
        add_generation_prompt=data.get("add_generation_prompt"),
        return_token_strs=data.get("return_token_strs"),
    )


def parse_detokenize_request(body: bytes, *, vocab_size: int) -> tuple[str | None, tuple[int, ...]]:
    """Validate a ``/detokenize`` body: (model, token ids)."""
    data = _Body(parse_json_body(body), DETOKENIZE_FIELDS)
    tokens = data.raw("tokens")
    if tokens is None:
        raise invalid_request("tokens is required", "tokens")
    if not isinstance(tokens, list):
        raise invalid_request("tokens must be a list of token ids", "tokens")
    ids = _token_ids(tokens, vocab_size, "tokens", "tokens") if tokens else ()
    return data.get("model") or None, ids


def max_prompt_chars(max_context: int) -> int:
    """The most prompt characters worth rendering for a context of ``max_context`` tokens."""
    return max_context * MAX_CHARS_PER_TOKEN


def _too_long(param: str, chars: int, limit: int) -> APIError:
    return APIError(
        400,
        f"The {param} hold {chars} characters; this model's context cannot hold more than "
        f"{limit} ({MAX_CHARS_PER_TOKEN} characters per token at most). Shorten the {param}.",
        param=param,
        code="context_length_exceeded",
    )


def resolve_max_tokens(
    requested: int | None,
    *,
    prompt_tokens: int,
    max_context: int,
    default: int | None,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> int:
    """Check the prompt fits the context and choose ``max_tokens``.

    A prompt that leaves no room for one generated token is a 400
    (``context_length_exceeded``, naming the prompt), and so is a ``requested`` count that
    does not fit beside the prompt (naming ``max_tokens``), as OpenAI and vLLM answer: a
    silent clamp would hide from the client that it asked for more than the model can do.
    Without a request, ``default`` is clamped to the room left; ``default is None`` means
    "as much as the context allows".
    """
    room = max_context - prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens; the prompt has "
            f"{prompt_tokens} tokens, leaving no room to generate. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is not None:
        if requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {max_context} tokens; the prompt has "
                f"{prompt_tokens} tokens and {max_tokens_param} asks for {requested} more. "
                f"Ask for at most {room}, or shorten the prompt.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        return requested
    return room if default is None else min(default, room)


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


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid_request(f"{name} must be a boolean, not {_kind(value)}", name)
    return value


def _check_str(name: str, value: object, low: float | None, high: float | None) -> str:
    if not isinstance(value, str):
        raise invalid_request(f"{name} must be a string, not {_kind(value)}", name)
    if (low is not None and len(value) < low) or (high is not None and len(value) > high):
        raise invalid_request(f"{name} must have {low or 0} to {high} characters", name)
    return value


def _check_int(name: str, value: object, low: float | None, high: float | None) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"{name} must be an integer, not {_kind(value)}", name)
    _check_range(name, value, low, high)
    return value


def _check_float(
    name: str, value: object, low: float | None, high: float | None, low_open: bool
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_request(f"{name} must be a number, not {_kind(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
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


def _stream(data: _Body) -> tuple[bool, bool]:
    stream: bool = data.get("stream")
    options = data.raw("stream_options")
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
    data: _Body, *, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingOptions:
    top_k = data.get("top_k")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        top_k=top_k if top_k is not None and top_k > 0 else None,
        min_p=data.get("min_p"),
        presence_penalty=data.get("presence_penalty"),
        frequency_penalty=data.get("frequency_penalty"),
        repetition_penalty=data.get("repetition_penalty"),
        logit_bias=_logit_bias(data.raw("logit_bias"), vocab_size),
        seed=data.get("seed"),
        logprobs=logprobs,
        n=data.get("n"),
        stop=_stop(data.raw("stop")),
        ignore_eos=data.get("ignore_eos"),
    )


def _logit_bias(value: object, vocab_size: int) -> Mapping[int, float]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, dict):
        raise invalid_request(f"logit_bias must be an object, not {_kind(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid_request(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
            "logit_bias",
        )
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if not _TOKEN_ID_KEY.match(key):
            raise invalid_request(
                f"logit_bias keys must be token ids as strings, got {key[:32]!r}", "logit_bias"
            )
        token_id = int(key)
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
        if len(item) > MAX_STOP_LENGTH:
            raise invalid_request(
                f"stop sequences may have at most {MAX_STOP_LENGTH} characters, got {len(item)}",
                "stop",
            )
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
    spec = value.get("json_schema", _MISSING)
    if spec is not _MISSING and not isinstance(spec, dict):
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


def _messages(value: object, max_chars: int | None) -> tuple[Mapping[str, Any], ...]:
    if value is _MISSING or value is None:
        raise invalid_request("messages is required", "messages")
    if not isinstance(value, list):
        raise invalid_request(f"messages must be an array, not {_kind(value)}", "messages")
    if not value:
        raise invalid_request("messages must not be empty", "messages")
    if len(value) > MAX_MESSAGES:
        raise invalid_request(
            f"messages may hold at most {MAX_MESSAGES} messages, got {len(value)}", "messages"
        )
    messages = tuple(_message(item, f"messages[{i}]") for i, item in enumerate(value))
    if max_chars is not None:
        chars = sum(len(m["content"] or "") for m in messages)
        if chars > max_chars:
            raise _too_long("messages", chars, max_chars)
    return messages


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


def _prompts(value: object, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    """The prompts of a completions body: a string, a list of strings, token ids, or a list
    of lists of token ids (OpenAI's four forms)."""
    if value is _MISSING or value is None:
        raise invalid_request("prompt is required", "prompt")
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise invalid_request(
            "prompt must be a string, a list of strings, a non-empty list of token ids, or "
            "a list of such lists",
            "prompt",
        )
    strings = all(isinstance(item, str) for item in value)
    lists = not strings and all(isinstance(item, list) for item in value)
    if not (strings or lists):
        return (_token_ids(value, vocab_size, "prompt"),)
    if len(value) > MAX_PROMPTS:
        raise invalid_request(
            f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request", "prompt"
        )
    if strings:
        return tuple(value)
    return tuple(_token_ids(item, vocab_size, f"prompt[{i}]") for i, item in enumerate(value))


def _token_ids(
    value: list[Any], vocab_size: int, where: str, param: str = "prompt"
) -> tuple[int, ...]:
    """Token ids as given (``where`` names them in messages, ``param`` in the error)."""
    if not value:
        raise invalid_request(f"{where} must be a non-empty list of token ids", param)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise invalid_request(f"{where}: token ids must be integers, not {_kind(item)}", param)
        if not 0 <= item < vocab_size:
            raise invalid_request(
                f"{where}: token id {item} is outside the vocabulary (0..{vocab_size - 1})",
                param,
            )
    return tuple(value)
