"""I/O-free parsing and validation of OpenAI request bodies: what every endpoint's
validator shares.

Input is the raw body bytes; output is a frozen request record or an
:class:`~furnace_trio.server.errors.APIError` (400, naming the parameter). Nothing here touches a
socket, the tokenizer or the engine, so every rule is testable in microseconds. Each API
family has its own module on top of this one: :mod:`~furnace_trio.server.chat_request`,
:mod:`~furnace_trio.server.completion_request` and
:mod:`~furnace_trio.server.tokenizer_request`, with
:mod:`~furnace_trio.server.chat_messages` and :mod:`~furnace_trio.server.sampling_options`
for the parts two of them share.

Rules that keep the server safe from surprising input:

- JSON is decoded from bytes by us (invalid UTF-8 and invalid JSON are 400s, whatever the
  content type says); the body must be an object.
- A body is refused before it is decoded when it could hold more than
  :data:`~furnace_trio.server.schemas.MAX_JSON_VALUES` values (counted from its commas,
  colons and brackets, so strings full of them count too): decoding is C code that holds
  the GIL throughout, so its cost must be bounded before it starts.
- Decoding gives the interpreter a switch point per JSON object (an ``object_pairs_hook``
  in Python), so a body decoded in a worker thread lets the event loop run meanwhile.
- Every string is valid Unicode: a lone UTF-16 surrogate escape (``"\\ud800"``) is a 400
  naming the field, not a failure later in the tokenizer or the response encoder. A
  number beyond the interpreter's digit limit (4,300 digits) is a 400 too.
- ``bool`` is never accepted where a number is expected (``True`` is an ``int`` in Python).
- Unknown fields are ignored, as OpenAI does; known fields are checked strictly, and
  ``null`` means "not given".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from furnace_trio.server.errors import APIError, invalid_request
from furnace_trio.server.schemas import (
    MAX_CHARS_PER_TOKEN,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    FieldSpec,
)

__all__ = [
    "MISSING",
    "FieldBody",
    "check_sequences",
    "json_values_bound",
    "kind_of",
    "max_prompt_chars",
    "parse_json_body",
    "parse_stream",
    "parse_token_ids",
    "resolve_max_tokens",
    "too_long",
]

#: A field absent from the body (``None`` there means JSON ``null``).
MISSING: Any = object()


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decode a request body as a JSON object, or raise a 400 :class:`APIError`.

    The cost is bounded by the body's size and :data:`MAX_JSON_VALUES`; call it from a
    worker thread for bodies of any size (see :mod:`~furnace_trio.server.off_loop`).
    """
    values = json_values_bound(body)
    if values > MAX_JSON_VALUES:
        raise invalid_request(
            f"request body holds up to {values} JSON values (counting its commas, colons and "
            f"brackets); this server decodes at most {MAX_JSON_VALUES} per request"
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"request body is not valid UTF-8: {exc.reason}") from None
    if not text.strip():
        raise invalid_request("request body is empty; expected a JSON object")
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None
    except ValueError:  # int() past sys.get_int_max_str_digits(), the one other ValueError
        raise invalid_request(
            "request body holds a number with too many digits to decode"
        ) from None
    if not isinstance(value, dict):
        raise invalid_request(f"request body must be a JSON object, not {kind_of(value)}")
    if _depth(value) > MAX_JSON_DEPTH:
        raise invalid_request(
            f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        )
    if _SURROGATE_ESCAPE.search(body):
        _check_surrogates(value)
    return value


def json_values_bound(body: bytes) -> int:
    """An upper bound on the JSON values (keys included) in ``body``, from its bytes alone.

    A container of ``k`` members holds ``k - 1`` commas, and each object member a colon, so
    values and keys number at most commas + colons + brackets + 1. Counting is ``memchr``
    speed, about a millisecond per MiB for the four counts.
    """
    return body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{") + 1


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # The same dict the decoder builds, through a Python frame: the interpreter may hand the
    # GIL to another thread (the event loop) here, which the C decoder never does.
    return dict(pairs)


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


#: A ``\uD800``-``\uDFFF`` escape: the only way a surrogate gets into a decoded string (the
#: UTF-8 decoder refuses encoded ones). Pairs decode to one character; lone ones stay.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_surrogates(body: dict[str, Any]) -> None:
    """A 400 naming the top-level field whose strings (or keys) hold a lone surrogate."""
    for name, field_value in body.items():
        pending: list[object] = [name, field_value]
        while pending:
            item = pending.pop()
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    raise invalid_request(
                        f"{name[:64]!r} holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                        "\\udfff escape), which is not a Unicode character",
                        name if name.isidentifier() else None,
                    )
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)


