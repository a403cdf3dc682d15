"""A conversation rendered by the model's chat template and tokenized.

Tools are folded into the prompt as the template expects them
(:func:`~furnace_trio.tools.tool_prompt.prepare_tool_messages`). Every string the client
sent is protected first (:mod:`furnace_trio.text.special_text`), so that only the
template's own markers become special tokens; the tokenizer's marker is the same for every
rendering, so a session's history renders to the same text each turn. A session turn's
prompt is encoded by its :class:`~furnace_trio.engine.sessions.Turn`, which reuses the
exact token ids of the session's history. These functions block for as long as rendering and tokenizing
take, so handlers call them in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from furnace_trio.engine.sessions import Turn
from furnace_trio.server.chat_request import ChatRequest
from furnace_trio.server.errors import invalid_request
from furnace_trio.text.special_text import ChatText
from furnace_trio.tools.tool_prompt import prepare_tool_messages, template_supports_tools

if TYPE_CHECKING:
    from furnace_trio.server.backend import Backend


def render_chat(
    backend: Backend, parsed: ChatRequest, turn: Turn | None = None, *, instruct: bool = True
) -> tuple[int, ...]:
    """Template and tokenize (runs in a worker thread; big inputs take a while). For a
    session ``turn``, ``parsed.messages`` are its prompt messages.

    ``instruct``: tell the model a forced ``tool_choice`` in the tool prompt. Without it
    (a grammar enforces the call) the prompt is the same whatever ``tool_choice``, so the
    tools' system prompt stays cached, a session's history included, when an agent
    forces a call in one turn and not in the next.
    """
    chat = render_messages(
        backend,
        parsed.messages,
        parsed.tools if parsed.tool_choice != "none" else None,
        required=instruct and parsed.tool_choice == "required",
        function=parsed.tool_function if instruct else None,
    )
    tokenizer = backend.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode_chat(ChatText(text, chat.marker))

    if turn is not None:
        return turn.encode_prompt(chat.text, encode)
    return tuple(encode(chat.text))


def render_messages(
    backend: Backend,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    required: bool = False,
    function: str | None = None,
    add_generation_prompt: bool = True,
) -> ChatText:
    """A conversation (and its tools) rendered by the chat template, for
    :meth:`~furnace_trio.loading.tokenizer.Tokenizer.encode_chat`; a 400 naming
    ``messages`` when it cannot be."""
    tokenizer = backend.tokenizer
    marker = tokenizer.chat_marker
    protect = tokenizer.special_texts.protect
    try:
        prepared, tools_out = prepare_tool_messages(
            protect(messages, marker),
            protect(tools, marker),
            template_has_tools=template_supports_tools(tokenizer.chat_template),
            required=required,
            function=function,
        )
        text = tokenizer.apply_chat_template(
            prepared, add_generation_prompt=add_generation_prompt, tools=tools_out
        )
    except ValueError as exc:
        raise invalid_request(f"cannot render the chat template: {exc}", "messages") from None
    return ChatText(text, marker)
