"""A generation's events as the Responses API streams them: I/O-free.

:class:`ResponseEvents` is fed the events of a generation after tool-call parsing
(:class:`~furnace_trio.engine.engine.Delta`,
:class:`~furnace_trio.server.tool_stream.ToolCallReady`,
:class:`~furnace_trio.engine.engine.Finished`) and returns the stream events they stand for,
each numbered by ``sequence_number``, while it builds the response's output items::

    response.created, response.in_progress
    per message:  output_item.added, content_part.added, output_text.delta ...,
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta/.done, output_item.done
    response.completed | response.incomplete | response.failed

The same object folds a non-streamed response (its events are dropped), so both answers
are built by one path. Text that is only whitespace before a call is not an output message
(the model's newline before ``<tool_call>``).
"""

from __future__ import annotations

from typing import Any

from furnace_trio.engine import Delta, Finished
from furnace_trio.server.responses_input import new_item_id
from furnace_trio.server.responses_object import ResponseObject
from furnace_trio.server.sse import Collector, dumps
from furnace_trio.server.tool_stream import ToolCallReady
from furnace_trio.tools.tool_calls import ToolCall

Event = dict[str, Any]


class ResponseEvents:
    """One response's output items and stream events; see the module docstring."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence = 0
        self._message: dict[str, Any] | None = None  # the message being streamed
        self._text: list[str] = []
        self._held = ""  # leading whitespace not yet known to be a message

    def start(self) -> list[Event]:
        return [
            self._lifecycle("response.created"),
            self._lifecycle("response.in_progress"),
        ]

    def feed(self, event: object) -> list[Event]:
        if isinstance(event, Delta):
            return self._delta(event.text)
        if isinstance(event, ToolCallReady):
            return [*self._close_message(), *self._call(event.call)]
        if isinstance(event, Finished):
            return self._close_message()
        return []

    def finish(self, collector: Collector) -> list[Event]:
        """Generation ended (the last ``Finished`` was fed): the terminal event."""
        out = self._close_message()
        if not self.response.output:
            out += self._delta("", force=True)  # an empty answer is still one message
            out += self._close_message()
        self.response.finish(collector)
        if self.response.incomplete:
            for item in self.response.output:
                if item["type"] == "message":
                    item["status"] = "incomplete"
            return [*out, self._lifecycle("response.incomplete")]
        return [*out, self._lifecycle("response.completed")]

    def fail(self, code: str, message: str) -> list[Event]:
        self.response.fail(code, message)
        return [self._lifecycle("response.failed")]

    def error(self, code: str, message: str) -> Event:
        """An ``error`` event: the stream itself broke (not the model)."""
        return self._event({"type": "error", "code": code, "message": message, "param": None})

    # -- items ------------------------------------------------------------------------------

    def _delta(self, text: str, *, force: bool = False) -> list[Event]:
        out: list[Event] = []
        if self._message is None:
            if not force and not text.strip():
                self._held += text
                return out
            text, self._held = self._held + text, ""
            out += self._open_message()
        if text:
            self._text.append(text)
            out.append(
                self._event(
                    {
                        "type": "response.output_text.delta",
                        **self._text_position(),
                        "delta": text,
                        "logprobs": [],
                    }
                )
            )
        return out

    def _open_message(self) -> list[Event]:
        self._message = {
            "id": new_item_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self._text = []
        return [
            self._event(
                {
                    "type": "response.output_item.added",
                    "output_index": len(self.response.output),
                    "item": dict(self._message),
                }
            ),
            self._event(
                {
                    "type": "response.content_part.added",
                    **self._text_position(),
                    "part": _text_part(""),
                }
            ),
        ]

    def _close_message(self) -> list[Event]:
        self._held = ""
        message = self._message
        if message is None:
            return []
        text = "".join(self._text)
        position = self._text_position()
        message["content"] = [_text_part(text)]
        message["status"] = "completed"
        out = [
            self._event(
                {"type": "response.output_text.done", **position, "text": text, "logprobs": []}
            ),
            self._event(
                {"type": "response.content_part.done", **position, "part": _text_part(text)}
            ),
            self._event(
                {
                    "type": "response.output_item.done",
                    "output_index": position["output_index"],
                    "item": message,
                }
            ),
        ]
        self.response.output.append(message)
        self._message = None
        return out

    def _call(self, call: ToolCall) -> list[Event]:
        index = len(self.response.output)
        item = {
            "id": new_item_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        position = {"item_id": item["id"], "output_index": index}
        out = [
            self._event(
                {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
            ),
            self._event(
                {
                    "type": "response.function_call_arguments.delta",
                    **position,
                    "delta": call.arguments,
                }
            ),
            self._event(
                {
                    "type": "response.function_call_arguments.done",
                    **position,
                    "name": call.name,
                    "arguments": call.arguments,
                }
            ),
        ]
        item["arguments"] = call.arguments
        item["status"] = "completed"
        out.append(
            self._event({"type": "response.output_item.done", "output_index": index, "item": item})
        )
        self.response.output.append(item)
        return out

    # -- framing ----------------------------------------------------------------------------

    def _text_position(self) -> dict[str, Any]:
        assert self._message is not None  # only called while a message is open
        return {
            "item_id": self._message["id"],
            "output_index": len(self.response.output),
            "content_index": 0,
        }

    def _lifecycle(self, kind: str) -> Event:
        return self._event({"type": kind, "response": self.response.body()})

    def _event(self, body: Event) -> Event:
        body["sequence_number"] = self._sequence
        self._sequence += 1
        return body


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def sse_frame(event: Event) -> bytes:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n".encode()
