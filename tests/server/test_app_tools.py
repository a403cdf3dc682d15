"""Tool calls end to end: a scripted model, the HTTP API on a socket, the ``openai`` SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from .. import scripted
from ..http_server import MODEL_NAME, Served, serve_scripted, smollm2_tokenizer

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def _call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


#: What the scripted model answers, chosen by a keyword in the last user turn.
REPLIES = {
    "weather?": "Let me check. " + _call("get_weather", {"city": "Paris"}),
    "both?": _call("get_weather", {"city": "Rome"}) + "\n" + _call("get_time", {}),
    "broken?": 'Hmm. <tool_call>{"name": get_weather}</tool_call>',
    "long?": _call("get_weather", {"city": "A very long city name that goes on"}),
    "twice?": _call("get_weather", {"city": "Rome"})
    + "\n"
    + _call("get_weather", {"city": "Rome"}),
}
PROMPTS: list[str] = []


def script(prompt: tuple[int, ...], index: int) -> list[int]:
    text = smollm2_tokenizer().decode(prompt, skip_special_tokens=False)
    PROMPTS.append(text)
    last_turn = text.rsplit("<|im_start|>", 2)[-2]
    if "<tool_response>" in last_turn:
        reply = "It is 21 C in Paris."
    else:
        reply = next((r for key, r in REPLIES.items() if key in last_turn), "No tools needed.")
    return [*scripted.encode(reply), scripted.EOS]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    runner = scripted.ScriptedRunner(script, num_blocks=2048, max_context=4096)
    async with serve_scripted(runner) as s:
        yield s


def client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=served.api_key, max_retries=0)


async def test_single_call_non_streaming(served: Served) -> None:
    async with client(served) as c:
        response = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER, TIME],
        )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    # the default template cannot render tools: the Hermes-style prompt was used
    assert "<tools>" in PROMPTS[-1] and '"get_time"' in PROMPTS[-1]


async def test_streaming_deltas(served: Served) -> None:
    async with client(served) as c:
        stream = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "both?"}],
            tools=[WEATHER, TIME],
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == ""
    entries = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    heads = [e for e in entries if e.id is not None]
    assert [(h.index, h.type, h.function and h.function.name) for h in heads] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    # the head of each call comes before its argument fragments
    for call_index, expected in ((0, {"city": "Rome"}), (1, {})):
        mine = [e for e in entries if e.index == call_index]
        assert mine[0].id is not None
        arguments = "".join((e.function and e.function.arguments) or "" for e in mine)
        assert json.loads(arguments) == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_streaming_content_before_call(served: Served) -> None:
    async with client(served) as c:
        stream = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER],
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
    kinds = []
    for ch in chunks:
        delta = ch.choices[0].delta
        if delta.content:
            kinds.append("content")
        if delta.tool_calls:
            kinds.append("call")
    assert kinds[0] == "content" and "call" in kinds
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "content")


async def test_parallel_calls_and_follow_up_turn(served: Served) -> None:
    async with client(served) as c:
        first = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "both?"}],
            tools=[WEATHER, TIME],
        )
        calls = first.choices[0].message.tool_calls
        assert calls is not None
        assert [c.function.name for c in calls] == ["get_weather", "get_time"]
        assert len({c.id for c in calls}) == 2
        history: list[Any] = [
            {"role": "user", "content": "both?"},
            first.choices[0].message.model_dump(exclude_none=True),
            *(
                {"role": "tool", "tool_call_id": call.id, "content": f"result of {call.id}"}
                for call in calls
            ),
        ]
        second = await c.chat.completions.create(
            model=MODEL_NAME, messages=history, tools=[WEATHER, TIME]
        )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is 21 C in Paris."
    assert not second.choices[0].message.tool_calls
    prompt = PROMPTS[-1]
    assert prompt.count("<tool_response>") == 2 and f"result of {calls[1].id}" in prompt
    assert '"city": "Rome"' in prompt  # the assistant's calls are in the history


async def test_parallel_tool_calls_false_keeps_the_first(served: Served) -> None:
    async with client(served) as c:
        response = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "both?"}],
            tools=[WEATHER, TIME],
            parallel_tool_calls=False,
        )
    calls = response.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("tool_choice", "calls"),
    [
        ("auto", 2),
        ("required", 1),
        ({"type": "function", "function": {"name": "get_weather"}}, 1),
    ],
)
async def test_identical_calls_stand_unless_forced(
    served: Served, tool_choice: Any, calls: int
) -> None:
    """A model that chose to call the same tool twice meant it; a forced one repeats."""
    async with client(served) as c, httpx.AsyncClient(base_url=served.url) as http:
        response = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "twice?"}],
            tools=[WEATHER, TIME],
            tool_choice=tool_choice,
        )
        metrics = (await http.get("/metrics")).text
    got = response.choices[0].message.tool_calls or []
    assert [(t.function.name, json.loads(t.function.arguments)) for t in got] == [
        ("get_weather", {"city": "Rome"})
    ] * calls
    assert len({t.id for t in got}) == calls
    dropped = 'furnace_tool_call_fallbacks_total{reason="duplicate_call"} 1' in metrics
    assert dropped == (calls == 1)


async def test_call_cut_by_max_tokens_keeps_length(served: Served) -> None:
    async with client(served) as c:
        response = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "long?"}],
            tools=[WEATHER],
            max_tokens=50,
        )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert '{"city": "A very long city name that goes on"}'.startswith(call.function.arguments)
    assert "<tool_call>" not in (choice.message.content or "")


async def test_malformed_call_falls_back_and_is_counted(served: Served) -> None:
    async with client(served) as c:
        response = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "broken?"}],
            tools=[WEATHER],
        )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Hmm."
    assert not choice.message.tool_calls
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(served.url + "/metrics")).text
    assert 'furnace_tool_call_fallbacks_total{reason="malformed_json"} 1' in metrics


async def test_tool_choice_none_leaves_text_alone(served: Served) -> None:
    async with client(served) as c:
        response = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER],
            tool_choice="none",
        )
    assert response.choices[0].finish_reason == "stop"
    assert "<tools>" not in PROMPTS[-1]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
async def test_bad_tool_requests_are_400(served: Served, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **extra}
    async with httpx.AsyncClient() as http:
        response = await http.post(served.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_bad_history_is_400(served: Served) -> None:
    bad_messages = [
        [{"role": "tool", "content": "x"}],
        [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 3}}]}],
        [
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
            }
        ],
    ]
    async with httpx.AsyncClient() as http:
        for messages in bad_messages:
            response = await http.post(
                served.url + "/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": messages},
            )
            assert response.status_code == 400, messages
            assert response.json()["error"]["param"].startswith("messages[0]")


async def test_tool_calls_in_a_session_turn_and_its_follow_up(served: Served) -> None:
    """A session turn parses calls like a stateless one; the next turn sends only the tool
    result, and the session's history supplies the call it answers."""
    async with client(served) as c:
        first = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER],
            extra_body={"session_id": "tools-1"},
        )
        call = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert call is not None and call[0].function.name == "get_weather"
        assert json.loads(call[0].function.arguments) == {"city": "Paris"}
        second = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "tool", "tool_call_id": call[0].id, "content": "21 C"}],
            tools=[WEATHER],
            extra_body={"session_id": "tools-1"},
        )
    assert second.choices[0].message.content == "It is 21 C in Paris."
    assert second.choices[0].finish_reason == "stop"
    assert "<tool_response>" in PROMPTS[-1] and "get_weather" in PROMPTS[-1]
