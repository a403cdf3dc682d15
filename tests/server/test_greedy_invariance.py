"""Greedy answers over the socket do not depend on the prefix cache, on the other requests
of the same steps, on streaming or on how the prefill is chunked: the server as configured
by default (the embedded model, its own weights' formats, the native CPU kernels) through
the official client."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig

from ..http_server import serve_app
from ..real_model import default_model

pytestmark = pytest.mark.model

QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)


async def _answer(client: openai.AsyncOpenAI, model: str, question: str) -> tuple[str, int]:
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=80,
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens or 0


async def test_greedy_answers_are_the_same_cached_batched_and_streamed() -> None:
    default_model()  # skips without the default model
    app = create_app(ServerConfig(device="cpu", kv_cache_mb=32))
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        model = (await client.models.list()).data[0].id
        fresh: dict[str, str] = {}
        first_cached: dict[str, int] = {}
        for question in QUESTIONS:
            text, first_cached[question] = await _answer(client, model, question)
            assert text
            fresh[question] = text

        # Again, more of each prompt in the prefix cache (the system turn the template
        # adds is shared from the first question on).
        for question in QUESTIONS:
            text, cached = await _answer(client, model, question)
            assert cached > first_cached[question]
            assert text == fresh[question], question

        # All at once: every step holds the other requests' prefill or decode rows.
        batched: dict[str, str] = {}

        async def one(question: str) -> None:
            batched[question] = (await _answer(client, model, question))[0]

        async with trio.open_nursery() as nursery:
            for question in QUESTIONS:
                nursery.start_soon(one, question)
        assert batched == fresh

        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=80,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == fresh[QUESTIONS[0]]


LONG_QUESTION = "Which colour do these notes name most often?\n" + "The sky is blue. " * 60


async def _prefill_steps(url: str) -> int:
    async with httpx.AsyncClient(base_url=url) as http:
        for line in (await http.get("/metrics")).text.splitlines():
            if line.startswith("furnace_prefill_step_seconds_count "):
                return int(line.split()[1])
    raise AssertionError("no prefill step count in /metrics")


async def test_greedy_answers_are_the_same_whatever_the_pacer_chunks() -> None:
    """Paced to an unreachable 1 ms, prompts that arrive while a stream decodes prefill
    in the pacer's smallest chunks; alone, each gets the whole step budget. The answers
    agree (no prefix cache, so every prompt is computed in full both ways)."""
    default_model()
    config = ServerConfig(device="cpu", kv_cache_mb=32, prefix_cache=False, target_itl_ms=1.0)
    app = create_app(config)
    questions = (*QUESTIONS[1:], LONG_QUESTION)
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        model = (await client.models.list()).data[0].id
        alone = {q: (await _answer(client, model, q))[0] for q in questions}
        before = await _prefill_steps(url)

        paced: dict[str, str] = {}

        async def one(question: str) -> None:
            paced[question] = (await _answer(client, model, question))[0]

        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=80,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async with trio.open_nursery() as nursery:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break  # it decodes: the others' prompts now join its steps, paced
            for question in questions:
                nursery.start_soon(one, question)
            async for _ in stream:
                pass
        # the long prompt alone needs more than 16 steps in 16-token chunks
        assert await _prefill_steps(url) - before > 16
        assert paced == alone
