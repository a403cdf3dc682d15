"""``FURNACE_SPECULATIVE=ngram`` over the socket with the official client: greedy answers,
their logprobs, stop strings, ``max_tokens`` and ``n`` are those of a server that does not
speculate; the drafts show in ``/metrics`` and in the request's log line."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import openai
import pytest

from furnace_trio.server.app import create_app
from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.log_setup import FIELDS

from ..http_server import serve_app
from ..real_model import default_model
from ..tools.test_grammar import PERSON

pytestmark = pytest.mark.model

CODE = """def area(radius):
    return 3.14159 * radius * radius


def circumference(radius):
    return 2 * 3.14159 * radius
"""
EDIT = [
    {
        "role": "user",
        "content": "Rewrite this code with math.pi instead of 3.14159. Only the code.\n\n" + CODE,
    }
]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]

REQUESTS: list[dict[str, Any]] = [
    {"messages": EDIT, "max_tokens": 60},
    {"messages": EDIT, "max_tokens": 23},
    {"messages": EDIT, "max_tokens": 60, "stop": ["circumference"]},
    {"messages": EDIT, "max_tokens": 30, "logprobs": True, "top_logprobs": 2},
    {"messages": EDIT, "max_tokens": 30, "n": 2},
    {"messages": CHAT, "max_tokens": 40},
]


def spec_counts(metrics: str) -> dict[str, float]:
    """The drafted and accepted token totals of a ``/metrics`` page, by metric name."""
    return {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(("furnace_spec_drafted_tokens_total ", "furnace_spec_accepted"))
    }


async def _answers(
    config: ServerConfig, requests: list[dict[str, Any]] = REQUESTS
) -> tuple[list[Any], list[str], str]:
    app = create_app(config)
    async with (
        serve_app(app) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        model = (await client.models.list()).data[0].id
        replies = []
        for body in requests:
            reply = await client.chat.completions.create(model=model, temperature=0, **body)
            replies.append(
                [
                    (
                        c.message.content,
                        c.finish_reason,
                        None if c.logprobs is None else c.logprobs.model_dump(),
                    )
                    for c in reply.choices
                ]
                + [reply.usage.completion_tokens if reply.usage else None]
            )
        stream = await client.chat.completions.create(
            model=model, temperature=0, stream=True, **requests[0]
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        metrics = (await http.get("/metrics")).text
    return replies, pieces, metrics


async def test_speculating_server_answers_as_one_that_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    default_model()  # skips without the default model
    caplog.set_level(logging.INFO, logger="furnace_trio.server.request_log")
    plain, plain_stream, _ = await _answers(ServerConfig(device="cpu", kv_cache_mb=32))
    caplog.clear()
    spec, spec_stream, metrics = await _answers(
        ServerConfig(device="cpu", kv_cache_mb=32, speculative="ngram")
    )
    assert spec == plain
    assert "".join(spec_stream) == "".join(plain_stream) == plain[0][0][0]
    drafted = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("furnace_spec_drafted_tokens_total ")
    )
    assert drafted > 0
    assert "furnace_spec_acceptance_ratio_bucket" in metrics
    lines = [r for r in caplog.records if r.name == "furnace_trio.server.request_log"]
    assert any(getattr(r, FIELDS)["drafted_tokens"] > 0 for r in lines)
    assert all("drafted=" in r.getMessage() for r in lines)


PEOPLE = {"type": "array", "items": PERSON}
JSON_REQUEST: dict[str, Any] = {
    "messages": [
        {
            "role": "user",
            "content": "Ann is 7, Bob is 9, Cid is 11 and Dee is 13. List them as JSON with "
            "their name and age.",
        }
    ],
    "max_tokens": 90,
    "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}},
}


async def test_a_grammar_constrained_request_speculates_and_answers_the_same() -> None:
    """JSON that repeats its keys, under a JSON schema: prompt lookup drafts the keys, the
    grammar checks the drafts, and the answer is the one without speculation."""
    default_model()
    plain, plain_stream, _ = await _answers(
        ServerConfig(device="cpu", kv_cache_mb=32), [JSON_REQUEST]
    )
    spec, spec_stream, metrics = await _answers(
        ServerConfig(device="cpu", kv_cache_mb=32, speculative="ngram"), [JSON_REQUEST]
    )
    assert spec == plain
    assert "".join(spec_stream) == "".join(plain_stream) == plain[0][0][0]
    assert json.loads(plain[0][0][0])[0].keys() == {"name", "age"}
    assert spec_counts(metrics)["furnace_spec_accepted_tokens_total"] > 0


def test_the_setting() -> None:
    assert ServerConfig.from_env({}).speculative == "off"
    config = ServerConfig.from_env(
        {"FURNACE_SPECULATIVE": "NGRAM", "FURNACE_SPECULATIVE_TOKENS": "5"}
    )
    assert (config.speculative, config.speculative_tokens) == ("ngram", 5)
    # a draft model's path keeps its case
    draft = ServerConfig.from_env({"FURNACE_SPECULATIVE": " Draft:/Models/Small.gguf "})
    assert draft.speculative == "draft:/Models/Small.gguf"
    for value in ("draft:", "draft: ", "eagle", "on"):
        with pytest.raises(ConfigError, match="FURNACE_SPECULATIVE"):
            ServerConfig.from_env({"FURNACE_SPECULATIVE": value})
    with pytest.raises(ConfigError, match="FURNACE_SPECULATIVE_MAX_BATCH"):
        ServerConfig.from_env({"FURNACE_SPECULATIVE_MAX_BATCH": "0"})
