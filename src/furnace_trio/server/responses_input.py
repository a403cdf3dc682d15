"""A Responses ``input``: items validated, listed as ``input_items`` shows them, and turned
into the chat messages the chat template renders.

The mapping onto chat messages:

==========================  =========================================================
input item                  chat message
==========================  =========================================================
a string                    ``{"role": "user", "content": ...}``
``message`` (any role)      the same role (``developer`` as ``system``), text parts joined
``function_call``           an assistant message's ``tool_calls`` entry; consecutive calls
                            (and the assistant text just before them) are one message
``function_call_output``    ``{"role": "tool", "tool_call_id": call_id, ...}``
==========================  =========================================================

Plain data: no tokenizer, no engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import kind_of
from furnace_trio.server.responses_schemas import INPUT_ROLES, TEXT_PARTS
from furnace_trio.server.schemas import MAX_MESSAGES


@dataclass(frozen=True, slots=True)
class InputItems:
    """``items``: each input item as ``input_items`` lists it (with an id);
    ``messages``: the chat messages they render as; ``calls``: the call ids of the
    ``function_call`` items; ``outputs``: (index, call id) of each ``function_call_output``;
    ``chars``: how much text they hold."""

    items: tuple[Mapping[str, Any], ...]
    messages: tuple[Mapping[str, Any], ...]
    calls: frozenset[str]
    outputs: tuple[tuple[int, str], ...]
    chars: int


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parse_input(value: object) -> InputItems:
    if value is None:
        raise invalid_request("input is required", "input")
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid_request(
            f"input must be a string or an array of items, not {kind_of(value)}", "input"
        )
    if not value:
        raise invalid_request("input must not be empty", "input")
    if len(value) > MAX_MESSAGES:
        raise invalid_request(f"input may hold at most {MAX_MESSAGES} items", "input")
    builder = _Builder()
    for i, item in enumerate(value):
        builder.add(item, i)
    return builder.done()


class _Builder:
    """Collects the items one by one; a ``function_call`` joins the assistant message
    before it."""

    __slots__ = ("calls", "chars", "items", "messages", "outputs")

    def __init__(self) -> None:
        self.items: list[Mapping[str, Any]] = []
        self.messages: list[dict[str, Any]] = []
        self.calls: set[str] = set()
        self.outputs: list[tuple[int, str]] = []
        self.chars = 0

    def add(self, item: object, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"{where} must be an object, not {kind_of(item)}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._function_call(item, where)
        elif kind == "function_call_output":
            self._function_call_output(item, where, i)
        else:
            raise invalid_request(
                f"{where}.type {kind!r} is not supported: input items are messages, "
                "function_call and function_call_output",
                f"{where}.type",
                "unsupported",
            )

    def done(self) -> InputItems:
        return InputItems(
            tuple(self.items),
            tuple(MappingProxyType(m) for m in self.messages),
            frozenset(self.calls),
            tuple(self.outputs),
            self.chars,
        )

    def _message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise invalid_request(
                f"{where}.role must be one of {', '.join(INPUT_ROLES)}, not {role!r}",
                f"{where}.role",
            )
        text, parts = _content(item.get("content"), f"{where}.content")
        self.chars += len(text)
        item_id = _given_id(item, where) or new_item_id("msg")
        if role == "assistant":
            self.items.append(
                {
                    "id": item_id,
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": p, "annotations": [], "logprobs": []}
                        for p in parts
                    ],
                }
            )
        else:
            self.items.append(
                {
                    "id": item_id,
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": [{"type": "input_text", "text": p} for p in parts],
                }
            )
        self.messages.append({"role": "system" if role == "developer" else role, "content": text})

    def _function_call(self, item: dict[str, Any], where: str) -> None:
        call_id = _string(item, "call_id", where, required=True)
        name = _string(item, "name", where, required=True)
        arguments = _string(item, "arguments", where, required=True, empty=True)
        self.chars += len(arguments) + len(name)
        self.calls.add(call_id)
        self.items.append(
            {
                "id": _given_id(item, where) or new_item_id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
            }
        )
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            if not last["content"]:
                last["content"] = None
        else:
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})

    def _function_call_output(self, item: dict[str, Any], where: str, i: int) -> None:
        call_id = _string(item, "call_id", where, required=True)
        output, _ = _content(item.get("output"), f"{where}.output")
        self.chars += len(output)
        self.outputs.append((i, call_id))
        self.items.append(
            {
                "id": _given_id(item, where) or new_item_id("fco"),
                "type": "function_call_output",
                "status": "completed",
                "call_id": call_id,
                "output": output,
            }
        )
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


def _given_id(item: Mapping[str, Any], where: str) -> str | None:
    value = item.get("id")
    if value is not None and not isinstance(value, str):
        raise invalid_request(f"{where}.id must be a string", f"{where}.id")
    return value or None


def _string(
    item: Mapping[str, Any], key: str, where: str, *, required: bool, empty: bool = False
) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise invalid_request(
            f"{where}.{key} is required and must be a{'' if empty else ' non-empty'} string",
            f"{where}.{key}",
        )
    return value


def _content(value: object, where: str) -> tuple[str, list[str]]:
    """(the text, joined; each text part) of a content string or list of parts."""
    if isinstance(value, str):
        return value, [value]
    if not isinstance(value, list):
        raise invalid_request(
            f"{where} must be a string or a list of content parts, not {kind_of(value)}", where
        )
    parts: list[str] = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise invalid_request(f"{at} must be an object, not {kind_of(part)}", at)
        kind = part.get("type")
        key = "refusal" if kind == "refusal" else "text"
        if kind not in (*TEXT_PARTS, "refusal"):
            raise invalid_request(
                f"{at}.type {kind!r} is not supported: only text parts are (input_text, "
                "output_text, refusal)",
                f"{at}.type",
                "unsupported",
            )
        text = part.get(key)
        if not isinstance(text, str):
            raise invalid_request(f"{at}.{key} must be a string", f"{at}.{key}")
        parts.append(text)
    return "".join(parts), parts
