"""Output a client can rely on, over a real socket with the openai SDK and the real model:
strict JSON (the suite's ``json.loads`` rejects NaN and Infinity, see ``conftest.py``),
forced tool calls that end, partial calls on ``length``, grammars that end."""

from __future__ import annotations

import math
from typing import Any

import openai

from ..real_model import NAME, serve_real
from .test_app_tools import WEATHER

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
