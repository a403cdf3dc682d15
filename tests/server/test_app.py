"""The OpenAI-compatible API over a real hypercorn socket, driven by the official SDK.

The engine runs a scripted runner (exact, instant output) with the real SmolLM2 tokenizer
for prompts; see ``tests/http_server.py``.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import trio

from furnace_trio.engine import EngineConfig

from .. import scripted
from ..http_server import ANSWERS, MODEL_NAME, Served, serve_scripted

MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serve_scripted() as s:
        yield s


def client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=served.api_key, max_retries=0)


async def test_chat_completion(served: Served) -> None:
    async with client(served) as c:
        result = await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert result.id.startswith("chatcmpl-")
    assert result.object == "chat.completion"
    assert result.model == MODEL_NAME and result.system_fingerprint
    assert result.choices[0].message.content == ANSWERS[0]
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].finish_reason == "stop"
    usage = result.usage
    assert usage is not None and usage.completion_tokens == len(ANSWERS[0])
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    await served.wait_idle()


async def test_chat_sampling_parameters_reach_the_runner(served: Served) -> None:
    async with client(served) as c:
        result = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_completion_tokens=3,
            temperature=0.5,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            logit_bias={"42": 5},
            seed=7,
            extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True},
        )
    assert result.choices[0].message.content == ANSWERS[0][:3]
    assert result.choices[0].finish_reason == "length"
    params = served.runner.plans[0].chunks[0].samples[0].params
    assert params.max_tokens == 3 and params.temperature == 0.5 and params.top_p == 0.9
    assert params.top_k == 5 and params.min_p == 0.1 and params.repetition_penalty == 1.2
    assert params.presence_penalty == 0.5 and params.frequency_penalty == 0.25
    assert dict(params.logit_bias) == {42: 5.0} and params.seed == 7 and params.ignore_eos


async def test_chat_stop_and_max_tokens(served: Served) -> None:
    async with client(served) as c:
        stopped = await c.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, stop=["wor", "zzz"]
        )
        limited = await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    assert stopped.choices[0].message.content == "Hello "
    assert stopped.choices[0].finish_reason == "stop"
    assert limited.choices[0].message.content == "Hell"
    assert limited.choices[0].finish_reason == "length"


async def test_chat_stream_n2_with_usage(served: Served) -> None:
    texts = ["", ""]
    finish: dict[int, str] = {}
    usage_chunks = []
    async with client(served) as c:
        stream = await c.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if not chunk.choices:
                usage_chunks.append(chunk.usage)
                continue
            assert chunk.usage is None
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
    assert texts == list(ANSWERS)
    assert finish == {0: "stop", 1: "stop"}
    assert len(usage_chunks) == 1
    assert usage_chunks[0].completion_tokens == len(ANSWERS[0]) + len(ANSWERS[1])
    await served.wait_idle()


async def test_the_startup_heap_is_frozen_out_of_the_collector_until_shutdown() -> None:
    """Once serving, the objects alive at startup (the engine among them) sit in the cyclic
    collector's permanent generation, which its full passes skip; shutdown thaws them."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    async with serve_scripted() as served:
        assert gc.get_freeze_count() > 1000
        assert not any(o is served.engine for o in gc.get_objects())  # in no generation
        async with client(served) as c:
            reply = await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
        assert reply.choices[0].message.content == ANSWERS[0]
    assert gc.get_freeze_count() == 0


async def test_chat_stream_with_a_stream_interval() -> None:
    """stream_interval 3: the first token alone, then chunks of three, the rest at the end."""
    async with serve_scripted(engine_config=EngineConfig(stream_interval=3)) as served:
        contents: list[str] = []
        usage = None
        async with client(served) as c:
            stream = await c.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        contents.append(choice.delta.content)
        # scripted tokens are single characters: "Hello world" is 11 tokens
        assert contents == ["H", "ell", "o w", "orl", "d"]
        assert usage is not None and usage.completion_tokens == len(ANSWERS[0])
        await served.wait_idle()


async def test_chat_stream_raw_sse_framing(served: Served) -> None:
    async with (
        httpx.AsyncClient() as http,
        http.stream(
            "POST",
            served.url + "/v1/chat/completions",
            json={"messages": MESSAGES, "stream": True},
        ) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        body = (await response.aread()).decode()
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])