class FieldBody:
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


def max_prompt_chars(max_context: int) -> int:
    """The most prompt characters worth rendering for a context of ``max_context`` tokens."""
    return max_context * MAX_CHARS_PER_TOKEN


def too_long(param: str, chars: int, limit: int) -> APIError:
    return APIError(
        400,
        f"The {param} hold {chars} characters; this model's context cannot hold more than "
        f"{limit} ({MAX_CHARS_PER_TOKEN} characters per token at most). Shorten the {param}.",
        param=param,
        code="context_length_exceeded",
    )


def check_sequences(n: int, prompts: int, limit: int | None) -> None:
    """A 400 when ``prompts`` x ``n`` sequences exceed ``limit`` (``None``: no limit).

    Every sequence is a slot in the queue and in the batch; one request may not take more
    than ``FURNACE_MAX_SEQUENCES_PER_REQUEST`` of them, whatever the queue holds now.
    """
    if limit is None or n * prompts <= limit:
        return
    asked = f"{prompts} prompts x n = {n}" if prompts > 1 else f"n = {n}"
    raise invalid_request(
        f"{asked} asks for {n * prompts} sequences; this server generates at most {limit} "
        "per request (FURNACE_MAX_SEQUENCES_PER_REQUEST, or FURNACE_MAX_WAITING where smaller). "
        "Send fewer prompts or a smaller n.",
        "n" if n > 1 else "prompt",
    )


def resolve_max_tokens(
    requested: int | None,
    *,
    prompt_tokens: int,
    max_context: int,
    default: int | None,
    limit: int | None = None,
    prompt_param: str = "messages",
    max_tokens_param: str = "max_tokens",
) -> int:
    """Check the prompt fits the context and choose ``max_tokens``.

    A prompt that leaves no room for one generated token is a 400
    (``context_length_exceeded``, naming the prompt), and so is a ``requested`` count that
    does not fit beside the prompt (naming ``max_tokens``), as OpenAI and vLLM answer: a
    silent clamp would hide from the client that it asked for more than the model can do.
    ``limit`` (``FURNACE_MAX_OUTPUT_TOKENS``) is the server's cap: a ``requested`` count
    above it is a 400 (``invalid_value``, OpenAI's answer to a ``max_tokens`` above a
    model's output limit), and it replaces ``default``. Without a request, the default is
    clamped to the room left; ``None`` for both means "as much as the context allows".
    """
    if requested is not None and limit is not None and requested > limit:
        raise APIError(
            400,
            f"{max_tokens_param} is too large: {requested}. This server supports at most "
            f"{limit} completion tokens, whereas you provided {requested}.",
            param=max_tokens_param,
            code="invalid_value",
        )
    if limit is not None:
        default = limit
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


def kind_of(value: object) -> str:
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
        raise invalid_request(f"{name} must be a boolean, not {kind_of(value)}", name)
    return value


def _check_str(name: str, value: object, low: float | None, high: float | None) -> str:
    if not isinstance(value, str):
        raise invalid_request(f"{name} must be a string, not {kind_of(value)}", name)
    if (low is not None and len(value) < low) or (high is not None and len(value) > high):
        raise invalid_request(f"{name} must have {low or 0} to {high} characters", name)
    return value


def _check_int(name: str, value: object, low: float | None, high: float | None) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"{name} must be an integer, not {kind_of(value)}", name)
    _check_range(name, value, low, high)
    return value


def _check_float(
    name: str, value: object, low: float | None, high: float | None, low_open: bool
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_request(f"{name} must be a number, not {kind_of(value)}", name)
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


def parse_stream(data: FieldBody) -> tuple[bool, bool]:
    stream: bool = data.get("stream")
    options = data.raw("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid_request(
            f"stream_options must be an object, not {kind_of(options)}", "stream_options"
        )
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise invalid_request(
            "stream_options.include_usage must be a boolean", "stream_options.include_usage"
        )
    return stream, bool(include_usage) and stream


def parse_token_ids(
    value: list[Any], vocab_size: int, where: str, param: str = "prompt"
) -> tuple[int, ...]:
    """Token ids as given (``where`` names them in messages, ``param`` in the error)."""
    if not value:
        raise invalid_request(f"{where} must be a non-empty list of token ids", param)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise invalid_request(
                f"{where}: token ids must be integers, not {kind_of(item)}", param
            )
        if not 0 <= item < vocab_size:
            raise invalid_request(
                f"{where}: token id {item} is outside the vocabulary (0..{vocab_size - 1})",
                param,
            )
    return tuple(value)
