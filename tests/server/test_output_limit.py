"""``FURNACE_MAX_OUTPUT_TOKENS``: the default ``max_tokens`` of a request that names none,
and a cap (a larger request is OpenAI's 400 ``invalid_value``), for chat, completions and
session turns; over a real socket with the SDK (a scripted model: the limit is the server's,
not the model's)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from furnace_trio.server.config import ConfigError, ServerConfig
from furnace_trio.server.errors import APIError
from furnace_trio.server.protocol import resolve_max_tokens

from .. import scripted
from ..http_server import MODEL_NAME, Served, serve_scripted

LIMIT = 4
#: A reply longer than LIMIT tokens (the scripted model's tokens are characters).
LONG = "A long answer that goes on and on"


def _long(prompt: tuple[int, ...], index: int) -> list[int]:
    return [*scripted.encode(LONG), scripted.EOS]


def test_the_setting_is_read_and_checked() -> None:
    assert ServerConfig.from_env({"FURNACE_MAX_OUTPUT_TOKENS": "512"}).max_output_tokens == 512
    assert ServerConfig.from_env({}).max_output_tokens is None
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(ConfigError, match="FURNACE_MAX_OUTPUT_TOKENS"):
            ServerConfig.from_env({"FURNACE_MAX_OUTPUT_TOKENS": bad})


def test_the_limit_is_the_default_and_a_cap() -> None:
    def resolve(requested: int | None, default: int | None = None, prompt: int = 10) -> int:
        return resolve_max_tokens(
            requested, prompt_tokens=prompt, max_context=100, default=default, limit=LIMIT
        )

    assert resolve(None) == LIMIT  # chat: instead of the rest of the context
    assert resolve(None, default=16) == LIMIT  # completions: instead of 16
    assert resolve(None, prompt=98) == 2  # never past the context
    assert resolve(LIMIT) == LIMIT and resolve(1) == 1
    with pytest.raises(APIError) as info:
        resolve(LIMIT + 1)
    error = info.value
    assert (error.status, error.param, error.code) == (400, "max_tokens", "invalid_value")
    assert f"at most {LIMIT} completion tokens" in error.message


def _served(**config: Any) -> Any:
    return serve_scripted(scripted.ScriptedRunner(_long, num_blocks=256), **config)


def _client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "Tell me"}]


async def test_requests_without_max_tokens_stop_at_the_limit() -> None:
    async with _served(max_output_tokens=LIMIT) as served, _client(served) as client:
        chat = await client.chat.completions.create(model=MODEL_NAME, messages=ASK)
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == LIMIT
        assert chat.choices[0].message.content == LONG[:LIMIT]
        completion = await client.completions.create(model=MODEL_NAME, prompt="Tell me")
        assert completion.choices[0].text == LONG[:LIMIT]
        assert completion.choices[0].finish_reason == "length"
        small = await client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=2)
        assert small.choices[0].message.content == LONG[:2]
        models = await client.models.list()
        assert models.data[0].model_dump()["max_output_tokens"] == LIMIT


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat/completions", {"messages": ASK, "max_tokens": LIMIT + 1}, "max_tokens"),
        (
            "chat/completions",
            {"messages": ASK, "max_completion_tokens": 10_000},
            "max_completion_tokens",
        ),
        ("completions", {"prompt": "Tell me", "max_tokens": LIMIT + 1}, "max_tokens"),
    ],
)
async def test_a_request_above_the_limit_is_400_naming_it(
    endpoint: str, body: dict[str, Any], param: str
) -> None:
    async with _served(max_output_tokens=LIMIT) as served:
        async with httpx.AsyncClient(base_url=served.url + "/v1") as http:
            response = await http.post(f"/{endpoint}", json={"model": MODEL_NAME, **body})
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert (error["param"], error["code"]) == (param, "invalid_value")
            assert f"at most {LIMIT} completion tokens" in error["message"]
            # the server goes on serving
            ok = await http.post(
                "/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 1}
            )
            assert ok.status_code == 200
        await served.wait_idle()


async def test_a_session_turn_goes_through_the_same_rule() -> None:
    async with _served(max_output_tokens=LIMIT) as served, _client(served) as client:
        first = await client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, extra_headers={"X-Session-Id": "s1"}
        )
        assert first.choices[0].message.content == LONG[:LIMIT]
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "More"}],
                max_tokens=LIMIT + 1,
                extra_headers={"X-Session-Id": "s1"},
            )
        assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
        await served.wait_idle(sessions_may_hold=True)


async def test_without_the_setting_chat_may_fill_the_context() -> None:
    """OpenAI's behaviour: no cap, and a chat request without max_tokens runs to its end."""
    async with _served() as served, _client(served) as client:
        chat = await client.chat.completions.create(model=MODEL_NAME, messages=ASK)
        assert chat.choices[0].message.content == LONG
        assert chat.choices[0].finish_reason == "stop"
        big = await client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=500)
        assert big.choices[0].message.content == LONG
        completion = await client.completions.create(model=MODEL_NAME, prompt="Tell me")
        assert completion.choices[0].text == LONG[:16]  # OpenAI's completions default
        models = await client.models.list()
        assert models.data[0].model_dump()["max_output_tokens"] is None
