"""Gemma 3 270M (base, Q4_K_M) served whole: the GGUF's SentencePiece vocabulary, its
K-quant and Q5_0 blocks on the native kernels, and its sliding-window layers, over a real
socket through the official client's completions API (a base model has no chat template).
"""

from __future__ import annotations

import openai
import pytest

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig

from ..http_server import serve_app
from ..real_model import gemma3_gguf

PROMPT = "The capital of France is the city of"


async def test_gemma3_completes_the_capital_of_france() -> None:
    app = create_app(ServerConfig(model=str(gemma3_gguf()), device="cpu", kv_cache_mb=32))
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        models = await client.models.list()
        name = models.data[0].id
        # a base model: chat is refused with OpenAI's error object, and serving goes on
        with pytest.raises(openai.BadRequestError, match="chat template"):
            await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        reply = await client.completions.create(
            model=name, prompt=PROMPT, temperature=0, max_tokens=12
        )
        text = reply.choices[0].text
        assert "Paris" in text
        # <bos> first, then 8 tokens, as llama.cpp tokenizes it (whose greedy completion
        # with this file is " Paris. It is the most visited city in the world.")
        assert reply.usage is not None and reply.usage.prompt_tokens == 9
        stream = await client.completions.create(
            model=name, prompt=PROMPT, temperature=0, max_tokens=12, stream=True
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(pieces) == text