async def test_chat_logprobs(served: Served) -> None:
    async with client(served) as c:
        result = await c.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=2
        )
        stream = await c.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, logprobs=True, max_tokens=2, stream=True
        )
        streamed = [
            entry
            async for chunk in stream
            for choice in chunk.choices
            if choice.logprobs and choice.logprobs.content
            for entry in choice.logprobs.content
        ]
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [e.token for e in content] == ["H", "e"]  # type: ignore[union-attr]
    assert content[0].logprob == -0.5 and content[0].bytes == [ord("H")]  # type: ignore[index]
    assert len(content[0].top_logprobs) == 2  # type: ignore[index]
    assert [e.token for e in streamed] == ["H", "e"]
    assert streamed[0].top_logprobs == []


async def test_completion_prompt_forms(served: Served) -> None:
    async with client(served) as c:
        for prompt in ("Once upon", ["Once upon"], [1, 2, 3]):
            result = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=50)
            assert result.id.startswith("cmpl-") and result.object == "text_completion"
            assert result.choices[0].text == ANSWERS[0]
            assert result.choices[0].finish_reason == "stop"
        default = await c.completions.create(
            model=MODEL_NAME, prompt="x", extra_body={"ignore_eos": True}
        )
    assert default.usage is not None and default.usage.completion_tokens == 16
    assert served.runner.plans[-1].chunks[0].samples[0].params.max_tokens == 16


async def test_completion_stream_logprobs_and_usage(served: Served) -> None:
    text = ""
    logprob_tokens: list[str] = []
    offsets: list[int] = []
    usage = None
    async with client(served) as c:
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt="Once upon",
            stream=True,
            logprobs=2,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs is not None:
                    logprob_tokens += choice.logprobs.tokens or []
                    offsets += choice.logprobs.text_offset or []
                    assert len(choice.logprobs.top_logprobs or []) == len(
                        choice.logprobs.tokens or []
                    )
    assert text == ANSWERS[0]
    assert "".join(logprob_tokens) == ANSWERS[0]
    assert offsets == list(range(len(ANSWERS[0])))
    assert usage is not None and usage.completion_tokens == len(ANSWERS[0])


async def test_sync_client_in_a_thread(served: Served) -> None:
    def call() -> str:
        with openai.OpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0) as c:
            result = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)  # type: ignore[arg-type]
            return result.choices[0].message.content or ""

    assert await trio.to_thread.run_sync(call) == ANSWERS[0]


async def test_models_health_metrics(served: Served) -> None:
    async with client(served) as c:
        models = await c.models.list()
        model = await c.models.retrieve(MODEL_NAME)
        with pytest.raises(openai.NotFoundError) as info:
            await c.models.retrieve("other-model")
        await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert model.id == MODEL_NAME and model.object == "model"
    assert info.value.code == "model_not_found"
    async with httpx.AsyncClient(base_url=served.url) as http:
        health = await http.get("/health")
        metrics = await http.get("/metrics")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        "furnace_time_to_first_token_seconds_bucket",
        "furnace_inter_token_latency_seconds_count",
        "furnace_e2e_request_latency_seconds_sum",
        "furnace_request_queue_time_seconds_count",
        "furnace_requests_running 0",
        "furnace_requests_waiting 0",
        "furnace_kv_blocks_used 0",
        'furnace_requests_total{outcome="finished_stop"} 1',
        'furnace_http_responses_total{status="200"}',
        'furnace_http_responses_total{status="404"} 1',
        "furnace_generation_tokens_total 11",
    ):
        assert name in text, name


async def test_long_stream_outlives_response_timeout() -> None:
    """RESPONSE_TIMEOUT (here 0.2 s) must not cut a stream that takes longer."""
    runner = scripted.ScriptedRunner(lambda prompt, i: [], sleep=0.02)
    async with serve_scripted(runner, response_timeout=0.2) as served, client(served) as c:
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt="go",
            max_tokens=25,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    assert "".join(ch.text for chunk in chunks for ch in chunk.choices) == "x" * 25
    assert chunks[-1].choices[0].finish_reason == "length"
