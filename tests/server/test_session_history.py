"""A session stores each reply as the client received it, and its next turn reuses the KV of
everything before: the official SDK on a real socket, the real default model (and a
scripted one for a streamed call)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import openai

from furnace_trio.runtime.runner import DEFAULT_BLOCK_SIZE

from .. import scripted
from ..http_server import MODEL_NAME, serve_scripted
from ..real_model import NAME, serve_real
from .test_app_tools import WEATHER as OPEN_WEATHER
from .test_app_tools import script as tools_script

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
#: ``get_weather`` whose arguments admit no other property (so the forced call ends).
WEATHER = copy.deepcopy(OPEN_WEATHER)
WEATHER["function"]["parameters"]["additionalProperties"] = False
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


async def _session(url: str, session_id: str) -> dict[str, Any]:
    """``GET /v1/sessions/{id}`` as the client with the test servers' key."""
    async with httpx.AsyncClient(headers={"Authorization": "Bearer unused"}) as http:
        response = await http.get(f"{url}/v1/sessions/{session_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_a_tool_call_turn_is_kept_as_sent_and_its_answer_reuses_the_cache() -> None:
    async with (
        serve_real() as (url, _),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        first = await client.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=FORCE_WEATHER,
            temperature=0,
            max_tokens=60,
            extra_body={"session_id": "agent"},
        )
        calls = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1
        sent = calls[0]
        stored = await _session(url, "agent")
        assert stored["messages"] == [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": sent.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": sent.function.arguments},
                    }
                ],
            },
        ]
        assert "<tool_call>" not in json.dumps(stored)

        # The agent answers the call (tool_choice back to auto): the history, the call
        # included, comes from the session's KV; only the new input is computed.
        second = await client.chat.completions.create(
            model=NAME,
            messages=[{"role": "tool", "tool_call_id": sent.id, "content": '{"celsius": 21}'}],
            tools=[WEATHER],
            temperature=0,
            max_tokens=30,
            extra_body={"session_id": "agent"},
        )
        assert first.usage is not None and second.usage is not None
        assert second.usage.prompt_tokens_details is not None
        # every position the first turn computed (its last token, EOS, never is), in full blocks
        history = first.usage.prompt_tokens + first.usage.completion_tokens - 1
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached == history // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE, (cached, history)
        stored = await _session(url, "agent")
        assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert stored["messages"][2]["tool_call_id"] == sent.id
        reply = second.choices[0].message
        assert stored["messages"][3] == {"role": "assistant", "content": reply.content}


async def test_a_streamed_tool_call_turn_is_kept_with_the_streamed_ids() -> None:
    """Streamed, the reply is assembled from the chunks the client got: content, call ids."""
    runner = scripted.ScriptedRunner(tools_script, num_blocks=2048, max_context=4096)
    async with (
        serve_scripted(runner) as served,
        openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as c,
    ):
        stream = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[OPEN_WEATHER],
            stream=True,
            extra_body={"session_id": "streamed"},
        )
        chunks = [chunk async for chunk in stream]
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        calls = [call for d in deltas for call in d.tool_calls or []]
        (call_id,) = [call.id for call in calls if call.id]
        arguments = "".join(c.function.arguments or "" for c in calls if c.function)
        stored = await _session(served.url, "streamed")
    assert stored["messages"][1] == {
        "role": "assistant",
        "content": "".join(d.content or "" for d in deltas),
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    assert stored["messages"][1]["content"] == "Let me check."
