"""How tools reach the prompt, and which output format to parse.

Two paths (documented for users in ``docs/tools.md``):

- The chat template references ``tools``: tools go to the template as it expects (the
  Hugging Face convention: a list of ``{"type": "function", "function": {...}}``), and
  assistant ``tool_calls`` keep ``arguments`` as objects, which is what such templates
  serialise with ``tojson``.
- It does not (the default SmolLM2's template): a Hermes-style system prompt lists the
  tools in ``<tools>`` and asks for ``<tool_call>`` blocks; history is rewritten to plain
  text the template can render: assistant calls become ``<tool_call>`` blocks in the
  content, tool results become user turns wrapped in ``<tool_response>``, exactly the
  shape the prompt describes, so a follow-up turn reads like the model's own output.

Pure functions over plain data: no tokenizer, no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from furnace_trio.tools.tool_calls import ToolCallFormat

__all__ = [
    "prepare_tool_messages",
    "template_supports_tools",
    "tool_call_format",
    "tool_system_prompt",
]

_TOOLS_REFERENCE = re.compile(r"\btools\b")


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders ``tools`` itself (it names the variable)."""
    return chat_template is not None and bool(_TOOLS_REFERENCE.search(chat_template))


def tool_call_format(configured: str, chat_template: str | None) -> ToolCallFormat:
    """The output format to parse: the configured one, else what the template teaches.

    ``auto``: ``[TOOL_CALLS]`` in the template means Mistral, ``<|python_tag|>`` or
    Llama 3's ``"parameters"`` convention means Llama 3, anything else (including the
    fallback prompt of this module) Hermes.
    """
    if configured != "auto":
        return ToolCallFormat(configured)
    template = chat_template or ""
    if not template_supports_tools(template):
        return ToolCallFormat.HERMES
    if "[TOOL_CALLS]" in template:
        return ToolCallFormat.MISTRAL
    if "<tool_call>" in template:
        return ToolCallFormat.HERMES
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return ToolCallFormat.LLAMA3
    return ToolCallFormat.HERMES


def tool_system_prompt(
    tools: Sequence[Mapping[str, Any]], *, required: bool = False, function: str | None = None
) -> str:
    """The Hermes-style tool prompt (the text is part of the documented behaviour)."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
        *(json.dumps(dict(tool), ensure_ascii=False) for tool in tools),
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    if function is not None:
        lines += ["", f"You must call the function {function!r}."]
    elif required:
        lines += ["", "You must call at least one function."]
    return "\n".join(lines)


def _arguments_object(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def prepare_tool_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    template_has_tools: bool,
    required: bool = False,
    function: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to hand the chat template.

    ``tools is None`` (none offered, or ``tool_choice`` ``none``) still rewrites a history
    that holds calls or tool results when the template cannot render them.
    """
    if template_has_tools:
        out = []
        for message in messages:
            item = dict(message)
            if "tool_calls" in item:
                item["tool_calls"] = [
                    {
                        **call,
                        "function": {
                            **call.get("function", {}),
                            "arguments": _arguments_object(
                                call.get("function", {}).get("arguments")
                            ),
                        },
                    }
                    for call in item["tool_calls"]
                ]
            out.append(item)
        return out, [dict(t) for t in tools] if tools else None

    out = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            parts = [message["content"]] if message.get("content") else []
            parts += [_call_text(call) for call in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role in ("tool", "function"):
            content = message.get("content") or ""
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools:
        prompt = tool_system_prompt(tools, required=required, function=function)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
