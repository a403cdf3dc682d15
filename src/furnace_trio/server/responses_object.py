"""The Responses API's ``response`` object, as plain data: what it echoes of its request,
its output items, its status and usage.

:class:`ResponseObject` is one response's state while it is generated (the stream's
lifecycle events carry snapshots of it) and, once finished, what ``GET
/v1/responses/{id}`` returns. No I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from furnace_trio.server.responses_input import new_item_id
from furnace_trio.server.responses_request import ResponsesRequest
from furnace_trio.server.sse import Collector

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def new_response_id() -> str:
    return new_item_id("resp")


@dataclass(slots=True)
class ResponseObject:
    """One response. ``output`` holds finished items only; the stream adds each as it is
    done. ``usage`` is set when generation ends."""

    id: str
    model: str
    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: Status = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete: bool = False
    completed_at: int | None = None

    def finish(self, collector: Collector) -> None:
        """Generation ended: usage from the collector; ``incomplete`` when the token limit
        cut it."""
        choice = collector.choices[0]
        self.incomplete = choice.finish_reason == "length"
        self.status = "incomplete" if self.incomplete else "completed"
        self.completed_at = int(time.time())
        self.usage = {
            "input_tokens": collector.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": collector.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": collector.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": collector.prompt_tokens + collector.completion_tokens,
        }

    def fail(self, code: str, message: str) -> None:
        self.status = "failed"
        self.error = {"code": code, "message": message}

    def body(self) -> dict[str, Any]:
        """The ``response`` object as the SDK parses it."""
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": {"reason": "max_output_tokens"} if self.incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.sampling.max_tokens,
            "model": self.model,
            "output": list(self.output),
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p,
            "text": {"format": dict(request.published_format)},
            "tool_choice": request.published_tool_choice(),
            "tools": [dict(t) for t in request.published_tools],
            "truncation": "disabled",
            "store": request.store,
            "background": False,
            "metadata": dict(request.metadata),
            "usage": self.usage,
        }

    def output_text(self) -> str:
        """The text of every output message, joined (the SDK's ``output_text``)."""
        return "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )

    def reply(self) -> dict[str, Any]:
        """This response's output as one assistant chat message (its text, its calls)."""
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.output
            if item["type"] == "function_call"
        ]
        text = self.output_text()
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message

    def call_ids(self) -> frozenset[str]:
        return frozenset(item["call_id"] for item in self.output if item["type"] == "function_call")
