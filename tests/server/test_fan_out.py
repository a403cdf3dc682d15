"""Fan-out in one request: prompts x ``n`` is what a request costs, counted against
``FURNACE_MAX_SEQUENCES_PER_REQUEST`` (a 400) and against the queue, ``FURNACE_MAX_WAITING``
(a 503 with ``Retry-After``), and refused before anything is queued. Over a real socket
with the ``openai`` client (retries off, so a 503 is seen as sent)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai
import pytest
import trio

from furnace_trio.engine import EngineConfig
from furnace_trio.server.config import ServerConfig

from .. import scripted
from ..http_server import MODEL_NAME, Served, default_script, serve_scripted
from .waiting import wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


def client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


async def test_128_prompts_times_n_16_is_a_400_before_any_work() -> None:
    async with serve_scripted() as served, client(served) as c:
        assert ServerConfig().max_sequences_per_request == 128
        with pytest.raises(openai.BadRequestError) as refused:
            await c.completions.create(
                model=MODEL_NAME, prompt=[f"prompt {i}" for i in range(128)], n=16, max_tokens=4
            )
        error = refused.value
        assert error.param == "n"
        assert "2048 sequences" in error.message and "at most 128" in error.message
        assert served.engine.statistics().requests.get("rejected", 0) == 0  # never reached it
        assert served.runner.plans == []
        # the cap itself is served: 8 prompts x n 16
        ok = await c.completions.create(
            model=MODEL_NAME, prompt=[f"prompt {i}" for i in range(8)], n=16, max_tokens=4
        )
        assert len(ok.choices) == 128
    await served.wait_idle()


async def test_the_cap_is_a_setting_and_counts_chat_n_and_single_prompts() -> None:
    async with serve_scripted(max_sequences_per_request=4) as served, client(served) as c:
        with pytest.raises(openai.BadRequestError) as chat:
            await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=5)
        assert chat.value.param == "n" and "n = 5" in chat.value.message
        with pytest.raises(openai.BadRequestError) as batch:
            await c.completions.create(model=MODEL_NAME, prompt=["a"] * 5, max_tokens=2)
        assert batch.value.param == "prompt" and "5 prompts x n = 1" in batch.value.message
        ok = await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=4)
        assert len(ok.choices) == 4
    await served.wait_idle()


async def chat(http: openai.AsyncOpenAI, n: int) -> None:
    answer = await http.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=n, max_tokens=8
    )
    assert len(answer.choices) == n


@asynccontextmanager
async def _queue_holding_three(
    served: Served, http: openai.AsyncOpenAI, nursery: trio.Nursery
) -> AsyncIterator[None]:
    """One request running (its step blocked on the gate) and one of n = 3 waiting: three
    of the queue's four places taken. Opens the gate on the way out."""
    gate = served.runner.gate
    assert gate is not None
    nursery.start_soon(chat, http, 1)
    await wait_until(lambda: served.engine.statistics().running == 1, "one running")
    nursery.start_soon(chat, http, 3)
    await wait_until(lambda: served.engine.statistics().waiting == 1, "one waiting")
    try:
        yield
    finally:
        gate.set()


async def test_the_queue_counts_sequences_not_requests() -> None:
    runner = scripted.ScriptedRunner(default_script, gate=threading.Event(), num_blocks=1024)
    config = EngineConfig(max_running=3, max_waiting=4)
    async with (
        serve_scripted(runner, engine_config=config) as served,
        client(served) as c,
        trio.open_nursery() as nursery,
        _queue_holding_three(served, c, nursery),
    ):
        with pytest.raises(openai.InternalServerError) as busy:  # 3 waiting + 2 > 4
            await c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8)
        assert busy.value.status_code == 503
        assert busy.value.response.headers["retry-after"] == "1"
        assert busy.value.code == "server_busy"
        assert "3 sequences are waiting" in busy.value.message
        with pytest.raises(openai.InternalServerError) as batch:  # two prompts, one place
            await c.completions.create(model=MODEL_NAME, prompt=["a", "b"], max_tokens=2)
        assert batch.value.code == "server_busy"
        # the batch was refused whole, before either prompt was queued
        stats = served.engine.statistics()
        assert stats.waiting == 1 and stats.requests.get("aborted", 0) == 0
        nursery.start_soon(chat, c, 1)  # 3 + 1 fits
        await wait_until(lambda: served.engine.statistics().waiting == 2, "the last place taken")
    await served.wait_idle()
