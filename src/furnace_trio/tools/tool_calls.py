"""I/O-free streaming parser that separates visible content from tool calls.

Feed it text deltas (:meth:`ToolCallParser.feed`), then :meth:`ToolCallParser.finish`; each
returns events: :class:`ContentDelta` (text the client may see), :class:`ToolCallParsed`
(a complete, validated call) and :class:`ToolCallFallback` (something went wrong and was
recovered; the caller logs and counts it). Formats (:class:`ToolCallFormat`)::

    hermes   ... <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...   (Qwen, Hermes)
    llama3   {"name": "f", "parameters": {...}}   or   <|python_tag|>{...}   (at the start)
    mistral  [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]

Invariants, and why:

- Markup never reaches content. Text that could still be the start of a marker is held back
  (like stop strings), so a marker split across deltas at any boundary is recognised.
- Complete calls stand. A call is emitted only once its body is complete and parsed, so a
  later malformed or truncated call cannot take back one already streamed.
- Recovery is always on and never poisons visible text: a malformed, truncated or unknown
  call inside markup is dropped (with a :class:`ToolCallFallback`), the content around it
  is kept; bare JSON that turns out not to be a call (Llama 3 style, no markup) is plain
  content and is published as such.
- Arguments are checked against the tool's JSON schema; a mismatch is reported, and the
  call still stands (the client, which owns the tool, decides what to do with it).
- With ``drop_repeats`` (forced calls: ``tool_choice`` required or named), a call that
  repeats an earlier one of the output (same name, same arguments) is dropped: a model
  made to call tends to repeat its call, and a client would run the tool twice for one
  intent. With ``auto`` the model chose each call, and two identical ones may be meant
  (two coin flips), so they stand.
- Whitespace between or after calls is dropped; other text after a call is content,
  reported once as ``trailing_text``.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from jsonschema.protocols import Validator

logger = logging.getLogger(__name__)

__all__ = [
    "ContentDelta",
    "FallbackReason",
    "ParserEvent",
    "ToolCall",
    "ToolCallFallback",
    "ToolCallFormat",
    "ToolCallParsed",
    "ToolCallParser",
    "new_tool_call_id",
]


class ToolCallFormat(enum.StrEnum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


class FallbackReason(enum.StrEnum):
    """Why the parser did not take the model's output as a clean call (metric label)."""

    MALFORMED_JSON = "malformed_json"  # markup around text that is not JSON: dropped
    NOT_A_CALL = "not_a_call"  # JSON without a string "name" or object arguments
    UNKNOWN_TOOL = "unknown_tool"  # a name the request did not offer: dropped
    SCHEMA_MISMATCH = "schema_mismatch"  # arguments fail the tool's schema: call kept
    TRUNCATED = "truncated"  # output ended inside a call: dropped
    MISSING_END_MARKER = "missing_end_marker"  # complete JSON, no closing tag: call kept
    TRAILING_TEXT = "trailing_text"  # content after a call: kept as content
    EXTRA_CALL = "extra_call"  # a second call with parallel_tool_calls false: dropped
    DUPLICATE_CALL = "duplicate_call"  # a forced call repeating an earlier one: dropped


