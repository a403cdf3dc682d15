"""End to end: the real default model behind a real hypercorn socket, the official SDK.

These run the whole stack (HTTP -> engine -> runner -> SmolLM2) and check what a user of
the SDK sees; the scripted-model HTTP tests cover the protocol details exhaustively.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch
import trio

from furnace_trio.engine import Engine

from ..real_model import (
    NAME,
    QUESTION,
    check_paris_streamed_and_not,
    default_model,
    default_runner,
    serve_real,
)
from .waiting import engine_idle, engine_reaches


async def _idle(engine: Engine) -> None:
    await engine_reaches(engine, engine_idle, "an idle engine")


async def test_chat_streaming_and_not_with_the_real_model() -> None:
    async with (
        serve_real() as (url, engine),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        models = await client.models.list()
        assert [m.id for m in models.data] == [NAME]

        reply = await client.chat.completions.create(
            model=NAME, messages=QUESTION, temperature=0, max_tokens=40
        )
        text = reply.choices[0].message.content or ""
        assert "Paris" in text
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage is not None and reply.usage.completion_tokens > 0

        stream = await client.chat.completions.create(
            model=NAME,
            messages=QUESTION,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces: list[str] = []
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
        assert "".join(pieces) == text  # the same greedy answer, streamed
        assert usage is not None
        assert usage.completion_tokens == reply.usage.completion_tokens
        await _idle(engine)


async def test_completions_n2_seeded_and_logprobs_with_the_real_model() -> None:
    async with (
        serve_real() as (url, engine),
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        kwargs: dict[str, Any] = dict(
            model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=2
        )
        first = await client.completions.create(**kwargs)
        second = await client.completions.create(**kwargs)
        assert [c.text for c in first.choices] == [c.text for c in second.choices]
        assert len(first.choices) == 2

        lp = await client.completions.create(
            model=NAME, prompt="The sky is", max_tokens=4, temperature=0, logprobs=3
        )
        logprobs = lp.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert len(logprobs.token_logprobs) == len(logprobs.tokens or []) > 0
        assert all(v is not None and v <= 0 for v in logprobs.token_logprobs)
        assert logprobs.top_logprobs is not None and all(len(t) == 3 for t in logprobs.top_logprobs)

        # A batch of prompts answers each as it would be answered alone (greedy; the CPU
        # runtime's output does not depend on its batch).
        prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
        alone = [
            (await client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0))
            .choices[0]
            .text
            for p in prompts
        ]
        batch = await client.completions.create(
            model=NAME, prompt=prompts, max_tokens=8, temperature=0
        )
        assert [c.index for c in batch.choices] == [0, 1, 2]
        assert [c.text for c in batch.choices] == alone
        assert len(set(alone)) == 3

        # echo with logprobs: the prompt's tokens scored as the model scores them (a
        # runner of its own computes the reference), then the greedy token's own.
        ids = default_model().tokenizer.encode("The capital of France is")
        scored = await client.completions.create(
            model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        values = scored.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
        assert values is not None and len(values) == len(ids) + 1 and values[0] is None
        reference = torch.log_softmax(default_runner().prompt_logits(ids), dim=-1)
        want = [reference[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        assert values[1 : len(ids)] == pytest.approx(want, abs=1e-4)
        assert values[-1] == pytest.approx(reference[-1].max().item(), abs=1e-4)
        await _idle(engine)


async def test_disconnect_mid_stream_frees_the_real_sequence() -> None:
    async with serve_real() as (url, engine):

        def stream_a_little() -> None:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
                stream = client.chat.completions.create(
                    model=NAME,
                    messages=[{"role": "user", "content": "Tell me a very long story."}],
                    max_tokens=400,
                    stream=True,
                )
                for i, _ in enumerate(stream):
                    if i == 3:
                        break
                stream.close()  # the client goes away mid-stream

        await trio.to_thread.run_sync(stream_a_little)
        await _idle(engine)
        stats = engine.statistics()
        assert stats.requests.get("aborted", 0) == 1


async def test_int8_kv_cache_from_the_server_settings() -> None:
    """``FURNACE_KV_CACHE_DTYPE=int8`` through the real loading path (``load_backend``): the
    pool holds the int8 cache's number of blocks for its megabytes, and the greedy answer
    still names Paris, streamed and not alike."""
    import httpx

    from furnace_trio.runtime.kv_cache import KVCache
    from furnace_trio.server.app import create_app
    from furnace_trio.server.config import ServerConfig

    from ..http_server import serve_app
    from ..real_model import default_model

    config = default_model().config  # skips without the default model
    app = create_app(ServerConfig(device="cpu", kv_cache_mb=16, kv_cache_dtype="int8"))
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        metrics = (await http.get("/metrics")).text
        total = next(
            line for line in metrics.splitlines() if line.startswith("furnace_kv_blocks_total ")
        )
        blocks = (16 << 20) // KVCache.bytes_per_block(config, 16, torch.int8)
        assert float(total.split()[1]) == blocks
        assert blocks > 1.8 * (16 << 20) // KVCache.bytes_per_block(config, 16, torch.float16)
        name = (await client.models.list()).data[0].id
        await check_paris_streamed_and_not(client, name)
