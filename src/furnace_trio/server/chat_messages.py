"""Chat messages validated for the chat template: a conversation's ``messages``, as the
chat endpoint and ``/tokenize`` accept them.

Each message becomes a plain read-only dict: ``role`` is one of
:data:`~furnace_trio.server.schemas.CHAT_ROLES` (``developer`` becomes ``system``),
``content`` a string (text parts joined) or ``None`` for an assistant turn that only
carries ``tool_calls``. The text of all messages is bounded before anything renders it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from furnace_trio.server.errors import invalid_request
from furnace_trio.server.protocol import MISSING, kind_of, too_long
from furnace_trio.server.schemas import CHAT_ROLES, MAX_MESSAGES


def parse_messages(value: object, max_chars: int | None) -> tuple[Mapping[str, Any], ...]:
    if value is MISSING or value is None:
        raise invalid_request("messages is required", "messages")
    if not isinstance(value, list):
        raise invalid_request(f"messages must be an array, not {kind_of(value)}", "messages")
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
            raise too_long("messages", chars, max_chars)
    return messages


def _message(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise invalid_request(f"{where} must be an object, not {kind_of(value)}", where)
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
    content = value.get("content", MISSING)
    if content is MISSING or content is None:
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
            f"{where} must be a string or a list of content parts, not {kind_of(value)}", where
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