def new_tool_call_id() -> str:
    """OpenAI-style id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed call; ``arguments`` is a JSON object serialised as a string (OpenAI's wire)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallParsed:
    """Call number ``index`` (0-based, in output order) is complete."""

    index: int
    call: ToolCall


@dataclass(frozen=True, slots=True)
class ToolCallFallback:
    reason: FallbackReason
    detail: str


ParserEvent = ContentDelta | ToolCallParsed | ToolCallFallback

_HERMES_START = "<tool_call>"
_HERMES_END = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_START = "[TOOL_CALLS]"
_START_MARKERS: dict[ToolCallFormat, tuple[str, ...]] = {
    ToolCallFormat.HERMES: (_HERMES_START,),
    ToolCallFormat.LLAMA3: (_PYTHON_TAG,),
    ToolCallFormat.MISTRAL: (_MISTRAL_START,),
}
#: Characters that may open bare JSON calls (no markup) at the start of the output.
_BARE_OPENERS: dict[ToolCallFormat, str] = {
    ToolCallFormat.HERMES: "",
    ToolCallFormat.LLAMA3: "{",
    # [TOOL_CALLS] is a special token many detokenizers drop: its array then comes bare.
    ToolCallFormat.MISTRAL: "[",
}


class _Mode(enum.Enum):
    TEXT = "text"
    BODY = "body"
    DISCARD = "discard"  # after unparseable markup: the rest of the output is dropped


@dataclass(slots=True)
class _JsonExtent:
    """Incremental scan for the end of one top-level JSON object or array.

    ``end`` becomes the index one past the closing bracket; ``bad`` is set when the text
    cannot start a JSON container. Strings and escapes are honoured, nothing is parsed.
    """

    pos: int = 0
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    end: int | None = None
    bad: bool = False

    def advance(self, text: str) -> None:
        i = self.pos
        n = len(text)
        while i < n and self.end is None and not self.bad:
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif self.depth == 0 and ch not in "{[":
                if not ch.isspace():
                    self.bad = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            elif ch == '"':
                self.in_string = True
            i += 1
        self.pos = i


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


@dataclass(slots=True)
class ToolCallParser:
    """Streaming parser for one choice of one response. See the module docstring.

    ``tools`` maps each offered function name to its parameters' JSON schema (``None``:
    anything goes). ``parallel`` false keeps only the first call. ``drop_repeats`` drops a
    call identical to an earlier one (for forced calls; see the module docstring).
    """

    format: ToolCallFormat
    tools: Mapping[str, Mapping[str, Any] | None]
    parallel: bool = True
    drop_repeats: bool = False
    id_factory: Callable[[], str] = new_tool_call_id
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _mode: _Mode = _Mode.TEXT
    _bare: bool = False  # the current body had no markup (it may yet be plain content)
    _scan: _JsonExtent | None = None  # None: the body ends at the end marker
    _content_seen: bool = False  # non-whitespace content emitted since the start
    _trailing_reported: bool = False
    _after_call: bool = False  # no content since the last call: strip leading whitespace
    _finished: bool = False
    _validators: dict[str, Validator] = field(default_factory=dict)

    def feed(self, text: str) -> list[ParserEvent]:
        """Take the next delta of generated text; return what is now known."""
        if self._finished:
            raise ValueError("feed() after finish()")
        self._buf += text
        out: list[ParserEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self, *, cut: bool = False) -> list[ParserEvent]:
        """The output ended: resolve whatever is held back. Call once.

        ``cut``: the token limit ended it. A call it cut inside markup is then returned as
        far as it got (its name and the argument text so far), as OpenAI does with
        ``finish_reason: "length"``; otherwise such a call is dropped."""
        if self._finished:
            raise ValueError("finish() called twice")
        out: list[ParserEvent] = []
        while self._step(out):
            pass
        self._finished = True
        buf, self._buf = self._buf, ""
        if self._mode is _Mode.BODY:
            self._finish_body(buf, out, cut=cut)
        elif buf and self._mode is _Mode.TEXT:
            if self.calls and self.format is ToolCallFormat.LLAMA3:
                buf = buf.strip().strip(";")
            held = _partial_marker_length(buf, _START_MARKERS[self.format])
            if held > 1:
                out.append(ToolCallFallback(FallbackReason.TRUNCATED, f"ended in {buf[-held:]!r}"))
                buf = buf[:-held].rstrip()
            if buf.strip() or not self.calls:
                self._content(buf, out)
        return out

    # -- text between calls ---------------------------------------------------------------

    def _step(self, out: list[ParserEvent]) -> bool:
        """Make one unit of progress on the buffer; False when more text is needed."""
        if self._mode is _Mode.BODY:
            return self._step_body(out)
        if self._mode is _Mode.DISCARD:
            self._buf = ""
            return False
        buf = self._buf
        opener = _BARE_OPENERS[self.format]
        if opener and not self._content_seen:
            stripped = buf.lstrip()
            if self.calls and self.format is ToolCallFormat.LLAMA3:
                stripped = stripped.lstrip(";").lstrip()  # Llama 3 separates calls with ';'
            if not stripped:
                return False
            markers = _START_MARKERS[self.format]
            if any(m.startswith(stripped) and len(stripped) < len(m) for m in markers):
                return False  # may still become a marker
            if stripped[0] == opener and not any(stripped.startswith(m) for m in markers):
                self._enter_body(stripped, bare=True)
                return True
        markers = _START_MARKERS[self.format]
        found = [(buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in found if i >= 0]
        if hits:
            i, marker = min(hits)
            self._content(buf[:i].rstrip(), out, before_marker=True)
            self._enter_body(buf[i + len(marker) :], bare=False)
            return True
        keep = _partial_marker_length(buf, markers)
        # Trailing whitespace is held too: it is dropped if a call follows.
        emit = buf[: len(buf) - keep].rstrip()
        if not emit:
            return False
        self._buf = buf[len(emit) :]
        self._content(emit, out)
        return False

    def _content(self, text: str, out: list[ParserEvent], *, before_marker: bool = False) -> None:
        if not text.strip():
            if before_marker or self.calls:
                return  # whitespace next to calls is layout, not content
            if text:
                out.append(ContentDelta(text))
            return
        if self._after_call:
            self._after_call = False
            text = text.lstrip()
            if not self._trailing_reported:
                self._trailing_reported = True
                out.append(ToolCallFallback(FallbackReason.TRAILING_TEXT, text[:80]))
        self._content_seen = True
        out.append(ContentDelta(text))

    # -- call bodies ----------------------------------------------------------------------

    def _enter_body(self, rest: str, *, bare: bool) -> None:
        self._mode = _Mode.BODY
        self._bare = bare
        self._buf = rest
        self._scan = None if self.format is ToolCallFormat.HERMES and not bare else _JsonExtent()

    def _step_body(self, out: list[ParserEvent]) -> bool:
        buf = self._buf
        if self._scan is None:
            end = buf.find(_HERMES_END)
            if end < 0:
                return False
            body, rest = buf[:end], buf[end + len(_HERMES_END) :]
        else:
            self._scan.advance(buf)
            if self._scan.bad:
                # Markup followed by something that is not JSON (another dialect, prose):
                # nothing after the marker can be shown without showing markup.
                out.append(ToolCallFallback(FallbackReason.MALFORMED_JSON, buf[:80]))
                self._mode = _Mode.DISCARD
                self._buf = ""
                return False
            if self._scan.end is None:
                return False
            body, rest = buf[: self._scan.end], buf[self._scan.end :]
        self._mode = _Mode.TEXT
        self._buf = rest
        self._handle_body(body, out, recovered=False)
        return True

    def _finish_body(self, buf: str, out: list[ParserEvent], *, cut: bool) -> None:
        """The output ended inside a call: keep it if its JSON is complete, or as a
        partial call when the token limit cut it (``cut``)."""
        self._mode = _Mode.TEXT
        text = buf
        if self._scan is None:
            held = _partial_marker_length(text, (_HERMES_END,))
            text = text[: len(text) - held]
        try:
            json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            if self._bare:
                out.append(ToolCallFallback(FallbackReason.TRUNCATED, "bare JSON kept as content"))
                self._content(buf, out)
                return
            partial = _partial_call(text) if cut else None
            if partial is None or (self.tools and partial[0] not in self.tools):
                out.append(ToolCallFallback(FallbackReason.TRUNCATED, buf[:80]))
                return
            if self.calls and not self.parallel:
                out.append(ToolCallFallback(FallbackReason.EXTRA_CALL, partial[0]))
                return
            out.append(
                ToolCallFallback(FallbackReason.TRUNCATED, f"partial call {partial[0]} kept")
            )
            self.calls.append(ToolCall(self.id_factory(), *partial))
            out.append(ToolCallParsed(len(self.calls) - 1, self.calls[-1]))
            return
        self._handle_body(text, out, recovered=not self._bare)

    def _handle_body(self, body: str, out: list[ParserEvent], *, recovered: bool) -> None:
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as exc:
            self._reject(body, FallbackReason.MALFORMED_JSON, str(exc), out)
            return
        items = value if isinstance(value, list) else [value]
        parsed: list[tuple[str, dict[str, Any]]] = []
        for item in items:
            found = _as_call(item)
            if found is None:
                self._reject(body, FallbackReason.NOT_A_CALL, body[:80], out)
                return
            if self.tools and found[0] not in self.tools:
                self._reject(body, FallbackReason.UNKNOWN_TOOL, found[0], out)
                return
            parsed.append(found)
        if not parsed:
            self._reject(body, FallbackReason.NOT_A_CALL, "empty list", out)
            return
        if recovered:
            out.append(ToolCallFallback(FallbackReason.MISSING_END_MARKER, parsed[0][0]))
        for name, arguments in parsed:
            if self.calls and not self.parallel:
                out.append(ToolCallFallback(FallbackReason.EXTRA_CALL, name))
                continue
            serialised = json.dumps(arguments, ensure_ascii=False)
            if self.drop_repeats and any(
                c.name == name and c.arguments == serialised for c in self.calls
            ):
                out.append(ToolCallFallback(FallbackReason.DUPLICATE_CALL, name))
                continue
            problem = self._schema_problem(name, arguments)
            if problem is not None:
                out.append(ToolCallFallback(FallbackReason.SCHEMA_MISMATCH, f"{name}: {problem}"))
            call = ToolCall(self.id_factory(), name, serialised)
            self.calls.append(call)
            self._after_call = True
            out.append(ToolCallParsed(len(self.calls) - 1, call))

    def _reject(
        self, body: str, reason: FallbackReason, detail: str, out: list[ParserEvent]
    ) -> None:
        """A body that is not a usable call: bare JSON is content, markup is dropped."""
        out.append(ToolCallFallback(reason, detail))
        if self._bare:
            self._content(body, out)

    def _schema_problem(self, name: str, arguments: Mapping[str, Any]) -> str | None:
        schema = self.tools.get(name)
        if not schema:
            return None
        validator = self._validators.get(name)
        if validator is None:
            cls = jsonschema.validators.validator_for(schema)
            validator = cls(schema)
            self._validators[name] = validator
        error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
        if error is None:
            return None
        return error.message


_PARTIAL_HEAD = re.compile(r'\s*\[?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*)?')
_PARTIAL_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _partial_call(text: str) -> tuple[str, str] | None:
    """``(name, argument text so far)`` of a call object cut short, when its name is
    complete and comes first (the order every supported format writes)."""
    head = _PARTIAL_HEAD.match(text)
    if head is None:
        return None
    name = json.loads(head.group(1))
    rest = text[head.end() :]
    arguments = _PARTIAL_ARGUMENTS.match(rest)
    return name, rest[arguments.end() :].rstrip() if arguments else ""


def _as_call(item: object) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of one call object, or None when it is not one.

    Accepts ``arguments`` or ``parameters``, as an object or as a string holding one, and
    OpenAI's nested ``{"function": {...}}`` shape; a missing argument object means ``{}``.
    """
    if not isinstance(item, dict):
        return None
    obj: dict[str, Any] = item
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return name, arguments
