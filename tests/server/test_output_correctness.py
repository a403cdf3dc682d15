"""Output a client can rely on, over a real socket with the openai SDK and the real model:
strict JSON (the suite's ``json.loads`` rejects NaN and Infinity, see ``conftest.py``),
forced tool calls that end, partial calls on ``length``, grammars that end."""

from __future__ import annotations

import copy
import math
from typing import Any

import openai

from ..real_model import NAME, serve_real
from .test_app_tools import TIME, WEATHER


def _closed(tool: dict[str, Any]) -> dict[str, Any]:
    """``tool`` with ``additionalProperties: false`` on its arguments (a well-formed tool)."""
    closed = copy.deepcopy(tool)
    closed["function"]["parameters"]["additionalProperties"] = False
    return closed


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_logprobs_of_a_constrained_request_are_finite_json() -> None:
    """The grammar masks most of the vocabulary; the top alternatives are tokens it allows,
    with finite logprobs, streamed and not."""
    async with serve_real() as (url, _), _client(url) as client:
        common: dict[str, Any] = {
            "model": NAME,
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "required",
            "temperature": 0,
            "max_tokens": 40,
            "logprobs": True,
            "top_logprobs": 5,
        }
        reply = await client.chat.completions.create(**common)
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.content
        entries = list(logprobs.content)
        stream = await client.chat.completions.create(**common, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                entries += chunk.choices[0].logprobs.content or []
    forced = 0
    for entry in entries:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert all(math.isfinite(t.logprob) for t in entry.top_logprobs)
        assert 1 <= len(entry.top_logprobs) <= 5
        forced += len(entry.top_logprobs) < 5
    assert forced > 0  # the markup is forced: fewer than 5 tokens are allowed there


async def test_forced_calls_end_on_their_own() -> None:
    """``required`` may call several tools but ends (the model prefers to repeat its call:
    the repeat ends the output and is dropped); ``parallel_tool_calls: false`` and a named
    function give exactly one call. Each stops well before ``max_tokens``."""
    tools = [_closed(WEATHER), _closed(TIME)]
    cases: list[dict[str, Any]] = [
        {"tool_choice": "required"},
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ]
    async with serve_real() as (url, _), _client(url) as client:
        for extra in cases:
            reply = await client.chat.completions.create(
                model=NAME, messages=ASK, tools=tools, temperature=0, max_tokens=200, **extra
            )
            choice = reply.choices[0]
            calls = [
                (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
            ]
            assert choice.finish_reason == "tool_calls", (extra, calls)
            assert reply.usage is not None and reply.usage.completion_tokens < 200
            assert calls and len(set(calls)) == len(calls), calls
            if extra != {"tool_choice": "required"}:
                assert [name for name, _ in calls] == ["get_weather"]


async def test_a_forced_call_cut_by_max_tokens_is_returned_with_length() -> None:
    """The call as far as it got (its name, the argument text so far), streamed and not."""
    common: dict[str, Any] = {
        "model": NAME,
        "messages": ASK,
        "tools": [_closed(WEATHER)],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 18,
    }
    async with serve_real() as (url, _), _client(url) as client:
        reply = await client.chat.completions.create(**common)
        stream = await client.chat.completions.create(**common, stream=True)
        chunks = [c async for c in stream]
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments and '{"city":"Paris"}'.startswith(call.function.arguments)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_weather"]
    streamed = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert streamed == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_special_tokens_among_top_logprobs_are_named() -> None:
    """Past the end of the answer (``ignore_eos``), ``<|im_end|>`` and ``<|im_start|>`` are
    among the alternatives, and chosen: each entry's ``token`` is the token's text, the
    same as its ``bytes`` say, never an empty string."""
    async with serve_real() as (url, _), _client(url) as client:
        reply = await client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=12,
            logprobs=True,
            top_logprobs=20,
            extra_body={"ignore_eos": True},
        )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    entries = [*logprobs.content, *(t for e in logprobs.content for t in e.top_logprobs)]
    special = {"<|im_end|>", "<|im_start|>"}
    named = set()
    for entry in entries:
        assert entry.bytes is not None
        text = bytes(entry.bytes).decode("utf-8", errors="replace")
        assert entry.token == text, (entry.token, text)
        if text in special:
            named.add(text)
    assert named == special
