"""A mixture-of-experts model served whole: a tiny random Qwen3-MoE (a dense layer between
two sparse ones) from a Hugging Face directory and a tiny Mixtral from a GGUF, over a real
socket through the official client, with the tokens routed to each expert read back from
``/metrics``: every token the model ran went to ``top_k`` experts of every sparse layer.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import httpx
import openai
import pytest

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ServerConfig

from .._arch_fixtures import ARCHES, write_arch_gguf, write_arch_model
from ..http_server import serve_app

SERIES = re.compile(r'^furnace_expert_tokens_total\{layer="(\d+)",expert="(\d+)"\} (\d+)$', re.M)


def _routed(metrics: str) -> dict[int, dict[int, int]]:
    """Tokens per expert, per layer, from ``/metrics``."""
    layers: dict[int, dict[int, int]] = defaultdict(dict)
    for layer, expert, count in SERIES.findall(metrics):
        layers[int(layer)][int(expert)] = int(count)
    return dict(layers)


def _fed(usage: openai.types.CompletionUsage, finish: str | None) -> int:
    """Tokens a request ran through the model: its prompt and every output token but a
    last one that ended it by length (sampled, never fed back)."""
    return usage.prompt_tokens + usage.completion_tokens - (1 if finish == "length" else 0)


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
async def test_experts_answer_over_http_and_count_their_tokens(tmp_path: Path, name: str) -> None:
    if name == "mixtral":
        model, _ = write_arch_gguf(tmp_path, name)
    else:
        model = write_arch_model(tmp_path, name)
    extra = ARCHES[name][2]
    top_k = extra["num_experts_per_tok"]
    experts = extra.get("num_experts", extra.get("num_local_experts"))
    dense = set(extra.get("mlp_only_layers", ()))
    layers = extra.get("num_hidden_layers", 2)
    config = ServerConfig(model=str(model), device="cpu", kv_cache_mb=16, prefix_cache=False)
    app = create_app(config)
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        # nothing routed before the first request (start-up warm-up steps are not counted)
        assert not any(
            any(row.values()) for row in _routed((await http.get("/metrics")).text).values()
        )
        model_name = (await client.models.list()).data[0].id
        reply = await client.completions.create(
            model=model_name,
            prompt="a b c d e",
            temperature=0,
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 6
        first = _fed(reply.usage, reply.choices[0].finish_reason)
        routed = _routed((await http.get("/metrics")).text)
        assert set(routed) == set(range(layers)) - dense  # a series per sparse layer only
        for counts in routed.values():
            assert set(counts) == set(range(experts))
            assert sum(counts.values()) == top_k * first
        # the same prompt streamed: the same greedy text, and the counts grow by its tokens
        stream = await client.completions.create(
            model=model_name,
            prompt="a b c d e",
            temperature=0,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert "".join(pieces) == reply.choices[0].text
        assert usage is not None
        second = _fed(usage, finish)
        again = _routed((await http.get("/metrics")).text)
        for layer, counts in again.items():
            assert sum(counts.values()) == top_k * (first + second)
            assert all(counts[e] >= routed[layer][e] for e in counts)
