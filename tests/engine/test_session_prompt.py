"""A session's next prompt starts with exactly the tokens its KV holds, for each template the
tests cover (SmolLM2's, which takes no tools, and Qwen 2.5's, which renders them itself),
while its history shows each reply as the client received it: tool calls, no markup.

The real SmolLM2 tokenizer; the store alone (the engine's side is in ``test_sessions.py``,
the whole path over HTTP in ``tests/server/test_session_history.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from furnace_trio.engine.sessions import SessionReply, SessionStore, Turn
from furnace_trio.loading.tokenizer import Tokenizer
from furnace_trio.text.chat_template import compile_chat_template
from furnace_trio.tools.tool_prompt import prepare_tool_messages, template_supports_tools

pytestmark = pytest.mark.model

QWEN = (Path(__file__).parent.parent / "data" / "qwen2_5_chat_template.jinja").read_text()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
#: What a grammar-forced call looks like as generated: compact JSON, a newline after it.
GENERATED = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
#: The same reply as the client received it.
SENT = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_0123456789abcdef01234567",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
ANSWER = {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "21 C"}


@pytest.fixture(params=["smollm2", "qwen2.5"])
def template(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> str:
    if request.param == "qwen2.5":
        return QWEN
    assert tokenizer.chat_template is not None
    return tokenizer.chat_template


def render(
    tokenizer: Tokenizer,
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = (WEATHER,),
) -> str:
    """What the chat route renders: tools through the template, or the Hermes prompt."""
    prepared, tools_out = prepare_tool_messages(
        messages, tools, template_has_tools=template_supports_tools(template)
    )
    return compile_chat_template(template).render(
        prepared,
        add_generation_prompt=True,
        tools=tools_out,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )


def sampled(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """``text`` as a sampler may write it: a token per character, not the tokenizer's own
    (longest-merge) encoding, which re-encoding the text would give."""
    ids = tuple(i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False))
    assert tokenizer.decode(ids) == text
    assert ids != tuple(tokenizer.encode(text, add_special_tokens=False))
    return ids


def store() -> SessionStore:
    return SessionStore(ttl_s=60.0, max_blocks=0, max_sessions=4, release=lambda blocks: None)


def run_turn(
    s: SessionStore,
    tokenizer: Tokenizer,
    template: str,
    message: Mapping[str, Any],
    reply: SessionReply,
    output: Sequence[int],
    *,
    exact: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = (WEATHER,),
) -> tuple[Turn, str, tuple[int, ...]]:
    """One committed turn: (the turn, its prompt text, its prompt ids)."""
    turn = s.begin_turn("s", "me", [message], 0.0)
    text = render(tokenizer, template, turn.prompt_messages, tools)
    ids = turn.encode_prompt(text, lambda t: tokenizer.encode(t, add_special_tokens=False))
    s.commit(
        turn,
        reply,
        token_ids=(),
        blocks=(),
        output_token_ids=output,
        seed=None,
        now=0.0,
        reply_exact=exact,
    )
    s.end_turn(turn, 0.0)
    return turn, text, ids


def test_a_tool_call_turn_is_shown_as_sent_and_its_next_prompt_reuses_every_token(
    tokenizer: Tokenizer, template: str
) -> None:
    s = store()
    call = sampled(tokenizer, GENERATED)
    _, text1, ids1 = run_turn(s, tokenizer, template, ASK, SessionReply(SENT, GENERATED), call)
    assert ids1 == tuple(tokenizer.encode(text1, add_special_tokens=False))
    session = s.get("s", "me", 0.0)
    assert session.messages == [ASK, SENT]
    kv = (*ids1, *call)  # every token the turn's KV holds (its EOS has no KV)

    said = "It is 21 C in Paris."
    said_ids = sampled(tokenizer, said)
    turn2, text2, ids2 = run_turn(
        s,
        tokenizer,
        template,
        ANSWER,
        SessionReply({"role": "assistant", "content": said}, said),
        said_ids,
    )
    assert ids2[: len(kv)] == kv  # the history is the KV's own tokens: nothing recomputes
    assert tokenizer.decode(ids2, skip_special_tokens=False) == text2  # and reads as rendered
    assert "<tool_response>\n21 C\n</tool_response>" in text2
    # the display view re-rendered would not do: the call's JSON is spaced differently
    shown = render(tokenizer, template, [*session.messages[:2], ANSWER])
    assert GENERATED not in shown
    assert tokenizer.encode(shown, add_special_tokens=False)[: len(kv)] != list(kv)

    _, text3, ids3 = run_turn(
        s,
        tokenizer,
        template,
        {"role": "user", "content": "Thanks!"},
        SessionReply({"role": "assistant", "content": "You are welcome."}, "You are welcome."),
        sampled(tokenizer, "You are welcome."),
    )
    assert ids3[: len(ids2) + len(said_ids)] == (*ids2, *said_ids)
    assert tokenizer.decode(ids3, skip_special_tokens=False) == text3
    roles = ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert [m["role"] for m in session.messages] == roles
    assert turn2.prompt_text == text2 and "<tool_call>" not in repr(session.messages)


def test_a_reply_whose_tokens_are_not_its_text_is_encoded_afresh(
    tokenizer: Tokenizer, template: str
) -> None:
    """A stop string cut the reply: its tokens run past its text, so the next prompt reuses
    the previous prompt's tokens and encodes the reply's text."""
    s = store()
    cut = "Sunny, 21 C."
    output = sampled(tokenizer, cut + " STOP and more")
    reply = SessionReply({"role": "assistant", "content": cut}, cut)
    _, _, ids1 = run_turn(s, tokenizer, template, ASK, reply, output, exact=False)
    _, text2, ids2 = run_turn(
        s, tokenizer, template, {"role": "user", "content": "And tomorrow?"}, reply, output
    )
    assert ids2[: len(ids1)] == ids1
    assert ids2[len(ids1) : len(ids1) + len(output)] != output
    assert tokenizer.decode(ids2, skip_special_tokens=False) == text2


def test_a_history_the_template_renders_differently_is_encoded_whole(
    tokenizer: Tokenizer, template: str
) -> None:
    """The tools changed (so did the system prompt): the prompt is the text's own encoding;
    the prefix cache then reuses what still matches."""
    s = store()
    call = sampled(tokenizer, GENERATED)
    run_turn(s, tokenizer, template, ASK, SessionReply(SENT, GENERATED), call)
    turn, text, ids = run_turn(
        s, tokenizer, template, ANSWER, SessionReply(SENT, GENERATED), call, tools=None
    )
    assert ids == tuple(tokenizer.encode(text, add_special_tokens=False))
    assert GENERATED in text  # the history still renders the call as generated
    assert turn.session.messages[1] == SENT
