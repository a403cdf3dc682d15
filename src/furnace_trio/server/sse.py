"""OpenAI response objects and Server-Sent Events framing, as plain data.

The handler feeds engine events into a :class:`Collector` (one per request); the functions
here turn what it holds into the exact JSON the OpenAI SDK parses: ``chat.completion``,
``chat.completion.chunk``, ``text_completion`` and the usage object. No I/O, no Trio.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from furnace_trio import __version__
from furnace_trio.tools.tool_calls import ToolCall

Kind = Literal["chat", "completion"]
SYSTEM_FINGERPRINT = f"furnace-trio-{__version__}"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


#: Stands for a content chunk's text while its frame is serialized (private-use characters,
#: which JSON keeps as they are, so the quoted placeholder appears verbatim in the bytes).
_HOLE = "\ue000furnace-text\ue000"


#: ``json.dumps`` with options builds a new encoder for every call; this one is built once.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def dumps(value: object) -> str:
    """Compact JSON, UTF-8 kept as is (the body is encoded as UTF-8 once).

    Strict: NaN or an infinity raises ``ValueError`` (the request fails as a server error)
    instead of writing ``NaN``/``Infinity``, which no strict JSON parser reads."""
    return _ENCODER.encode(value)


def sse_event(value: object) -> bytes:
    """One SSE ``data:`` event. JSON never contains a raw newline, so one line suffices."""
    return f"data: {dumps(value)}\n\n".encode()


_HOLE_JSON = dumps(_HOLE).encode()


def _bytes_list(value: object) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return list(value.encode("utf-8"))
    return list(value)  # type: ignore[call-overload]


def chat_logprobs(entries: Sequence[Any]) -> dict[str, Any]:
    """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes_list(e.bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": _bytes_list(t.bytes)}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[Any], text_offset: int) -> dict[str, Any]:
    """Legacy logprobs: parallel lists of tokens, logprobs, top alternatives and offsets.

    ``text_offset`` is where the first entry's token starts in the completion text; the
    following offsets add the token strings' lengths.
    """
    offsets: list[int] = []
    offset = text_offset
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        # An echoed prompt's first token has no logprob, and no alternatives: null.
        "top_logprobs": [
            None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


@dataclass(slots=True)
class Choice:
    """What one choice index has produced so far."""

    text: list[str] = field(default_factory=list)
    text_length: int = 0
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class Collector:
    """Per-request response state: id, model, created time, choices and usage.

    ``prompt_tokens`` starts as the handler's count and is replaced by the engine's
    ``Admitted`` event; ``cached_tokens`` comes from that event only.
    """

    kind: Kind
    response_id: str
    model: str
    created: int
    n: int
    prompt_tokens: int
    want_logprobs: bool = False
    cached_tokens: int = 0
    choices: list[Choice] = field(default_factory=list)
    #: (choice index, include_usage) -> the bytes before and after a content chunk's text.
    _frames: dict[tuple[int, bool], tuple[bytes, bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.choices = [Choice() for _ in range(self.n)]

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }

    # --- non-streaming ---------------------------------------------------------------------

    def add_delta(self, index: int, text: str, logprobs: Sequence[Any]) -> None:
        choice = self.choices[index]
        choice.text.append(text)
        choice.text_length += len(text)
        if self.want_logprobs:
            choice.logprobs.extend(logprobs)

    def finish(self, index: int, reason: str, completion_tokens: int) -> None:
        """Record the end of a choice. ``tool_calls`` replaces ``stop`` only: a call cut
        by the token limit keeps ``length``, so the client learns output was truncated."""
        choice = self.choices[index]
        choice.finish_reason = "tool_calls" if reason == "stop" and choice.tool_calls else reason
        choice.completion_tokens = completion_tokens

    def response(self) -> dict[str, Any]:
        """The whole ``chat.completion`` or ``text_completion`` object."""
        choices: list[dict[str, Any]] = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.text)
            if self.kind == "chat":
                choices.append(
                    {
                        "index": index,
                        "message": self.message(index),
                        "logprobs": chat_logprobs(choice.logprobs) if self.want_logprobs else None,
                        "finish_reason": choice.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": (
                            completion_logprobs(choice.logprobs, 0) if self.want_logprobs else None
                        ),
                        "finish_reason": choice.finish_reason,
                    }
                )
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion")
        body["choices"] = choices
        body["usage"] = self.usage()
        return body

    def message(self, index: int) -> dict[str, Any]:
        """Choice ``index``'s assistant message as the client received it, streamed or not
        (``content`` is ``None`` beside tool calls when there is no text)."""
        choice = self.choices[index]
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if choice.tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [_tool_call(c) for c in choice.tool_calls]
        return message

    # --- streaming -------------------------------------------------------------------------

    def chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        role: bool = False,
        logprobs: Sequence[Any] = (),
        finish_reason: str | None = None,
        include_usage: bool = False,
    ) -> dict[str, Any]:
        """One streaming chunk for choice ``index`` (records the text it carries)."""
        choice = self.choices[index]
        offset = choice.text_length
        if text:
            choice.text.append(text)
            choice.text_length += len(text)
        return self._chunk_body(index, text, role, logprobs, finish_reason, include_usage, offset)

    def content_event(self, index: int, text: str, *, include_usage: bool = False) -> bytes:
        """The SSE event of a chunk that carries only ``text`` (no role, logprobs or
        finish): the same bytes as ``sse_event(self.chunk(index, text=text, ...))``, from
        a frame serialized once per choice, so a token costs one string escape."""
        choice = self.choices[index]
        choice.text.append(text)
        choice.text_length += len(text)
        frame = self._frames.get((index, include_usage))
        if frame is None:
            body = self._chunk_body(index, _HOLE, False, (), None, include_usage, 0)
            head, _, tail = sse_event(body).rpartition(_HOLE_JSON)
            frame = self._frames[(index, include_usage)] = (head, tail)
        return frame[0] + dumps(text).encode() + frame[1]

    def _chunk_body(
        self,
        index: int,
        text: str | None,
        role: bool,
        logprobs: Sequence[Any],
        finish_reason: str | None,
        include_usage: bool,
        offset: int,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            if text:
                delta["content"] = text
            entry: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(logprobs) if self.want_logprobs and logprobs else None,
                "finish_reason": finish_reason,
            }
            body = self._envelope("chat.completion.chunk")
        else:
            entry = {
                "index": index,
                "text": text or "",
                "logprobs": (
                    completion_logprobs(logprobs, offset)
                    if self.want_logprobs and logprobs
                    else None
                ),
                "finish_reason": finish_reason,
            }
            body = self._envelope("text_completion")
        body["choices"] = [entry]
        if include_usage:
            body["usage"] = None
        return body

    def add_tool_call(self, index: int, call: ToolCall) -> None:
        self.choices[index].tool_calls.append(call)

    def tool_call_chunks(
        self, index: int, call: ToolCall, *, include_usage: bool = False
    ) -> list[dict[str, Any]]:
        """Two chunks for one complete call, as OpenAI streams them: the first carries
        ``index``, ``id``, ``type`` and the function name, the next the arguments."""
        choice = self.choices[index]
        position = len(choice.tool_calls)
        choice.tool_calls.append(call)
        head = {
            "index": position,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        tail = {"index": position, "function": {"arguments": call.arguments}}
        chunks = []
        for entry in (head, tail):
            body = self._envelope("chat.completion.chunk")
            body["choices"] = [
                {
                    "index": index,
                    "delta": {"tool_calls": [entry]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            if include_usage:
                body["usage"] = None
            chunks.append(body)
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage()
        return body


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
