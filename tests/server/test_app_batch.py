"""``/v1/completions`` with a batch of prompts, over a real socket with the ``openai`` client.

Each prompt is its own engine request; the response numbers sample ``j`` of prompt ``i``
as choice ``i * n + j``. The scripted runner answers each prompt with its own text, so a
choice that carries another prompt's answer, or a wrong index, fails.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence

import httpx
import openai

from furnace_trio.engine import EngineConfig

from .. import scripted
from ..http_server import MODEL_NAME, Served, serve_scripted
from .test_app_disconnect import aborted
from .waiting import engine_reaches, wait_until


def answer(prompt: Sequence[int], index: int) -> str:
    """What the script says for sample ``index`` of ``prompt``."""
    return f"p{prompt[-1]}s{index}"


def script(prompt: tuple[int, ...], index: int) -> list[int]:
    return [*scripted.encode(answer(prompt, index)), scripted.EOS]


def client(served: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


PROMPTS = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]


def tasks(served: Served) -> int:
    """Tasks in the app's nursery, where a batch's readers run."""
    return len(served.app.nursery.child_tasks)


async def test_a_batch_of_token_prompts_with_n_2() -> None:
    async with serve_scripted(scripted.ScriptedRunner(script)) as served, client(served) as c:
        before = tasks(served)
        result = await c.completions.create(model=MODEL_NAME, prompt=PROMPTS, n=2, max_tokens=50)
        await served.wait_idle()
        await wait_until(lambda: tasks(served) == before)
    assert [choice.index for choice in result.choices] == list(range(6))
    expected = [answer(prompt, j) for prompt in PROMPTS for j in range(2)]
    assert [choice.text for choice in result.choices] == expected
    assert {choice.finish_reason for choice in result.choices} == {"stop"}
    assert result.usage is not None
    assert result.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    assert result.usage.completion_tokens == sum(len(text) for text in expected)
    assert result.id.startswith("cmpl-")
    prefilled = {
        tuple(s.prompt_token_ids) for p in served.runner.plans for c in p.chunks for s in c.samples
    }
    assert prefilled == {tuple(p) for p in PROMPTS}


async def test_a_batch_of_text_prompts_streams_interleaved_with_usage() -> None:
    texts = ["Once upon a time", "Hello there", "The capital of France"]
    runner = scripted.ScriptedRunner(script, sleep=0.002)
    async with serve_scripted(runner) as served, client(served) as c:
        ids = [served.state.serving_backend().tokenizer.encode(t) for t in texts]
        stream = await c.completions.create(
            model=MODEL_NAME,
            prompt=texts,
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
        order: list[int] = []
        text: dict[int, str] = defaultdict(str)
        finished: dict[int, list[str | None]] = defaultdict(list)
        usage = []
        async for chunk in stream:
            if chunk.usage is not None:
                usage.append(chunk.usage)
            for choice in chunk.choices:
                if choice.text:
                    order.append(choice.index)
                    text[choice.index] += choice.text
                if choice.finish_reason is not None:
                    finished[choice.index].append(choice.finish_reason)
        await served.wait_idle()
    assert dict(text) == {i: answer(ids[i], 0) for i in range(3)}
    assert dict(finished) == {i: ["stop"] for i in range(3)}
    assert len(usage) == 1 and usage[0].prompt_tokens == sum(len(i) for i in ids)
    assert usage[0].completion_tokens == sum(len(t) for t in text.values())
    # Read together, not one after another: prompt 1's text starts before prompt 0's ends.
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)


async def test_a_prompt_that_does_not_fit_refuses_the_batch_and_runs_nothing() -> None:
    runner = scripted.ScriptedRunner(script, max_context=8)
    async with serve_scripted(runner) as served, client(served) as c:
        try:
            await c.completions.create(
                model=MODEL_NAME, prompt=[[1, 2], [1] * 8, [3]], max_tokens=2
            )
        except openai.BadRequestError as exc:
            error = exc
        else:
            raise AssertionError("the batch was accepted")
        assert error.code == "context_length_exceeded"
        assert error.param == "prompt" and "prompt[1]:" in error.message
        assert runner.plans == []
        ok = await c.completions.create(model=MODEL_NAME, prompt=[[1, 2], [3]], max_tokens=5)
    assert [choice.text for choice in ok.choices] == [answer([2], 0), answer([3], 0)]


async def test_a_batch_the_queue_cannot_take_is_refused_whole() -> None:
    async with (
        serve_scripted(
            scripted.ScriptedRunner(script), engine_config=EngineConfig(max_waiting=2)
        ) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        response = await http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 5}
        )
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "server_busy"
        # refused before any prompt was queued: nothing to abort, nothing ran
        assert aborted(served) == 0
        assert served.engine.statistics().requests["rejected"] == 1
        await served.wait_idle()
        assert served.runner.plans == []


async def test_leaving_a_batched_stream_aborts_every_prompt() -> None:
    # Filler tokens to the end; room in the KV pool for all three at once.
    runner = scripted.ScriptedRunner(lambda prompt, i: [], sleep=0.005, num_blocks=1024)
    async with serve_scripted(runner) as served, httpx.AsyncClient(base_url=served.url) as http:
        before = tasks(served)
        body = {"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 500, "stream": True}
        seen: set[int] = set()
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if seen == {0, 1, 2}:
                    break
        await engine_reaches(served.engine, lambda s: s.requests["aborted"] == 3)
        await served.wait_idle()
        assert served.engine.num_requests == 0
        await wait_until(lambda: tasks(served) == before)  # the group's tasks ended too
