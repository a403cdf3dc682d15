"""Responses bodies into the chat path's request: I/O-free, no model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from furnace_trio.server.errors import APIError
from furnace_trio.server.responses_request import parse_responses_request


def _parse(**body: Any) -> Any:
    return parse_responses_request(json.dumps(body).encode(), vocab_size=1000)


def test_items_become_chat_messages() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    parsed = _parse(
        instructions="be brief",
        input=[
            {"role": "developer", "content": "dev"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "let me look", "annotations": []}],
            },
            call,
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ],
    )
    chat = parsed.chat_request(parsed.input.messages)
    messages = [dict(m) for m in chat.messages]
    assert messages[:3] == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "q"},
    ]
    assistant = messages[3]
    assert assistant["content"] == "let me look"
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert messages[4:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert parsed.input.calls == {"c1", "c2"}
    assert parsed.input.outputs == ((5, "c1"), (6, "c2"))
    # input_items keep what was given, with ids (a given one is kept)
    assert [item["type"] for item in parsed.input.items] == [
        "message",
        "message",
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
    ]
    assert parsed.input.items[2]["id"] == "msg_1"
    assert parsed.input.items[1]["content"] == [{"type": "input_text", "text": "q"}]


def test_tools_format_and_sampling() -> None:
    parsed = _parse(
        input="hi",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        temperature=0,
        max_output_tokens=5,
    )
    chat = parsed.chat_request(parsed.input.messages)
    assert chat.tools == (
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    )
    assert (chat.tool_choice, chat.tool_function) == ("function", "f")
    assert chat.response_format is not None and chat.response_format.kind == "json_schema"
    assert chat.sampling.max_tokens == 5 and chat.sampling.max_tokens_param == "max_output_tokens"
    assert parsed.published_tool_choice() == {"type": "function", "name": "f"}
    assert parsed.published_tools[0]["strict"] is True
    # no tools: auto and none both mean no tool parsing
    assert _parse(input="hi", tool_choice="auto").tool_choice == "none"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({}, "input"),
        ({"input": "x", "text": {"format": None}}, "text.format"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
            "text.format.schema",
        ),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}],
            },
            "tools[1].name",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
            "tools[0].strict",
        ),
        ({"input": "x", "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
        (
            {"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
    ],
)
def test_bad_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        _parse(**body)
    assert refused.value.status == 400
    assert refused.value.param == param


def test_input_too_long_for_the_context() -> None:
    with pytest.raises(APIError) as refused:
        parse_responses_request(
            json.dumps({"input": "x" * 100, "instructions": "y" * 10}).encode(),
            vocab_size=1000,
            max_prompt_chars=105,
        )
    assert refused.value.param == "input" and refused.value.code == "context_length_exceeded"
