"""Tool rendering: template detection, the Hermes-style prompt, history rewriting."""

from __future__ import annotations

import json

from furnace_trio.tools.tool_calls import ToolCallFormat
from furnace_trio.tools.tool_prompt import (
    prepare_tool_messages,
    template_supports_tools,
    tool_call_format,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HISTORY = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


def test_format_detection() -> None:
    assert not template_supports_tools("{{ messages }}")
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert tool_call_format("auto", None) is ToolCallFormat.HERMES
    assert tool_call_format("auto", "{{ tools }}[TOOL_CALLS]") is ToolCallFormat.MISTRAL
    assert tool_call_format("auto", "{{ tools }}<|python_tag|>") is ToolCallFormat.LLAMA3
    assert tool_call_format("auto", "{{ tools }}<tool_call>") is ToolCallFormat.HERMES
    assert tool_call_format("llama3", "{{ tools }}<tool_call>") is ToolCallFormat.LLAMA3


def test_fallback_prompt_and_history_rewrite() -> None:
    messages, tools = prepare_tool_messages(HISTORY, [TOOL], template_has_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "<tools>" in messages[0]["content"] and json.dumps(TOOL) in messages[0]["content"]
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\n42\n</tool_response>"
    assert all(isinstance(m["content"], str) for m in messages)


def test_existing_system_prompt_is_extended_and_choice_is_stated() -> None:
    messages, _ = prepare_tool_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
        [TOOL],
        template_has_tools=False,
        function="f",
    )
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert messages[0]["content"].endswith("You must call the function 'f'.")


def test_tool_aware_template_gets_objects() -> None:
    messages, tools = prepare_tool_messages(HISTORY, [TOOL], template_has_tools=True)
    assert tools == [TOOL]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[2]["role"] == "tool"


def test_no_tools_still_rewrites_history() -> None:
    messages, tools = prepare_tool_messages(HISTORY, None, template_has_tools=False)
    assert tools is None and messages[0]["role"] == "user" and len(messages) == 3
