"""The model's sampling defaults fill what a request leaves unset; the request's own values
win. Unit rules, then a Hugging Face directory with ``generation_config.json`` served
through the real loading path on a real socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from furnace_trio.loading.generation_defaults import GenerationDefaults
from furnace_trio.server.app import create_app
from furnace_trio.server.chat_request import parse_chat_request
from furnace_trio.server.config import ServerConfig

from .._model_fixtures import write_tiny_model
from ..http_server import serve_app

MODEL = GenerationDefaults(
    temperature=0.6, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.1, source="test"
)


def _sampling(**fields: Any) -> Any:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode(), vocab_size=100).sampling


def test_unset_fields_take_the_models_defaults() -> None:
    params = _sampling().to_params(8, MODEL)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.8, 20)
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.1)


def test_request_fields_override_the_models_defaults() -> None:
    sampling = _sampling(temperature=0, top_p=1, top_k=-1, min_p=0, repetition_penalty=1)
    params = sampling.to_params(8, MODEL)
    assert (params.temperature, params.top_p, params.top_k) == (0, 1, None)
    assert (params.min_p, params.repetition_penalty) == (0, 1)
    # null is "not given", as everywhere in the protocol
    assert _sampling(temperature=None).to_params(8, MODEL).temperature == 0.6


def test_without_model_defaults_openai_s_apply() -> None:
    params = _sampling().to_params(8)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, None)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
    partial = _sampling().to_params(8, GenerationDefaults(top_k=0, temperature=0.3))
    assert (partial.temperature, partial.top_k, partial.top_p) == (0.3, None, 1.0)


async def test_a_models_generation_config_applies_over_the_socket(tmp_path: Path) -> None:
    """``generation_config.json`` says temperature 0: a request without one is greedy
    (the same tokens as an explicit temperature 0, whatever its seed), an explicit
    temperature samples; ``/v1/models`` shows what is applied."""
    directory = write_tiny_model(tmp_path, "llama", tied=False)
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 2, "temperature": 0.0, "top_k": 50})
    )
    app = create_app(ServerConfig(model=str(directory), device="cpu", kv_cache_mb=4))
    ask: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hello, world!"}],
        "extra_body": {"ignore_eos": True},
    }
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        (card,) = (await client.models.list()).data
        assert card.model_dump()["generation_defaults"] == {"temperature": 0.0, "top_k": 50}
        name = card.id

        async def answer(top_k: int | None = None, **extra: Any) -> str:
            body = {**ask["extra_body"], "top_k": top_k}
            reply = await client.chat.completions.create(
                model=name, messages=ask["messages"], max_tokens=12, extra_body=body, **extra
            )
            return reply.choices[0].message.content or ""

        greedy = await answer(temperature=0)
        assert greedy
        assert await answer(seed=1) == greedy
        assert await answer(seed=2) == greedy
        sampled = await answer(temperature=2.0, top_k=0, seed=1)
        assert sampled != greedy
        assert await answer(temperature=2.0, top_k=0, seed=1) == sampled  # seeded, not noise
        completion = await client.completions.create(
            model=name, prompt="Hello", max_tokens=8, seed=3, extra_body={"ignore_eos": True}
        )
        explicit = await client.completions.create(
            model=name, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert completion.choices[0].text == explicit.choices[0].text
